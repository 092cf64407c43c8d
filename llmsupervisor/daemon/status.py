"""The daemon's state as others see it: the snapshot, the status JSON, the one-line summary.

Every projection here is a function of the engines' published statuses (engine/status.py) plus
the daemon's own facts (the policy's memory, the GPUs' latest samples, its counters): nothing
reads a runner. A ``Snapshot`` is taken per reader call (an HTTP scrape, a status request, a
status-file write) and holds the immutable ``EngineStatus`` values themselves, so a reader can
never see a half-updated engine, and there is one engine record, not a copy of it per reader.
The exporter (daemon/exporter.py) and the JSON (``status_json``, the one projection the status file,
the CLI and the HTTP endpoints read) both read a ``Snapshot``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.node_condition import NodeCondition
from llmsupervisor.core.policy_memory import PolicyMemory
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.gpu_release_state import GpuRelease, release_json
from llmsupervisor.daemon.reconcile import roll_due
from llmsupervisor.detectors.load import ServedLoad
from llmsupervisor.engine.status import EngineLoad, EngineStatus
from llmsupervisor.files import JsonFileWriter, UnsavedFile, flush_all, remove_stale_temporaries
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.cpus import format_cpu_list
from llmsupervisor.probes.gpu_readings import GpuSample, NvmlHealth
from llmsupervisor.probes.gpus import RELEASED
from llmsupervisor.redact import redact_json

log = logging.getLogger("llmsupervisor")

STATUS_REFRESH_S: Final = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonCounters:
    ticks_total: int = 0
    last_tick_duration_s: float = 0.0
    notify_failures_total: int = 0
    config_path: str = ""
    config_loaded_timestamp_s: float = 0.0  # wall clock, for a *_timestamp_seconds gauge
    reloads_total: Mapping[str, int] = field(default_factory=dict)  # by result: "ok", "invalid"
    probe_errors_total: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (probe, error)
    open_fds: int | None = None  # None when it could not be read (out of descriptors)
    fds_limit: int | None = None  # the soft RLIMIT_NOFILE


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """What one reader sees: the engines' published statuses as they are (never copied field by
    field: a new status field is one line in ``EngineStatus`` and one in ``_engine_json``), and
    the daemon's own facts beside them, each taken once per reader call."""

    engines: tuple[EngineStatus, ...]
    now_s: float = 0.0  # the loop clock when taken: ages are now_s - since
    counters: DaemonCounters = field(default_factory=DaemonCounters)
    # The policy's memory (core/policy_memory.py), by engine: actions by (kind, reason), and the
    # wall-clock time of the last of each kind.
    actions_total: Mapping[str, Mapping[tuple[str, str], int]] = field(default_factory=dict)
    last_action_at: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    gpu_samples: Mapping[int, GpuSample] = field(default_factory=dict)  # the engines' GPUs (NVML)
    gpu_faults_marked: Mapping[int, int] = field(default_factory=dict)  # GPU index -> faults
    node_conditions: tuple[NodeCondition, ...] = ()  # GPUs handed to node-level remediation
    # The operator's holds (daemon/holds.py) by engine, as JSON: kind, who, when.
    holds: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # A reload's roll by engine (``config_roll``): "pending", "halted" or "failed"; absent: none.
    config_roll: Mapping[str, str] = field(default_factory=dict)
    # Holds whose file is not yet what the hold is (a full disk): why, by engine.
    holds_unsaved: Mapping[str, str] = field(default_factory=dict)
    # State files whose newest content is not on disk, tried again until it is (files.py).
    unsaved_files: tuple[UnsavedFile, ...] = ()
    nvml: NvmlHealth | None = None  # None: no GPU monitor (tests)
    gpu_release: GpuRelease | None = None  # `gpu release` under way, or the last one

    def state_age_s(self, s: EngineStatus) -> float:
        """Seconds in the current state."""
        return self.now_s - s.state_since_s

    def down_s(self, s: EngineStatus) -> float:
        """Seconds meant to serve and not serving (0 while serving or held by an operator)."""
        return max(0.0, self.now_s - s.down_since_s) if s.down_since_s is not None else 0.0

    def last_exit_age_s(self, s: EngineStatus) -> float | None:
        return self.now_s - s.last_exit_at_s if s.last_exit_at_s is not None else None

    def gpu_reading(
        self, s: EngineStatus, attribute: str, reduce: Callable[[list[float]], float]
    ) -> float | None:
        """One reading over the engine's GPUs (the hottest: ``max``; memory in all: ``sum``);
        None without NVML or where no GPU of the engine has the reading."""
        values = [
            value
            for gpu in s.spec.gpus
            if (sample := self.gpu_samples.get(gpu)) is not None
            and (value := getattr(sample, attribute)) is not None
        ]
        return reduce(values) if values else None


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


