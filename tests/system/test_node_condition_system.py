"""GPU faults the engine cannot survive, through the real daemon with the fake GPU file: an XID 48
whose recovery action says reset, and a lost GPU, set the node condition at once (/readyz,
/engines/NAME/ready, status), and the engine is not restarted into READY on that GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lib.daemon import FAST_DETECTORS, cli, fake_engine, free_port, metric, write_gpu


@pytest.mark.system
def test_xid_48_with_recovery_action_gpu_reset_sets_the_condition_at_once(
    daemon_factory: Any, tmp_path: Path
) -> None:
    port = free_port()
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu)
    d = daemon_factory(
        {"engines": [fake_engine("a", port, gpus=[0], detectors=FAST_DETECTORS)]},
        run_args=("--fake-gpu", str(gpu)),
    )
    d.start()
    first = d.wait_state("a", "ready")
    assert httpx.get(d.http_url + "/readyz", timeout=5).status_code == 200
    # The GPU's verdict after the double-bit ECC error: reset (NVML field 230 = GPU_RESET).
    write_gpu(gpu, recovery_action=1, events=[{"id": 1, "gpu": 0, "xid": 48}])
    d.wait_log("node condition gpu_unrecoverable on GPU 0", timeout_s=30)
    ready = httpx.get(d.http_url + "/readyz", timeout=5)
    assert ready.status_code == 503
    assert ready.json()["reason"].startswith("gpu_unrecoverable on GPU 0 (GPU-fake-0000): gpu_fault (needs a")
    # Not restarted into READY on the un-reset GPU: stopped.
    d.wait_state("a", "stopped", timeout_s=30)
    assert d.engine("a")["pid"] != first["pid"] or d.engine("a").get("pid") is None
    assert "engine stopped, not restarted" in d.log()
    assert metric(d.http_url, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="0") == 1
    assert d.status()["node_conditions"][0]["uuid"] == "GPU-fake-0000"
    marks = json.loads((d.state_dir / "gpu-faults.json").read_text())
    assert len(marks["gpus"]["GPU-fake-0000"]["marks"]) == 1
    assert "unrecoverable" in marks["gpus"]["GPU-fake-0000"]
    assert d.stop() == 0


@pytest.mark.system
def test_a_lost_gpu_sets_the_node_condition_at_once(daemon_factory: Any, tmp_path: Path) -> None:
    p1, p2 = free_port(), free_port()
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"gpus": [{"index": 0}, {"index": 1}], "events": []}))
    d = daemon_factory(
        {
            "supervisor": {"readyz_requires": "any"},
            "engines": [
                fake_engine("a", p1, gpus=[0], detectors=FAST_DETECTORS),
                fake_engine("b", p2, gpus=[1], detectors=FAST_DETECTORS),
            ],
        },
        run_args=("--fake-gpu", str(gpu)),
    )
    d.start()
    d.wait_state("a", "ready")
    d.wait_state("b", "ready")
    # XID 79: GPU 1 fell off the bus.
    lost = {"gpus": [{"index": 0}, {"index": 1}], "events": [{"id": 1, "gpu": 1, "xid": 79}]}
    gpu.write_text(json.dumps(lost))
    d.wait_log("node condition gpu_unrecoverable on GPU 1", timeout_s=30)
    ready = httpx.get(d.http_url + "/readyz", timeout=5)
    # Not ready even under "any", with a on GPU 0 still in rotation: the node needs repair.
    assert ready.status_code == 503 and ready.json()["reason"].startswith(
        "gpu_unrecoverable on GPU 1 (GPU-fake-0001): gpu_lost"
    )
    assert httpx.get(d.http_url + "/engines/a/ready", timeout=5).status_code == 200
    assert httpx.get(d.http_url + "/engines/b/ready", timeout=5).status_code == 503
    assert metric(d.http_url, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="1") == 1
    assert metric(d.http_url, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="0") is None
    assert d.stop() == 0


@pytest.mark.system
def test_a_condition_from_earlier_in_the_boot_keeps_the_engine_stopped_until_cleared(
    daemon_factory: Any, tmp_path: Path
) -> None:
    port = free_port()
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu)
    engine = fake_engine("a", port, gpus=[0], detectors=FAST_DETECTORS)
    d = daemon_factory({"engines": [engine]}, run_args=("--fake-gpu", str(gpu)))
    d.start()
    d.wait_state("a", "ready")
    write_gpu(gpu, recovery_action=1, events=[{"id": 1, "gpu": 0, "xid": 48}])
    d.wait_log("node condition gpu_unrecoverable on GPU 0", timeout_s=30)
    d.wait_state("a", "stopped", timeout_s=30)
    # While the daemon runs, clearing is refused: the GPU is reset with the daemon stopped.
    refused = cli(d, "gpu", "clear", "GPU-fake-0000")
    assert refused.returncode == 75 and "stop it, reset the GPU" in refused.stderr
    assert d.stop() == 0

    # A daemon restart on the same boot, the GPU not reset (its action still says GPU_RESET):
    # the engine stays STOPPED, with the condition as its reason, and never reaches READY.
    write_gpu(gpu, recovery_action=1)
    d2 = daemon_factory({"engines": [engine]}, name="daemon2", run_args=("--fake-gpu", str(gpu)))
    d2.start()
    d2.wait_log("engine a not started: gpu_unrecoverable on GPU 0 (GPU-fake-0000)", timeout_s=30)
    stopped = d2.wait_state("a", "stopped", timeout_s=30)
    assert stopped["reason"].startswith("gpu_unrecoverable on GPU 0 (GPU-fake-0000)")
    assert "llm-supervisor gpu clear GPU-fake-0000" in stopped["reason"]
    assert stopped["pid"] is None and "a: STOPPED -> STARTING" not in d2.log()
    assert httpx.get(d2.http_url + "/readyz", timeout=5).status_code == 503
    assert d2.stop() == 0

    # The operator resets the GPU (its action now NONE), clears the condition, starts the daemon.
    write_gpu(gpu, recovery_action=0)
    unknown = cli(d2, "gpu", "clear", "GPU-fake-0001")
    assert unknown.returncode == 1 and "held: GPU-fake-0000" in unknown.stderr
    cleared = cli(d2, "gpu", "clear", "GPU-fake-0000")
    assert cleared.returncode == 0, cleared.stderr
    assert "GPU-fake-0000: condition cleared" in cleared.stdout
    marks = json.loads((d2.state_dir / "gpu-faults.json").read_text())
    assert "unrecoverable" not in marks["gpus"]["GPU-fake-0000"]
    assert len(marks["gpus"]["GPU-fake-0000"]["marks"]) == 1  # the history stays
    d3 = daemon_factory({"engines": [engine]}, name="daemon3", run_args=("--fake-gpu", str(gpu)))
    d3.start()
    d3.wait_state("a", "ready", timeout_s=30)
    assert d3.status()["node_conditions"] == []
    assert httpx.get(d3.http_url + "/readyz", timeout=5).status_code == 200
    assert d3.stop() == 0
