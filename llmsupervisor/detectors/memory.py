"""Memory: MEMORY_GROWTH, the engine's process group's RSS rising steadily (a least-squares
line over ``memory_window_s`` that is both steep enough and explains most of the variance).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Final

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import ObservationWindow
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import MIB, new_finding

K = FindingKind

_MAX_FIT_POINTS: Final = 256
_AT_S: Final = operator.itemgetter(0)


def _least_squares(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Slope and r^2 of y on x; r^2 is 0 for a flat line. Two passes (the means, then the
    centred sums in one loop): each sum takes the same terms in the same order as ``sum`` over
    a generator would, so the result is the same to the last bit, at a third of the loops."""
    n = len(points)
    sum_x = sum_y = 0.0
    for x, y in points:
        sum_x += x
        sum_y += y
    mean_x, mean_y = sum_x / n, sum_y / n
    sxx = syy = sxy = 0.0
    for x, y in points:
        dx, dy = x - mean_x, y - mean_y
        sxx += dx**2
        syy += dy**2
        sxy += dx * dy
    if sxx == 0:
        return 0.0, 0.0
    slope = sxy / sxx
    r2 = 0.0 if syy == 0 else (sxy * sxy) / (sxx * syy)
    return slope, r2


def detect_memory_growth(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """The group's RSS rising along a line steeper than ``memory_growth_mib_per_h``."""
    latest = window.latest()
    if latest is None:
        return None
    # The window keeps its RSS series as it appends, in time order: the span is found by
    # bisection and copied at C speed, not walked observation by observation (900 at 2 s).
    series = window.rss_series
    end = len(series)
    while end and series[end - 1][0] > now:  # not seen yet at ``now`` (never in the loop)
        end -= 1
    if not end:
        return None
    newest_s, pgid, _ = series[end - 1]
    if now - newest_s > cfg.stale_after_s:
        return None
    start = bisect.bisect_left(series, now - cfg.memory_window_s, hi=end, key=_AT_S)
    # One incarnation only: the newest sweep's group. In the loop the span is the newest entries,
    # almost always of one group (window.rss_run_start): then it is the span itself, and only the
    # points fitted are read (~256 of ~900), by a C-speed islice. Otherwise each entry's group is
    # looked at. Both give the same points, so the same fit to the last bit.
    first_s: float
    if end == len(series) and start >= window.rss_run_start:
        count = end - start
        if count < cfg.memory_min_samples:
            return None
        first_s, last_rss = series[start][0], series[end - 1][2]
        stride = -(-count // _MAX_FIT_POINTS)
        fitted: Iterable[tuple[float, int]] = (
            (at_s, rss) for at_s, _, rss in itertools.islice(series, start, end, stride)
        )
    else:
        samples = [(at_s, rss) for at_s, group, rss in itertools.islice(series, start, end) if group == pgid]
        count = len(samples)
        if count < cfg.memory_min_samples:
            return None
        first_s, last_rss = samples[0][0], samples[-1][1]
        # An evenly thinned series has the same trend; a few hundred points keep the fit cheap.
        stride = -(-count // _MAX_FIT_POINTS)
        fitted = samples[::stride]
    span_s = newest_s - first_s
    if span_s < cfg.memory_min_span_s:
        return None
    points = [(at_s - first_s, rss_bytes / MIB) for at_s, rss_bytes in fitted]
    slope_mib_per_s, r2 = _least_squares(points)
    slope_mib_per_h = slope_mib_per_s * 3600.0
    if slope_mib_per_h < cfg.memory_growth_mib_per_h or r2 < cfg.memory_min_r2:
        return None
    rss_mib = last_rss / MIB
    return new_finding(
        latest,  # for its engine: every observation of a window is of one engine
        K.MEMORY_GROWTH,
        Severity.WARNING,
        first_s,
        f"RSS growing {slope_mib_per_h:.0f} MiB/h over {span_s / 60:.0f} min (now {rss_mib:.0f} MiB)",
        slope_mib_per_h=slope_mib_per_h,
        r2=r2,
        rss_mib=rss_mib,
        samples=count,
        span_s=span_s,
    )


__all__ = ["detect_memory_growth"]
