"""The tiers keep to what docs/testing.md ("Tiers") says they hold, as far as the source shows it:
no test module imports another (shared code lives in tests/lib/), and no unit test starts the
daemon or its CLI (``python -m llmsupervisor``), a bench script or py-spy: those are system
tests. (tests/conftest.py refuses a module outside the tier folders and a marker of another tier.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.lib.paths import TESTS

TIERS = ("unit", "system", "fleet", "vllm", "host")
_TEST_IMPORT = re.compile(rf"^\s*(?:from|import)\s+tests\.(?:{'|'.join(TIERS)})\b", re.M)
# What a unit test may not start: the package as a program, a script under bench/, py-spy.
_NOT_UNIT = {
    "the daemon or its CLI as a process": re.compile(r"""["']-m["'],\s*["']llmsupervisor["']"""),
    "a bench script": re.compile(r"""REPO\s*/\s*["']bench["']|(?<!["'])["']bench/[\w/.-]+["']"""),
    "py-spy over a real process": re.compile(r"\bdump_stacks\(\[(?!os\.getpid\(\))"),
}


def modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (TESTS / folder).rglob("*.py"))


def test_the_patterns_read_what_they_mean() -> None:
    assert _TEST_IMPORT.search("from tests.unit.test_files import HeldDisk")
    assert _TEST_IMPORT.search("import tests.system.test_control")
    assert not _TEST_IMPORT.search("from tests.lib.held_disk import HeldDisk")
    argv = '[sys.executable, "-m", "llmsupervisor", "--config", str(path)]'
    assert _NOT_UNIT["the daemon or its CLI as a process"].search(argv)
    assert _NOT_UNIT["a bench script"].search('REPO / "bench" / "gpu_proof.py"')
    assert _NOT_UNIT["a bench script"].search('[sys.executable, "bench/fuzz_config.py"]')
    assert not _NOT_UNIT["a bench script"].search('"""bench/gpu_proof.py\'s runner, in this process')
    assert not _NOT_UNIT["a bench script"].search('"bench/results/overhead-<date>.{json,md}",')
    assert _NOT_UNIT["py-spy over a real process"].search("dump_stacks([running.pid], timeout_s=5)")
    assert not _NOT_UNIT["py-spy over a real process"].search("dump_stacks([os.getpid()], timeout_s=1)")


@pytest.mark.parametrize("tier", TIERS)
def test_no_test_module_imports_another(tier: str) -> None:
    found = [p.relative_to(TESTS).as_posix() for p in modules(tier) if _TEST_IMPORT.search(p.read_text())]
    assert found == [], "move what they share to tests/lib/"


def test_no_unit_test_starts_the_daemon_a_bench_script_or_py_spy() -> None:
    found = [
        f"tests/{p.relative_to(TESTS).as_posix()}: {what}"
        for p in modules("unit")
        if p.name != Path(__file__).name
        for what, pattern in _NOT_UNIT.items()
        if pattern.search(p.read_text())
    ]
    assert found == [], "a system test (docs/testing.md, 'Tiers')"
