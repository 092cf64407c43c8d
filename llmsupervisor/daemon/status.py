"""The daemon's state as others see it: the snapshot, the status JSON, the one-line summary.

Every projection here is a function of the engines' published statuses (engine/status.py) plus
the daemon's own counters: nothing reads a runner. A snapshot is built per reader call (an
HTTP scrape, a status request, a status-file write) from those immutable values, so a reader
can never see a half-updated engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from llmsupervisor.core.node_condition import NodeCondition
from llmsupervisor.core.placement import format_cpu_list
from llmsupervisor.core.policy_memory import PolicyMemory
from llmsupervisor.core.state import EngineState
from llmsupervisor.detectors.load import ServedLoad
from llmsupervisor.engine.status import EngineStatus
from llmsupervisor.files import remove_stale_temporaries, write_json_atomic
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.nvml import GpuSample

log = logging.getLogger("llmsupervisor")

STATUS_REFRESH_S: Final = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot:
    name: str
    state: EngineState
    state_reason: str
    state_age_s: float  # seconds in the current state
    gpus: tuple[int, ...]
    port: int
    pid: int | None
    cpus: tuple[int, ...] = ()  # the CPUs the engine is bound to (none: not placed)
    # Hang/stall evidence kept before a kill (engine/evidence.py), and the newest file.
    incidents_total: int = 0
    last_incident: str | None = None
    restarts_total: int
    # Restarts by cause: "crash", "health", "start_failed", "operator", "config_change", ...
    restarts_by_reason: Mapping[str, int] = field(default_factory=dict)
    state_changes_total: int = 0
    last_exit: str | None = None
    last_failure: str | None = None
    # Whether a load balancer should send this engine traffic (READY and not shedding load).
    in_rotation: bool = False
    canary_latency_s: float | None = None
    # Active findings as (kind, severity, summary), e.g. ("hang", "critical", "canary missed ...").
    findings: tuple[tuple[str, str, str], ...] = ()
    # Batch-size ladder: 0 is the engine's own flags, n is n steps down (of ladder_steps).
    ladder_step: int = 0
    ladder_steps: int = 0
    # Automatic actions by (kind, reason), and the wall-clock time of the last of each kind.
    actions_total: Mapping[tuple[str, str], int] = field(default_factory=dict)
    last_action_at: Mapping[str, float] = field(default_factory=dict)
    # The hottest / most power-hungry of the engine's GPUs (None without NVML).
    gpu_temperature_c: float | None = None
    gpu_power_w: float | None = None
    # GPU memory in use and in all, summed over the engine's GPUs (None without NVML).
    gpu_memory_used_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None
    model: str = ""  # the served model name (what /v1/models lists)
    start_phase: str | None = None  # while STARTING: spawned, loading weights, ... (engine/output.py)
    incarnation: int | None = None  # the live spawn's number (1, 2, ...), None without a process
    last_exit_age_s: float | None = None  # seconds since last_exit happened
    enabled: bool = True
    wants_run: bool = True  # the engine is meant to run (not stopped by an operator or config)
    drain_timeout_s: float = 0.0
    # Load, while the engine is observed (None: unknown): the autoscaling gauges.
    requests_running: int | None = None
    requests_waiting: int | None = None
    kv_usage_ratio: float | None = None
    ttft_p95_s: float | None = None
    # An operator holds the engine out of service: drained (`drain`), or stopped / disabled
    # (it is not meant to run). Alerts on a down engine leave such an engine alone.
    held_by_operator: bool = False
    start_timeout_s: float = 0.0  # the engine's start deadline: a start within it is not "down"
    down_s: float = 0.0  # seconds meant to serve and not serving (0 while serving or held)
    canary_requests_total: int = 0  # the supervisor's own canaries: in vLLM's counters, not traffic
    served: ServedLoad | None = None  # the last minute's traffic, canaries excluded


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    engines: tuple[EngineSnapshot, ...]
    ticks_total: int = 0
    last_tick_duration_s: float = 0.0
    notify_failures_total: int = 0
    config_path: str = ""
    config_loaded_timestamp_s: float = 0.0  # wall clock, for a *_timestamp_seconds gauge
    reloads_total: Mapping[str, int] = field(default_factory=dict)  # by result: "ok", "invalid"
    gpu_faults_marked: Mapping[int, int] = field(default_factory=dict)  # GPU index -> faults
    node_conditions: tuple[NodeCondition, ...] = ()  # GPUs handed to node-level remediation
    probe_errors_total: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (probe, error)
    open_fds: int | None = None  # None when it could not be read (out of descriptors)
    fds_limit: int | None = None  # the soft RLIMIT_NOFILE

    def engine(self, name: str) -> EngineSnapshot | None:
        return next((e for e in self.engines if e.name == name), None)


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonCounters:
    ticks_total: int = 0
    last_tick_duration_s: float = 0.0
    notify_failures_total: int = 0
    config_path: str = ""
    config_loaded_timestamp_s: float = 0.0
    reloads_total: Mapping[str, int] = field(default_factory=dict)
    probe_errors_total: Mapping[tuple[str, str], int] = field(default_factory=dict)
    open_fds: int | None = None
    fds_limit: int | None = None


def descriptor_usage() -> tuple[int | None, int | None]:
    """(open descriptors, soft limit) of this process; None where it cannot be read (listing
    /proc/self/fd needs a descriptor itself, which is exactly what is missing at EMFILE)."""
    import resource

    try:
        open_fds: int | None = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        open_fds = None
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = -1
    return open_fds, (soft if soft >= 0 else None)


GpuSamples = Callable[[Iterable[int]], Mapping[int, GpuSample | ProbeFailure]]


def _gpu_max(samples: GpuSamples, gpus: tuple[int, ...], attribute: str) -> float | None:
    values = [
        getattr(sample, attribute)
        for sample in samples(gpus).values()
        if isinstance(sample, GpuSample) and getattr(sample, attribute) is not None
    ]
    return float(max(values)) if values else None


def _gpu_sum(samples: GpuSamples, gpus: tuple[int, ...], attribute: str) -> int | None:
    values = [
        getattr(sample, attribute)
        for sample in samples(gpus).values()
        if isinstance(sample, GpuSample) and getattr(sample, attribute) is not None
    ]
    return int(sum(values)) if values else None


def snapshot(
    statuses: Sequence[EngineStatus],
    *,
    now: float,
    memory: PolicyMemory,
    gpu_samples: GpuSamples,
    gpu_faults_marked: Mapping[int, int],
    counters: DaemonCounters,
    node_conditions: tuple[NodeCondition, ...] = (),
) -> Snapshot:
    return Snapshot(
        engines=tuple(
            EngineSnapshot(
                name=s.name,
                state=s.state,
                state_reason=s.state_reason,
                state_age_s=now - s.state_since_s,
                gpus=s.spec.gpus,
                cpus=s.spec.placement,
                incidents_total=s.incidents_total,
                last_incident=s.last_incident,
                port=s.spec.port,
                pid=s.pid,
                restarts_total=s.restarts_total,
                restarts_by_reason=dict(s.restarts_by_reason),
                state_changes_total=s.state_changes_total,
                last_exit=s.last_exit,
                last_failure=s.last_failure,
                in_rotation=s.in_rotation,
                canary_latency_s=s.canary_latency_s,
                findings=tuple((f.kind.value, f.severity.value, f.summary) for f in s.findings),
                ladder_step=s.ladder_step,
                ladder_steps=s.ladder_steps,
                actions_total=dict(memory.of(s.name).actions_total),
                last_action_at=dict(memory.of(s.name).last_action_at),
                gpu_temperature_c=_gpu_max(gpu_samples, s.spec.gpus, "temperature_c"),
                gpu_power_w=_gpu_max(gpu_samples, s.spec.gpus, "power_w"),
                gpu_memory_used_bytes=_gpu_sum(gpu_samples, s.spec.gpus, "memory_used_bytes"),
                gpu_memory_total_bytes=_gpu_sum(gpu_samples, s.spec.gpus, "memory_total_bytes"),
                model=s.spec.model_id,
                start_phase=s.start_phase,
                incarnation=s.incarnation.number if s.incarnation is not None else None,
                last_exit_age_s=now - s.last_exit_at_s if s.last_exit_at_s is not None else None,
                enabled=s.spec.enabled,
                wants_run=s.wants_run,
                drain_timeout_s=s.spec.drain_timeout_s,
                requests_running=s.load.requests_running if s.load else None,
                requests_waiting=s.load.requests_waiting if s.load else None,
                kv_usage_ratio=s.load.kv_usage_ratio if s.load else None,
                ttft_p95_s=s.load.ttft_p95_s if s.load else None,
                held_by_operator=s.held or not s.wants_run,
                start_timeout_s=s.spec.start_timeout_s,
                down_s=max(0.0, now - s.down_since_s) if s.down_since_s is not None else 0.0,
                canary_requests_total=s.canary_requests_total,
                served=s.served,
            )
            for s in statuses
        ),
        gpu_faults_marked=dict(gpu_faults_marked),
        node_conditions=node_conditions,
        ticks_total=counters.ticks_total,
        last_tick_duration_s=counters.last_tick_duration_s,
        notify_failures_total=counters.notify_failures_total,
        config_path=counters.config_path,
        config_loaded_timestamp_s=counters.config_loaded_timestamp_s,
        reloads_total=dict(counters.reloads_total),
        probe_errors_total=dict(counters.probe_errors_total),
        open_fds=counters.open_fds,
        fds_limit=counters.fds_limit,
    )


def status_json(snap: Snapshot) -> dict[str, Any]:
    """The snapshot as JSON: the status file, and `llm-supervisor status --json`."""
    return {
        "pid": os.getpid(),
        "config": snap.config_path,
        "engines": {
            e.name: {
                "state": e.state.value,
                "phase": e.start_phase,
                "reason": e.state_reason,
                "for_s": round(e.state_age_s, 1),
                "pid": e.pid,
                "incarnation": e.incarnation,
                "state_changes": e.state_changes_total,
                "model": e.model,
                "port": e.port,
                "gpus": list(e.gpus),
                "cpus": format_cpu_list(e.cpus) if e.cpus else None,
                "in_rotation": e.in_rotation,
                "restarts": e.restarts_total,
                "restarts_by_reason": dict(e.restarts_by_reason),
                "canary_latency_s": e.canary_latency_s,
                "findings": [{"kind": k, "severity": sev, "summary": text} for k, sev, text in e.findings],
                "last_exit": e.last_exit,
                "last_exit_age_s": round(e.last_exit_age_s, 1) if e.last_exit_age_s is not None else None,
                "requests_running": e.requests_running,
                "enabled": e.enabled,
                "wants_run": e.wants_run,
                "start_timeout_s": e.start_timeout_s,
                "drain_timeout_s": e.drain_timeout_s,
                "last_failure": e.last_failure,
                "batch_step": e.ladder_step,
                "batch_steps": e.ladder_steps,
                "actions": {f"{kind}/{reason}": n for (kind, reason), n in sorted(e.actions_total.items())},
                "gpu_temperature_c": e.gpu_temperature_c,
                "gpu_power_w": e.gpu_power_w,
                "gpu_memory_used_bytes": e.gpu_memory_used_bytes,
                "gpu_memory_total_bytes": e.gpu_memory_total_bytes,
                "requests_waiting": e.requests_waiting,
                "kv_usage_ratio": e.kv_usage_ratio,
                "ttft_p95_s": e.ttft_p95_s,
                "held_by_operator": e.held_by_operator,
                "canary_requests": e.canary_requests_total,
                "served": _served_json(e.served),
                "incidents": e.incidents_total,
                "last_incident": e.last_incident,
            }
            for e in snap.engines
        },
        "gpu_faults_marked": {str(g): n for g, n in sorted(snap.gpu_faults_marked.items())},
        "node_conditions": [c.as_json() for c in snap.node_conditions],
    }


def _served_json(served: ServedLoad | None) -> dict[str, Any] | None:
    """Requests and tokens per second over the last minute, the canaries taken out."""
    if served is None:
        return None

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {
        "span_s": round(served.span_s, 1),
        "requests_per_s": rounded(served.requests_per_s),
        "prompt_tokens_per_s": rounded(served.prompt_tokens_per_s),
        "generation_tokens_per_s": rounded(served.generation_tokens_per_s),
        "canary_requests": served.canary_requests,
    }


def summary(statuses: Sequence[EngineStatus], *, now: float, reload_problem: str | None = None) -> str:
    """One line for STATUS=, e.g. ``1/2 engines ready; gpu1 starting (2m10s)``."""
    enabled = [s for s in statuses if s.spec.enabled]
    ready = sum(1 for s in enabled if s.state is EngineState.READY)
    parts = [f"{ready}/{len(enabled)} engines ready"]
    if reload_problem:
        parts.insert(0, reload_problem)
    for s in statuses:
        if s.state is EngineState.READY or (s.state is EngineState.STOPPED and not s.spec.enabled):
            continue
        age_s = int(now - s.state_since_s)
        text = f"{s.name} {s.state.value} ({age_s // 60}m{age_s % 60:02d}s)"
        if s.state is EngineState.STARTING and s.start_phase:
            text += f": {s.start_phase}"
        if s.state in (EngineState.BACKOFF, EngineState.FATAL) and s.last_failure:
            text += f": {s.last_failure[:80]}"
        elif s.state in (EngineState.SHEDDING, EngineState.DRAINING):
            text += f": {s.state_reason[:80]}"
        parts.append(text)
    return "; ".join(parts)


class StatusFile:
    """``STATE_DIR/status.json``, rewritten when something in it changed (the ages aside), or
    every STATUS_REFRESH_S for the ages: not a disk write on every tick.

    The write itself runs in a thread, one at a time, always with the newest content: a write
    blocks when the disk is busy (the kernel throttles writers while a vLLM engine saves its
    compile cache), and the loop must keep answering load balancers meanwhile."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # A daemon killed mid-write (SIGKILL) left its temporary file; nothing else removes it.
        remove_stale_temporaries(path)
        self._written: str | None = None
        self._written_at_s = 0.0
        self._pending: dict[str, Any] | None = None
        self._writer: asyncio.Task[None] | None = None

    def write(self, status: dict[str, Any], *, now: float) -> None:
        content = json.dumps(
            # Ages and rates move every tick: refreshed every STATUS_REFRESH_S, not every change.
            {
                **status,
                "engines": {
                    n: {**e, "for_s": None, "last_exit_age_s": None, "served": None}
                    for n, e in status["engines"].items()
                },
            },
            sort_keys=True,
        )
        if content == self._written and now - self._written_at_s < STATUS_REFRESH_S:
            return
        self._written, self._written_at_s = content, now
        self._pending = status
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_pending(), name="status-file")

    async def _write_pending(self) -> None:
        while self._pending is not None:
            status, self._pending = self._pending, None
            try:
                await asyncio.to_thread(write_json_atomic, self.path, status)
            except OSError as exc:
                log.warning("cannot write %s: %s", self.path, exc)
                self._written = None  # try again at the next change or tick

    async def flush(self) -> None:
        """Wait for the newest content to be on disk (at shutdown)."""
        if self._writer is not None:
            await self._writer
