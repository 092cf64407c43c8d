"""The status JSON's shape, pinned: `status --json`, STATE_DIR/status.json and the HTTP status
endpoints are read by scripts and dashboards, so a key may be added on purpose, never lost by a
refactor of how the status is assembled."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.node_condition import GPU_UNRECOVERABLE, NodeCondition
from llmsupervisor.core.policy import Action, ActionKind
from llmsupervisor.core.policy_memory import PolicyMemory
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon import status as daemon_status
from llmsupervisor.detectors import Finding, FindingKind, Severity
from llmsupervisor.detectors.load import ServedLoad
from llmsupervisor.engine.status import EngineLoad, EngineStatus, Incarnation
from llmsupervisor.probes.gpu_readings import GpuSample

TOP_KEYS = {
    "pid",
    "config",
    "engines",
    "gpu_faults_marked",
    "node_conditions",
    "state_files_unsaved",
    "nvml",
    "gpu_verdicts",
    "gpu_release",
}
ENGINE_KEYS = {
    "state", "hold", "phase", "reason", "for_s", "pid", "incarnation", "state_changes", "model", "port",
    "gpus", "hold_unsaved",
    "cpus", "in_rotation", "restarts", "restarts_by_reason", "canary_latency_s", "findings", "last_exit",
    "last_exit_age_s", "requests_running", "enabled", "wants_run", "meant_to_serve", "running",
    "start_timeout_s", "drain_timeout_s", "last_error_line",
    "last_failure", "batch_step", "batch_steps", "actions", "gpu_temperature_c", "gpu_power_w",
    "gpu_memory_used_bytes", "gpu_memory_total_bytes", "requests_waiting", "kv_usage_ratio", "ttft_p95_s",
    "held_by_operator", "canary_requests", "served", "incidents", "last_incident", "last_restart",
    "config_roll",
}  # fmt: skip
SERVED_KEYS = {
    "span_s", "requests_per_s", "prompt_tokens_per_s", "generation_tokens_per_s", "canary_requests",
}  # fmt: skip
NOW_S = 1_000.0


def busy_engine() -> EngineStatus:
    spec = EngineSpec(name="gpu0", model="org/m", gpus=(0, 1), port=8001, placement=(2, 3, 4))
    return EngineStatus(
        name="gpu0",
        spec=spec,
        state=EngineState.READY,
        state_reason="checks passed",
        state_since_s=NOW_S - 12.34,
        state_changes_total=3,
        incarnation=Incarnation(number=2, pid=4242, pgid=4242, step=1, started_s=900.0),
        findings=(
            Finding(
                engine="gpu0",
                kind=FindingKind.KV_PRESSURE,
                severity=Severity.WARNING,
                evidence={},
                since_s=990.0,
                summary="KV cache 97% full",
            ),
        ),
        ladder_step=1,
        ladder_steps=2,
        restarts_total=1,
        restarts_by_reason={"crash": 1},
        last_exit="exit code 1",
        last_exit_at_s=NOW_S - 100.0,
        canary_latency_s=0.125,
        canary_requests_total=40,
        served=ServedLoad(
            span_s=58.04,
            requests_per_s=2.5,
            prompt_tokens_per_s=400.0,
            generation_tokens_per_s=120.0,
            canary_requests=20,
        ),
        incidents_total=1,
        last_incident="/state/engines/gpu0/incidents/1.txt",
        load=EngineLoad(requests_running=3, requests_waiting=1, kv_usage_ratio=0.97, ttft_p95_s=0.2),
    )


def idle_engine() -> EngineStatus:
    spec = EngineSpec(name="off", model="org/m", gpus=(2,), port=8002, enabled=False)
    return EngineStatus(
        name="off", spec=spec, state=EngineState.STOPPED, state_reason="", state_since_s=0.0, wants_run=False
    )


def sample(gpu: int, temperature_c: int, memory_used_bytes: int) -> GpuSample:
    return GpuSample(
        index=gpu,
        uuid=f"GPU-{gpu}",
        name="H100",
        temperature_c=temperature_c,
        power_w=300.0,
        power_limit_w=700.0,
        sm_clock_mhz=None,
        mem_clock_mhz=None,
        clock_event_reasons=None,
        memory_used_bytes=memory_used_bytes,
        memory_total_bytes=80 << 30,
        utilization_gpu_pct=None,
        ecc_uncorrected_volatile=None,
        processes=None,
    )


def status_json(*statuses: EngineStatus) -> dict[str, Any]:
    memory = PolicyMemory()
    step_down = Action(engine="gpu0", kind=ActionKind.STEP_DOWN, reason="kv_pressure", detail="")
    memory.record(step_down, NOW_S, wall_s=1_790_000_100.0)
    samples = {0: sample(0, 71, 10 << 30), 1: sample(1, 88, 20 << 30)}
    return daemon_status.status_json(
        daemon_status.snapshot(
            statuses,
            now=NOW_S,
            memory=memory,
            gpu_samples=lambda gpus: {g: samples[g] for g in gpus if g in samples},
            gpu_faults_marked={1: 2},
            node_conditions=(NodeCondition(GPU_UNRECOVERABLE, 1, "xid 48 on GPU 1"),),
            counters=daemon_status.DaemonCounters(config_path="/etc/llm-supervisor/config.yaml"),
        )
    )


def test_the_status_json_keeps_its_keys() -> None:
    doc = status_json(busy_engine(), idle_engine())
    assert set(doc) == TOP_KEYS
    assert set(doc["engines"]) == {"gpu0", "off"}
    for engine in doc["engines"].values():
        assert set(engine) == ENGINE_KEYS
    assert set(doc["engines"]["gpu0"]["served"]) == SERVED_KEYS
    assert doc["engines"]["off"]["served"] is None


def test_the_status_json_values_for_a_busy_and_an_idle_engine() -> None:
    doc = status_json(busy_engine(), idle_engine())
    assert doc["config"] == "/etc/llm-supervisor/config.yaml"
    assert doc["gpu_faults_marked"] == {"1": 2}
    assert doc["node_conditions"][0]["gpu"] == 1
    # Issue 36 (M4): which way each GPU's faults are judged; these samples read no field 230.
    assert doc["gpu_verdicts"] == {"0": "xid_catalogue", "1": "xid_catalogue"}
    busy = doc["engines"]["gpu0"]
    assert busy == {
        **busy,
        "state": "ready",
        "phase": None,
        "reason": "checks passed",
        "for_s": 12.3,
        "pid": 4242,
        "incarnation": 2,
        "state_changes": 3,
        "model": "org/m",
        "port": 8001,
        "gpus": [0, 1],
        "cpus": "2-4",
        "in_rotation": True,
        "restarts": 1,
        "restarts_by_reason": {"crash": 1},
        "canary_latency_s": 0.125,
        "findings": [{"kind": "kv_pressure", "severity": "warning", "summary": "KV cache 97% full"}],
        "last_exit": "exit code 1",
        "last_exit_age_s": 100.0,
        "requests_running": 3,
        "requests_waiting": 1,
        "kv_usage_ratio": 0.97,
        "ttft_p95_s": 0.2,
        "enabled": True,
        "wants_run": True,
        "meant_to_serve": True,
        "running": True,
        "batch_step": 1,
        "batch_steps": 2,
        "actions": {"step_down/kv_pressure": 1},
        "gpu_temperature_c": 88.0,  # the hottest of its GPUs
        "gpu_power_w": 300.0,
        "gpu_memory_used_bytes": 30 << 30,  # summed over its GPUs
        "gpu_memory_total_bytes": 160 << 30,
        "held_by_operator": False,
        "canary_requests": 40,
        "incidents": 1,
        "last_incident": "/state/engines/gpu0/incidents/1.txt",
    }
    assert isinstance(busy["gpu_memory_used_bytes"], int)
    assert busy["served"]["span_s"] == 58.0
    idle = doc["engines"]["off"]
    assert idle["cpus"] is None and idle["pid"] is None and idle["incarnation"] is None
    assert idle["gpu_temperature_c"] is None and idle["gpu_memory_used_bytes"] is None
    assert idle["held_by_operator"] is True and idle["enabled"] is False
    assert idle["meant_to_serve"] is False and idle["running"] is False
    assert idle["actions"] == {} and idle["requests_running"] is None


def test_an_operator_hold_and_a_down_engine() -> None:
    held = dataclasses.replace(busy_engine(), held=True)
    assert status_json(held)["engines"]["gpu0"]["held_by_operator"] is True


def test_config_roll_says_per_engine_that_a_new_spec_waits_and_when_the_roll_is_halted() -> None:
    """Follow-up of the rolling reload: the status shows, per engine, that the config names another
    spec than the one running (the policy will roll it), and when the roll is halted."""
    gpu0 = busy_engine()
    new_spec = dataclasses.replace(gpu0.spec, port=9001)
    other = dataclasses.replace(gpu0, name="gpu1", spec=dataclasses.replace(gpu0.spec, name="gpu1"))
    off = idle_engine()
    specs = {
        "gpu0": new_spec,
        "gpu1": other.spec,
        "off": dataclasses.replace(off.spec, port=9002),  # stopped: takes it without a roll
    }
    assert daemon_status.config_roll((gpu0, other, off), specs, ()) == {"gpu0": "pending"}
    assert daemon_status.config_roll((gpu0, other, off), specs, ("gpu1",)) == {
        "gpu0": "halted",
        "gpu1": "failed",
    }
    fatal = dataclasses.replace(gpu0, state=EngineState.FATAL)  # not rolled (reload.py rolling)
    assert daemon_status.config_roll((fatal,), specs, ()) == {}
    snap = daemon_status.snapshot(
        (gpu0, other),
        now=NOW_S,
        memory=PolicyMemory(),
        gpu_samples=lambda gpus: {},
        gpu_faults_marked={},
        counters=daemon_status.DaemonCounters(),
        roll={"gpu0": "halted", "gpu1": "failed"},
    )
    doc = daemon_status.status_json(snap)
    assert doc["engines"]["gpu0"]["config_roll"] == "halted"
    assert doc["engines"]["gpu1"]["config_roll"] == "failed"


def test_the_status_file_has_a_written_at_time_and_a_dead_daemons_file_reads_as_stale(tmp_path: Any) -> None:
    """Issue 26 (11): status.json said READY after the daemon was killed; now it carries the
    daemon's pid and the wall clock of the write, and a reader whose pid is gone says so."""
    import asyncio
    import time

    path = tmp_path / "status.json"

    async def write() -> None:
        status_file = daemon_status.StatusFile(path)
        status_file.write(status_json(busy_engine()), now=NOW_S)
        await status_file.flush()

    before = time.time()
    asyncio.run(write())
    found = daemon_status.read_status_file(path)
    assert found is not None and found.daemon_alive  # this process wrote it
    assert found.written_at is not None and before <= found.written_at <= time.time()
    assert found.status["pid"] == os.getpid()
    dead = daemon_status.read_status_file(path, alive=lambda pid: False)
    assert dead is not None and not dead.daemon_alive
    assert dead.describe().startswith(f"daemon not running (pid {os.getpid()} is gone); last status at ")
    assert daemon_status.read_status_file(tmp_path / "none.json") is None
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert daemon_status.read_status_file(tmp_path / "junk.json") is None


