"""Degradation: the engine against its own baseline. DEGRADATION_THROUGHPUT (tokens/s per
running request), DEGRADATION_TTFT (TTFT p95) and DEGRADATION_PREFIX_CACHE (hit rate).

The baseline is the first ``degradation_baseline_s`` of real traffic (``baseline_has_traffic``),
pinned by the window; the current span is the last ``degradation_eval_s``. Both are reduced to
``SpanStats`` and compared only at similar load, since per-request throughput and TTFT move with
the batch size. The three detectors share one reading of the spans: ``degradation_spans``, and
``FROM_SPANS`` for ``detect_all``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import Observation, ObservationWindow, canary_load
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import metric_readings, new_finding, reading_span, upto
from llmsupervisor.probes.vllm_metrics import window_quantile

K = FindingKind


@dataclass(frozen=True, slots=True)
class SpanStats:
    """What an engine did over a span of readings (first to last), for baselines and comparisons."""

    start_s: float
    duration_s: float
    requests: int | None  # finished, canaries excluded
    mean_running: float | None
    busy_ratio: float | None  # share of readings with requests running
    tokens_per_s_per_running: float | None
    ttft_p95_s: float | None
    ttft_count: int
    prefix_queries: int | None
    prefix_hit_ratio: float | None


def _delta(older: int | None, newer: int | None) -> int | None:
    if older is None or newer is None or newer < older:
        return None
    return newer - older


def span_stats(observations: Sequence[Observation]) -> SpanStats | None:
    """Rates and quantiles between the first and last readings of ``observations``."""
    readings = metric_readings(observations)
    span = reading_span(readings)
    if span is None:
        return None
    first_obs, first, last_obs, last, duration_s = span
    running = [m.requests_running for _, m in readings if m.requests_running is not None]
    mean_running = sum(running) / len(running) if running else None
    busy_ratio = sum(1 for r in running if r > 0) / len(running) if running else None
    finished = _delta(first.requests_finished_total, last.requests_finished_total)
    # The canaries' own completions are not traffic. Those of the first observation's tick
    # finished before its reading, as far as we can tell, so they are not in the delta.
    # A canary that timed out was aborted by its client, which vLLM does not count as finished.
    canary = canary_load(observations, first_obs.at_s, last_obs.at_s)
    requests = None if finished is None else max(0, finished - canary.requests)
    generated = _delta(first.generation_tokens_total, last.generation_tokens_total)
    if generated is not None:
        generated = max(0, generated - canary.generation_tokens)
    tokens_per_s_per_running = (
        generated / duration_s / mean_running
        if generated is not None and mean_running is not None and mean_running > 0
        else None
    )
    ttft = None if last.ttft_seconds is None else last.ttft_seconds.minus(first.ttft_seconds)
    # Each canary completion is one TTFT observation too; the quantile cannot shed them (the
    # canary is one token, so they sit at its fast end), but the count of real requests can.
    ttft_count = 0 if ttft is None else max(0, ttft.count - canary.requests)
    queries = _delta(first.prefix_cache_queries_total, last.prefix_cache_queries_total)
    hits = _delta(first.prefix_cache_hits_total, last.prefix_cache_hits_total)
    return SpanStats(
        start_s=first_obs.at_s,
        duration_s=duration_s,
        requests=requests,
        mean_running=mean_running,
        busy_ratio=busy_ratio,
        tokens_per_s_per_running=tokens_per_s_per_running,
        ttft_p95_s=window_quantile(last.ttft_seconds, first.ttft_seconds, 0.95),
        ttft_count=ttft_count,
        prefix_queries=queries,
        prefix_hit_ratio=hits / queries if hits is not None and queries else None,
    )


def baseline_has_traffic(observations: Sequence[Observation], cfg: DetectorConfig) -> bool:
    """The window's rule for pinning a baseline span: enough real requests, running most of the
    time, and enough load on average."""
    stats = span_stats(observations)
    return (
        stats is not None
        and stats.requests is not None
        and stats.requests >= cfg.degradation_min_requests
        and stats.mean_running is not None
        and stats.mean_running >= cfg.degradation_min_running
        and stats.busy_ratio is not None
        and stats.busy_ratio >= cfg.degradation_min_busy_ratio
    )


# The baseline's stats, the current span's stats, and the newest observation of the current span.
Spans = tuple[SpanStats, SpanStats, Observation]


def degradation_spans(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Spans | None:
    """The baseline and the last ``degradation_eval_s``, if both can be compared at all; the
    three degradation detectors share it (``detect_all`` computes it once per tick)."""
    baseline_span = window.baseline_span
    if baseline_span is None:
        return None
    recent = upto(window, now - cfg.degradation_eval_s, now)
    # The current span must not overlap the baseline, and must be nearly the full eval span.
    recent = tuple(o for o in recent if o.at_s > baseline_span[1])
    if not recent or now - recent[-1].at_s > cfg.stale_after_s:
        return None
    # The pinned baseline's stats are computed once, by the window that pins it.
    base, current = window.baseline_stats(span_stats), span_stats(recent)
    if base is None or current is None or current.duration_s < 0.8 * cfg.degradation_eval_s:
        return None
    return base, current, recent[-1]


def _at_similar_load(spans: Spans | None, cfg: DetectorConfig) -> Spans | None:
    """``spans`` if both carried enough load, and similar load; else None."""
    if spans is None:
        return None
    base, current, _ = spans
    if base.mean_running is None or current.mean_running is None:
        return None
    if base.mean_running < cfg.degradation_min_running or current.mean_running < cfg.degradation_min_running:
        return None
    load_ratio = current.mean_running / base.mean_running
    if not 1 / cfg.degradation_max_load_ratio <= load_ratio <= cfg.degradation_max_load_ratio:
        return None
    return spans


def _below_baseline(
    spans: Spans,
    kind: FindingKind,
    name: str,
    *,
    factor: float,
    summary: Callable[[float, float, float], str],
    higher_is_worse: bool = False,
    **evidence: float,
) -> Finding | None:
    """The shared tail of the three detectors: the current span's ``name`` (a ``SpanStats``
    field) against the baseline's, as a ratio; a finding when the ratio is at or below
    ``factor`` (at or above it when a higher value is worse, as for TTFT). None while either is
    unknown or the baseline is not positive. ``summary`` gets (current, baseline, ratio); the
    evidence carries ``name``, ``baseline_<name>``, ``ratio`` and ``evidence``."""
    base_stats, current_stats, latest = spans
    base, current = getattr(base_stats, name), getattr(current_stats, name)
    if base is None or current is None or base <= 0:
        return None
    ratio = current / base
    if (ratio < factor) if higher_is_worse else (ratio > factor):
        return None
    return new_finding(
        latest,
        kind,
        Severity.WARNING,
        current_stats.start_s,
        summary(current, base, ratio),
        **{name: current, f"baseline_{name}": base, "ratio": ratio},
        **evidence,
    )


def detect_throughput_degradation(
    window: ObservationWindow, now: float, cfg: DetectorConfig
) -> Finding | None:
    """Generated tokens/s per running request at or below factor x the baseline, at similar load."""
    return _throughput_degradation(degradation_spans(window, now, cfg), cfg)


def _throughput_degradation(all_spans: Spans | None, cfg: DetectorConfig) -> Finding | None:
    spans = _at_similar_load(all_spans, cfg)
    if spans is None:
        return None
    return _below_baseline(
        spans,
        K.DEGRADATION_THROUGHPUT,
        "tokens_per_s_per_running",
        factor=cfg.degradation_throughput_factor,
        # Said in the terms of docs/fragmentation.md: what drifted, at equal load (not "fragmentation").
        summary=lambda _, __, ratio: (
            f"throughput per running request at {ratio:.0%} of its baseline at similar load"
            " (KV thrash, preemptions or slower clocks)"
        ),
        mean_running=spans[1].mean_running or 0.0,
    )


def detect_ttft_degradation(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """TTFT p95 at or above factor x the baseline's, at similar load, with enough requests."""
    return _ttft_degradation(degradation_spans(window, now, cfg), cfg)


