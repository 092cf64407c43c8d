"""docs/architecture.md names every module under llmsupervisor/ (and no module that is gone), and
says why each module over 500 lines is that large: the layout map cannot go stale unnoticed.

The convention the checks read: each module is a list item that starts with its path under
llmsupervisor/ in backticks (``- `engine/runner.py`: ...``), and the item of a module over
LARGE_LINES lines contains ``**Why large:**``.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "llmsupervisor"
ARCHITECTURE = REPO / "docs" / "architecture.md"
LARGE_LINES = 500

# A list item that names a module, and its text up to the next item, heading or blank line.
_ITEM = re.compile(r"^- `([\w/]+\.py)`(.*?)(?=^- |^#|^\s*$)", re.M | re.S)


def modules() -> dict[str, int]:
    """Every module file under llmsupervisor/, as a path relative to it, with its line count."""
    return {
        p.relative_to(PACKAGE).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def items() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _ITEM.finditer(ARCHITECTURE.read_text(encoding="utf-8"))}


def test_the_item_pattern_reads_the_convention() -> None:
    text = "- `a.py`: one.\n  **Why large:** two.\n- `b/c.py`: three.\n\n### next\n"
    found = {m.group(1): m.group(2) for m in _ITEM.finditer(text)}
    assert list(found) == ["a.py", "b/c.py"]
    assert "**Why large:**" in found["a.py"] and "**Why large:**" not in found["b/c.py"]


def test_every_module_is_named() -> None:
    missing = sorted(set(modules()) - set(items()))
    assert missing == [], f"add a line for each to docs/architecture.md: {missing}"


def test_every_named_module_exists() -> None:
    gone = sorted(set(items()) - set(modules()))
    assert gone == [], f"docs/architecture.md names modules that are not there: {gone}"


def test_every_large_module_says_why() -> None:
    described = items()
    unexplained = sorted(
        f"{path} ({lines} lines)"
        for path, lines in modules().items()
        if lines > LARGE_LINES and "**Why large:**" not in described.get(path, "")
    )
    assert unexplained == [], f"say under **Why large:** in docs/architecture.md why: {unexplained}"