def blind_snapshot() -> daemon_status.Snapshot:
    from llmsupervisor.probes.gpu_readings import NvmlHealth

    health = NvmlHealth(
        up=False,
        reason="reboot_pending",
        detail="the driver library and kernel module differ: reboot pending after a driver upgrade",
        since_s=NOW_S - 65.0,
        attempts=7,
        next_try_s=NOW_S + 12.0,
        hung=(3,),
        events_unwatched={2: "registering xid failed: NVMLError_Unknown: Unknown Error"},
        event_wait_errors=4,
        waiting={"gpu0": NOW_S + 235.0},
    )
    return dataclasses.replace(
        daemon_status.snapshot(
            (busy_engine(),),
            now=NOW_S,
            memory=PolicyMemory(),
            gpu_samples=lambda gpus: {},
            gpu_faults_marked={},
            counters=daemon_status.DaemonCounters(),
        ),
        nvml=health,
    )


def test_nvml_that_cannot_be_opened_is_in_the_status_the_summary_the_table_and_the_metrics() -> None:
    """Issue 36 (H1): blind is said wherever the operator looks."""
    from llmsupervisor.cli.render import format_status
    from llmsupervisor.daemon.exporter import Exporter

    snap = blind_snapshot()
    doc = daemon_status.status_json(snap)
    assert doc["nvml"] == {
        "up": False,
        "needed": True,
        "reason": "reboot_pending",
        "detail": "the driver library and kernel module differ: reboot pending after a driver upgrade",
        "for_s": 65.0,
        "attempts": 7,
        "next_try_in_s": 12.0,
        "gpus": 0,
        "engines_waiting": {"gpu0": 235.0},
        "hung_gpus": [3],
        "events_unwatched": {"2": "registering xid failed: NVMLError_Unknown: Unknown Error"},
        "event_wait_errors": 4,
    }
    line = daemon_status.nvml_line(snap.nvml, now=NOW_S)
    assert line == (
        "NVML unavailable (reboot_pending) for 1m05s, no GPU telemetry, retrying;"
        " gpu0 wait for it (3m55s left)"
    )
    assert daemon_status.summary(snap.engines, now=NOW_S, nvml=line).startswith(line + "; 1/1 engines ready")
    table = format_status(doc).splitlines()
    assert "NVML unavailable (reboot_pending) for 1m05s: no GPU telemetry" in table[-4]
    assert "reboot pending after a driver upgrade" in table[-4]
    assert table[-3] == "Waiting for NVML before starting (named by GPU index): gpu0 (3m55s left)"
    assert table[-2].startswith("GPU 3: NVML calls stopped answering")
    assert table[-1].startswith("GPU 2: XID events not seen")
    metrics = Exporter(lambda: snap).render().decode()
    assert 'llmsupervisor_nvml_up{reason="reboot_pending"} 0.0' in metrics
    assert "llmsupervisor_nvml_open_attempts_total 7.0" in metrics
    assert "llmsupervisor_engines_waiting_for_nvml 1.0" in metrics
    assert "llmsupervisor_nvml_event_wait_errors_total 4.0" in metrics
    assert 'llmsupervisor_nvml_hung_gpu{gpu="3"} 1.0' in metrics


