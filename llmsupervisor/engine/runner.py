"""One engine's life: commands in, one status out, and the loop in between.

Each engine is one asyncio task (``EngineRunner.run``) in the daemon's single loop. Nobody
reaches into it: others ``send`` it commands (engine/commands.py) and read the ``EngineStatus``
it publishes (engine/status.py); it sets the shared ``changed`` event after each publish and
never calls anyone back. The daemon decides what to do about a status on its own turn.

A pass of the loop::

    desired not to run ─────────────────────────────► wait for a command
    start: launch ─► await_ready ──ready──► serve: rotation, observation rounds
                         │                     │
                         │ failed              ├── stop asked ──────► drain, stop ─► STOPPED
                         │                     ├── restart asked ───► drain?, stop, count ─► start
                         ▼                     ├── broken (policy) ─► drain?, failure
                      failure ◄────────────────┴── exited, /health 503
                         │
                         └─► clean up, then BACKOFF (at once the first time, growing after)
                             or FATAL (budget spent; an operator `start` tries again)

The runner takes its inbox only at its own waits (``_pause``), so what it should be doing never
changes in the middle of a step, and a command sent at any time wakes it at once. Its helpers'
tasks (the output readers, a prefix-cache reset) report what they saw to that inbox too, and the
runner alone publishes, from its own task; ``build_status`` (engine/status.py) makes the status.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import replace

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.findings import Blame
from llmsupervisor.core.state import SERVING, EngineState, rotation_target
from llmsupervisor.engine.commands import (
    Command,
    Desired,
    Note,
    ResetPrefixCache,
    Start,
    StepTo,
    apply,
    restart_taken,
    spec_taken,
)
from llmsupervisor.engine.evidence import EVIDENCE_CAUSES, NO_EVIDENCE, take_evidence
from llmsupervisor.engine.heartbeat import heartbeat_path
from llmsupervisor.engine.http import EngineHttp
from llmsupervisor.engine.ladder import LadderStore
from llmsupervisor.engine.launch import launch_when_free
from llmsupervisor.engine.ledger import Ledger, rotation_reason, start_reason
from llmsupervisor.engine.observer import GpuSource, GroupSampler, NoGpus, Observer, round_unless_interrupted
from llmsupervisor.engine.output import OutputForwarder, OutputSeen
from llmsupervisor.engine.processes import EngineProcess, Processes
from llmsupervisor.engine.readiness import Readiness, await_ready
from llmsupervisor.engine.repair import PrefixRepair, ResetDone
from llmsupervisor.engine.status import (
    EngineStatus,
    Incarnation,
    StartProgress,
    Tally,
    build_status,
    seen,
    turned_ready,
)
from llmsupervisor.engine.stopping import await_gpu_release, drain, terminate

log = logging.getLogger("llmsupervisor.engine")

S = EngineState
POLICY_TURN_S = 1.0  # how long a BACKOFF after an out-of-memory start waits for the policy
OUTPUT_SETTLE_S = 0.5  # after an exit, how long its last lines may take to arrive


class Outcome(enum.Enum):
    READY = "ready"
    STOP = "stop requested"
    RESTART = "planned restart"
    BROKEN = "restart of a broken engine"  # the policy: hang, stall, GPU fault
    FAILED = "failed"  # exited, missed its deadline, failed a check
    DEAD = "engine dead"  # /health 503: the process lives, the engine core does not


class EngineRunner:
    def __init__(
        self,
        spec: EngineSpec,
        *,
        procs: Processes,
        http_for: Callable[[EngineSpec], EngineHttp],
        tick_interval_s: float,
        changed: aio.Changes,
        gpus: GpuSource | None = None,
        sweeper: GroupSampler,
        rng: random.Random | None = None,
        ledger: Ledger | None = None,
        desired: Desired | None = None,
    ) -> None:
        self.name = spec.name
        self._spec = spec
        self._procs = procs
        self._http_for = http_for
        self._http = http_for(spec)
        self._tick_s = tick_interval_s
        self._changed = changed
        self._gpus: GpuSource = gpus or NoGpus()
        self._sweeper = sweeper
        self._rng = rng or random.Random()
        # A successor (daemon/fleet.py) carries on its predecessor's ledger and desired state:
        # counters, budget and state, and the operator's stop or drain (review 3, E2).
        self._ledger = ledger or Ledger(spec.name, now=aio.now())
        self._desired = desired or Desired(run=spec.enabled)
        self._inbox: collections.deque[Command] = collections.deque()
        # What the helpers' tasks saw, for the runner to take at its waits: output lines do not
        # wake it (a start's phase waits for the next readiness poll), a reset's end does.
        self._reports: collections.deque[OutputSeen | ResetDone] = collections.deque()
        self._wake = aio.Flag()
        self._ladder = LadderStore(procs.state_dir, spec)
        self._proc: EngineProcess | None = None
        self._inc: Incarnation | None = None
        self._output: OutputForwarder | None = None
        self._observer: Observer | None = None
        # A stop, restart or failure is being carried out (from the drain to the next READY or
        # rest): the policy must leave the engine alone meanwhile. Not a state: the STARTING of
        # a restart is busy, a first start is not.
        self._acting = False
        self._start = StartProgress()
        self._repair = PrefixRepair(spec.name, report=self._report_now)
        self._reset_supported: bool | None = None  # None: not tried yet
        self._tally = Tally()
        self._down_since_s: float | None = None
        self._publish(quietly=True)

    # ---- the contract ----

    def send(self, cmd: Command) -> None:
        self._inbox.append(cmd)
        self._wake.set()

    def status(self) -> EngineStatus:
        """The last published status: immutable, consistent, cheap to read."""
        return self._status

    @property
    def ledger(self) -> Ledger:
        """State, counters and the failure budget, for a successor if this runner's task dies."""
        return self._ledger

    @property
    def desired(self) -> Desired:
        """What the engine was told (an immutable value), for a successor likewise."""
        return self._desired

    def _publish(self, *, quietly: bool = False) -> None:
        """The one place a status is made, on this runner's task only."""
        self._status = build_status(
            self._spec,
            now=aio.now(),
            ledger=self._ledger,
            desired=self._desired,
            incarnation=self._inc,
            next_step=self._ladder.step,
            start=self._start,
            observer=self._observer,
            tally=self._tally,
            resetting=self._repair.running,
            reset_supported=self._reset_supported,
            acting=self._acting,
            down_since_s=self._down_since_s,
        )
        self._down_since_s = self._status.down_since_s
        if not quietly:
            self._changed.set(self.name)

    # ---- commands and reports ----

    def _report_now(self, report: OutputSeen | ResetDone) -> None:
        self._reports.append(report)
        self._wake.set()

    def _take_reports(self) -> bool:
        """Fold what the helpers reported; whether it changed anything to publish. A start's
        progress counts only while STARTING (an OOM of a serving engine is no failed start)."""
        changed = False
        while self._reports:
            report = self._reports.popleft()
            if isinstance(report, ResetDone):
                self._reset_supported, changed = report.supported, True
            elif self._ledger.state is S.STARTING and (progress := seen(self._start, report)) != self._start:
                self._start, changed = progress, True
        return changed

    def _take_inbox(self) -> None:
        """Fold the inbox into Desired, and the reports. Called only from this runner's own task."""
        changed = self._take_reports()
        if not self._inbox and not changed:
            return
        while self._inbox:
            cmd = self._inbox.popleft()
            self._tally.commands_taken += 1
            if isinstance(cmd, Start) and self._ledger.gave_up and not self._desired.final:
                self._ledger.reset_budget("operator start")
            elif isinstance(cmd, StepTo):
                self._ladder.set(cmd.step, cmd.reason)
                self._start = replace(self._start, failed_oom=False)
            elif isinstance(cmd, ResetPrefixCache):
                self._repair.start(self._http, cmd.reason, verify_s=self._spec.repair_verify_s)
            elif isinstance(cmd, Note) and self._ledger.state is S.STOPPED and not self._desired.wants_run:
                self._ledger.note(cmd.reason)
            self._desired = apply(self._desired, cmd)
        self._publish()

    async def _pause(self, timeout_s: float | None) -> None:
        """The runner's one wait: until ``timeout_s`` passes, a command arrives or the process
        exits; then the inbox is taken. A command sent while the runner was busy elsewhere left
        the wake event set, so it is never lost (defect D11)."""
        if not self._inbox:
            waits: list[Awaitable[object]] = [self._wake.future()]
            if self._proc is not None and not self._proc.returned:
                waits.append(self._proc.exited)
            await aio.wait_any(*waits, timeout_s=timeout_s)
        self._wake.clear()
        self._take_inbox()

    def _to(self, state: EngineState, reason: str) -> None:
        self._ledger.to(state, reason, now=aio.now())
        self._publish()

    # ---- the loop ----

    async def run(self) -> None:
        try:
            self._take_inbox()
            while True:
                d = self._desired
                if not d.wants_run or self._ledger.gave_up:
                    self._acting = False
                    if self._ledger.state is S.BACKOFF:
                        self._to(S.STOPPED, "stop requested during backoff")
                    elif self._ledger.state is S.FATAL and not d.wants_run and not d.final:  # held, as asked
                        self._to(S.STOPPED, "stop requested: stopped (it had given up)")
                    self._apply_spec()
                    if d.restart is not None:  # a restart of a stopped engine leaves it stopped (D5)
                        self._desired = restart_taken(self._desired)
                    if self._desired.final:
                        return
                    self._publish()
                    await self._pause(None)
                    continue
                outcome, why = await self._start_once()
                cause, blame = "start_failed", None
                if outcome is Outcome.READY:
                    outcome, why = await self._serve()
                    cause = "engine_dead" if outcome is Outcome.DEAD else "crash"
                self._acting = True
                if outcome is Outcome.STOP:
                    await self._stop(why, drain_first=True)
                    continue
                planned = self._desired.restart
                if planned is not None and outcome in (Outcome.RESTART, Outcome.BROKEN):
                    self._desired = restart_taken(self._desired)
                    if outcome is Outcome.RESTART:
                        await self._stop(why, drain_first=planned.drain)
                        self._ledger.restarted(planned.cause, reason=why, now=aio.now())
                        continue
                    if planned.drain:
                        await self._drain(why)
                    cause, blame = planned.cause, planned.blame
                await self._after_failure(why, cause, blame)
        finally:
            # Whatever happened (a bug, cancellation), leave no process behind.
            self._repair.cancel()
            if self._proc is not None and not self._procs.group_gone(self._proc):
                await asyncio.shield(self._terminate(quick=True))

    async def _start_once(self) -> tuple[Outcome, str]:
        # This spawn is the pending restart, with the pending spec (no process runs now).
        self._apply_spec()
        self._desired = restart_taken(self._desired)
        spec, step = self._spec, self._ladder.step
        self._start = StartProgress()
        ledger = self._ledger
        self._to(S.STARTING, start_reason(ledger.state, ledger.history.last_failure, step, len(spec.ladder)))
        launched = await launch_when_free(spec, step, self._procs, wait=self._wait_for_port)
        if launched is None:  # a stop or restart while someone else held the port
            return self._interrupted_start()
        if launched.proc is not None:
            proc = self._proc = launched.proc
            self._inc = Incarnation(
                number=self._ledger.spawned(), pid=proc.pid, pgid=proc.pgid, step=step, started_s=aio.now()
            )
            self._start = StartProgress(phase="spawned")
            fds, drop = (proc.stdout_fd, proc.stderr_fd), not spec.log_probe_requests
            self._output = OutputForwarder(
                self.name,
                proc.pid,
                fds,
                self._reports.append,
                drop_probe_access=drop,
                own=self._http.own_addresses,
            )
            self._publish()
        if launched.failure:
            return Outcome.FAILED, launched.failure
        assert self._proc is not None
        result, why, latency_s = await await_ready(
            spec,
            self._http,
            self._proc,
            pause=self._pause,
            interrupted=lambda: self._desired.interrupts,
            on_canary=self._canary_phase,
        )
        if result is Readiness.READY:
            self._tally.canary_latency_s = latency_s
            if latency_s is not None:
                self._tally.count_canary()
            return Outcome.READY, why
        if result is Readiness.FAILED:
            if self._proc.returned:
                self._record_exit(self._proc)
            return Outcome.FAILED, why
        return self._interrupted_start()

    async def _wait_for_port(self, reason: str, wait_s: float) -> bool:
        """STARTING with ``reason`` (who holds the port) for ``wait_s`` or until a command; False
        when a stop or restart ends the wait (engine/launch.py ``launch_when_free``)."""
        self._ledger.note(reason)
        self._publish()
        await self._pause(wait_s)
        return not self._desired.interrupts

    def _interrupted_start(self) -> tuple[Outcome, str]:
        d = self._desired
        if not d.wants_run:
            return Outcome.STOP, "stop requested during start"
        # An operator's restart during a start abandons it and starts again at once: a 70B
        # model's load is minutes, and finishing it only to restart would pay twice.
        return Outcome.RESTART, d.restart.reason if d.restart is not None else "restart during start"

    async def _serve(self) -> tuple[Outcome, str]:
        proc, inc, spec = self._proc, self._inc, self._spec
        assert proc is not None and inc is not None
        # The incarnation is complete before READY is published, with no await in between: the
        # policy can never see a READY engine with the previous incarnation's due time (D2).
        self._observer = Observer(
            spec,
            incarnation_started_s=inc.started_s,
            http=self._http,
            gpus=self._gpus,
            sweeper=self._sweeper,
            on_canary=self._tally.count_canary,
            heartbeat_path=heartbeat_path(self._procs.state_dir, spec.name),
        )
        self._observer.note_canary(self._tally.canary_latency_s)
        self._inc = inc = turned_ready(inc, spec, now=aio.now(), uniform=self._rng.uniform)
        self._ledger.reached_ready()
        self._acting = False
        self._to(S.READY, "ready")
        next_round_s = aio.now() + self._tick_s
        while True:
            if proc.returned:
                self._record_exit(proc)
                return Outcome.FAILED, f"process {self._ledger.history.last_exit} unexpectedly"
            d = self._desired
            if not d.wants_run:
                return Outcome.STOP, "stop requested"
            if d.restart is not None:
                return (Outcome.BROKEN if d.restart.failure else Outcome.RESTART), d.restart.reason
            self._follow_rotation()
            if (left := next_round_s - aio.now()) > 0:
                await self._pause(left)
                continue
            due_at_s = next_round_s
            self._ledger.settled(inc.ready_since_s, now=aio.now(), policy=spec.restart_policy)
            assert self._observer is not None
            rotating = self._ledger.state is S.READY  # no canary to an engine out of rotation
            obs = await round_unless_interrupted(  # None: it exited, or a stop or restart came
                self._observer, proc, self._wake, rotating, self._take_inbox, self._interrupted
            )
            next_round_s = aio.now() + self._tick_s
            if obs is None:
                continue  # a stop or restart came in: act on it now, not after a slow canary
            # Timed from when the round was due: waking late because the shared loop was busy
            # is part of what a round costs (and what bench/overhead sees from outside).
            self._tally.rounds_total += 1
            self._tally.last_round_s = aio.now() - due_at_s
            self._publish()
            if obs.health is not None and obs.health.engine_dead:
                # vLLM's own watchdog would exit ~5 s later; restart now (docs/vllm-notes.md §6).
                return Outcome.DEAD, "/health 503: engine core is dead"

    def _follow_rotation(self) -> None:
        """READY, SHEDDING or DRAINING as the operator's hold and the policy's shedding say,
        walking only EDGES (core.state.rotation_target)."""
        d = self._desired
        while (target := rotation_target(self._ledger.state, held=d.held, shed=d.shed)) is not None:
            self._to(target, rotation_reason(self._ledger.state, target, d.shed))

    # ---- stopping and failing ----

    async def _drain(self, why: str) -> None:
        proc = self._proc
        if proc is None or proc.returned or self._ledger.state not in SERVING or self._desired.quick:
            return
        if self._ledger.state is not S.DRAINING:
            self._to(S.DRAINING, f"draining: {why}")
        await drain(self._spec, self._http, proc, pause=self._pause, quick=lambda: self._desired.quick)

    async def _stop(self, why: str, *, drain_first: bool) -> None:
        if drain_first:
            await self._drain(why)
        self._to(S.STOPPING, why)
        if self._output is not None:
            self._output.planned_stop()  # vLLM's errors while it stops are no problem (output.py)
        await self._terminate(quick=not drain_first)
        self._to(S.STOPPED, f"{why}: stopped")

    async def _terminate(self, *, quick: bool = False, hung: bool = False) -> None:
        """The stop ladder on the current incarnation; returns once none of it is left."""
        if (proc := self._proc) is None:
            return
        ladder = self._spec.stop_ladder.quick() if quick else self._spec.stop_ladder
        ladder = replace(ladder, kill_only=hung)  # a hung engine acts on no SIGTERM
        await terminate(
            self.name, proc, ladder, self._procs, pause=self._pause, quick=lambda: self._desired.quick
        )
        if self._output is not None:
            await self._output.close()
            self._output = None
            self._take_reports()  # what the pipes still said (an OOM line after the exit); published below
        pids = frozenset({proc.pid})
        if self._observer is not None:
            pids |= self._observer.engine_pids
            self._tally.canary_latency_s = self._observer.canary_latency_s  # shown after it stops
            self._observer.close("engine stopped")
            self._observer = None
        self._repair.cancel()
        self._proc = self._inc = None
        self._publish()
        await await_gpu_release(self._spec, pids, self._gpus.samples_for)

    async def _after_failure(self, reason: str, cause: str, blame: Blame | None = None) -> None:
        """Clean up, then restart (at once the first time within the failure window, with a
        growing backoff on repeats), or give up (FATAL). ``blame``: what a hang's finding blames."""
        policy = self._spec.restart_policy
        said = None  # exited by itself: the last error line it printed, which ends the reason (output.py)
        if self._output is not None and self._proc is not None and self._proc.returned:
            reason, said = await self._output.explained(reason, settle_s=OUTPUT_SETTLE_S)
        got = NO_EVIDENCE
        verdict = self._ledger.failed(reason, said, now=aio.now(), policy=policy, draw=self._rng.random)
        if self._proc is not None:
            if not self._procs.group_gone(self._proc):
                # Failing: nothing to drain. A hang's stacks cut the API server first (evidence.py).
                self._to(S.STOPPING, f"cleaning up after failure: {reason}")
                if cause in EVIDENCE_CAUSES:
                    got = await take_evidence(
                        self.name, self._proc, self._procs, cause=cause, reason=reason, blame=blame
                    )
                    if got.incident is not None:
                        self._ledger.incident(got.incident)
                        self._publish()
            await self._terminate(quick=True, hung=cause in EVIDENCE_CAUSES)
        self._acting = False
        if verdict.give_up:
            self._to(S.FATAL, verdict.give_up_reason(reason, self.name))
            return
        delay_s = verdict.backoff_s
        # A start that ran out of memory waits for the policy's turn (bounded): it decides
        # whether the next spawn runs a batch step down, and a 0 s backoff would not let it.
        oom_step = self._start.failed_oom and self._ladder.step < len(self._spec.ladder)
        wait_s = max(delay_s, POLICY_TURN_S) if oom_step else delay_s
        self._to(S.BACKOFF, verdict.backoff_reason(reason, policy, wait_s))
        deadline = aio.now() + wait_s
        # An operator's restart during the backoff means "try now"; so does the policy's step.
        while (
            (left := deadline - aio.now()) > 0 and self._desired.wants_run and self._desired.restart is None
        ):
            if oom_step and not self._start.failed_oom and aio.now() >= deadline - wait_s + delay_s:
                break
            await self._pause(left)
        if self._desired.wants_run:
            self._ledger.restarted(cause, reason=reason, now=aio.now(), incident=got.incident)

    # ---- helpers ----

    def _interrupted(self) -> bool:
        return self._desired.interrupts

    def _apply_spec(self) -> None:
        """A new spec (from a reload) takes effect only while no process runs."""
        spec = self._desired.spec
        if spec is None or self._proc is not None:
            return
        self._desired = spec_taken(self._desired)
        self._spec = spec
        self._ladder.respec(spec)
        self._http = self._http_for(spec)
        self._publish()

    def _record_exit(self, proc: EngineProcess) -> None:
        """An exit nobody asked for: what it was, and when (`status` shows "crashed ... ago")."""
        assert proc.exit_status is not None
        self._ledger.exited(proc.exit_status.describe(), now=aio.now())

    def _canary_phase(self) -> None:
        """The readiness canary is under way (called on this task, from await_ready)."""
        self._reports.append(OutputSeen(phase="canary"))
        if self._take_reports():
            self._publish()
