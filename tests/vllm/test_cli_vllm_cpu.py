"""`llm-supervisor restart --wait` against the real vLLM CPU build: it reaches READY, and its
progress showed a start phase read from vLLM's own log lines (engine/output.py). One engine,
its own daemon: minutes on 2 cores (run it under the heavy lock)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.lib.daemon import Daemon, free_port
from tests.lib.vllm_env import READY_TIMEOUT_S, build_model, vllm_engine, vllm_python

pytestmark = pytest.mark.vllm_cpu

LOG_PHASES = ("loading weights", "compiling", "capturing graphs", "listening")


def test_restart_wait_on_real_vllm_reaches_ready_showing_phases(tmp_path: Path) -> None:
    python = vllm_python()
    model = build_model(python, "tiny")
    home = tmp_path / "home"
    home.mkdir()
    config = {
        "supervisor": {"tick_interval_s": 1.0, "shutdown_timeout_s": 120},
        # The compile cache of test_vllm_cpu's e1: warm when that ran before.
        "engines": [vllm_engine("e1", free_port(), model, home)],
    }
    d = Daemon(tmp_path, config)
    d.start()
    try:
        d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
        first = d.engine("e1")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmsupervisor",
                "restart",
                "e1",
                "--wait",
                "--config",
                str(d.config_path),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=READY_TIMEOUT_S + 60,
        )
        print(out.stdout)  # the progress as the operator saw it (pytest -rP shows it)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("e1: restart accepted; draining")
        assert lines[-1] == "e1: READY (restart done)"
        starting = [line for line in lines if line.startswith("e1 STARTING ")]
        assert any(f": {phase} " in line for line in starting for phase in LOG_PHASES), lines
        again = d.engine("e1")
        assert again["state"] == "ready" and again["incarnation"] == first["incarnation"] + 1
        assert again["phase"] is None  # only while STARTING
        assert d.stop() == 0
    finally:
        d.cleanup()
