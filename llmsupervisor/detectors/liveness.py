"""Liveness: is the engine doing anything at all? HANG (no sign of life, deadlines missed) and
STALL (work queued, counters still).

Busy is not dead (docs/vllm-notes.md §7): a slow canary while the step or token counters advance is
load, not a hang. These two are the only detectors that need no ``sustain_s``: each already
needs its counters frozen for a stretch of readings.
"""

from __future__ import annotations

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import Observation, ObservationWindow, check_timed_out
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import counters_progressed, in_flight, new_finding, newest_first
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.vllm_metrics import EngineMetrics

K = FindingKind


def _metrics_timed_out(obs: Observation) -> bool:
    return isinstance(obs.metrics, ProbeFailure) and obs.metrics.kind == "timeout"


def _unresponsive(obs: Observation) -> bool:
    # Only deadline misses: a refused connection or a 503 is the crash path, not a hang.
    return check_timed_out(obs.canary) or check_timed_out(obs.health) or _metrics_timed_out(obs)


def _miss_detail(obs: Observation) -> str:
    parts = []
    if check_timed_out(obs.canary):
        parts.append("canary")
    if check_timed_out(obs.health):
        parts.append("/health")
    if _metrics_timed_out(obs):
        parts.append("/metrics")
    return "+".join(parts)


def detect_hang(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """No sign of life for ``hang_*after_s`` and at least ``hang_min_misses`` deadline misses.

    Signs of life: a canary that answered, or a step/token counter that moved between two
    readings (busy, not dead, even if the canary was slow). A deadline miss: the canary,
    ``/health`` or ``/metrics`` timing out. ``/health`` 200 proves nothing (docs/vllm-notes.md §7).
    """
    newest: Observation | None = None
    oldest: Observation | None = None
    last_life_s: float | None = None
    missed: list[Observation] = []
    newer: tuple[Observation, EngineMetrics] | None = None  # the next newer reading
    last_reading: EngineMetrics | None = None
    for obs in newest_first(window, now):  # back to the last sign of life
        newest = newest or obs
        oldest = obs
        if isinstance(obs.metrics, EngineMetrics):
            last_reading = last_reading or obs.metrics
            if newer is not None and counters_progressed(obs.metrics, newer[1]):
                last_life_s = newer[0].at_s  # the counters moved by the newer reading
                break
            newer = (obs, obs.metrics)
        if obs.canary is not None and obs.canary.ok:
            last_life_s = obs.at_s
            break
        if _unresponsive(obs):
            missed.append(obs)
    if newest is None or oldest is None:
        return None
    # The observation whose reading showed progress was alive, whatever else timed out in it.
    missed = [o for o in missed if last_life_s is None or o.at_s > last_life_s]
    misses = len(missed)
    last_miss = missed[0] if missed else None
    if misses < cfg.hang_min_misses or last_miss is None:
        return None
    # Without any sign of life in the window, count from the first observation: the window
    # shows nothing earlier.
    frozen_since = last_life_s if last_life_s is not None else oldest.at_s
    work = None if last_reading is None else in_flight(last_reading)
    idle = work == 0
    limit_s = cfg.hang_idle_after_s if idle else cfg.hang_after_s
    frozen_s = now - frozen_since
    if frozen_s < limit_s:
        return None
    latest = newest
    evidence: dict[str, float | str] = {
        "frozen_s": frozen_s,
        "misses": misses,
        "last_miss": _miss_detail(last_miss),
        "limit_s": limit_s,
    }
    if last_reading is not None:
        if work is not None:
            evidence["requests_in_flight"] = work
        if last_reading.iterations_total is not None:
            evidence["iterations_total"] = last_reading.iterations_total
        if last_reading.generation_tokens_total is not None:
            evidence["generation_tokens_total"] = last_reading.generation_tokens_total
    if last_miss.canary is not None:
        evidence["canary_latency_s"] = last_miss.canary.latency_s
    state = "idle by its gauges" if idle else "with work queued or unknown"
    return new_finding(
        latest,
        K.HANG,
        Severity.CRITICAL,
        frozen_since,
        f"hung: no progress and no canary answer for {frozen_s:.0f} s ({misses} deadline misses, {state})",
        **evidence,
    )


def detect_stall(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """Requests running or waiting in every reading, and the counters still, for ``stall_after_s``.

    Covers the KV livelock too (waiting > 0, running = 0; docs/vllm-notes.md §9 #5). Readings only:
    failed scrapes neither extend nor break the stretch, and stale gauges reading 0 (the SIGSTOP
    case) are the hang detector's.
    """
    readings = ((o, o.metrics) for o in newest_first(window, now) if isinstance(o.metrics, EngineMetrics))
    newest = next(readings, None)
    if newest is None:
        return None
    latest_obs, latest = newest
    if now - latest_obs.at_s > cfg.stale_after_s:
        return None
    work = in_flight(latest)
    if not work:
        return None
    frozen_since = latest_obs.at_s
    newer = latest
    for obs, m in readings:
        if counters_progressed(m, newer) is not False or not in_flight(m):
            break
        frozen_since = obs.at_s
        newer = m
    frozen_s = latest_obs.at_s - frozen_since
    if frozen_s < cfg.stall_after_s:
        return None
    evidence: dict[str, float | str] = {"frozen_s": frozen_s, "requests_in_flight": work}
    if latest.requests_running is not None:
        evidence["requests_running"] = latest.requests_running
    if latest.requests_waiting is not None:
        evidence["requests_waiting"] = latest.requests_waiting
    if latest.kv_usage_ratio is not None:
        evidence["kv_usage_ratio"] = latest.kv_usage_ratio
    return new_finding(
        latest_obs,
        K.STALL,
        Severity.WARNING,
        frozen_since,
        f"stalled: {work} requests in flight and no step or token progress for {frozen_s:.0f} s",
        **evidence,
    )


__all__ = ["detect_hang", "detect_stall"]
