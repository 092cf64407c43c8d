"""HANG: is the engine doing anything at all?

Busy is not dead (docs/vllm-notes.md §7): a slow canary while the step or token counters advance is
load, not a hang. Like STALL (detectors/stall.py), the detector needs no ``sustain_s``: each rule
already needs its signs frozen for a stretch of readings.

A HANG is found by the first of these rules (issues 16 and 25), fastest first:

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
"""

from __future__ import annotations

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import Observation, ObservationWindow, check_timed_out
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.hang.front import front_hung
from llmsupervisor.detectors.hang.steps import (
    beat_progressed,
    frozen_engine,
    overdue_step,
    spinning_engine,
    step_bound_s,
)
from llmsupervisor.detectors.hang.sweeps import cpu_used_s, sweeps_in
from llmsupervisor.detectors.series import counters_progressed, in_flight, new_finding, newest_first
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcInfo, ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics

K = FindingKind


def _stopped(window: ObservationWindow, now: float, cfg: DetectorConfig) -> tuple[ProcInfo, float] | None:
    """A process stopped, CPU time unchanged, in sweeps ``hang_stopped_after_s`` apart: the
    process and the time of the oldest of those sweeps."""
    sweeps = sweeps_in(window, now, now - cfg.stale_after_s)
    newest = next(sweeps, None)
    if newest is None or newest.at_s is None:
        return None
    held = {p.pid: p for p in newest.processes if p.stopped and not p.zombie}
    for older in sweeps:
        if not held:
            return None
        before = {p.pid: p for p in older.processes}
        held = {
            pid: p
            for pid, p in held.items()
            if (b := before.get(pid)) is not None and b.stopped and b.cpu_seconds == p.cpu_seconds
        }
        assert older.at_s is not None  # _sweeps yields only timed samples
        if held and newest.at_s - older.at_s >= cfg.hang_stopped_after_s:
            return min(held.values(), key=lambda p: p.pid), older.at_s
    return None


