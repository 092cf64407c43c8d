"""Resetting one GPU while the daemon runs (issue 36 point 8, M7), through the real daemon with
``--fake-gpu`` and the real CLI: `gpu release 1` stops the engine on GPU 1 (drained, held) and
closes NVML, which the fake GPU file shows (``FILE.held`` goes: the test's stand-in for
`nvidia-smi -r` refuses while it is there, as the real one refuses a GPU any process holds);
the engine on GPU 0 serves throughout; `gpu take-back 1` opens NVML again, clears the condition
and starts the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lib.daemon import FAST_DETECTORS, cli, fake_engine, free_port, metric, wait_for

pytestmark = pytest.mark.system


def write_gpus(
    path: Path, *, gpu1: dict[str, Any] | None = None, events: list[dict[str, Any]] | None = None
) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": [{"index": 0}, {"index": 1, **(gpu1 or {})}], "events": events or []}))
    tmp.replace(path)


def nvidia_smi_reset(path: Path) -> None:
    """`nvidia-smi -r -i GPU-fake-0001` against the fake: refused while the daemon holds NVML,
    else GPU 1 comes back with no recovery action."""
    held = path.with_name(path.name + ".held")
    assert not held.exists(), f"GPU in use by another client (pid {held.read_text().strip()})"
    write_gpus(path, gpu1={"recovery_action": 0})


def test_one_gpu_is_reset_while_the_daemon_and_the_other_engine_run(
    daemon_factory: Any, tmp_path: Path
) -> None:
    gpu = tmp_path / "gpu.json"
    write_gpus(gpu)
    held = gpu.with_name(gpu.name + ".held")
    ports = {"a": free_port(), "b": free_port()}
    engines = [
        fake_engine(n, port, gpus=[i], detectors=FAST_DETECTORS) for i, (n, port) in enumerate(ports.items())
    ]
    d = daemon_factory({"engines": engines}, run_args=("--fake-gpu", str(gpu)))
    d.start()
    a = d.wait_state("a", "ready")
    d.wait_state("b", "ready")
    assert held.exists()
    # GPU 1 asks for a reset after a double-bit ECC error: its condition, b stopped.
    write_gpus(gpu, gpu1={"recovery_action": 1}, events=[{"id": 1, "gpu": 1, "xid": 48}])
    d.wait_log("node condition gpu_unrecoverable on GPU 1", timeout_s=30)
    d.wait_state("b", "stopped", timeout_s=30)
    with pytest.raises(AssertionError, match="in use"):
        nvidia_smi_reset(gpu)

    released = cli(d, "gpu", "release", "1")
    assert released.returncode == 0, released.stdout + released.stderr
    assert "nvidia-smi -r -i GPU-fake-0001" in released.stdout
    assert "llm-supervisor gpu take-back 1" in released.stdout
    assert not held.exists()  # the daemon let go of NVML
    status = d.status()
    assert status["gpu_release"]["phase"] == "released" and status["nvml"]["reason"] == "released"
    assert status["engines"]["b"]["hold"]["gpu_reset"] == {"gpu": 1, "uuid": "GPU-fake-0001"}
    assert metric(d.http_url, "llmsupervisor_nvml_up", reason="released") == 0
    shown = cli(d, "status")
    assert "GPU 1 released for its reset" in shown.stdout, shown.stdout
    described = cli(d, "describe", "b")
    assert "for the reset of GPU 1" in described.stdout and "GPU release:" in described.stdout
    refused = cli(d, "start", "b")
    assert refused.returncode == 1 and "take it back first" in refused.stderr
    assert httpx.get(f"http://127.0.0.1:{ports['a']}/health", timeout=5).status_code == 200

    nvidia_smi_reset(gpu)
    taken = cli(d, "gpu", "take-back", "1")
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert "gpu_unrecoverable cleared" in taken.stdout and "started b" in taken.stdout
    d.wait_state("b", "ready", timeout_s=30)
    wait_for(lambda: d.status()["node_conditions"] == [], timeout_s=10, what="the condition cleared")
    assert held.exists()
    assert d.engine("b")["hold"] is None
    after = d.engine("a")
    assert after["pid"] == a["pid"] and after["restarts"] == 0
    assert httpx.get(d.http_url + "/readyz", timeout=5).status_code == 200
    log = d.log()
    assert "GPU 1 (GPU-fake-0001) release for its reset" in log and "GPU 1 (GPU-fake-0001) taken back" in log
    assert d.stop() == 0