def config_roll(
    statuses: Iterable[EngineStatus], specs: Mapping[str, EngineSpec], halted_by: Iterable[str]
) -> dict[str, str]:
    """Where a reload's roll (core/policy.py ``CONFIG_RESTART``) stands per engine: "pending" (it
    runs another spec than the config's and the policy will restart it onto it, as
    daemon/reload.py ``rolling`` counts), "halted" (pending, and the roll is halted by an engine
    that failed on the new config), "failed" (one of those: the roll is halted by it)."""
    halted = frozenset(halted_by)
    roll: dict[str, str] = {}
    for s in statuses:
        target = specs.get(s.name)
        if s.name in halted:
            roll[s.name] = "failed"
        elif roll_due(s, target):
            roll[s.name] = "halted" if halted else "pending"
    return roll


def snapshot(
    statuses: Sequence[EngineStatus],
    *,
    now: float,
    memory: PolicyMemory,
    gpu_samples: GpuSamples,
    gpu_faults_marked: Mapping[int, int],
    counters: DaemonCounters,
    node_conditions: tuple[NodeCondition, ...] = (),
    holds: Mapping[str, Mapping[str, Any]] | None = None,
    roll: Mapping[str, str] | None = None,
    holds_unsaved: Mapping[str, str] | None = None,
    unsaved_files: Sequence[UnsavedFile] = (),
    nvml: NvmlHealth | None = None,
    gpu_release: GpuRelease | None = None,
) -> Snapshot:
    """The statuses with the daemon's facts beside them; the mutable ones (the policy's memory,
    the marks) copied, so a reader never sees them change under it."""
    gpus = {g for s in statuses for g in s.spec.gpus}
    return Snapshot(
        engines=tuple(statuses),
        now_s=now,
        counters=counters,
        actions_total={s.name: dict(memory.of(s.name).actions_total) for s in statuses},
        last_action_at={s.name: dict(memory.of(s.name).last_action_at) for s in statuses},
        gpu_samples={g: v for g, v in gpu_samples(sorted(gpus)).items() if isinstance(v, GpuSample)},
        gpu_faults_marked=dict(gpu_faults_marked),
        node_conditions=node_conditions,
        holds=dict(holds or {}),
        config_roll=dict(roll or {}),
        holds_unsaved=dict(holds_unsaved or {}),
        unsaved_files=tuple(unsaved_files),
        nvml=nvml,
        gpu_release=gpu_release,
    )


def status_json(snap: Snapshot) -> dict[str, Any]:
    """The snapshot as JSON: the status file, `llm-supervisor status --json` and the HTTP
    endpoints."""
    return {
        "pid": os.getpid(),
        "config": snap.counters.config_path,
        "engines": {s.name: _engine_json(snap, s) for s in snap.engines},
        "gpu_faults_marked": {str(g): n for g, n in sorted(snap.gpu_faults_marked.items())},
        "node_conditions": [c.as_json() for c in snap.node_conditions],
        # Written once the disk has room; until then a daemon restart would not find them.
        "state_files_unsaved": [u.as_json() for u in snap.unsaved_files],
        "nvml": nvml_json(snap),
        "gpu_verdicts": gpu_verdict_sources(snap.gpu_samples),
        # `gpu release N`: where the GPU's release stands (daemon/gpu_release.py); the last one
        # stays, done or failed, until the next.
        "gpu_release": release_json(snap.gpu_release, snap.now_s),
    }


