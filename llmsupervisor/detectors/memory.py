"""Memory: MEMORY_GROWTH, the engine's process group's RSS rising steadily (a least-squares
line over ``memory_window_s`` that is both steep enough and explains most of the variance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import MIB, new_finding, newest_first
from llmsupervisor.probes.host import ProcSample

K = FindingKind

_MAX_FIT_POINTS: Final = 256


def _least_squares(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Slope and r^2 of y on x; r^2 is 0 for a flat line."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    syy = sum((y - mean_y) ** 2 for _, y in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    if sxx == 0:
        return 0.0, 0.0
    slope = sxy / sxx
    r2 = 0.0 if syy == 0 else (sxy * sxy) / (sxx * syy)
    return slope, r2


def detect_memory_growth(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """The group's RSS rising along a line steeper than ``memory_growth_mib_per_h``."""
    # One pass from the newest back over up to memory_window_s of observations (900 at 2 s).
    start_s = now - cfg.memory_window_s
    samples: list[tuple[Observation, ProcSample]] = []
    pgid: int | None = None
    for o in newest_first(window, now):
        if o.at_s < start_s:
            break
        if not isinstance(o.proc, ProcSample):
            continue
        if pgid is None:
            if now - o.at_s > cfg.stale_after_s:
                return None
            pgid = o.proc.pgid
        if o.proc.pgid == pgid:  # one incarnation only
            samples.append((o, o.proc))
    samples.reverse()
    if len(samples) < cfg.memory_min_samples:
        return None
    span_s = samples[-1][0].at_s - samples[0][0].at_s
    if span_s < cfg.memory_min_span_s:
        return None
    origin = samples[0][0].at_s
    # An evenly thinned series has the same trend; a few hundred points keep the fit cheap.
    stride = -(-len(samples) // _MAX_FIT_POINTS)
    points = [(o.at_s - origin, p.rss_bytes_total / MIB) for o, p in samples[::stride]]
    slope_mib_per_s, r2 = _least_squares(points)
    slope_mib_per_h = slope_mib_per_s * 3600.0
    if slope_mib_per_h < cfg.memory_growth_mib_per_h or r2 < cfg.memory_min_r2:
        return None
    rss_mib = samples[-1][1].rss_bytes_total / MIB
    return new_finding(
        samples[-1][0],
        K.MEMORY_GROWTH,
        Severity.WARNING,
        samples[0][0].at_s,
        f"RSS growing {slope_mib_per_h:.0f} MiB/h over {span_s / 60:.0f} min (now {rss_mib:.0f} MiB)",
        slope_mib_per_h=slope_mib_per_h,
        r2=r2,
        rss_mib=rss_mib,
        samples=len(samples),
        span_s=span_s,
    )


__all__ = ["detect_memory_growth"]
