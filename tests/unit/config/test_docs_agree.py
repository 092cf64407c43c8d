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


# ---- issue 39 (6): what the reference says in prose, against the code ----

CONFIGURATION = ROOT / "docs" / "configuration.md"
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def _section(page: Path, title: str) -> str:
    text = page.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_the_keys_defaults_may_not_set_are_the_codes() -> None:
    from llmsupervisor.config.fields import PER_ENGINE_ONLY

    found = re.search(r"`defaults:` \*\*any engine key except (.*?)\*\*", CONFIGURATION.read_text(), re.S)
    assert found is not None
    assert set(re.findall(r"`(\w+)`", found.group(1))) == set(PER_ENGINE_ONLY)


def test_the_number_of_ladder_flags_said_is_the_codes() -> None:
    """ "the three ladder flags" outlived the fourth (max-num-active-seqs); the ones outside vLLM's
    compile key are counted apart."""
    from llmsupervisor.config.spec import COMPILE_KEY_FLAGS

    outside = len(LADDER_FLAGS) - len(COMPILE_KEY_FLAGS)
    said = [
        (page.name, NUMBERS[m.group(1).lower()], bool(m.group(2)))
        for page in PAGES
        for m in re.finditer(r"\b(\w+) ladder flags\b(\s+are\s+outside\s+the\s+key)?", page.read_text(), re.I)
        if m.group(1).lower() in NUMBERS
    ]
    assert said, "no page says how many ladder flags there are"
    assert all(n == (outside if apart else len(LADDER_FLAGS)) for _, n, apart in said), said


def test_what_venv_runs_is_what_the_launcher_chooses() -> None:
    from llmsupervisor.config.fields import ENGINE_FIELDS
    from llmsupervisor.config.launcher import choose

    what = " ".join(_section(CONFIGURATION, "What to run: `venv` or `command`").split())
    serve, module = (" ".join(choose("DIR", launcher).command) for launcher in ("serve", "module"))
    assert f"`{serve} MODEL`" in what and f"`{module}`" in what, what
    assert ENGINE_FIELDS["launcher"].default == "auto" and "`launcher: auto`, the default" in what, what


def test_the_canarys_answered_requests_are_said_to_be_kept_out_of_the_log() -> None:
    """The forwarder drops an answered canary's access line (engine/output.py is_own_canary_line):
    engines.md said only the three GETs were dropped, so the canary's completions seemed to stay."""
    from llmsupervisor.engine import output

    assert hasattr(output, "is_own_canary_line")
    section = " ".join(_section(ROOT / "docs" / "engines.md", "Access-log filtering").split())
    assert "the access line of each canary that was answered" in section, section
    assert "Every other access line stays: users' completions" in section, section