def _stopped_at_miss(missed: list[Observation]) -> tuple[ProcInfo, float] | None:
    """A process stopped in the sweep of a round whose canary or /health then missed its
    deadline: the sweep is taken as the round starts, the probes sent with it, so the stop came
    first and the engine did not answer after it. One round instead of two sweeps a second apart."""
    for obs in missed:
        sample = obs.proc
        late = check_timed_out(obs.canary) or check_timed_out(obs.health)
        if not late or not isinstance(sample, ProcSample):
            continue
        held = [p for p in sample.processes if p.stopped and not p.zombie]
        if held:
            return held[0], sample.at_s if sample.at_s is not None else obs.at_s
    return None


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
    """A process of the group stopped, or a canary missed while the group used no CPU (the
    ``stopped`` and ``cpu_idle`` rules, module docstring); else no sign of life for
    ``hang_*after_s`` and at least ``hang_min_misses`` deadline misses (``deadlines``).

    Signs of life: a canary that answered, or a step/token counter that moved between two
    readings (busy, not dead, even if the canary was slow). A deadline miss: the canary,
    ``/health`` or ``/metrics`` timing out. ``/health`` 200 proves nothing (docs/vllm-notes.md §7).
    """
    newest: Observation | None = None
    oldest: Observation | None = None
    last_life_s: float | None = None
    missed: list[Observation] = []
    newer: tuple[Observation, EngineMetrics] | None = None  # the next newer reading
    newer_beat: Observation | None = None  # the next newer observation with a heartbeat
    last_reading: EngineMetrics | None = None
    for obs in newest_first(window, now):  # back to the last sign of life
        newest = newest or obs
        oldest = obs
        if isinstance(obs.heartbeat, StepBeat):
            if newer_beat is not None and beat_progressed(obs, newer_beat):
                last_life_s = newer_beat.at_s  # a step completed by the newer reading
                break
            newer_beat = obs
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
    # Without any sign of life in the window, count from the first observation: the window
    # shows nothing earlier.
    frozen_since = last_life_s if last_life_s is not None else oldest.at_s
    work = None if last_reading is None else in_flight(last_reading)
    idle = work == 0
    evidence: dict[str, float | str] = {}
    stopped = _stopped(window, now, cfg) or _stopped_at_miss(missed)
    # The newest canary miss that a sweep has been taken after (the sweeps must bracket it).
    newest_sweep = next(sweeps_in(window, now, now - cfg.stale_after_s), None)
    canary_miss = next(
        (
            o
            for o in missed
            if check_timed_out(o.canary)
            and newest_sweep is not None
            and newest_sweep.at_s is not None
            and o.at_s <= newest_sweep.at_s
        ),
        None,
    )
    cpu_idle = None if canary_miss is None else _cpu_idle_through(window, now, cfg, canary_miss)
    # Each rule is tried only if the ones before it found nothing (they read the same window).
    front = None if stopped is not None else front_hung(window, now, cfg)
    frozen = None if stopped is not None or front is not None else frozen_engine(window, now, cfg)
    spinning = None if stopped or front or frozen else spinning_engine(window, now, cfg)
    overdue = None if stopped or front or frozen or spinning else overdue_step(window, now, cfg)
    if stopped is not None:
        proc, frozen_since = stopped
        rule, limit_s = "stopped", cfg.hang_stopped_after_s
        evidence["stopped_pid"] = proc.pid
        evidence["stopped_process"] = proc.title[:80]
        evidence["hung_pid"] = proc.pid
        why = f"process {proc.pid} ({proc.title[:40]}) stopped"
    elif front is not None:
        rule, limit_s = "front", cfg.hang_front_after_s
        frozen_since = front.since_s
        evidence.update(
            front=front.how,
            hung_pid=front.pid,
            hung_role="api_server",
            cpu_ratio=round(front.cpu_ratio, 4),
            cpu_span_s=round(front.span_s, 3),
        )
        what = (
            "asleep at no CPU"
            if front.how == "deadlocked"
            else f"at {front.cpu_ratio:.0%} of a core, admitting nothing"
        )
        why = (
            f"the API server's loop is held ({front.how}): /health missed {front.misses} times in "
            f"{now - front.since_s:.1f} s, the API server {what}"
        )
    elif frozen is not None:
        stuck, ratio, span_s = frozen
        rule, limit_s = "frozen", step_bound_s(stuck.beat, cfg.hang_cpu_min_span_s, cfg)
        frozen_since = stuck.since_s
        evidence.update(cpu_ratio=round(ratio, 4), cpu_span_s=round(span_s, 3), steps=stuck.beat.done)
        what = "a canary waited" if stuck.idle else f"{stuck.beat.work} requests held"
        why = f"no step for {now - stuck.since_s:.1f} s while {what}, the engine at {ratio:.1%} of a core"
    elif spinning is not None:
        stuck, ratio, worker_ratio, span_s = spinning
        rule, limit_s = "spinning", step_bound_s(stuck.beat, cfg.hang_spin_after_s, cfg)
        frozen_since = stuck.since_s
        evidence.update(
            hung_role="engine_core",
            cpu_ratio=round(ratio, 4),
            worker_cpu_ratio=round(worker_ratio, 4),
            cpu_span_s=round(span_s, 3),
            steps=stuck.beat.done,
        )
        what = "a canary waited" if stuck.idle else f"{stuck.beat.work} requests held"
        why = (
            f"no step for {now - stuck.since_s:.1f} s while {what}, the engine busy ({ratio:.0%} of a "
            f"core) and its Worker idle ({worker_ratio:.1%})"
        )
    elif overdue is not None:
        stuck, bound_s, worker_ratio, span_s = overdue
        rule, limit_s = "overdue", bound_s
        frozen_since = stuck.since_s
        evidence.update(
            hung_role="worker",
            worker_cpu_ratio=round(worker_ratio, 4),
            cpu_span_s=round(span_s, 3),
            steps=stuck.beat.done,
            step_tokens=stuck.beat.tokens_pending,
        )
        why = (
            f"a step of {stuck.beat.tokens_pending} tokens under way for {now - stuck.since_s:.1f} s, "
            f"over its bound of {bound_s:.1f} s, its Worker busy ({worker_ratio:.0%} of a core)"
        )
    elif cpu_idle is not None and canary_miss is not None:
        rule, limit_s = "cpu_idle", cfg.hang_cpu_min_span_s
        evidence["cpu_ratio"] = round(cpu_idle[0], 4)
        evidence["cpu_span_s"] = cpu_idle[1]
        frozen_since = min(frozen_since, canary_miss.at_s)
        why = f"a canary missed its deadline and the engine used {cpu_idle[0]:.1%} of a core meanwhile"
    else:
        if misses < cfg.hang_min_misses or last_miss is None:
            return None
        rule = "deadlines"
        limit_s = cfg.hang_idle_after_s if idle else cfg.hang_after_s
        if now - frozen_since < limit_s:
            return None
        why = f"no progress and no canary answer for {now - frozen_since:.0f} s"
    frozen_s = now - frozen_since
    latest = newest
    evidence.update({"rule": rule, "frozen_s": frozen_s, "misses": misses, "limit_s": limit_s})
    if last_miss is not None:
        evidence["last_miss"] = _miss_detail(last_miss)
    if last_reading is not None:
        if work is not None:
            evidence["requests_in_flight"] = work
        if last_reading.iterations_total is not None:
            evidence["iterations_total"] = last_reading.iterations_total
        if last_reading.generation_tokens_total is not None:
            evidence["generation_tokens_total"] = last_reading.generation_tokens_total
    if last_miss is not None and last_miss.canary is not None:
        evidence["canary_latency_s"] = last_miss.canary.latency_s
    state = "idle by its gauges" if idle else "with work queued or unknown"
    return new_finding(
        latest,
        K.HANG,
        Severity.CRITICAL,
        frozen_since,
        f"hung: {why} ({misses} deadline misses, {state})",
        **evidence,
    )


__all__ = ["detect_hang"]
