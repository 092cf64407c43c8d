"""The observation round's plan: what one round asks of an engine, decided before it asks.

Pure, as the kubelet's prober decides before it probes: the observer (engine/observer.py) reads
the step heartbeat as the round begins, calls ``plan_round`` with what the rounds before it saw,
and probes as the plan says. Each decision, and why:

    canary       due canary_interval_s after the last one while the engine makes no progress;
                 never out of rotation, nor with canary_kind none (``may_ask``)
    progressing  the heartbeat's steps moved since the last round, or vLLM's counters moved
                 while the heartbeat says work is held: a canary would only queue behind it
    idle         nothing held and no step under way, by the heartbeat read now (else the
                 window's newest): the last round's read lags a load that just ended
    sweep first  an idle engine with no canary due is swept before its probes, and asked at once
                 if that sweep shows it burning CPU (``canary_after_sweep``)
    metrics      /metrics due metrics_interval_s after the last read (METRICS_DUE_EARLY_S
                 early); the first read places the engine at its own phase of the interval
    late         the round waits hang_probe_late_s for /health (at most health_timeout_s)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Final

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.observe import ObservationWindow
from llmsupervisor.detectors import DetectorConfig, counters_progressed
from llmsupervisor.detectors.hang.steps import beat_idle, idle_but_busy, idle_by_heartbeat
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics

# Rounds start tick_interval_s after the previous one ended, a little later than a multiple of
# the tick: /metrics is due this much before metrics_interval_s has fully passed, so that a 4 s
# interval at a 2 s tick reads it every other round, not every third.
METRICS_DUE_EARLY_S: Final = 0.5


def metrics_phase(name: str) -> float:
    """A fraction in [0, 1) that is the same for a name in every run (unlike ``hash``)."""
    return zlib.crc32(name.encode()) % 1000 / 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan:
    """What one round asks, decided as it begins (``begun_s``)."""

    begun_s: float
    start_beat: StepBeat | None  # the heartbeat as the round began, where it was read
    idle: bool
    progressing: bool
    canary: bool  # due now, whatever the sweep shows
    sweep_first: bool  # idle, no canary due: sweep before the probes (``canary_after_sweep``)
    metrics: bool  # /metrics due this round
    metrics_from_s: float  # where the /metrics interval counts from after this round
    timeout_s: float  # each probe's deadline (health_timeout_s)
    late_s: float  # how long the round waits for /health: a later answer is a miss


def may_ask(spec: EngineSpec, *, in_rotation: bool) -> bool:
    """Whether a round may send a canary at all. Out of rotation (drained, held, shedding) it
    would be the only request the engine gets, counted as "in flight" by a drain, and a hang
    there hurts no user; the first round back in rotation sends one at once."""
    return spec.canary_kind != "none" and in_rotation


def plan_round(
    spec: EngineSpec,
    now: float,
    *,
    in_rotation: bool,
    window: ObservationWindow,
    start_beat: StepBeat | ProbeFailure | None,
    beat_moved: bool,
    previous_metrics: EngineMetrics | None,
    last_metrics: EngineMetrics | None,
    last_canary_s: float,
    last_metrics_s: float | None,
) -> RoundPlan:
    """The plan of the round that begins at ``now``. ``start_beat``: the heartbeat read as it
    began (None where ``may_ask`` is False: not read); ``beat_moved``: whether the heartbeat's
    steps moved between the last two rounds; the two latest /metrics reads; when the last canary
    ended and when the /metrics interval counts from (None: never read)."""
    asks = may_ask(spec, in_rotation=in_rotation)
    beat = start_beat if isinstance(start_beat, StepBeat) else None
    idle = beat_idle(beat) if beat is not None else idle_by_heartbeat(window, now)
    # While step counters move the engine is alive: a canary would only queue behind real work
    # and read busy as dead (docs/vllm-notes.md §7). The heartbeat's steps count too: they move
    # through a long prefill, when vLLM's counters do not. But not vLLM's counters once the
    # heartbeat says nothing is held: read metrics_interval_s apart, they still move for up to
    # two reads after the last request, when there is nothing left for a canary to queue
    # behind, and an engine that deadlocked as its last request ended went unasked that long.
    progressing = beat_moved or (
        not idle
        and previous_metrics is not None
        and last_metrics is not None
        and bool(counters_progressed(previous_metrics, last_metrics))
    )
    canary = asks and not progressing and now - last_canary_s >= spec.canary_interval_s
    # An idle engine, no canary due: the round's sweep first, so that one burning CPU with
    # nothing to do (a spinning Worker, an EngineCore looping) is asked in this round, not the
    # next (detectors/hang/steps.py, idle_but_busy). A busy engine's round keeps its probes and its
    # sweep together. Even while the heartbeat's last steps were moving (issue 25: a Worker that
    # began to spin as a load ended went unasked for 9 s).
    sweep_first = asks and not canary and idle
    metrics, metrics_from_s = _metrics_due(spec, now, last_metrics_s)
    return RoundPlan(
        begun_s=now,
        start_beat=beat,
        idle=idle,
        progressing=progressing,
        canary=canary,
        sweep_first=sweep_first,
        metrics=metrics,
        metrics_from_s=metrics_from_s,
        timeout_s=spec.health_timeout_s,
        # /health answers in milliseconds from a live API server; a frozen one would hold every
        # round for the whole health_timeout_s (issue 25: 11.8 s to find a stopped API server).
        # A late answer is a miss, and a miss is evidence for the hang rules, never a finding by
        # itself. (/metrics keeps the full deadline: it is read every other round, and its 50 kB
        # take longer on a loaded host.)
        late_s=min(spec.health_timeout_s, spec.detectors.hang_probe_late_s),
    )


def _metrics_due(spec: EngineSpec, now: float, last_s: float | None) -> tuple[bool, float]:
    """Whether /metrics is due, and where its interval counts from after this round."""
    if last_s is None:
        # After the first read, each engine reads at its own phase of the interval (a fraction
        # of it from its name), so that engines that became READY together do not all fetch and
        # parse /metrics in the same round: at 64 engines those bursts made the slowest rounds
        # (docs/benchmarks.md, "Faster and cheaper").
        return True, now - spec.metrics_interval_s * metrics_phase(spec.name)
    if now - last_s >= spec.metrics_interval_s - METRICS_DUE_EARLY_S:
        return True, now
    return False, last_s


def canary_after_sweep(
    plan: RoundPlan, swept: ProcSample | ProbeFailure, window: ObservationWindow, cfg: DetectorConfig
) -> bool:
    """Whether a round that swept first (``plan.sweep_first``) asks after all: the heartbeat says
    idle, yet the engine's processes burn CPU across this sweep and the window's newest."""
    fresh = swept if isinstance(swept, ProcSample) else None
    return idle_but_busy(window, plan.begun_s, cfg, fresh, plan.start_beat)
