"""What the docs state that cannot be generated is checked against the code (issue 26, point 5):
the ladder's flags wherever a page lists what a step may set, and the hang detection latency
stated in one place only (docs/benchmarks.md), not repeated where it would go stale."""

from __future__ import annotations

import re
from pathlib import Path

from llmsupervisor.config.spec import LADDER_FLAGS

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# A sentence that lists what a ladder step may set ("each setting any of ...", "may set only ...").
LISTS_LADDER_FLAGS = re.compile(r"(each setting (any|some) of|a ladder step may set only|each setting)", re.I)
# A hang detection latency stated as a number of seconds ("found in 2.3-4.0 s", "13 s in the ...").
HANG_LATENCY = re.compile(
    r"(frozen|hang|hung)[^.]{0,80}?\b(found|detected|caught) in \d+(\.\d+)?\s*"
    r"(\u2013|-|to)?\s*(\d+(\.\d+)?)?\s*s\b"
    r"|canary deadlines missed[^.]{0,40}?\d+(\.\d+)? s",
    re.I,
)


def _paragraphs(page: Path) -> list[str]:
    return re.split(r"\n\s*\n", page.read_text(encoding="utf-8"))


def _named(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_list_of_ladder_flags_in_the_docs_is_the_codes() -> None:
    checked = 0
    for page in PAGES:
        for para in _paragraphs(page):
            if "ladder" not in para.lower() or not LISTS_LADDER_FLAGS.search(para):
                continue
            checked += 1
            missing = [f for f in LADDER_FLAGS if not _named(para, f)]
            assert not missing, (
                f"{page.relative_to(ROOT)}: the ladder's flags without {missing}: {para[:120]!r}"
            )
    assert checked >= 2  # operations.md and the generated field reference at least


def test_hang_detection_latency_is_stated_only_in_the_benchmarks() -> None:
    """Stated in docs/benchmarks.md, where it is measured. The README's headline figure (issue 25:
    it says which kind of hang) is the one exception, and only beside its link to that section."""
    for page in PAGES:
        if page.name == "benchmarks.md":
            continue
        for para in _paragraphs(page):
            if page.name == "README.md" and "benchmarks.md#every-kind-of-hang" in para:
                continue
            match = HANG_LATENCY.search(para)
            assert match is None, (
                f"{page.relative_to(ROOT)} states a hang detection latency ({match.group(0)!r}):"
                " link docs/benchmarks.md instead, where it is measured"
            )
