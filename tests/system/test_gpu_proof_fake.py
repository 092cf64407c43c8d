"""bench/gpu_proof.py (issue 24) run as a command with ``--fake``, against the pynvml-level fake
and no CUDA: every check prints one JSON line of the agreed shape, in order, with the CUDA parts
listed as skipped; check 7 runs the real daemon over a fake vLLM engine, its GPU telemetry from
``run --fake-gpu FILE`` that the check rewrites as a driver would (the engine's memory listed
under its PID, a foreign process, the release a moment after the engine exits). On a GPU machine
the same checks run against the driver, with real CUDA allocations (tests/host/test_gpu_proof.py);
the runner's error handling is a unit test (tests/unit/test_gpu_proof.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.lib.gpu_proof import CHECKS, LINE_KEYS
from tests.lib.paths import REPO

SCRIPT = REPO / "bench" / "gpu_proof.py"
QUICK = ["--burn-s", "0.5", "--event-waits", "1", "--event-wait-ms", "200", "--cost-samples", "5"]


def run_script(*args: str, timeout_s: float = 180) -> tuple[int, list[dict[str, Any]]]:
    """``bench/gpu_proof.py --fake ARGS`` run to its end: its exit code and its lines."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--fake", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.stdout, done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def check_shape(line: dict[str, Any]) -> None:
    assert set(line) == LINE_KEYS
    assert (
        isinstance(line["check"], int) and line["name"] == dict((n, s) for n, s, _ in CHECKS)[line["check"]]
    )
    assert isinstance(line["ok"], bool) and isinstance(line["elapsed_s"], float)
    for key in ("problems", "skipped", "notes"):
        assert isinstance(line[key], list) and all(isinstance(x, str) for x in line[key])
    assert line["error"] is None or isinstance(line["error"], str)
    assert isinstance(line["data"], dict)


def test_the_fake_run_prints_one_line_per_check_in_order_with_cuda_parts_skipped() -> None:
    rc, lines = run_script("--fake-gpus", "2", "--checks", "1,2,3,4,5,6,8", *QUICK)
    for line in lines:
        check_shape(line)
    assert [line["check"] for line in lines] == [1, 2, 3, 4, 5, 6, 8]
    assert [line["problems"] for line in lines] == [[]] * 7
    assert all(line["ok"] for line in lines), lines
    assert rc == 0
    facts, pids, mem, mapping, faults, thermal, cost = (line["data"] for line in lines)
    by = {line["check"]: line for line in lines}

    assert facts["fake"] is True and facts["driver_version"] and facts["nvidia_ml_py"]
    assert [g["index"] for g in facts["gpus"]] == [0, 1]
    assert set(facts["gpus"][0]) == {
        "index",
        "name",
        "uuid",
        "pci_bus_id",
        "mig_mode",
        "memory_total_bytes",
        "fabric",
    }
    # The fake's GPUs sit outside an NVSwitch fabric: both calls answer NotSupported (nvml.h).
    assert facts["gpus"][0]["fabric"] == {
        "versioned": {"error": "NVMLError_NotSupported"},
        "unversioned": {"error": "NVMLError_NotSupported"},
    }
    assert isinstance(facts["host_pid_namespace"], bool)

    # The holder ran for real (setsid parent, spawned grandchild); the fake listed the grandchild.
    holder = pids["holder"]
    assert holder["parent_sid"] == holder["parent_pid"] != holder["grandchild_pid"]
    assert (
        str(holder["grandchild_pid"]) in pids["nvml_pids"] and holder["grandchild_pid"] in pids["reader_pids"]
    )
    assert isinstance(pids["unlisted_after_exit_s"], float) and isinstance(
        pids["memory_fell_after_exit_s"], float
    )
    assert any("CUDA allocation" in s and "--fake" in s for s in by[2]["skipped"])

    assert mem["idle"]["reserved_mib"] == 512.0 and mem["idle"]["v1_minus_v2_used_mib"] == 512.0
    assert mem["held"]["v2_used_grew_gib"] == 10.0 and mem["held"]["reader"]["used"] == 10 * 1024**3

    assert [g["env"]["by_index"] for g in mapping["gpus"]] == ["0", "1"]
    assert len(by[4]["skipped"]) == 2  # one CUDA child per GPU

    assert [g["registered"] == g["supported_names"] for g in faults["gpus"]] == [True, True]
    assert faults["gpus"][0]["recovery_action"] == {"return": "NVML_SUCCESS", "value": 0, "name": "none"}
    assert len(faults["wait"]["waits_s"]) == 1 and faults["wait"]["samples_meanwhile"] > 0

    # The scripted hot, power-capped GPU 0 reached the detectors; default sustain opens nothing.
    # SW thermal alone is INFO (issue 36, M1: boost at the max operating temperature).
    assert {"thermal/info", "power_throttle/info"} <= set(thermal["detectors_raw"])
    assert thermal["burn"]["0"]["reasons_seen"] == ["sw_power_cap", "sw_thermal"]
    assert thermal["idle"]["1"]["reasons_seen"] == ["gpu_idle"]
    assert thermal["throttle_seconds_delta"]["269"] > 0
    assert thermal["thresholds"]["0"]["slowdown"] == 90
    assert thermal["findings_opened"] == []

    assert cost["gpus"] == 2 and cost["cpu_ms_per_gpu_sample"] >= 0 and cost["event_waits"] == 1


def test_the_daemon_check_runs_over_the_fake_gpu_file() -> None:
    rc, lines = run_script("--checks", "7", "--cpu-window-s", "1", timeout_s=300)
    (line,) = lines
    check_shape(line)
    assert (line["check"], line["name"], line["error"], line["problems"]) == (7, "daemon", None, []), line
    assert line["ok"] and rc == 0
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


def test_unknown_checks_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--fake", "--checks", "1,9"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "known checks are [1, 2, 3, 4, 5, 6, 7, 8]" in done.stderr
