"""Every relative link in README.md and docs/*.md reaches a file, and every #anchor a heading there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped but for - and _, spaces as -."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_reach_their_targets(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert broken == []


def test_nothing_points_at_a_design_outside_the_repository() -> None:
    """The design lives in docs/design.md; a clone has no other design file to read."""
    name = "DESIGN" + ".md"  # spelled apart: this file names it too
    ignored = {".git", "build", "dist"}
    files = [
        p
        for p in ROOT.rglob("*")
        if p.suffix in (".py", ".md", ".toml", ".txt") and not ignored & set(p.parts) and not p.parts[len(ROOT.parts)].startswith(".venv")
    ]
    outside = [p.relative_to(ROOT).as_posix() for p in files if name in p.read_text(errors="replace")]
    assert outside == []
    assert (ROOT / "docs" / "design.md").is_file()
