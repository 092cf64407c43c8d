"""bench/gpu_proof.py's check 7 (issue 24) with ``--fake``: the real daemon over a fake vLLM
engine, its GPU telemetry from ``run --fake-gpu FILE`` that the check rewrites as a driver would
(the engine's memory listed under its PID, a foreign process, the release a moment after the
engine exits). On a GPU machine the same check runs with a real CUDA allocation
(tests/host/test_gpu_proof.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.lib.gpu_proof import LINE_KEYS
from tests.lib.paths import REPO


def test_the_daemon_check_runs_over_the_fake_gpu_file() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu_proof.py"),
            "--fake",
            "--checks",
            "7",
            "--cpu-window-s",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    (line,) = [json.loads(x) for x in done.stdout.splitlines()]
    assert set(line) == LINE_KEYS
    assert (line["check"], line["name"], line["error"], line["problems"]) == (7, "daemon", None, []), line
    assert line["ok"] and done.returncode == 0
    data = line["data"]
    assert data["engine_cuda"] == {"cuda_visible_devices": "0", "cuda_device_order": "PCI_BUS_ID"}
    assert data["status_gpu_memory_used_bytes"] == 4 * 1024**3
    assert data["metrics"]["gpu_memory_used_bytes"] == 4 * 1024**3 and data["metrics"]["engine_info"] == 1.0
    assert data["foreign"]["finding"]["kind"] == "foreign_gpu_memory"
    assert str(data["foreign"]["pid"]) in data["foreign"]["finding"]["summary"]
    assert data["stop"]["rc"] == 0
    assert data["release_log"].startswith("GPU memory released ")
    assert data["daemon_cpu"]["cpu_s"] >= 0
    assert any("--fake" in s for s in line["skipped"])