def test_nvml_open_says_nothing_more() -> None:
    from llmsupervisor.cli.render import format_status
    from llmsupervisor.probes.gpu_readings import NvmlHealth

    snap = dataclasses.replace(
        blind_snapshot(), nvml=NvmlHealth(up=True, since_s=NOW_S - 5, attempts=1, gpus=2)
    )
    doc = daemon_status.status_json(snap)
    assert doc["nvml"]["up"] is True and doc["nvml"]["reason"] is None
    assert daemon_status.nvml_line(snap.nvml, now=NOW_S) is None
    assert "NVML" not in format_status(doc)


def test_a_host_with_no_engine_on_a_gpu_is_not_called_blind() -> None:
    """The vLLM CPU build on a host without NVML: nothing needs it, so STATUS= and the table say
    nothing of it (the JSON and /metrics still do)."""
    from llmsupervisor.cli.render import format_status

    snap = blind_snapshot()
    assert snap.nvml is not None
    cpu_only = dataclasses.replace(snap, nvml=dataclasses.replace(snap.nvml, needed=False, waiting={}))
    assert daemon_status.nvml_line(cpu_only.nvml, now=NOW_S) is None
    doc = daemon_status.status_json(cpu_only)
    assert doc["nvml"]["needed"] is False
    assert not any(line.startswith("NVML unavailable") for line in format_status(doc).splitlines())