def nvml_json(snap: Snapshot) -> dict[str, Any] | None:
    """Whether the daemon can read its GPUs (docs/gpu.md): ``up``; while down, why (``reason``,
    ``detail``), for how long, the tries so far and when the next is; the engines waiting for it
    (seconds left of their wait); GPUs taken as lost for calls that hang; GPUs whose events are
    not watched; failed event waits; each NVSwitch GPU's fabric state, and the engines waiting
    for their GPUs' fabric (with why)."""
    health = snap.nvml
    if health is None:
        return None

    def age(since_s: float | None) -> float | None:
        return None if since_s is None else round(snap.now_s - since_s, 1)

    def left(until_s: float | None) -> float | None:
        return None if until_s is None else round(max(0.0, until_s - snap.now_s), 1)

    return {
        "up": health.up,
        "needed": health.needed,
        "reason": health.reason,
        "detail": health.detail,
        "for_s": age(health.since_s),
        "attempts": health.attempts,
        "next_try_in_s": left(health.next_try_s),
        "gpus": health.gpus,
        "engines_waiting": {n: left(until) for n, until in health.waiting.items()},
        "hung_gpus": list(health.hung),
        "events_unwatched": {str(g): why for g, why in health.events_unwatched.items()},
        "event_wait_errors": health.event_wait_errors,
        "fabric": {str(g): state for g, state in sorted(health.fabric.items())},
        "engines_waiting_fabric": dict(sorted(health.fabric_waiting.items())),
    }


# How a GPU's faults are judged (docs/gpu.md): its own recovery action, or NVIDIA's XID catalogue
# where the driver does not answer field 230 (before R565).
VERDICTS_FROM_RECOVERY_ACTION: Final = "recovery_action"
VERDICTS_FROM_XID_CATALOGUE: Final = "xid_catalogue"


def gpu_verdict_sources(samples: Mapping[int, GpuSample]) -> dict[str, str]:
    """Per GPU index (the engines' GPUs), which way its faults are judged."""
    return {
        str(index): VERDICTS_FROM_XID_CATALOGUE
        if sample.recovery_action is None
        else VERDICTS_FROM_RECOVERY_ACTION
        for index, sample in sorted(samples.items())
    }


def _hottest(values: list[float]) -> float:
    return float(max(values))


def _summed(values: list[float]) -> float:
    return int(sum(values))


def _engine_json(snap: Snapshot, s: EngineStatus) -> dict[str, Any]:
    """The one JSON projection of an engine's status."""
    last_exit_age_s = snap.last_exit_age_s(s)
    load = s.load or EngineLoad()
    return {
        "state": s.state.value,
        "hold": dict(hold) if (hold := snap.holds.get(s.name)) is not None else None,
        "hold_unsaved": snap.holds_unsaved.get(s.name),  # why the hold is not on disk yet
        "phase": s.start_phase,
        "reason": s.state_reason,
        "for_s": round(snap.state_age_s(s), 1),
        "pid": s.pid,
        "incarnation": s.incarnation.number if s.incarnation is not None else None,
        "state_changes": s.state_changes_total,
        "model": s.spec.model_id,
        "port": s.spec.port,
        "gpus": list(s.spec.gpus),
        "cpus": format_cpu_list(s.spec.placement) if s.spec.placement else None,
        "in_rotation": s.in_rotation,
        "restarts": s.restarts_total,
        "restarts_by_reason": dict(s.restarts_by_reason),
        "canary_latency_s": s.canary_latency_s,
        "findings": [
            {"kind": f.kind.value, "severity": f.severity.value, "summary": f.summary} for f in s.findings
        ],
        "last_exit": s.last_exit,
        "last_exit_age_s": round(last_exit_age_s, 1) if last_exit_age_s is not None else None,
        "requests_running": load.requests_running,
        "enabled": s.spec.enabled,
        "wants_run": s.wants_run,
        "meant_to_serve": s.meant_to_serve,
        "running": s.running,
        "start_timeout_s": s.spec.start_timeout_s,
        "drain_timeout_s": s.spec.drain_timeout_s,
        "last_failure": s.last_failure,
        "last_error_line": s.last_error_line,
        "batch_step": s.ladder_step,
        "batch_steps": s.ladder_steps,
        "actions": {
            f"{kind}/{reason}": n for (kind, reason), n in sorted(snap.actions_total.get(s.name, {}).items())
        },
        "gpu_temperature_c": snap.gpu_reading(s, "temperature_c", _hottest),
        "gpu_power_w": snap.gpu_reading(s, "power_w", _hottest),
        "gpu_memory_used_bytes": snap.gpu_reading(s, "memory_used_bytes", _summed),
        "gpu_memory_total_bytes": snap.gpu_reading(s, "memory_total_bytes", _summed),
        "requests_waiting": load.requests_waiting,
        "kv_usage_ratio": load.kv_usage_ratio,
        "ttft_p95_s": load.ttft_p95_s,
        "held_by_operator": s.held_by_operator,
        "canary_requests": s.canary_requests_total,
        "served": _served_json(s.served),
        "incidents": s.incidents_total,
        "last_incident": s.last_incident,
        "last_restart": _restart_json(snap, s),
        "config_roll": snap.config_roll.get(s.name),
    }


