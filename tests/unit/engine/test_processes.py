"""The Processes seam over the host (engine/processes.py): what must not run on the loop."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmsupervisor import process
from llmsupervisor.engine.processes import HostProcesses


def test_the_sweep_for_strays_runs_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It reads every process's environment: on a loaded host it once took 6.7 s on the loop,
    and HAProxy's checks on the HTTP listener went unanswered (the other engine marked down)."""
    on_main: list[bool] = []

    def sweep(state_dir: Path, *, engine: str) -> list[int]:
        on_main.append(threading.current_thread() is threading.main_thread())
        return [100, 200]

    monkeypatch.setattr(process, "marker_processes", sweep)
    assert asyncio.run(HostProcesses(tmp_path).strays("e", leader=100)) == [200]
    assert on_main == [False]


def test_signal_each_stops_the_living_and_skips_the_gone(tmp_path: Path) -> None:
    """The freeze before an engine's stacks (engine/evidence.py): SIGSTOP to each member."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        HostProcesses(tmp_path).signal_each([gone.pid, sleeper.pid], signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while "State:\tT" not in Path(f"/proc/{sleeper.pid}/status").read_text():
            assert time.monotonic() < deadline, "never stopped"
            time.sleep(0.01)
    finally:
        sleeper.kill()  # SIGKILL ends a stopped process too
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
