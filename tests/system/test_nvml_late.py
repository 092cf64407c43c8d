"""A driver that loads after the daemon (issue 36, H1): the real daemon with ``--fake-gpu``, whose
file makes ``nvmlInit`` answer DRIVER_NOT_LOADED until the test drops it. Blind is said in
``status``, ``status --json`` and ``/metrics``; the engine named by GPU index waits, then starts
once NVML opens, with GPU telemetry, and the daemon never restarts. And an HGX box whose Fabric
Manager is late (M6): the engine on a GPU whose fabric is not registered waits for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.lib.daemon import cli, fake_engine, free_port, metric, wait_for

pytestmark = pytest.mark.system


def test_a_driver_that_loads_after_the_daemon(daemon_factory: Any, tmp_path: Path) -> None:
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"init_error": "DriverNotLoaded", "gpus": [{"index": 0}], "events": []}))
    d = daemon_factory(
        {"supervisor": {"nvml_wait_s": 300}, "engines": [fake_engine("a", free_port(), gpus=[0])]},
        run_args=("--fake-gpu", str(gpu)),
    )
    d.start()
    waiting = d.wait_state("a", "stopped", timeout_s=30)
    assert "waiting for NVML" in waiting["reason"]
    wait_for(lambda: d.status()["nvml"]["attempts"] >= 2, timeout_s=30, what="a second try")
    nvml = d.status()["nvml"]
    assert nvml["up"] is False and nvml["reason"] == "driver_not_loaded" and "a" in nvml["engines_waiting"]
    assert metric(d.http_url, "llmsupervisor_nvml_up", reason="driver_not_loaded") == 0
    shown = cli(d, "status")
    assert "NVML unavailable (driver_not_loaded)" in shown.stdout, shown.stdout + shown.stderr
    assert "Waiting for NVML before starting (named by GPU index): a" in shown.stdout

    gpu.write_text(json.dumps({"gpus": [{"index": 0, "temperature_c": 55}], "events": []}))
    d.wait_state("a", "ready", timeout_s=60)
    wait_for(lambda: d.engine("a").get("gpu_temperature_c") == 55, timeout_s=30, what="GPU telemetry")
    assert d.status()["nvml"]["up"] is True
    assert metric(d.http_url, "llmsupervisor_nvml_up", reason="") == 1
    assert "NVML opened after" in d.log()
    assert d.engine("a")["restarts"] == 0
    assert d.stop() == 0


def test_an_engine_waits_for_its_gpus_fabric_then_starts(daemon_factory: Any, tmp_path: Path) -> None:
    """Issue 36, M6: an HGX box whose Fabric Manager is not running (``--fake-gpu`` with GPU 0's
    fabric NOT_STARTED). The engine on it does not start (CUDA would fail with error 802), and
    ``status`` and ``/metrics`` say why; once the fabric reads COMPLETED it starts, no restart."""
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"gpus": [{"index": 0, "fabric": "not_started"}], "events": []}))
    d = daemon_factory(
        {"engines": [fake_engine("a", free_port(), gpus=[0])]}, run_args=("--fake-gpu", str(gpu))
    )
    d.start()
    waiting = d.wait_state("a", "stopped", timeout_s=30)
    assert waiting["reason"].startswith("fabric not ready on GPU 0: fabric manager not running?"), waiting
    nvml = d.status()["nvml"]
    assert nvml["fabric"] == {"0": "not_started"} and set(nvml["engines_waiting_fabric"]) == {"a"}
    assert metric(d.http_url, "llmsupervisor_gpu_fabric_ready", gpu="0") == 0
    shown = cli(d, "status")
    assert "Waiting for the GPU fabric before starting: a: fabric not ready on GPU 0" in shown.stdout, (
        shown.stdout + shown.stderr
    )

    gpu.write_text(json.dumps({"gpus": [{"index": 0, "fabric": "completed"}], "events": []}))
    d.wait_state("a", "ready", timeout_s=60)
    assert metric(d.http_url, "llmsupervisor_gpu_fabric_ready", gpu="0") == 1
    assert d.status()["nvml"]["engines_waiting_fabric"] == {}
    assert d.engine("a")["restarts"] == 0
    assert d.stop() == 0
