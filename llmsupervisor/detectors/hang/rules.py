"""The hang rules, in the order ``detect_hang`` tries them: ``HANG_RULES``.

A HANG is found by the first of these rules that fires (issues 16 and 25), fastest first:

``stopped``    a process of the group held by the kernel (SIGSTOP, a tracer) in two process
               sweeps ``hang_stopped_after_s`` apart, its CPU time unchanged, or in the sweep of
               a round whose canary or /health then missed its deadline: a fact;
``front``      /health missed twice in a row over ``hang_front_after_s`` while the API server
               was asleep at no CPU, or burned a core and handed the scheduler nothing: its
               event loop is held (detectors/hang/front.py);
``frozen``     (step heartbeat) work outstanding, no step for the learned bound, and the
               engine's processes (the API server aside) near 0 % CPU: a deadlock;
``spinning``   (step heartbeat) work outstanding, no step for the learned bound, the engine's
               processes busy and the one that computes (the Worker, CPU hosts) idle: a loop
               that is not the model, e.g. a thread holding the GIL;
``overdue``    (step heartbeat, CPU hosts) a step under way for ``hang_step_factor`` x the
               bound its tokens give (the engine's slowest recent time per token) while the
               Worker computes: a Worker that spins;
``cpu_idle``   a canary missed its deadline and the group used (almost) no CPU between the
               sweeps around it: nothing is computing it (a deadlocked or frozen core);
``deadlines``  ``hang_min_misses`` deadline misses and no sign of life for ``hang_*after_s``:
               the backstop for what the others cannot tell (a GPU engine spinning in a hung
               kernel, whose CPU looks like a long step's), 10-14 s.

None of them reads a busy engine as dead: a running engine is not stopped, completes a step at
least every few of its own longest steps (the bound is learned from the heartbeat), and burns
CPU in the process that computes. The heartbeat's steps are signs of life for the deadline rule:
they continue through a long prefill, when the token counters stand still.

Each rule is a pure function ``(facts, window, now, cfg) -> RuleHit | None`` over the facts
gathered once (detectors/hang/facts.py); its docstring says when it fires and why a busy engine
cannot trip it. A new rule is one function, one place in ``HANG_RULES`` and one row of the table
test (tests/unit/detectors/hang/test_rules.py); docs/operations.md's table lists them in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from llmsupervisor.core.findings import counted
from llmsupervisor.core.observe import Observation, ObservationWindow, check_timed_out
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.hang.facts import HangFacts
from llmsupervisor.detectors.hang.front import front_hung
from llmsupervisor.detectors.hang.steps import (
    Stuck,
    frozen_engine,
    overdue_step,
    spinning_engine,
    step_bound_s,
)
from llmsupervisor.detectors.hang.sweeps import cpu_used_s, sweeps_in
from llmsupervisor.probes.host import ProcSample


@dataclass(frozen=True, slots=True)
class RuleHit:
    """A rule that fired: its name (the finding's ``rule``), the time it allowed (``limit_s``),
    since when the engine has been hung, why (the finding's summary) and its own evidence."""

    rule: str
    limit_s: float
    since_s: float
    why: str
    evidence: Mapping[str, float | str] = field(default_factory=dict)


HangRule = Callable[[HangFacts, ObservationWindow, float, DetectorConfig], RuleHit | None]


def stopped(facts: HangFacts, window: ObservationWindow, now: float, cfg: DetectorConfig) -> RuleHit | None:
    """``stopped``: a process of the group is held by the kernel (SIGSTOP, a tracer), in two
    sweeps ``hang_stopped_after_s`` apart with its CPU time unchanged, or in the sweep of a round
    whose canary or /health then missed its deadline (``HangFacts.stopped``).

    Why a busy engine cannot trip it: a working process is never stopped; the kernel's state is a
    fact, not a reading of speed."""
    if facts.stopped is None:
        return None
    proc, since_s = facts.stopped
    evidence: dict[str, float | str] = {
        "stopped_pid": proc.pid,
        "stopped_process": proc.title[:80],
        "hung_pid": proc.pid,
    }
    why = f"process {proc.pid} ({proc.title[:40]}) stopped"
    return RuleHit("stopped", cfg.hang_stopped_after_s, since_s, why, evidence)


def front(facts: HangFacts, window: ObservationWindow, now: float, cfg: DetectorConfig) -> RuleHit | None:
    """``front``: /health missed twice in a row, the first sent ``hang_front_after_s`` ago, while
    the API server was asleep at no CPU (``deadlocked``) or burned a core and handed the
    scheduler nothing (``spinning``): its event loop is held (``front_hung``,
    detectors/hang/front.py).

    Why a busy engine cannot trip it: vLLM's API server answers /health from its loop in
    milliseconds however busy its engine is; a loaded one burns CPU on its main thread (not
    asleep) and admits requests; one starved of CPU is runnable, not asleep."""
    hang = front_hung(window, now, cfg)
    if hang is None:
        return None
    evidence: dict[str, float | str] = {
        "front": hang.how,
        "hung_pid": hang.pid,
        "hung_role": "api_server",
        "cpu_ratio": round(hang.cpu_ratio, 4),
        "cpu_span_s": round(hang.span_s, 3),
    }
    what = (
        "asleep at no CPU"
        if hang.how == "deadlocked"
        else f"at {hang.cpu_ratio:.0%} of a core, admitting nothing"
    )
    why = (
        f"the API server's loop is held ({hang.how}): /health missed {counted(hang.misses, 'time')} in "
        f"{now - hang.since_s:.1f} s, the API server {what}"
    )
    return RuleHit("front", cfg.hang_front_after_s, hang.since_s, why, evidence)


def _held(stuck: Stuck) -> str:
    """What the stuck engine held: its requests, or only the canary."""
    return "a canary waited" if stuck.idle else f"{counted(stuck.beat.work, 'request')} held"


def frozen(facts: HangFacts, window: ObservationWindow, now: float, cfg: DetectorConfig) -> RuleHit | None:
    """``frozen`` (step heartbeat): work held, no step for the learned bound, and the engine's
    processes other than the API server at (almost) no CPU while stuck: a deadlock
    (``frozen_engine``, detectors/hang/steps.py).

    Why a busy engine cannot trip it: a working engine completes a step within a few of its own
    longest steps, and computes meanwhile; a process waiting on I/O defers it to ``deadlines``."""
    found = frozen_engine(window, now, cfg, facts.stuck)
    if found is None:
        return None
    stuck, ratio, span_s = found
    evidence: dict[str, float | str] = {
        "cpu_ratio": round(ratio, 4),
        "cpu_span_s": round(span_s, 3),
        "steps": stuck.beat.done,
    }
    why = f"no step for {now - stuck.since_s:.1f} s while {_held(stuck)}, the engine at {ratio:.1%} of a core"
    return RuleHit(
        "frozen", step_bound_s(stuck.beat, cfg.hang_cpu_min_span_s, cfg), stuck.since_s, why, evidence
    )


def spinning(facts: HangFacts, window: ObservationWindow, now: float, cfg: DetectorConfig) -> RuleHit | None:
    """``spinning`` (step heartbeat, hosts without GPUs): work held, no step for the learned bound
    (``hang_spin_after_s`` at least), the engine's processes busy and its Worker idle: a loop that
    is not the model, e.g. a thread holding the GIL (``spinning_engine``, detectors/hang/steps.py).

    Why a busy engine cannot trip it: its steps complete within a few of its own longest steps,
    and a step, however long, is computed by the Worker, which then burns CPU."""
    found = spinning_engine(window, now, cfg, facts.stuck)
    if found is None:
        return None
    stuck, ratio, worker_ratio, span_s = found
    evidence: dict[str, float | str] = {
        "hung_role": "engine_core",
        "cpu_ratio": round(ratio, 4),
        "worker_cpu_ratio": round(worker_ratio, 4),
        "cpu_span_s": round(span_s, 3),
        "steps": stuck.beat.done,
    }
    why = (
        f"no step for {now - stuck.since_s:.1f} s while {_held(stuck)}, the engine busy ({ratio:.0%} of a "
        f"core) and its Worker idle ({worker_ratio:.1%})"
    )
    return RuleHit(
        "spinning", step_bound_s(stuck.beat, cfg.hang_spin_after_s, cfg), stuck.since_s, why, evidence
    )


def overdue(facts: HangFacts, window: ObservationWindow, now: float, cfg: DetectorConfig) -> RuleHit | None:
    """``overdue`` (step heartbeat, hosts without GPUs): a step under way for ``hang_step_factor``
    x the bound its tokens give (``hang_spin_after_s`` at least) while the Worker computes: a
    Worker that spins (``overdue_step``, detectors/hang/steps.py).

    Why a busy engine cannot trip it: the bound comes from the engine's own steps on this host
    under its load now, so a long prefill gets a long bound and a slower host a slower one."""
    found = overdue_step(window, now, cfg, facts.stuck)
    if found is None:
        return None
    stuck, bound_s, worker_ratio, span_s = found
    evidence: dict[str, float | str] = {
        "hung_role": "worker",
        "worker_cpu_ratio": round(worker_ratio, 4),
        "cpu_span_s": round(span_s, 3),
        "steps": stuck.beat.done,
        "step_tokens": stuck.beat.tokens_pending,
    }
    why = (
        f"a step of {stuck.beat.tokens_pending} tokens under way for {now - stuck.since_s:.1f} s, "
        f"over its bound of {bound_s:.1f} s, its Worker busy ({worker_ratio:.0%} of a core)"
    )
    return RuleHit("overdue", bound_s, stuck.since_s, why, evidence)


def cpu_idle(facts: HangFacts, window: ObservationWindow, now: float, cfg: DetectorConfig) -> RuleHit | None:
    """``cpu_idle``: a canary missed its deadline and the group used under ``hang_cpu_idle_ratio``
    of a core between the sweeps around it: nothing is computing it (a deadlocked or frozen core).

    Why a busy engine cannot trip it: the canary runs only while the counters stand still, and an
    engine that computes a long prefill burns CPU, however many canaries queue behind it."""
    miss = _bracketed_canary_miss(facts)
    if miss is None:
        return None
    found = _cpu_idle_through(window, now, cfg, miss)
    if found is None:
        return None
    ratio, span_s = found
    why = f"a canary missed its deadline and the engine used {ratio:.1%} of a core meanwhile"
    evidence: dict[str, float | str] = {"cpu_ratio": round(ratio, 4), "cpu_span_s": span_s}
    return RuleHit("cpu_idle", cfg.hang_cpu_min_span_s, min(facts.since_s, miss.at_s), why, evidence)


def _bracketed_canary_miss(facts: HangFacts) -> Observation | None:
    """The newest canary miss that a sweep has been taken after (the sweeps must bracket it)."""
    sweep_s = facts.newest_sweep.at_s if facts.newest_sweep is not None else None
    if sweep_s is None:
        return None
    return next((o for o in facts.missed if check_timed_out(o.canary) and o.at_s <= sweep_s), None)


def _cpu_idle_through(
    window: ObservationWindow, now: float, cfg: DetectorConfig, miss: Observation
) -> tuple[float, float] | None:
    """(CPU share of one core, span) between the newest sweep taken before ``miss``'s canary was
    sent and the oldest taken after it gave up, when that share is under ``hang_cpu_idle_ratio``."""
    assert miss.canary is not None
    sent_s = miss.at_s - miss.canary.latency_s
    after: ProcSample | None = None
    for sample in sweeps_in(window, now, miss.at_s - cfg.hang_cpu_max_span_s):
        assert sample.at_s is not None
        if sample.at_s >= miss.at_s:
            after = sample  # walking back: ends at the oldest sweep after the miss
            continue
        if sample.at_s > sent_s or after is None:
            continue
        assert after.at_s is not None
        span_s = after.at_s - sample.at_s
        if not cfg.hang_cpu_min_span_s <= span_s <= cfg.hang_cpu_max_span_s:
            return None
        used_s = cpu_used_s(sample, after)
        if used_s is None or used_s > cfg.hang_cpu_idle_ratio * span_s:
            return None
        return used_s / span_s, span_s
    return None


def deadlines(facts: HangFacts, window: ObservationWindow, now: float, cfg: DetectorConfig) -> RuleHit | None:
    """``deadlines``: ``hang_min_misses`` deadline misses (canary, /health, /metrics) and no sign of
    life for ``hang_after_s`` (``hang_idle_after_s`` when idle by its gauges): the backstop for
    what the others cannot tell (a GPU engine spinning in a hung kernel), 10-14 s.

    Why a busy engine cannot trip it: a canary answer, a step (heartbeat) or a counter that moved
    is a sign of life, and steps continue through a long prefill when the token counters stand
    still."""
    if facts.misses < cfg.hang_min_misses or facts.last_miss is None:
        return None
    limit_s = cfg.hang_idle_after_s if facts.idle else cfg.hang_after_s
    if now - facts.since_s < limit_s:
        return None
    why = f"no progress and no canary answer for {now - facts.since_s:.0f} s"
    return RuleHit("deadlines", limit_s, facts.since_s, why)


# The order they are tried in: the first that fires names the finding.
HANG_RULES: Final[tuple[HangRule, ...]] = (stopped, front, frozen, spinning, overdue, cpu_idle, deadlines)


__all__ = [
    "HANG_RULES",
    "HangRule",
    "RuleHit",
    "cpu_idle",
    "deadlines",
    "front",
    "frozen",
    "overdue",
    "spinning",
    "stopped",
]
