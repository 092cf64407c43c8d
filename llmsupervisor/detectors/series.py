"""What the detector families share: walking a window by time, reading its engine counters,
and building a ``Finding`` from the observation that shows it.

Every walker takes ``now`` and skips observations stamped after it: a detector never reads a
clock, and never sees an observation from its own future.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final, NamedTuple

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.probes.vllm_metrics import EngineMetrics

MIB: Final = 1024 * 1024


def new_finding(
    obs: Observation,
    kind: FindingKind,
    severity: Severity,
    since_s: float,
    summary: str,
    **evidence: float | str,
) -> Finding:
    return Finding(
        engine=obs.engine, kind=kind, severity=severity, evidence=evidence, since_s=since_s, summary=summary
    )


def upto(window: ObservationWindow, start_s: float, now: float) -> tuple[Observation, ...]:
    """Observations in [start_s, now]: an observation stamped after ``now`` is not seen yet."""
    since = window.since(start_s)
    if not since or since[-1].at_s <= now:  # the loop's case: nothing newer than now to drop
        return since
    return tuple(o for o in since if o.at_s <= now)


def newest_first(window: ObservationWindow, now: float) -> Iterator[Observation]:
    """Newest first, from ``now`` back; detectors stop as soon as they know, to stay cheap."""
    for obs in reversed(window):
        if obs.at_s <= now:
            yield obs


def metric_readings(observations: Sequence[Observation]) -> list[tuple[Observation, EngineMetrics]]:
    return [(o, o.metrics) for o in observations if isinstance(o.metrics, EngineMetrics)]


class ReadingSpan(NamedTuple):
    """The first and last /metrics readings of a span and the seconds between them: what every
    rate over a span divides by."""

    first_obs: Observation
    first: EngineMetrics
    last_obs: Observation
    last: EngineMetrics
    duration_s: float


def reading_span(readings: Sequence[tuple[Observation, EngineMetrics]]) -> ReadingSpan | None:
    """None without two readings some time apart."""
    if len(readings) < 2:
        return None
    (first_obs, first), (last_obs, last) = readings[0], readings[-1]
    duration_s = last_obs.at_s - first_obs.at_s
    return ReadingSpan(first_obs, first, last_obs, last, duration_s) if duration_s > 0 else None


def _counters(m: EngineMetrics) -> tuple[int | None, ...]:
    # Steps advance on every engine step; tokens cover versions without the step histogram (V0).
    return (m.iterations_total, m.generation_tokens_total, m.prompt_tokens_total)


def counters_progressed(older: EngineMetrics, newer: EngineMetrics) -> bool | None:
    """True if any counter known in both moved (a decrease is a restart: also not frozen);
    False if all comparable ones stood still; None if none can be compared."""
    pairs = [
        (a, b)
        for a, b in zip(_counters(older), _counters(newer), strict=True)
        if a is not None and b is not None
    ]
    if not pairs:
        return None
    return any(a != b for a, b in pairs)


def in_flight(m: EngineMetrics) -> int | None:
    if m.requests_running is None or m.requests_waiting is None:
        return None
    return m.requests_running + m.requests_waiting + m.requests_swapped


__all__ = [
    "MIB",
    "ReadingSpan",
    "counters_progressed",
    "in_flight",
    "metric_readings",
    "new_finding",
    "newest_first",
    "reading_span",
    "upto",
]
