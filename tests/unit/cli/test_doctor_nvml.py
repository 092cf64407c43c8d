"""`doctor` on NVML as a real box gets it wrong (issue 36): what the daemon does about NVML that is
not there yet, what the running daemon says of its GPUs, and GPUs NVML left out below an engine's
index."""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmsupervisor import doctor
from llmsupervisor.config import load_config
from llmsupervisor.doctor import Level
from llmsupervisor.errors import NvmlUnavailable
from llmsupervisor.probes.fake_gpu import FakeGpu, nominal_sample
from tests.lib.configs import write_config
from tests.lib.daemon import fake_engine, free_port


def test_nvml_not_there_says_what_the_daemon_will_do(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, [fake_engine("a", free_port(), gpus=[0])], nvml_wait_s=120))
    gone = FakeGpu(unavailable=NvmlUnavailable("driver_not_loaded", "the NVIDIA kernel module is not loaded"))
    (result,) = doctor.check_nvml(gone, config)
    assert result.level is Level.FAIL
    assert "the daemon keeps trying" in result.detail and "nvml_wait_s (120 s)" in result.detail


def test_an_engine_above_a_gpu_nvml_left_out_fails(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, [fake_engine("a", free_port(), gpus=[2])]))
    # NVML lists GPUs 0 and 2: it could not read GPU 1.
    left_out = FakeGpu({"GPU-fake-0000": [nominal_sample(0)], "GPU-fake-0002": [nominal_sample(2)]})
    results = doctor.check_nvml(left_out, config)
    assert [r.level for r in results] == [Level.OK, Level.FAIL]
    assert "NVML cannot read GPU(s) [1]" in results[1].detail and "will not start it" in results[1].detail


def status_file(tmp_path: Path, nvml: dict[str, object], pid: int) -> None:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "status.json").write_text(json.dumps({"pid": pid, "engines": {}, "nvml": nvml}))


def test_the_running_daemon_s_view_of_its_gpus(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, [fake_engine("a", free_port(), gpus=[0])], state_dir=str(tmp_path / "state")
    )
    config = load_config(path)
    assert doctor.check_daemon_gpus(config) == []  # no daemon
    blind = {
        "up": False,
        "reason": "driver_not_loaded",
        "detail": "the NVIDIA kernel module is not loaded",
        "for_s": 95.0,
        "engines_waiting": {"a": 205.0},
        "hung_gpus": [],
        "events_unwatched": {},
    }
    status_file(tmp_path, blind, os.getpid())
    (result,) = doctor.check_daemon_gpus(config)
    assert result.level is Level.FAIL
    assert result.detail == (
        f"the running daemon (pid {os.getpid()}) has had no GPU telemetry for 95 s: NVML unavailable"
        " (driver_not_loaded): the NVIDIA kernel module is not loaded; engines waiting for it: a"
    )
    trouble = {"up": True, "gpus": 2, "hung_gpus": [1], "events_unwatched": {"0": "the GPU is lost"}}
    status_file(tmp_path, trouble, os.getpid())
    hung, unwatched = doctor.check_daemon_gpus(config)
    assert hung.level is Level.FAIL and "GPU 1: NVML calls stopped answering" in hung.detail
    assert (
        unwatched.level is Level.WARN and "GPU 0: the daemon does not see its XID events" in unwatched.detail
    )
    waits = "fabric not ready on GPU 0: fabric manager not running? (...)"
    status_file(tmp_path, {"up": True, "gpus": 2, "engines_waiting_fabric": {"a": waits}}, os.getpid())
    (held,) = doctor.check_daemon_gpus(config)
    assert held.level is Level.FAIL and held.detail == f"the running daemon holds engine a: {waits}"
    released = {"up": False, "reason": "released", "detail": "released by alice for the reset of GPU 1"}
    status_file(tmp_path, released, os.getpid())
    (closed,) = doctor.check_daemon_gpus(config)  # `gpu release`: on purpose, a warning, not a FAIL
    assert closed.level is Level.WARN and "closed NVML on purpose: released by alice" in closed.detail
    status_file(tmp_path, {"up": True, "gpus": 2}, os.getpid())
    (fine,) = doctor.check_daemon_gpus(config)
    assert fine.level is Level.OK and "reads 2 GPU(s)" in fine.detail
    status_file(tmp_path, blind, 2**22 + 7)  # a dead daemon's file says nothing about now
    assert doctor.check_daemon_gpus(config) == []
