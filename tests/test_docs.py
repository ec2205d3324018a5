"""The documentation holds together: every relative link resolves, every `ttt` option it names exists, and the
README stays a short front door.

Links: in README.md, CHANGELOG.md and every docs/**/*.md. A relative link `[text](path)` must name an existing file
or folder (relative to the page that links); `[text](path#anchor)` and `[text](#anchor)` must also find a heading of
the target page whose GitHub-style slug is the anchor. Links to http(s) and mailto addresses are not followed, and
links inside code (fenced or indented blocks, `inline code`) are not links.

Options: in README.md and every docs/**/*.md (CHANGELOG.md is history: it names options as they were), every
`--option` written after `ttt <command> [<subcommand>]` on the same line, in prose, inline code or a code block, must
be one that command's --help lists, read through click (cli.py's `main`), not by running it. A line that ends with a
backslash goes on in the next one; an option belongs to the nearest `ttt <command>` before it on its line, and to no
ttt command once another program is named after that (`python -m bench.NAME --quick`, `pip`, `make`, `dask`...).

The README's headline table: no cell longer than 120 characters (the details live in the page it links to).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import click
import pytest

from cli import main

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
EXTERNAL = ("http://", "https://", "mailto:")

# `ttt` and up to two words after it (a command, a group's subcommand), not `ttt[train]`, `ttt's` or a path.
TTT_COMMAND = re.compile(r"(?<![\w./\[-])ttt(?=[\s`]|$)(?:[ \t]+([a-z][\w-]*))?(?:[ \t]+([a-z][\w-]*))?")
OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
# Another program named after a ttt command: the options after it are that program's.
OTHER_PROGRAM = re.compile(
    r"(?<![\w./-])(?:python3?|pip|make|dask|huggingface-cli|pytest|img2dataset|git|curl|docker|sudo)(?=\s)"
    r"|(?<![\w./-])bench\.\w+"
)
HEADLINE = "Headline numbers"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [path for path in files if path.is_file()]


def prose_lines(text: str) -> list[str]:
    """The page's lines with code blocks blanked out (fenced, and indented after a blank line)."""
    lines, fence, in_indented = [], None, False
    previous_blank = True
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
            lines.append("")
            continue
        if opening:
            fence = opening.group(1)
            lines.append("")
            continue
        blank = not line.strip()
        indented = line.startswith("    ") or line.startswith("\t")
        in_indented = indented and not blank and (previous_blank or in_indented)
        lines.append("" if in_indented else line)
        previous_blank = blank
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (hyphens kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug in the page; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in enumerate(prose_lines(path.read_text(encoding="utf-8")), start=1):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if target and not target.lower().startswith(EXTERNAL):
                links.append((number, target))
    return links


def broken(path: Path, target: str) -> str | None:
    """Why a relative link from `path` does not resolve, or None when it does."""
    file_part, _, anchor = target.partition("#")
    destination = (path.parent / unquote(file_part)).resolve() if file_part else path
    if not destination.exists():
        return f"no file {destination.relative_to(ROOT) if destination.is_relative_to(ROOT) else destination}"
    if anchor:
        if not destination.is_file() or destination.suffix != ".md":
            return f"#{anchor} points into {destination.name}, which is not a markdown page"
        if unquote(anchor).lower() not in anchors(destination):
            return f"no heading with the anchor #{anchor} in {destination.relative_to(ROOT)}"
    return None


def option_pages() -> list[Path]:
    """The pages that describe ttt as it is now: the README and docs/ (not CHANGELOG.md, which is history)."""
    return [path for path in doc_files() if path.name != "CHANGELOG.md"]


def logical_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines, each with its number, a line ending in a backslash joined with the next (one command)."""
    lines: list[tuple[int, str]] = []
    pending: list[str] = []
    first = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not pending:
            first = number
        pending.append(line.rstrip())
        if pending[-1].endswith("\\"):
            pending[-1] = pending[-1][:-1]
            continue
        lines.append((first, " ".join(pending)))
        pending = []
    if pending:
        lines.append((first, " ".join(pending)))
    return lines


def ttt_command(words: tuple[str | None, str | None]) -> tuple[str, set[str]] | None:
    """`ttt WORD [WORD]` as click resolves it: the command's name and every option it takes (its --help included);
    None when the first word names no command (prose such as "ttt runs on ...")."""
    first, second = words
    context = click.Context(main, info_name="ttt", **main.context_settings)
    name, command = "ttt", main
    if first is not None:
        if first not in main.commands:
            return None
        name, command = f"ttt {first}", main.commands[first]
        context = click.Context(command, info_name=first, parent=context)
        if isinstance(command, click.Group) and second in command.commands:
            name, command = f"{name} {second}", command.commands[second]
            context = click.Context(command, info_name=second, parent=context)
    options = {flag for param in command.get_params(context) for flag in (*param.opts, *param.secondary_opts)}
    return name, {flag for flag in options if flag.startswith("--")}


def unknown_options(line: str) -> list[tuple[str, str]]:
    """(command, option) for each option on this line that the nearest `ttt <command>` before it does not take."""
    events: list[tuple[int, str, object]] = []
    for match in TTT_COMMAND.finditer(line):
        events.append((match.start(), "command", ttt_command((match.group(1), match.group(2)))))
    events += [(match.start(), "command", None) for match in OTHER_PROGRAM.finditer(line)]
    events += [(match.start(), "option", match.group()) for match in OPTION.finditer(line)]
    unknown, current = [], None
    for _, kind, value in sorted(events, key=lambda event: event[0]):
        if kind == "command":
            current = value
        elif current is not None and value not in current[1]:
            unknown.append((current[0], value))
    return unknown


def headline_cells() -> list[tuple[int, str]]:
    """(line number, cell) of every cell of the README's headline table, its header row included."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(number for number, line in enumerate(lines) if HEADING.match(line) and HEADLINE in line)
    cells = []
    for number, line in enumerate(lines[start + 1 :], start=start + 2):
        if HEADING.match(line):
            break
        if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            cells += [(number, cell.strip()) for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    return cells


def test_the_pages_exist():
    names = {path.relative_to(ROOT).as_posix() for path in doc_files()}
    assert {"README.md", "CHANGELOG.md"} <= names
    assert any(name.startswith("docs/") for name in names)


@pytest.mark.parametrize("page", doc_files(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    problems = [
        f"{page.relative_to(ROOT)}:{number}: [{target}]: {reason}"
        for number, target in relative_links(page)
        if (reason := broken(page, target)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize(
    "heading, expected",
    [
        ("Quick start", "quick-start"),
        ("`ttt train --stream`: one peer of a collaborative run", "ttt-train---stream-one-peer-of-a-collaborative-run"),
        ("DiLoCo (`bench/diloco.py`)", "diloco-benchdilocopy"),
        ("Measured on a GPU (NVIDIA H100 80GB, 2026-11-23)", "measured-on-a-gpu-nvidia-h100-80gb-2026-11-23"),
        ("Will it fit? Memory, host RAM", "will-it-fit-memory-host-ram"),
    ],
)
def test_slug_rule(heading: str, expected: str):
    assert slug(heading) == expected


def test_links_in_code_are_not_links(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) and `[not](nowhere.md)`\n\n    [indented](nowhere.md)\n\n"
        "```\n[fenced](nowhere.md)\n# not a heading\n```\n\n## Title\n",
        encoding="utf-8",
    )
    assert relative_links(page) == [(3, "#title")]
    assert anchors(page) == {"title", "title-1"}


@pytest.mark.parametrize("page", option_pages(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_ttt_option_in_the_docs_exists(page: Path):
    problems = [
        f"{page.relative_to(ROOT)}:{number}: {command} has no option {option} (see `{command} --help`)"
        for number, line in logical_lines(page.read_text(encoding="utf-8"))
        for command, option in unknown_options(line)
    ]
    assert not problems, "\n".join(problems)


def test_options_are_read_as_the_docs_mean_them():
    assert unknown_options("ttt train --stream --no-such-option") == [("ttt train", "--no-such-option")]
    assert unknown_options("ttt auth issue --token-lifetime 60; ttt auth serve --certfile c") == []
    assert unknown_options("ttt auth issue --certfile c") == [("ttt auth issue", "--certfile")]
    two = "ttt train --local-steps 10; ttt monitor --wandb x --stream"
    assert unknown_options(two) == [("ttt monitor", "--stream")]
    assert unknown_options("`ttt train` and `python -m bench.diloco --quick --outer-steps 2`") == []
    assert unknown_options("ttt's loader, ttt[train] --whatever, ttt runs --anything") == []
    assert unknown_options('subprocess.run(["ttt", "calc", *options, "--json"])') == []
    assert unknown_options("ttt --help; ttt --no-such") == [("ttt", "--no-such")]
    text = "    ttt generate x --checkpoint ckpt \\\n        --top-p 0.9 --no-such\nttt demo --steps 3\n"
    assert logical_lines(text) == [
        (1, "    ttt generate x --checkpoint ckpt          --top-p 0.9 --no-such"),
        (3, "ttt demo --steps 3"),
    ]
    assert [unknown_options(line) for _, line in logical_lines(text)] == [[("ttt generate", "--no-such")], []]


def test_readme_headline_cells_are_short():
    cells = headline_cells()
    assert len(cells) > 3, f"no table under the README's {HEADLINE!r} heading"
    long = [f"README.md:{number}: {len(cell)} characters: {cell}" for number, cell in cells if len(cell) > 120]
    assert not long, "headline cells over 120 characters (move the detail into docs/):\n" + "\n".join(long)
