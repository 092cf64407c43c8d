"""Immutable views of the daemon's state, for the exporter, the status file and the control API.

The loop builds one ``Snapshot`` per tick (and on every state change); readers never touch live
objects, so an HTTP scrape can never see a half-updated engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from llmsupervisor.core.state import EngineState


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot:
    name: str
    state: EngineState
    state_reason: str
    state_age_s: float  # seconds in the current state
    gpus: tuple[int, ...]
    port: int
    pid: int | None
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

    def engine(self, name: str) -> EngineSnapshot | None:
        return next((e for e in self.engines if e.name == name), None)
