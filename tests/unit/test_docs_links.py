"""Every relative link in README.md and docs/*.md points at a file that exists, every ``#anchor``
into a Markdown file at one of its headings (GitHub's slugs), and every repository path named in
inline code (```tests/...``, ```bench/...``, ```llmsupervisor/...``, ```docs/...``, with a
``:LINE`` or ``::test`` suffix allowed, ``{a,b}``, ``<date>`` and ``*`` read as patterns) at
something that exists: a file moved without its docs fails here."""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path

import pytest

from tests.lib.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# A repository path inside an inline code span: up to a space, a quote, a bracket or a comma
# outside braces; then what points into the file (a line, a test) is cut off.
_REPO_PATH = re.compile(r"(?<![\w/.-])(?:tests|bench|llmsupervisor|docs)/(?:\{[^}`]*\}|[^\s`'\"(),;{])*")
_INTO_FILE = re.compile(r"(?::\d+(?:-\d+)?|::\S*)$")


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


def code_paths(text: str) -> list[str]:
    """The repository paths named in inline code (fenced blocks are commands and output)."""
    spans = _INLINE_CODE.findall(_FENCE.sub("", text))
    return [m.group(0) for span in spans for m in _REPO_PATH.finditer(span)]


def alternatives(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd`` (every brace group, in turn)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in product(*choices)]


def exists(named: str) -> bool:
    """Whether what ``named`` names is in the repository (any of it, for a pattern)."""
    pattern = re.sub(r"<[^>]*>", "*", _INTO_FILE.sub("", named.rstrip(".:")))
    for alternative in alternatives(pattern):
        if any(ch in alternative for ch in "*?["):
            if any(REPO.glob(alternative)):
                return True
        elif (REPO / alternative).exists():
            return True
    return False


def test_code_paths_are_read_as_written() -> None:
    doc = "`tests/unit/test_files.py:12`, `tests/lib/daemon.py::Daemon`, `pytest tests/host -m gpu`, "
    doc += "`bench/results/overhead-<date>.{json,md}`, `llmsupervisor/engine/` and `etc/x`\n"
    doc += "```\ncat `tests/not/here.py`\n```\n"
    assert code_paths(doc) == [
        "tests/unit/test_files.py:12",
        "tests/lib/daemon.py::Daemon",
        "tests/host",
        "bench/results/overhead-<date>.{json,md}",
        "llmsupervisor/engine/",
    ]
    assert alternatives("a{b,c}d{e,f}") == ["abde", "abdf", "acde", "acdf"]
    assert exists("tests/unit/test_files.py:12") and exists("tests/lib/daemon.py::Daemon")
    assert exists("bench/results/overhead-<date>.{json,md}") and exists("llmsupervisor/engine/")
    assert not exists("tests/test_architecture.py") and not exists("tests/lib/nothing-*.py")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_paths_in_code_exist(doc: Path) -> None:
    missing = sorted({p for p in code_paths(doc.read_text(encoding="utf-8")) if not exists(p)})
    assert missing == [], f"{doc.relative_to(REPO)} names what is not in the repository"


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
    """The real demo first and the tests second (the project's rule for the README's first two
    commands), then the newcomer's minute without vLLM (issue 39)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first_block = re.search(r"^```\w*\n(.*?)^```", text, re.S | re.M)
    assert first_block is not None
    commands = [line.split("#")[0].split() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == [["scripts/demo"], ["scripts/test"], ["scripts/demo", "--fake"]]