def _restart_json(snap: Snapshot, s: EngineStatus) -> dict[str, Any] | None:
    """Why the engine last restarted: `describe` and the table's answer to "why did it restart?"."""
    last = s.last_restart
    if last is None:
        return None
    age_s = round(snap.now_s - last.at_s, 1) if last.at_s is not None else None
    return {"cause": last.cause, "reason": last.reason, "incident": last.incident, "age_s": age_s}


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


def _mmss(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


def nvml_line(health: NvmlHealth | None, *, now: float) -> str | None:
    """``NVML unavailable (driver_not_loaded) for 1m05s, no GPU telemetry, retrying; gpu0 wait for
    it (3m55s left)``; with NVML open, ``GPU fabric not ready (fabric manager not running?): gpu0
    waits for it``; None while NVML is open and no engine waits, or no engine needs it."""
    if health is None or not health.needed:
        return None
    if health.up:
        return fabric_line(health)
    if health.reason == RELEASED:
        # Closed on purpose for a GPU reset: said as such, with when it opens by itself.
        line = "NVML closed on purpose for a GPU reset, no GPU telemetry"
        if health.next_try_s is not None:
            line += f" until the take-back (by itself in {_mmss(health.next_try_s - now)})"
        return line
    line = f"NVML unavailable ({health.reason})"
    if health.since_s is not None:
        line += f" for {_mmss(now - health.since_s)}"
    line += ", no GPU telemetry, retrying"
    if health.waiting:
        left = max(health.waiting.values()) - now
        line += f"; {', '.join(sorted(health.waiting))} wait for it ({_mmss(left)} left)"
    return line


def fabric_line(health: NvmlHealth) -> str | None:
    """The engines waiting for their GPUs' fabric, with its likeliest cause; None: none waits."""
    if not health.fabric_waiting:
        return None
    states = set(health.fabric.values())
    cause = (
        "fabric manager not running?"
        if "not_started" in states
        else "registration in progress"
        if "in_progress" in states
        else "registration failed"
    )
    names = sorted(health.fabric_waiting)
    return f"GPU fabric not ready ({cause}): {', '.join(names)} wait{'s' if len(names) == 1 else ''} for it"


def summary(
    statuses: Sequence[EngineStatus],
    *,
    now: float,
    reload_problem: str | None = None,
    unsaved: Sequence[UnsavedFile] = (),
    nvml: str | None = None,
) -> str:
    """One line for STATUS=, e.g. ``1/2 engines ready; gpu1 starting (2m10s)``; a reload that
    failed, a full state dir and ``nvml`` (``nvml_line``: NVML that cannot be opened) come first."""
    serving = [s for s in statuses if s.meant_to_serve]
    ready = sum(1 for s in serving if s.state is EngineState.READY)
    parts = [f"{ready}/{len(serving)} engines ready"]
    if nvml:
        parts.insert(0, nvml)
    if unsaved:  # a full state dir: what a daemon restart now would forget
        parts.insert(0, unsaved_text(unsaved))
    if reload_problem:
        parts.insert(0, reload_problem)
    for s in statuses:
        if s.state is EngineState.READY or (s.state is EngineState.STOPPED and not s.meant_to_serve):
            continue
        age_s = int(now - s.state_since_s)
        text = f"{s.name} {s.state.value} ({age_s // 60}m{age_s % 60:02d}s)"
        if s.state is EngineState.STARTING and s.start_phase:
            text += f": {s.start_phase}"
        if s.state in (EngineState.BACKOFF, EngineState.FATAL) and s.last_failure:
            text += f": {(s.last_error_line or s.last_failure)[:80]}"
        elif s.state in (EngineState.SHEDDING, EngineState.DRAINING):
            text += f": {s.state_reason[:80]}"
        parts.append(text)
    return "; ".join(parts)


def unsaved_text(unsaved: Sequence[UnsavedFile]) -> str:
    """``state dir full: 2 state file(s) not saved yet (No space left on device)``."""
    errors = sorted({u.error for u in unsaved})
    head = "state dir full" if all(u.disk_full for u in unsaved) else "state dir"
    return f"{head}: {len(unsaved)} state file(s) not saved yet ({'; '.join(errors)})"


def _nvml_aged(nvml: Any) -> Any:
    if not isinstance(nvml, dict):
        return nvml
    waiting = nvml.get("engines_waiting") or {}
    return {**nvml, "for_s": None, "next_try_in_s": None, "engines_waiting": sorted(waiting)}


def _release_aged(release: Any) -> Any:
    return {**release, "for_s": None, "ends_in_s": None} if isinstance(release, dict) else release


def _aged(engine: Mapping[str, Any]) -> Any:
    last = engine.get("last_restart")
    return {**last, "age_s": None} if isinstance(last, dict) else last


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class StatusFileRead:
    """STATE_DIR/status.json as a reader finds it: the status, whether its daemon still runs, and
    when it was written (wall clock; None from a daemon before ``written_at``)."""

    status: Mapping[str, Any]
    daemon_alive: bool
    written_at: float | None

    def describe(self) -> str:
        """``daemon not running (pid 4242 is gone); last status at 2026-11-26 08:00:12``."""
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.written_at))
            if self.written_at is not None
            else "an unknown time"
        )
        pid = self.status.get("pid")
        if self.daemon_alive:
            return f"daemon pid {pid} running; status written at {when}"
        return f"daemon not running (pid {pid} is gone); last status at {when}"


