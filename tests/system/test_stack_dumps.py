"""py-spy over real processes (engine/evidence.py's ``dump_stacks``): the stacks of a running and
of a stopped interpreter (which stays stopped), a failure for a process that is gone, and a py-spy
that never finishes cut at the deadline. The rest of the evidence is a unit test
(tests/unit/engine/test_evidence.py)."""

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

from llmsupervisor.stacks import dump_stacks, find_py_spy

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


def test_a_stuck_py_spy_is_cut_at_the_deadline(tmp_path: Path) -> None:
    stuck = tmp_path / "py-spy"
    stuck.write_text("#!/bin/sh\nsleep 30\n")
    stuck.chmod(0o755)
    started = time.monotonic()
    dumps = asyncio.run(dump_stacks([os.getpid(), os.getpid()], timeout_s=0.5, py_spy=str(stuck)))
    assert dumps is not None and [d.ok for d in dumps] == [False, False]
    assert "did not finish within 0.5 s" in dumps[0].text
    assert time.monotonic() - started < 20  # bounded (not a timing assertion: 30 s would be the bug)
