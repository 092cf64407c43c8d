"""Evidence before the kill (engine/evidence.py): the order of the moves, the incident files, and
the runner taking them over fake processes. The dumper itself: tests/unit/test_stacks.py; py-spy
over real processes is a system test (tests/system/test_stack_dumps.py), and so is the whole
through the real daemon (tests/system/test_evidence_system.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsupervisor.core.findings import Blame
from llmsupervisor.engine.commands import Restart
from llmsupervisor.engine.evidence import (
    CUT_FRONT_FIRST,
    STACKS_FIRST,
    Move,
    evidence_moves,
    write_incident,
)
from llmsupervisor.stacks import StackDump
from tests.lib.runner_harness import Harness, S, run, spec


def test_incidents_are_bounded_in_count_and_size(tmp_path: Path) -> None:
    big = StackDump(1, "VLLM::EngineCore", "S (sleeping)", True, "x" * 100_000)
    failed = StackDump(2, "VLLM::Worker", "T (stopped)", False, "py-spy failed: Permission denied")
    paths = [
        write_incident(
            tmp_path,
            engine="e",
            cause="hang",
            reason=f"hang: {i}",
            dumps=[big, failed],
            wall_time_s=1_700_000_000 + i,
            max_files=3,
            max_bytes=20_000,
        )
        for i in range(5)
    ]
    assert sorted(tmp_path.iterdir()) == paths[2:]  # the oldest are removed
    text = paths[-1].read_text()
    assert len(text.encode()) < 25_000
    assert "==== pid 1 [S (sleeping)] VLLM::EngineCore" in text and "[... cut at" in text
    assert "NO STACKS: py-spy failed: Permission denied" in text
    assert "processes: 2, stacks taken: 1" in text
    assert paths[-1].name == "20231114T221324.000Z-hang.txt"


def test_a_hang_that_blames_the_api_server_keeps_every_stack_first_and_others_do_not(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        h.send(Restart(cause="operator", reason="asked"))
        await h.published(lambda s: s.state is S.STOPPING)
        await h.state(S.READY)
        assert h.procs.dumped == []  # a planned restart takes no evidence
        pid = h.status.pid
        assert pid is not None
        blame = Blame(pid=pid)  # the stopped rule's stopped_pid: the API server itself
        h.send(Restart(cause="hang", reason="hang: canary missed", drain=False, failure=True, blame=blame))
        status = await h.published(lambda s: s.incidents_total == 1)
        assert h.procs.dumped == [[pid]]
        # Taken before the kill: the process had not been signalled yet.
        assert h.procs.signals_at_dump == [[]]
        assert h.procs.spawned[-1].signals  # and killed after
        assert status.last_incident is not None
        text = Path(status.last_incident).read_text()  # noqa: ASYNC240
        assert "cause: hang" in text and f"Thread {pid}: fake stack" in text
        assert Path(status.last_incident).parent == tmp_path / "engines" / "e" / "incidents"
        await h.close()

    run(scenario)


def _timeline(h: Harness, since: int) -> list[str]:
    return [what for _, what in h.procs.timeline[since:]]


def test_a_hung_engine_core_has_its_api_server_cut_before_the_stacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 27: the requests the hung engine holds are resent by the balancer once their
    connections close, so the API server dies first; the frozen rest keeps its stacks."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(), children=2)  # the API server, EngineCore, Worker
        await h.state(S.READY)
        proc = h.procs.spawned[-1]
        core, worker = (c.pid for c in proc.children)
        since = len(h.procs.timeline)
        h.send(Restart(cause="hang", reason="hang: frozen", drain=False, failure=True, blame=Blame()))
        status = await h.until(lambda s: s.state is S.READY and s.restarts_total == 1)
        assert _timeline(h, since) == [
            f"SIGSTOP {core}",
            f"SIGSTOP {worker}",
            "SIGKILL main",
            f"dump {core},{worker}",
            "SIGKILL group",  # no SIGTERM: a stopped process cannot act on one
        ]
        times = [t for t, _ in h.procs.timeline[since:]]
        assert times[2] == times[0]  # the front cut at once, not after the stacks
        assert times[4] == times[3]  # and the kill right after them
        assert all(child.stopped and not child.alive for child in proc.children)
        # The API server's death is this kill, not a new crash: one failure, no exit recorded.
        assert status.failures == 1 and status.last_exit is None
        assert status.restarts_by_reason == {"hang": 1}
        assert status.last_incident is not None
        text = Path(status.last_incident).read_text()  # noqa: ASYNC240
        assert f"==== pid {proc.pid} [killed]" in text and "front cut" in text
        assert f"Thread {core}: fake stack" in text and f"Thread {worker}: fake stack" in text
        await h.close()

    run(scenario)
    assert "front cut at 0.00 s" in caplog.text and "stacks of 2/2 stopped process(es)" in caplog.text


@pytest.mark.parametrize("leader", [True, False], ids=["stopped-pid-is-the-leader", "front-rule"])
def test_a_hang_of_the_api_server_is_dumped_whole_then_killed(tmp_path: Path, leader: bool) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(), children=2)
        await h.state(S.READY)
        proc = h.procs.spawned[-1]
        blame = Blame(pid=proc.pid) if leader else Blame(api_server=True)
        since = len(h.procs.timeline)
        h.send(Restart(cause="hang", reason="hang: front", drain=False, failure=True, blame=blame))
        await h.until(lambda s: s.state is S.READY and s.restarts_total == 1)
        core, worker = (c.pid for c in proc.children)
        # Every stack first (the API server's is the evidence), then SIGKILL: a stopped or
        # blocked API server acts on no SIGTERM.
        assert _timeline(h, since)[:2] == [f"dump {proc.pid},{core},{worker}", "SIGKILL group"]
        await h.close()

    run(scenario)


def test_a_stall_without_a_blamed_process_cuts_the_front_too(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(), children=1)
        await h.state(S.READY)
        (child,) = h.procs.spawned[-1].children
        since = len(h.procs.timeline)
        h.send(Restart(cause="stall", reason="stall: no progress", drain=False, failure=True))
        await h.until(lambda s: s.state is S.READY and s.restarts_total == 1)
        assert _timeline(h, since)[:3] == [f"SIGSTOP {child.pid}", "SIGKILL main", f"dump {child.pid}"]
        await h.close()

    run(scenario)


@pytest.mark.parametrize(
    ("blame", "moves"),
    [
        (None, CUT_FRONT_FIRST),
        (Blame(), CUT_FRONT_FIRST),
        (Blame(pid=7), CUT_FRONT_FIRST),  # a stopped EngineCore
        (Blame(pid=1), STACKS_FIRST),  # the leader stopped
        (Blame(api_server=True), STACKS_FIRST),
    ],
)
def test_the_order_of_the_evidence_is_data(blame: Blame | None, moves: tuple[Move, ...]) -> None:
    assert evidence_moves(blame, leader_pid=1) == moves


def test_without_py_spy_the_restart_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(), py_spy=False)
        await h.state(S.READY)
        h.send(Restart(cause="stall", reason="stall: no progress", drain=False, failure=True))
        status = await h.until(
            lambda s: s.state is S.READY and s.incarnation is not None and s.incarnation.number == 2
        )
        assert status.incidents_total == 0
        await h.close()

    run(scenario)
    assert "py-spy not found" in caplog.text


# ---- the real daemon with the fake vLLM ----------------------------------------------------------
