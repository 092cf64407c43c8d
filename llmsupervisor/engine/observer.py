"""One incarnation's eyes: every probe at once, the observation window, the findings.

An ``Observer`` is created when an incarnation turns READY and dropped when it stops; nothing it
holds (window, degradation baseline, findings, the last metrics, GPU events) survives a restart.
GPU events received before the incarnation was spawned belong to the previous one and are
dropped (XIDs of the incident that killed it reopened GPU_FAULT in its successor: defect D8).

A round (``Observer.round``) is a short sequence of named phases, in order: the plan, decided
before anything is asked (engine/round_plan.py, pure); the first look, every probe due at once;
the follow-up on a miss (/health asked again, a second sweep); the record, into the window and
through the detectors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Protocol, TypeVar, cast

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.findings import evidence_text
from llmsupervisor.core.observe import Observation, check_timed_out, describe
from llmsupervisor.detectors import (
    DetectorConfig,
    Finding,
    FindingTracker,
    Severity,
    detect_all,
    new_window,
)
from llmsupervisor.detectors.hang.steps import step_bound_s
from llmsupervisor.detectors.hang.suspect import hang_suspected
from llmsupervisor.detectors.load import ServedLoad, served_load
from llmsupervisor.engine.http import EngineHttp
from llmsupervisor.engine.processes import EngineProcess
from llmsupervisor.engine.round_plan import RoundPlan, canary_after_sweep, may_ask, plan_round
from llmsupervisor.engine.status import EngineLoad
from llmsupervisor.probes import PROBE_ERRORS, ProbeFailure, host
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuSample
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.heartbeat import StepBeat, read_heartbeat
from llmsupervisor.probes.vllm_metrics import EngineMetrics, window_quantile

log = logging.getLogger("llmsupervisor.engine")

# The window of the exported TTFT p95 (an autoscaler's signal): long enough to hold a few
# requests at low traffic, short enough to follow a burst.
LOAD_WINDOW_S: Final = 60.0

FINDING_LOG_LEVEL: Final = {
    Severity.INFO: logging.INFO,
    Severity.WARNING: logging.WARNING,
    Severity.CRITICAL: logging.ERROR,
}


# A step not back this long (and longer than the engine's longest recent one) while work is held
# is overdue: a loaded engine steps every few milliseconds.
OVERDUE_AFTER_S: Final = 0.5
# A second sweep for an overdue step is taken this much later than hang_cpu_min_span_s after
# the first, so that the span is not a hair short of it.
SPAN_MARGIN_S: Final = 0.05
# How many of the engine's latest successful canaries its live canary's deadline is learned from.
CANARY_HISTORY: Final = 8


def canary_deadline_s(recent_latencies_s: Iterable[float], spec: EngineSpec) -> float:
    """The live canary's deadline, learned from the engine's own recent canaries as TCP learns
    its retransmission timeout: ``live_canary_timeout_factor`` x the slowest of them, within
    [``live_canary_min_timeout_s``, ``live_canary_timeout_s``] (the ceiling wins if the floor is
    above it); the ceiling until one has answered.

    A one-token completion on an idle engine takes tens of milliseconds, so the floor (1 s by
    default) is what a healthy engine meets, and a frozen one is caught a deadline sooner than
    with a fixed 3 s. A slow canary raises the deadline for the next ones; the canary runs only
    while the counters stand still, so real load does not make it miss, and a miss alone opens
    nothing (detectors/hang/rules.py).
    """
    slowest = max(recent_latencies_s, default=None)
    if slowest is None:
        return spec.live_canary_timeout_s
    learned = spec.live_canary_timeout_factor * slowest
    # The ceiling wins: a config that sets only live_canary_timeout_s below the floor's default
    # (tests use 0.5 s) gets that fixed deadline, as before the deadline was learned.
    return min(spec.live_canary_timeout_s, max(spec.live_canary_min_timeout_s, learned))


def second_sweep_at(beat: StepBeat, now: float, swept_s: float, cfg: DetectorConfig) -> float | None:
    """When to take a second sweep for a step that is overdue (work held, none back for longer
    than the engine's longest recent step and OVERDUE_AFTER_S): hang_cpu_min_span_s after this
    round's sweep (``swept_s``), or later, when the spinning rule's bound is reached, but never
    more than hang_spin_after_s after the sweep. None when no step is overdue."""
    if not (beat.work > 0 or beat.pending) or now - beat.done_s < max(OVERDUE_AFTER_S, beat.expected_step_s):
        return None
    # The rules count a step under way from when it was scheduled (detectors/hang/steps.py,
    # find_stuck): on an idle engine that is the canary's step, long after the last one done.
    stuck_since_s = max(beat.done_s, beat.scheduled_s) if beat.pending else beat.done_s
    spin_s = stuck_since_s + step_bound_s(beat, cfg.hang_spin_after_s, cfg)
    at_s = min(max(swept_s + cfg.hang_cpu_min_span_s, spin_s), swept_s + cfg.hang_spin_after_s)
    return max(at_s, swept_s + cfg.hang_cpu_min_span_s) + SPAN_MARGIN_S


class GpuSource(Protocol):
    """What an engine may know of its GPUs: the shared monitor's latest samples and events."""

    def samples_for(self, gpus: Iterable[int]) -> Mapping[int, GpuSample | ProbeFailure]: ...

    def take_events(self, gpus: Iterable[int], since_s: float | None = None) -> tuple[GpuEvent, ...]: ...


class NoGpus:
    def samples_for(self, gpus: Iterable[int]) -> Mapping[int, GpuSample | ProbeFailure]:
        return {}

    def take_events(self, gpus: Iterable[int], since_s: float | None = None) -> tuple[GpuEvent, ...]:
        return ()


_T = TypeVar("_T")


async def _guarded(probe: str, call: Awaitable[_T]) -> _T | ProbeFailure:
    """A probe's result, or ``ProbeFailure("error")`` when it raised: the round goes on, the
    error is counted and logged (PROBE_ERRORS) under ``probe``, and the engine keeps serving.
    Probes return their foreseen failures as values (timeout, connect, http, parse); this is the
    one catch-all, for the ones nobody foresaw (EMFILE from a connect or a /proc read when the
    daemon is out of descriptors: issue 17). A probe keeps no catch-all of its own, so one
    failure is counted under one name wherever in the probe it raised."""
    try:
        return await call
    except Exception as exc:
        return PROBE_ERRORS.record(probe, exc)


async def _checked(probe: str, call: Awaitable[HttpCheck]) -> HttpCheck:
    """An HTTP check through the one catch-all, in the HTTP probes' own shape: one that raised
    is a failed check of kind ``error`` (``_guarded``'s ``ProbeFailure("error")``), so a round
    reads /health and its canary as one type whatever became of them."""
    got = await _guarded(probe, call)
    if isinstance(got, ProbeFailure):
        return HttpCheck(ok=False, detail=got.detail, latency_s=0.0, failure=got.kind)
    return got


async def _unless_late(
    call: Awaitable[EngineMetrics | ProbeFailure | None],
    health: asyncio.Future[HttpCheck],
    *,
    ask_again: Callable[[], Awaitable[HttpCheck]],
    late_s: float,
    went_late: list[HttpCheck],
) -> EngineMetrics | ProbeFailure | None:
    """``call``'s result, or a timeout as soon as the round's /health came back late: an API
    server that cannot answer /health in time will not send 50 kB of /metrics either, and the
    round should not wait out their longer deadline. And while /metrics is still not read
    ``late_s`` after /health answered, /health is asked again (``ask_again``) each ``late_s``:
    a loop held after its /health answered (issue 25: 5 s of a round spent on /metrics, found in
    9 s) misses that check, which goes to ``went_late`` as the round's /health, and /metrics is
    given up. A loaded host's slow /metrics keeps its full deadline while /health answers."""
    task = asyncio.ensure_future(call)
    try:
        pending: set[asyncio.Future[object]] = {
            cast("asyncio.Future[object]", task),
            cast("asyncio.Future[object]", health),
        }
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and check_timed_out(health.result()):
            return ProbeFailure("timeout", "not read: /health was late this round")
        while not task.done():
            await asyncio.wait({task}, timeout=late_s)
            if task.done():
                break
            again = await ask_again()
            if check_timed_out(again) and not task.done():
                went_late.append(again)
                return ProbeFailure("timeout", "not read: /health went late while /metrics was read")
        return await task
    finally:
        task.cancel()


async def _now(call: Callable[[Path], _T], path: Path) -> _T:
    return call(path)


async def _value(value: _T) -> _T:
    """A result the round already has, where gather wants an awaitable."""
    return value


class GroupSampler(Protocol):
    async def sample(
        self, pgid: int, *, timeout_s: float, fresh_after_s: float | None = None
    ) -> host.ProcSample | ProbeFailure: ...


async def round_unless_interrupted(
    observer: Observer,
    proc: EngineProcess,
    woken: aio.Flag,
    in_rotation: bool,
    on_wake: Callable[[], None],
    interrupted: Callable[[], bool],
) -> Observation | None:
    """One observation round, abandoned (None) as soon as the engine exits or ``interrupted()``
    says a stop or restart arrived (``on_wake`` takes the runner's inbox when ``woken``): a hung
    engine's canary would otherwise hold the restart for its whole deadline
    (live_canary_timeout_s), which the recovery benchmark measured."""
    observing = asyncio.ensure_future(observer.round(proc, in_rotation=in_rotation))
    try:
        while not observing.done():
            await aio.wait_any(observing, woken.future(), proc.exited, timeout_s=None)
            if not observing.done():
                woken.clear()
                on_wake()
            if proc.returned or interrupted():
                return None
        return observing.result()
    finally:
        if not observing.done():
            observing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observing


@dataclass(frozen=True, slots=True, kw_only=True)
class _Look:
    """What a round has seen so far: the first look makes it, each follow-up adds to it, and the
    record keeps it as the round's ``Observation``."""

    at_s: float  # when the round's probes came back
    health: HttpCheck
    canary: HttpCheck | None
    metrics: EngineMetrics | ProbeFailure | None
    proc: host.ProcSample | ProbeFailure
    sweep_after_s: float  # a second sweep is fresh after this: at_s, or a held loop's sweep
    beat: StepBeat | ProbeFailure | None = None
    health_after: HttpCheck | None = None
    beat_at_miss: StepBeat | ProbeFailure | None = None
    proc_after: host.ProcSample | None = None

    @property
    def stopped(self) -> bool:
        """The round's sweep shows a process of the engine stopped (SIGSTOP, a debugger)."""
        return isinstance(self.proc, host.ProcSample) and any(p.stopped for p in self.proc.processes)

    @property
    def missed(self) -> bool:
        """A probe of the round missed its deadline."""
        return check_timed_out(self.canary) or check_timed_out(self.health)


class Observer:
    def __init__(
        self,
        spec: EngineSpec,
        *,
        incarnation_started_s: float,
        http: EngineHttp,
        gpus: GpuSource,
        sweeper: GroupSampler,
        on_canary: Callable[[], None] = lambda: None,
        heartbeat_path: Path | None = None,
    ) -> None:
        self._spec = spec
        self._heartbeat_path = heartbeat_path
        self._last_beat: StepBeat | None = None
        self._beat_moved_since: int | None = None  # the steps done as of the round before
        self._on_canary = on_canary
        self._since_s = incarnation_started_s
        self._http = http
        self._gpus = gpus
        self._sweeper = sweeper
        self._cfg = spec.detectors
        self.window = new_window(self._cfg)
        self._canary_in_metrics = False  # the latest /metrics answered while a canary ran
        self._canary_running = False  # this round's canary is under way
        self.tracker = FindingTracker(self._cfg)
        self.findings: tuple[Finding, ...] = ()
        # Why a hang is suspected, before a HANG finding proves it: the load balancer's cue.
        self.suspect: str | None = None
        self.engine_pids: frozenset[int] = frozenset()
        self.canary_latency_s: float | None = None
        self.served: ServedLoad | None = None  # the last minute's traffic, canaries taken out
        self._canary_latencies_s: collections.deque[float] = collections.deque(maxlen=CANARY_HISTORY)
        self._last_metrics: EngineMetrics | None = None
        self._previous_metrics: EngineMetrics | None = None
        self._last_canary_s = aio.now()  # the readiness canary just ran
        self._last_metrics_s: float | None = None

    def note_canary(self, latency_s: float | None) -> None:
        self.canary_latency_s = latency_s
        if latency_s is not None:
            self._canary_latencies_s.append(latency_s)

    @property
    def canary_deadline_s(self) -> float:
        return canary_deadline_s(self._canary_latencies_s, self._spec)

    async def round(self, proc: EngineProcess, *, in_rotation: bool = True) -> Observation:
        """One look at the engine, every probe at once, each under its own deadline; then the
        detectors over the window. Findings are logged when they open and when they clear.

        The kubelet's shape: decide first (``plan_round``, pure), then probe, then record. What
        a miss brings is asked in this round, not the next: /health again after a late answer,
        and a second sweep after a miss or while a step is overdue.

        ``in_rotation`` False (drained, held, shedding): no canary (``may_ask``); /health,
        /metrics and the process sweep still run with their deadlines, and the first round back
        in rotation sends a canary at once (docs/operations.md, "Hang detection")."""
        now = aio.now()
        # Whether the engine is idle, by its heartbeat now, not the last round's: a round after
        # the last request ended read it busy, and an engine that began to spin then went a
        # round unasked (issue 25: found in 5.5 s). Two preads, not kept (``_heartbeat`` reads
        # the round's own after its probes).
        asks = may_ask(self._spec, in_rotation=in_rotation)
        start_beat = await self._heartbeat(keep=False) if asks else None
        plan = plan_round(
            self._spec,
            now,
            in_rotation=in_rotation,
            window=self.window,
            start_beat=start_beat,
            beat_moved=self._beat_moved,
            previous_metrics=self._previous_metrics,
            last_metrics=self._last_metrics,
            last_canary_s=self._last_canary_s,
            last_metrics_s=self._last_metrics_s,
        )
        look = await self._first_look(proc, plan)
        # The follow-up, in this round: /health again after a late answer, then a second sweep
        # after a miss or while a step is overdue.
        look = await self._ask_again(look, plan)
        look = await self._sweep_again(proc, look, plan)
        return self._record(look)

    async def _first_look(self, proc: EngineProcess, plan: RoundPlan) -> _Look:
        """The round's probes at once (``_probe_all``), after the sweep where the plan takes it
        first; the sweep again at a miss of a loop held after /health answered; then the
        heartbeat, read after the probes (so after the canary was sent)."""
        swept: host.ProcSample | ProbeFailure | None = None
        ask = plan.canary
        if plan.sweep_first:
            swept = await self._sweep(proc, plan.timeout_s)
            ask = canary_after_sweep(plan, swept, self.window, self._cfg)
        if plan.metrics:
            self._last_metrics_s = plan.metrics_from_s
        look, held = await self._probe_all(proc, plan, swept, ask=ask)
        if held:
            # The loop was held after the round's sweep was taken: the hang rules read CPU from
            # a sweep taken while it was held (front's span begins no earlier than its first
            # miss), so this one replaces it, and the second sweep (``_sweep_again``) comes a
            # miss later (a real-vLLM run otherwise waited a round more: found in 7 s).
            again = await self._sweep(proc, plan.timeout_s, fresh_after_s=look.at_s)
            if isinstance(again, host.ProcSample):
                look = replace(look, proc=again, sweep_after_s=aio.now())
        return replace(look, beat=await self._heartbeat())

    async def _probe_all(
        self, proc: EngineProcess, plan: RoundPlan, swept: host.ProcSample | ProbeFailure | None, *, ask: bool
    ) -> tuple[_Look, bool]:
        """/health, /metrics when due, the sweep unless ``swept`` already, and the canary when
        ``ask``, at once. The round waits ``plan.late_s`` for /health, and gives /metrics up
        when /health was late (``_unless_late``). True beside the look: the loop was held after
        /health answered (a /health asked while /metrics was read went late)."""
        # Only the probes this round runs become tasks: a probe that is not due (/metrics every
        # other round, the canary on a busy engine) was a task of its own that returned None, a
        # few of the event loop's microseconds per engine per round for nothing (issue 25).
        self._canary_running = ask
        went_late: list[HttpCheck] = []  # a /health asked again while /metrics was read, late
        health_t = asyncio.ensure_future(self._health(plan.late_s))
        metrics_t = (
            asyncio.ensure_future(
                _guarded(
                    "metrics",
                    _unless_late(
                        self._metrics(plan.timeout_s),
                        health_t,
                        ask_again=lambda: self._health(plan.late_s),
                        late_s=plan.late_s,
                        went_late=went_late,
                    ),
                )
            )
            if plan.metrics
            else None
        )
        # An idle engine's round has its sweep already (taken before its probes).
        proc_t = asyncio.ensure_future(self._sweep(proc, plan.timeout_s) if swept is None else _value(swept))
        canary_t = asyncio.ensure_future(_checked("canary", self._canary())) if ask else None
        await asyncio.gather(*(t for t in (health_t, metrics_t, proc_t, canary_t) if t is not None))
        health = health_t.result()
        if went_late and not check_timed_out(health):
            health = went_late[0]  # the loop was held after /health answered: the round's miss
        at_s = aio.now()
        look = _Look(
            at_s=at_s,
            health=health,
            canary=canary_t.result() if canary_t is not None else None,
            metrics=metrics_t.result() if metrics_t is not None else None,
            proc=proc_t.result(),
            sweep_after_s=at_s,
        )
        return look, bool(went_late)

    async def _ask_again(self, look: _Look, plan: RoundPlan) -> _Look:
        """/health asked again at once after a late answer, so that a held API server loop is two
        misses and hang_front_after_s old within this round (detectors/hang/front.py), and the second
        sweep spans both; then the heartbeat again: whether the API server handed the scheduler
        anything while it did not answer (the front rule's "admits nothing")."""
        if not check_timed_out(look.health):
            return look
        if look.stopped:
            # The round's sweep shows a process stopped: the stopped rule decides now, and a
            # second wait would only delay it.
            return look
        health_after = await self._health(plan.late_s)
        return replace(look, health_after=health_after, beat_at_miss=look.beat, beat=await self._heartbeat())

    async def _sweep_again(self, proc: EngineProcess, look: _Look, plan: RoundPlan) -> _Look:
        """A second sweep when a probe missed its deadline, or while the engine holds work and no
        step came back (``second_sweep_at``), so that the hang rules read the engine's CPU
        across it in this round, not a round later; for an overdue step, the heartbeat read again
        after it: a step may have come back meanwhile."""
        overdue_s = self._step_overdue(look.beat, look.at_s, look.proc)
        if overdue_s is None and not look.missed:
            return look
        if overdue_s is not None:
            # A span of hang_cpu_min_span_s after the first sweep: a wait only while a step is
            # overdue.
            await aio.wait_any(timeout_s=max(0.0, overdue_s - aio.now()))
        elif look.stopped and isinstance(look.proc, host.ProcSample) and look.proc.at_s is not None:
            # A stopped process is a hang in sweeps hang_stopped_after_s apart (the stopped rule).
            # The round's first sweep is that far back already, unless a held loop had it taken
            # again just now (``_first_look``): then the second waits for it. Otherwise a stop
            # that came while /metrics was read waited a round more whenever the steps before it
            # counted as life (a real-vLLM run: 5.0 s). At most the round's probe deadline: a
            # longer hang_stopped_after_s is left to the rounds after.
            due_s = min(look.proc.at_s + self._cfg.hang_stopped_after_s, look.at_s + plan.timeout_s)
            await aio.wait_any(timeout_s=max(0.0, due_s - aio.now()))
        after = await self._sweep(proc, plan.timeout_s, fresh_after_s=look.sweep_after_s)
        look = replace(look, proc_after=after if isinstance(after, host.ProcSample) else None)
        if overdue_s is None:
            return look
        return replace(look, beat=await self._heartbeat())

    def _record(self, look: _Look) -> Observation:
        """What the round saw, kept: the canary's latency, the /metrics reads, the group's PIDs,
        and the observation in the window; then the detectors over it."""
        spec = self._spec
        if look.canary is not None:
            self._last_canary_s = aio.now()
            if look.canary.ok:
                self.note_canary(look.canary.latency_s)
                self._on_canary()
        if isinstance(look.metrics, EngineMetrics):
            self._previous_metrics, self._last_metrics = self._last_metrics, look.metrics
        if isinstance(look.proc, host.ProcSample):
            self.engine_pids = frozenset(look.proc.pids)
        obs = Observation(
            engine=spec.name,
            at_s=look.at_s,
            metrics=look.metrics,
            health=look.health,
            canary=look.canary,
            gpus=self._gpus.samples_for(spec.gpus),
            gpu_events=self._gpus.take_events(spec.gpus, since_s=self._since_s),
            proc=look.proc,
            engine_pids=self.engine_pids,
            heartbeat=look.beat,
            proc_after=look.proc_after,
            health_after=look.health_after,
            heartbeat_at_miss=look.beat_at_miss,
        )
        self.window.append(obs)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(describe(obs), extra={"engine": spec.name})  # not an event: the journal only
        # Now, not at_s: a round that asked /health again or swept again after a miss ends a
        # second or two after its probes, and the rules read how long the engine has been stuck.
        decided_s = aio.now()
        self._detect(decided_s)
        self._suspect(decided_s)
        self.served = served_load(self.window, obs.at_s)
        return obs

    def _health(self, timeout_s: float) -> Awaitable[HttpCheck]:
        return _checked("health", self._http.health(timeout_s=timeout_s))

    def _sweep(
        self, proc: EngineProcess, timeout_s: float, *, fresh_after_s: float | None = None
    ) -> Awaitable[host.ProcSample | ProbeFailure]:
        return _guarded(
            "proc_sweep", self._sweeper.sample(proc.pgid, timeout_s=timeout_s, fresh_after_s=fresh_after_s)
        )

    async def _canary(self) -> HttpCheck:
        try:
            return await self._http.canary(timeout_s=self.canary_deadline_s)
        finally:
            self._canary_running = False

    async def _metrics(self, timeout_s: float) -> EngineMetrics | ProbeFailure:
        got = await self._http.metrics(timeout_s=timeout_s)
        # vLLM counts a canary still running when /metrics answers: not a user's request.
        if isinstance(got, EngineMetrics):
            self._canary_in_metrics = self._canary_running
        return got

    @property
    def _beat_moved(self) -> bool:
        return (
            self._beat_moved_since is not None
            and self._last_beat is not None
            and (self._last_beat.done != self._beat_moved_since)
        )

    def _step_overdue(
        self, beat: StepBeat | ProbeFailure | None, now: float, swept: host.ProcSample | ProbeFailure | None
    ) -> float | None:
        if not isinstance(beat, StepBeat) or not isinstance(swept, host.ProcSample) or swept.at_s is None:
            return None
        return second_sweep_at(beat, now, swept.at_s, self._cfg)

    async def _heartbeat(self, *, keep: bool = True) -> StepBeat | ProbeFailure | None:
        """The step heartbeat, read after the round's probes (so after its canary was sent);
        ``keep`` False: a look that leaves what the progress test compares (``_beat_moved``)."""
        if self._heartbeat_path is None:
            return None
        # In the loop, not a thread: two preads of a 96-byte record from a file in the daemon's own
        # state dir (7-12 us, docs/benchmarks.md), cheaper than the hop to a thread.
        beat = await _guarded("heartbeat", _now(read_heartbeat, self._heartbeat_path))
        if keep and isinstance(beat, StepBeat):
            previous = self._last_beat
            self._beat_moved_since = None if previous is None else previous.done
            self._last_beat = beat
        return beat

    def _detect(self, now: float) -> None:
        update = self.tracker.update(detect_all(self.window, now, self._cfg), now)
        for finding in update.opened:
            # Rounded, with units, for a person; the raw values go with the event (`events --json`).
            log.log(
                FINDING_LOG_LEVEL[finding.severity],
                "finding %s (%s): %s [%s]",
                finding.kind.value,
                finding.severity.value,
                finding.summary,
                evidence_text(finding.evidence),
                extra={"engine": self._spec.name, "event": "finding", "evidence": dict(finding.evidence)},
            )
        for finding in update.closed:
            log.info(
                "finding %s cleared after %.0f s",
                finding.kind.value,
                now - finding.since_s,
                extra={"engine": self._spec.name, "event": "finding"},
            )
        self.findings = tuple(update.active)

    def _suspect(self, now: float) -> None:
        suspect = hang_suspected(self.window, now, self._cfg)
        if suspect is not None and self.suspect is None:
            log.warning(
                "hang suspected, out of rotation until it answers: %s",
                suspect,
                extra={"engine": self._spec.name, "event": "finding"},
            )
        elif suspect is None and self.suspect is not None:
            log.info("hang no longer suspected", extra={"engine": self._spec.name, "event": "finding"})
        self.suspect = suspect

    def load(self) -> EngineLoad | None:
        """The latest gauges and the TTFT p95 of the last ``LOAD_WINDOW_S`` (None before the
        first scrape)."""
        latest = self._last_metrics
        if latest is None:
            return None
        now = aio.now()
        oldest = next(
            (
                obs.metrics
                for obs in self.window.since(now - LOAD_WINDOW_S)
                if isinstance(obs.metrics, EngineMetrics)
            ),
            None,
        )
        ttft_p95_s = None
        if oldest is not None and oldest is not latest:
            ttft_p95_s = window_quantile(latest.ttft_seconds, oldest.ttft_seconds, 0.95)
        running = latest.requests_running
        if running is not None and self._canary_in_metrics:
            running = max(0, running - 1)  # users' requests only: the daemon's canary taken out
        return EngineLoad(
            requests_running=running,
            requests_waiting=latest.requests_waiting,
            kv_usage_ratio=latest.kv_usage_ratio,
            ttft_p95_s=ttft_p95_s,
        )

    def close(self, why: str) -> None:
        for finding in self.findings:
            log.info(
                "finding %s closed: %s",
                finding.kind.value,
                why,
                extra={"engine": self._spec.name, "event": "finding"},
            )
        self.findings = ()
        self.suspect = None
