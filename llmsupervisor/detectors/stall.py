"""STALL: requests in flight, and the step and token counters still.

Busy is not dead (docs/vllm-notes.md §7): requests in flight while the counters advance is load.
Like the hang rules (detectors/hang/), the detector needs no ``sustain_s``: it already needs the
counters frozen across readings for ``stall_after_s``.
"""

from __future__ import annotations

from llmsupervisor.core.findings import Finding, FindingKind, Severity, counted
from llmsupervisor.core.observe import ObservationWindow
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import counters_progressed, in_flight, new_finding, newest_first
from llmsupervisor.probes.vllm_metrics import EngineMetrics

K = FindingKind


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
        f"{counted(work, 'request')} in flight and no step or token progress for {frozen_s:.0f} s",
        **evidence,
    )


__all__ = ["detect_stall"]
