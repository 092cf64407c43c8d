"""GPU faults the engine cannot survive, through the real daemon with the fake GPU file: a second
critical XID, and a lost GPU at once, set the node condition (/readyz, /engines/NAME/ready, status)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lib.daemon import FAST_DETECTORS, fake_engine, free_port, metric, write_gpu


@pytest.mark.system
def test_a_second_critical_xid_sets_the_node_condition(daemon_factory: Any, tmp_path: Path) -> None:
    port = free_port()
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu)
    d = daemon_factory(
        {"engines": [fake_engine("a", port, gpus=[0], detectors=FAST_DETECTORS)]},
        run_args=("--fake-gpu", str(gpu)),
    )
    d.start()
    d.wait_state("a", "ready")
    assert httpx.get(d.http_url + "/readyz", timeout=5).status_code == 200
    first = [{"id": 1, "gpu": 0, "xid": 48}]
    write_gpu(gpu, events=first)
    d.wait_state("a", "ready", timeout_s=30, restarts_by_reason={"gpu_fault": 1})
    # One critical XID: the restart may have cleared it. Still ready, no condition.
    assert httpx.get(d.http_url + "/readyz", timeout=5).status_code == 200
    assert metric(d.http_url, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="0") is None
    write_gpu(gpu, events=[*first, {"id": 2, "gpu": 0, "xid": 48}])
    d.wait_log("node condition gpu_unrecoverable on GPU 0", timeout_s=30)
    ready = httpx.get(d.http_url + "/readyz", timeout=5)
    assert ready.status_code == 503
    assert ready.json()["reason"].startswith(
        "gpu_unrecoverable on GPU 0: gpu_fault (fault 2): GPU fault: xid 48"
    )
    engine = httpx.get(d.http_url + "/engines/a/ready", timeout=5)
    assert engine.status_code == 503 and engine.json()["reason"].startswith("gpu_unrecoverable on GPU 0")
    assert metric(d.http_url, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="0") == 1
    assert d.status()["node_conditions"][0]["gpu"] == 0
    marks = json.loads((d.state_dir / "gpu-faults.json").read_text())
    assert marks["0"]["count"] == 2 and "unrecoverable" in marks["0"]
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
        "gpu_unrecoverable on GPU 1: gpu_lost"
    )
    assert httpx.get(d.http_url + "/engines/a/ready", timeout=5).status_code == 200
    assert httpx.get(d.http_url + "/engines/b/ready", timeout=5).status_code == 503
    assert metric(d.http_url, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="1") == 1
    assert metric(d.http_url, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="0") is None
    assert d.stop() == 0
