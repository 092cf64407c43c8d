"""Every relative link in README.md and docs/*.md points at a file that exists, and every
``#anchor`` into a Markdown file at one of its headings (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.lib.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text and code kept, punctuation dropped, lower case,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(path.read_text(encoding="utf-8"))) if not re.match(r"\w+:", t)]


def test_slugs_follow_github() -> None:
    assert slug("Fault matrix (issue 7)") == "fault-matrix-issue-7"
    assert slug("`model`: a path or a hub id") == "model-a-path-or-a-hub-id"
    assert slug("Metrics and alerts (from the README)") == "metrics-and-alerts-from-the-readme"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        relative = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
        if not path.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {relative}")
    assert broken == [], f"{doc.relative_to(REPO)}: {broken}"


def test_the_readme_links_every_doc() -> None:
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md")}
    unlinked = [p.name for p in DOCS[1:] if p.resolve() not in linked]
    assert unlinked == []


def test_the_readme_opens_with_the_demo_and_the_test_command() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first_block = re.search(r"^```\w*\n(.*?)^```", text, re.S | re.M)
    assert first_block is not None
    commands = [line.split()[0] for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["scripts/demo", "scripts/test"]