def read_status_file(path: Path, *, alive: Callable[[int], bool] = pid_alive) -> StatusFileRead | None:
    """The status file, or None when there is none (or it is not a status). A file whose daemon
    pid is gone is stale: its states are what they were when that daemon died."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("engines"), dict):
        return None
    pid = doc.get("pid")
    written_at = doc.get("written_at")
    return StatusFileRead(
        status=doc,
        daemon_alive=isinstance(pid, int) and alive(pid),
        written_at=float(written_at) if isinstance(written_at, int | float) else None,
    )


# The last status.json write at shutdown: a disk that does not answer must not hold the stop
# (systemd would SIGKILL the daemon at TimeoutStopSec with engines maybe still to sweep).
STATUS_FLUSH_TIMEOUT_S: Final = 5.0


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
        self._file = JsonFileWriter(path, what="the status")

    def write(self, status: dict[str, Any], *, now: float) -> None:
        content = json.dumps(
            # Ages and rates move every tick: refreshed every STATUS_REFRESH_S, not every change.
            {
                **status,
                "engines": {
                    n: {**e, "for_s": None, "last_exit_age_s": None, "served": None, "last_restart": _aged(e)}
                    for n, e in status["engines"].items()
                },
                "nvml": _nvml_aged(status.get("nvml")),
                "gpu_release": _release_aged(status.get("gpu_release")),
            },
            sort_keys=True,
        )
        # A write that failed is the writer's to try again (files.JsonFileWriter), newest content
        # first: nothing to do here for it.
        if content == self._written and now - self._written_at_s < STATUS_REFRESH_S:
            return
        self._written, self._written_at_s = content, now
        # The wall clock beside the pid: a reader tells a status left by a dead daemon (its
        # READY engines are long gone) from a live one (``read_status_file``).
        self._file.save(redact_json({**status, "written_at": time.time()}))  # not on every tick

    async def flush(self) -> None:
        """At shutdown: wait for this file's newest content, and every other state file's (a ladder
        step, a GPU mark saved just before), to be on disk, STATUS_FLUSH_TIMEOUT_S at most."""
        late = await flush_all(STATUS_FLUSH_TIMEOUT_S)
        if late:
            log.warning(
                "%s not written within %g s (the disk does not answer)",
                ", ".join(str(p) for p in late),
                STATUS_FLUSH_TIMEOUT_S,
            )
