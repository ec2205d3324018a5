"""The documentation holds together: every relative link resolves, and the README stays a short front door.

Checked files: README.md, CHANGELOG.md and every docs/**/*.md. A relative link `[text](path)` must name an
existing file or folder (relative to the page that links); `[text](path#anchor)` and `[text](#anchor)` must
also find a heading of the target page whose GitHub-style slug is the anchor. Links to http(s) and mailto
addresses are not followed, and links inside code (fenced or indented blocks, `inline code`) are not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
EXTERNAL = ("http://", "https://", "mailto:")


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
