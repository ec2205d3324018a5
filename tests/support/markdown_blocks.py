"""The fenced code blocks of a markdown page, and a console block's commands apart from the output it shows (for the
pages whose blocks the tests run: docs/tutorial.md, README.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Block:
    kind: str  # the fence's language
    line: int  # the line of the opening fence, from 1
    text: str  # the lines between the fences


def parse_blocks(markdown: str) -> list[Block]:
    """The fenced code blocks of a markdown text, in order."""
    blocks = []
    opening = None
    lines: list[str] = []
    for number, line in enumerate(markdown.splitlines(), start=1):
        if opening is None and line.startswith("```"):
            opening = Block(kind=line[3:].strip(), line=number, text="")
            lines = []
        elif opening is not None and line.strip() == "```":
            opening.text = "\n".join(lines) + "\n"
            blocks.append(opening)
            opening = None
        elif opening is not None:
            lines.append(line)
    if opening is not None:
        raise AssertionError(f"the block opened at line {opening.line} is never closed")
    return blocks


def split_console(text: str) -> tuple[list[str], list[str]]:
    """A console block's commands (continuation lines included) and the output lines it shows."""
    commands: list[str] = []
    shown: list[str] = []
    continuing = False
    for line in text.splitlines():
        if continuing:
            commands[-1] += "\n" + line
        elif line.startswith("$ "):
            commands.append(line[2:])
        else:
            shown.append(line)
            continue
        continuing = line.endswith("\\")
    return commands, shown
