"""Evidence before the kill (engine/evidence.py): py-spy stacks of a hung engine's processes (through
the real daemon: tests/system/test_evidence_system.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsupervisor.engine.commands import Restart
from llmsupervisor.engine.evidence import StackDump, dump_stacks, find_py_spy, write_incident
from tests.lib.runner_harness import Harness, S, run, spec

SLEEPER = "import time\ndef waiting_for_godot():\n    time.sleep(300)\nwaiting_for_godot()\n"


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPER]) for _ in range(2)]
    time.sleep(1.0)  # past the interpreter's start: py-spy needs its thread state
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_stacks_of_running_and_stopped_processes_and_of_the_gone(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    if find_py_spy() is None:
        pytest.skip("py-spy is not installed next to this python or on PATH")
    running, stopped = sleepers
    os.kill(stopped.pid, signal.SIGSTOP)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dumps = asyncio.run(dump_stacks([running.pid, stopped.pid, gone.pid], timeout_s=5))
    assert dumps is not None
    by_pid = {d.pid: d for d in dumps}
    assert by_pid[running.pid].ok and "waiting_for_godot" in by_pid[running.pid].text
    # A frozen process (SIGSTOP) is dumped too, and stays frozen.
    assert by_pid[stopped.pid].state.startswith("T")
    assert by_pid[stopped.pid].ok and "waiting_for_godot" in by_pid[stopped.pid].text
    assert "State:\tT" in Path(f"/proc/{stopped.pid}/status").read_text()
    assert not by_pid[gone.pid].ok and by_pid[gone.pid].text.startswith("py-spy failed")
    os.kill(stopped.pid, signal.SIGCONT)


def test_no_py_spy_is_none_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llmsupervisor.engine.evidence.find_py_spy", lambda: None)
    assert asyncio.run(dump_stacks([os.getpid()], timeout_s=1)) is None


def test_a_stuck_py_spy_is_cut_at_the_deadline(tmp_path: Path) -> None:
    stuck = tmp_path / "py-spy"
    stuck.write_text("#!/bin/sh\nsleep 30\n")
    stuck.chmod(0o755)
    started = time.monotonic()
    dumps = asyncio.run(dump_stacks([os.getpid(), os.getpid()], timeout_s=0.5, py_spy=str(stuck)))
    assert dumps is not None and [d.ok for d in dumps] == [False, False]
    assert "did not finish within 0.5 s" in dumps[0].text
    assert time.monotonic() - started < 20  # bounded (not a timing assertion: 30 s would be the bug)


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


def test_a_hang_restart_keeps_the_stacks_first_and_others_do_not(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        h.send(Restart(cause="operator", reason="asked"))
        await h.published(lambda s: s.state is S.STOPPING)
        await h.state(S.READY)
        assert h.procs.dumped == []  # a planned restart takes no evidence
        pid = h.status.pid
        h.send(Restart(cause="hang", reason="hang: canary missed", drain=False, failure=True))
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