def _ttft_degradation(all_spans: Spans | None, cfg: DetectorConfig) -> Finding | None:
    spans = _at_similar_load(all_spans, cfg)
    if spans is None:
        return None
    base, current, _ = spans
    if min(base.ttft_count, current.ttft_count) < cfg.degradation_min_requests:
        return None
    return _below_baseline(
        spans,
        K.DEGRADATION_TTFT,
        "ttft_p95_s",
        factor=cfg.degradation_ttft_factor,
        higher_is_worse=True,
        summary=lambda now_s, _, ratio: (
            f"TTFT p95 {now_s * 1000:.0f} ms, {ratio:.1f}x its baseline at similar load"
            " (queueing for KV blocks, prefix-cache misses or slower clocks)"
        ),
        requests=current.ttft_count,
    )


def detect_prefix_cache_degradation(
    window: ObservationWindow, now: float, cfg: DetectorConfig
) -> Finding | None:
    """Prefix-cache hit rate at or below factor x the baseline's (a baseline worth comparing)."""
    return _prefix_cache_degradation(degradation_spans(window, now, cfg), cfg)


def _prefix_cache_degradation(spans: Spans | None, cfg: DetectorConfig) -> Finding | None:
    if spans is None:
        return None
    base, current, _ = spans
    if min(base.prefix_queries or 0, current.prefix_queries or 0) < cfg.degradation_min_prefix_queries:
        return None
    if base.prefix_hit_ratio is None or base.prefix_hit_ratio < cfg.degradation_min_prefix_hit_ratio:
        return None
    return _below_baseline(
        spans,
        K.DEGRADATION_PREFIX_CACHE,
        "prefix_hit_ratio",
        factor=cfg.degradation_prefix_hit_factor,
        summary=lambda hit, base_hit, _: (
            f"prefix-cache hit rate {hit:.0%}, baseline {base_hit:.0%}"
            " (cached prompts evicted sooner, or the traffic changed)"
        ),
    )


# The degradation detectors on spans computed once for the three of them.
FROM_SPANS: Final[Mapping[FindingKind, Callable[[Spans | None, DetectorConfig], Finding | None]]] = (
    MappingProxyType(
        {
            K.DEGRADATION_THROUGHPUT: _throughput_degradation,
            K.DEGRADATION_TTFT: _ttft_degradation,
            K.DEGRADATION_PREFIX_CACHE: _prefix_cache_degradation,
        }
    )
)


__all__ = [
    "FROM_SPANS",
    "SpanStats",
    "Spans",
    "baseline_has_traffic",
    "degradation_spans",
    "detect_prefix_cache_degradation",
    "detect_throughput_degradation",
    "detect_ttft_degradation",
    "span_stats",
]
