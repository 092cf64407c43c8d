"""Load: the engine is up but has more work than its settings hold. KV_PRESSURE (the KV cache
nearly full) and PREEMPTION_STORM (requests evicted and recomputed, per minute).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Final

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import ObservationWindow, canary_load
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import metric_readings, new_finding, newest_first, reading_span, upto
from llmsupervisor.probes.vllm_metrics import EngineMetrics

K = FindingKind


def detect_kv_pressure(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """KV usage at or above the threshold, with value hysteresis read from the window.

    Between ``clear_below`` and the threshold the verdict is that of the last reading outside
    the band, so usage hovering at the threshold does not flap.
    """
    readings = (
        (o, o.metrics.kv_usage_ratio)
        for o in newest_first(window, now)
        if isinstance(o.metrics, EngineMetrics) and o.metrics.kv_usage_ratio is not None
    )
    newest = next(readings, None)
    if newest is None or now - newest[0].at_s > cfg.stale_after_s:
        return None
    high = cfg.kv_usage_threshold_ratio
    low = cfg.kv_usage_clear_below_ratio
    # Back to the last reading below `low`: pressure iff some reading since then reached `high`,
    # and it began at the earliest of those.
    since_s: float | None = None
    run: list[tuple[float, float]] = []
    for obs, usage in itertools.chain([newest], readings):
        if usage < low:
            break
        run.append((obs.at_s, usage))
        if usage >= high:
            since_s = obs.at_s
    if since_s is None:
        return None
    latest_obs, usage = newest
    peak = max(u for t, u in run if t >= since_s)
    return new_finding(
        latest_obs,
        K.KV_PRESSURE,
        Severity.WARNING,
        since_s,
        f"KV cache {usage:.0%} full (threshold {high:.0%}, clears below {low:.0%})",
        kv_usage_ratio=usage,
        kv_usage_peak_ratio=peak,
        threshold_ratio=high,
    )


def detect_preemption_storm(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """Preemptions per minute over the last ``preemption_window_s`` at or above the threshold."""
    readings = [
        (o, m.preemptions_total)
        for o, m in metric_readings(upto(window, now - cfg.preemption_window_s - cfg.stale_after_s, now))
        if m.preemptions_total is not None
    ]
    if not readings:
        return None
    latest_obs, latest = readings[-1]
    if now - latest_obs.at_s > cfg.stale_after_s:
        return None
    start = latest_obs.at_s - cfg.preemption_window_s
    first_obs, first = next((o, p) for o, p in readings if o.at_s >= start)
    span_s = latest_obs.at_s - first_obs.at_s
    delta = latest - first
    if span_s < cfg.preemption_min_span_s or delta < 0:  # too short for a rate, or a restart
        return None
    per_min = delta / span_s * 60.0
    if per_min < cfg.preemptions_per_min_threshold:
        return None
    evidence: dict[str, float | str] = {
        "preemptions_per_min": per_min,
        "preemptions": delta,
        "span_s": span_s,
    }
    kv = latest_obs.metrics.kv_usage_ratio if isinstance(latest_obs.metrics, EngineMetrics) else None
    if kv is not None:
        evidence["kv_usage_ratio"] = kv
    return new_finding(
        latest_obs,
        K.PREEMPTION_STORM,
        Severity.WARNING,
        first_obs.at_s,
        f"{per_min:.1f} preemptions a minute (threshold {cfg.preemptions_per_min_threshold:g})",
        **evidence,
    )


SERVED_SPAN_S: Final = 60.0  # the served rates are over the last minute


@dataclass(frozen=True, slots=True)
class ServedLoad:
    """What an engine served its clients over ``span_s``, the supervisor's canaries taken out
    (the engine's counters include them: at one canary every 3 s an idle engine would show
    0.3 requests/s of "traffic")."""

    span_s: float
    requests_per_s: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    canary_requests: int  # in the span, not counted above


def served_load(window: ObservationWindow, now: float, span_s: float = SERVED_SPAN_S) -> ServedLoad | None:
    """Requests and tokens per second between the first and last /metrics readings of the last
    ``span_s``, less the canaries answered in between; None without two readings."""
    observations = upto(window, now - span_s, now)
    span = reading_span(metric_readings(observations))
    if span is None:
        return None
    first_obs, first, last_obs, last, duration_s = span
    canary = canary_load(observations, first_obs.at_s, last_obs.at_s)

    def rate(older: int | None, newer: int | None, own: int) -> float | None:
        if older is None or newer is None or newer < older:
            return None  # not reported, or the counter went back (a restart)
        return max(0, newer - older - own) / duration_s

    return ServedLoad(
        span_s=duration_s,
        requests_per_s=rate(first.requests_finished_total, last.requests_finished_total, canary.requests),
        prompt_tokens_per_s=rate(first.prompt_tokens_total, last.prompt_tokens_total, canary.prompt_tokens),
        generation_tokens_per_s=rate(
            first.generation_tokens_total, last.generation_tokens_total, canary.generation_tokens
        ),
        canary_requests=canary.requests,
    )


__all__ = ["SERVED_SPAN_S", "ServedLoad", "detect_kv_pressure", "detect_preemption_storm", "served_load"]
