"""The Processes seam over the host (engine/processes.py): what must not run on the loop. Its
signals to real processes are a system test (tests/system/test_process_groups.py)."""

from __future__ import annotations

import asyncio
import threading
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
