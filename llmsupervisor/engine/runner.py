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
changes in the middle of a step, and a command sent at any time wakes it at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import random
from collections.abc import Awaitable, Callable

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.observe import Observation
from llmsupervisor.core.restarts import should_reset
from llmsupervisor.core.state import SERVING, EngineState, rotation_target
from llmsupervisor.engine.commands import (
    Command,
    Desired,
    ResetPrefixCache,
    Start,
    StepTo,
    apply,
    restart_taken,
    spec_taken,
)
from llmsupervisor.engine.evidence import EVIDENCE_CAUSES, take_evidence
from llmsupervisor.engine.http import EngineHttp
from llmsupervisor.engine.ladder import LadderStore
from llmsupervisor.engine.launch import launch
from llmsupervisor.engine.ledger import Ledger
from llmsupervisor.engine.observer import GpuSource, GroupSampler, NoGpus, Observer
from llmsupervisor.engine.output import OutputForwarder, later_phase
from llmsupervisor.engine.processes import EngineProcess, Processes
from llmsupervisor.engine.readiness import Readiness, await_ready
from llmsupervisor.engine.repair import PrefixRepair
from llmsupervisor.engine.status import EngineStatus, Incarnation
from llmsupervisor.engine.stopping import await_gpu_release, drain, terminate

log = logging.getLogger("llmsupervisor.engine")

S = EngineState
POLICY_TURN_S = 1.0  # how long a BACKOFF after an out-of-memory start waits for the policy


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
        self._wake = asyncio.Event()
        self._ladder = LadderStore(procs.state_dir, spec)
        self._proc: EngineProcess | None = None
        self._inc: Incarnation | None = None
        self._output: OutputForwarder | None = None
        self._observer: Observer | None = None
        self._gave_up = self._ledger.state is S.FATAL  # only an operator's Start tries again
        # A stop, restart or failure is being carried out (from the drain to the next READY or
        # rest): the policy must leave the engine alone meanwhile.
        self._acting = False
        self._start_failed_oom = False
        self._start_phase: str | None = None  # how far the current start has come (STARTING only)
        self._repair = PrefixRepair(spec.name, on_done=self._publish)
        self._canary_latency_s: float | None = None
        self._canaries_total = 0  # canaries answered, readiness ones included: not traffic
        self._commands_taken = 0
        self._rounds_total = 0
        self._last_round_s = 0.0
        self._down_since_s: float | None = None
        self._track_down()
        self._status = self._build_status()

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

    def _count_canary(self) -> None:
        self._canaries_total += 1

    def _track_down(self) -> None:
        """Since when the engine is meant to serve and does not: None while it serves (READY,
        SHEDDING) or an operator holds it (drained, stopped, disabled). A hold's end starts the
        clock again, so the alert on a down engine counts from then (packaging/prometheus)."""
        d = self._desired
        meant = d.run and not d.final and not d.held
        if not meant or self._ledger.state in (S.READY, S.SHEDDING):
            self._down_since_s = None
        elif self._down_since_s is None:
            self._down_since_s = aio.now()

    def _publish(self) -> None:
        self._track_down()
        self._status = self._build_status()
        self._changed.set(self.name)

    def _build_status(self) -> EngineStatus:
        d, spec = self._desired, self._spec
        stop_pending = self._ledger.state in SERVING and (not d.run or d.final)
        if self._observer is not None:
            self._canary_latency_s = self._observer.canary_latency_s
        return EngineStatus(
            name=self.name,
            spec=spec,
            **self._ledger.facts(now=aio.now(), policy=spec.restart_policy),
            incarnation=self._inc,
            wants_run=d.run and not d.final,
            held=d.held,
            shed=d.shed,
            final=d.final,
            busy=d.restart is not None or self._repair.running or stop_pending or self._acting,
            findings=self._observer.findings if self._observer is not None else (),
            suspect=self._observer.suspect if self._observer is not None else None,
            ladder_step=self._inc.step if self._inc is not None else self._ladder.step,
            ladder_steps=len(spec.ladder),
            start_failed_oom=self._start_failed_oom,
            start_phase=self._start_phase if self._ledger.state is S.STARTING else None,
            prefix_reset_supported=self._repair.supported,
            canary_latency_s=self._canary_latency_s,
            canary_requests_total=self._canaries_total,
            down_since_s=self._down_since_s,
            served=self._observer.served if self._observer is not None else None,
            commands_taken=self._commands_taken,
            rounds_total=self._rounds_total,
            last_round_s=self._last_round_s,
            load=self._observer.load() if self._observer is not None else None,
        )

    # ---- commands ----

    def _take_inbox(self) -> None:
        """Fold the inbox into Desired. Called only from this runner's own task."""
        if not self._inbox:
            return
        while self._inbox:
            cmd = self._inbox.popleft()
            self._commands_taken += 1
            if isinstance(cmd, Start) and self._gave_up and not self._desired.final:
                self._gave_up = False
                self._ledger.reset_budget("operator start")
            elif isinstance(cmd, StepTo):
                self._ladder.set(cmd.step, cmd.reason)
                self._start_failed_oom = False
            elif isinstance(cmd, ResetPrefixCache):
                self._repair.start(self._http, cmd.reason, verify_s=self._spec.repair_verify_s)
            self._desired = apply(self._desired, cmd)
        self._publish()

    async def _pause(self, timeout_s: float | None) -> None:
        """The runner's one wait: until ``timeout_s`` passes, a command arrives or the process
        exits; then the inbox is taken. A command sent while the runner was busy elsewhere left
        the wake event set, so it is never lost (defect D11)."""
        if not self._inbox:
            waits: list[Awaitable[object]] = [self._wake.wait()]
            if self._proc is not None and not self._proc.returned:
                waits.append(self._proc.wait())
            await aio.wait_any(*waits, timeout_s=timeout_s)
        self._wake.clear()
        self._take_inbox()

    def _quick(self) -> bool:
        return self._desired.quick

    def _to(self, state: EngineState, reason: str) -> None:
        self._ledger.to(state, reason, now=aio.now())
        self._publish()

    # ---- the loop ----

    async def run(self) -> None:
        try:
            self._take_inbox()
            while True:
                d = self._desired
                if d.final or not d.run or self._gave_up:
                    self._acting = False
                    if self._ledger.state is S.BACKOFF:
                        self._to(S.STOPPED, "stop requested during backoff")
                    self._apply_spec()
                    if d.restart is not None:  # a restart of a stopped engine leaves it stopped (D5)
                        self._desired = restart_taken(self._desired)
                    if self._desired.final:
                        return
                    self._publish()
                    await self._pause(None)
                    continue
                outcome, why = await self._start_once()
                cause = "start_failed"
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
                        self._ledger.restarted(planned.cause)
                        continue
                    if planned.drain:
                        await self._drain(why)
                    cause = planned.cause
                await self._after_failure(why, cause)
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
        self._start_failed_oom = False
        self._start_phase = None
        last_failure = self._ledger.history.last_failure
        reason = "start" if self._ledger.state in (S.STOPPED, S.FATAL) else f"restart after: {last_failure}"

        if step:
            reason += f" at ladder step {step}/{len(spec.ladder)}"
        self._to(S.STARTING, reason)
        launched = await launch(spec, step, self._procs)
        if launched.proc is not None:
            proc = self._proc = launched.proc
            self._inc = Incarnation(
                number=self._ledger.spawned(), pid=proc.pid, pgid=proc.pgid, step=step, started_s=aio.now()
            )
            self._start_phase = "spawned"
            self._output = OutputForwarder(
                self.name,
                proc.pid,
                (proc.stdout_fd, proc.stderr_fd),
                self._on_oom,
                self._on_phase,
                drop_probe_access=not spec.log_probe_requests,
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
            interrupted=self._start_interrupted,
            on_canary=lambda: self._on_phase("canary"),
        )
        if result is Readiness.READY:
            self._canary_latency_s = latency_s
            if latency_s is not None:
                self._count_canary()
            return Outcome.READY, why
        if result is Readiness.FAILED:
            if self._proc.returned:
                self._record_exit(self._proc)
            return Outcome.FAILED, why
        d = self._desired
        if d.final or not d.run:
            return Outcome.STOP, "stop requested during start"
        # An operator's restart during a start abandons it and starts again at once: a 70B
        # model's load is minutes, and finishing it only to restart would pay twice.
        return Outcome.RESTART, d.restart.reason if d.restart is not None else "restart during start"

    def _start_interrupted(self) -> bool:
        d = self._desired
        return d.final or not d.run or d.restart is not None

    async def _serve(self) -> tuple[Outcome, str]:
        proc, inc, spec = self._proc, self._inc, self._spec
        assert proc is not None and inc is not None
        now = aio.now()
        due_s = None
        if spec.restart_every_h is not None:
            due_s = now + spec.restart_every_h * 3600.0 + self._rng.uniform(0.0, spec.restart_jitter_s)
        # The incarnation is complete before READY is published, with no await in between: the
        # policy can never see a READY engine with the previous incarnation's due time (D2).
        self._observer = Observer(
            spec,
            incarnation_started_s=inc.started_s,
            http=self._http,
            gpus=self._gpus,
            sweeper=self._sweeper,
            on_canary=self._count_canary,
        )
        self._observer.note_canary(self._canary_latency_s)
        self._inc = inc = Incarnation(
            number=inc.number,
            pid=inc.pid,
            pgid=inc.pgid,
            step=inc.step,
            started_s=inc.started_s,
            ready_since_s=now,
            scheduled_due_s=due_s,
        )
        self._ledger.reached_ready()
        self._acting = False
        self._to(S.READY, "ready")
        next_round_s = aio.now() + self._tick_s
        while True:
            if proc.returned:
                self._record_exit(proc)
                return Outcome.FAILED, f"process {self._ledger.history.last_exit} unexpectedly"
            d = self._desired
            if d.final or not d.run:
                return Outcome.STOP, "stop requested"
            if d.restart is not None:
                return (Outcome.BROKEN if d.restart.failure else Outcome.RESTART), d.restart.reason
            self._follow_rotation()
            if (left := next_round_s - aio.now()) > 0:
                await self._pause(left)
                continue
            due_at_s = next_round_s
            policy = spec.restart_policy
            if self._ledger.history.failures.times_s and should_reset(inc.ready_since_s, aio.now(), policy):
                self._ledger.reset_budget(f"ready for {aio.now() - (inc.ready_since_s or 0.0):.0f} s")
            obs = await self._observe_unless_interrupted(proc)
            next_round_s = aio.now() + self._tick_s
            if obs is None:
                continue  # a stop or restart came in: act on it now, not after a slow canary
            # Timed from when the round was due: waking late because the shared loop was busy
            # is part of what a round costs (and what bench/overhead sees from outside).
            self._rounds_total += 1
            self._last_round_s = aio.now() - due_at_s
            self._publish()
            if obs.health is not None and obs.health.engine_dead:
                # vLLM's own watchdog would exit ~5 s later; restart now (docs/vllm-notes.md §6).
                return Outcome.DEAD, "/health 503: engine core is dead"

    async def _observe_unless_interrupted(self, proc: EngineProcess) -> Observation | None:
        """One observation round, abandoned (None) as soon as the engine exits or a stop or
        restart arrives: a hung engine's canary would otherwise hold the restart for its whole
        deadline (live_canary_timeout_s), which the recovery benchmark measured."""
        assert self._observer is not None
        observing = asyncio.ensure_future(self._observer.round(proc))
        try:
            while not observing.done():
                await aio.wait_any(asyncio.shield(observing), self._wake.wait(), proc.wait(), timeout_s=None)
                if not observing.done():
                    self._wake.clear()
                    self._take_inbox()
                d = self._desired
                if proc.returned or d.final or not d.run or d.restart is not None:
                    return None
            return observing.result()
        finally:
            if not observing.done():
                observing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await observing

    def _follow_rotation(self) -> None:
        """READY, SHEDDING or DRAINING as the operator's hold and the policy's shedding say,
        walking only EDGES (core.state.rotation_target)."""
        d = self._desired
        while (target := rotation_target(self._ledger.state, held=d.held, shed=d.shed)) is not None:
            if target is S.DRAINING:
                why = "drain requested: out of rotation until started again"
            elif target is S.SHEDDING:
                why = f"shedding load: {d.shed}"
            elif self._ledger.state is S.DRAINING:
                why = "drain cancelled: back in rotation"
            else:
                why = "load shedding over: back in rotation"
            self._to(target, why)

    # ---- stopping and failing ----

    async def _drain(self, why: str) -> None:
        proc = self._proc
        if proc is None or proc.returned or self._ledger.state not in SERVING or self._quick():
            return
        if self._ledger.state is not S.DRAINING:
            self._to(S.DRAINING, f"draining: {why}")
        await drain(self._spec, self._http, proc, pause=self._pause, quick=self._quick)

    async def _stop(self, why: str, *, drain_first: bool) -> None:
        if drain_first:
            await self._drain(why)
        self._to(S.STOPPING, why)
        await self._terminate(quick=not drain_first)
        self._to(S.STOPPED, f"{why}: stopped")

    async def _terminate(self, *, quick: bool = False) -> None:
        """The stop ladder on the current incarnation; returns once none of it is left."""
        proc = self._proc
        if proc is None:
            return
        ladder = self._spec.stop_ladder
        await terminate(
            self.name,
            proc,
            ladder.quick() if quick else ladder,
            self._procs,
            pause=self._pause,
            quick=self._quick,
        )
        if self._output is not None:
            await self._output.close()
            self._output = None
        pids = frozenset({proc.pid})
        if self._observer is not None:
            pids |= self._observer.engine_pids
            self._observer.close("engine stopped")
            self._observer = None
        self._repair.cancel()
        self._proc = self._inc = None
        self._publish()
        await await_gpu_release(self._spec, pids, self._gpus.samples_for)

    async def _after_failure(self, reason: str, cause: str) -> None:
        """Clean up, then restart (at once the first time within the failure window, with a
        growing backoff on repeats), or give up (FATAL)."""
        policy = self._spec.restart_policy
        verdict = self._ledger.failed(reason, now=aio.now(), policy=policy, draw=self._rng.random)
        if self._proc is not None:
            if not self._procs.group_gone(self._proc):
                # The engine is failing; there is nothing to drain.
                self._to(S.STOPPING, f"cleaning up after failure: {reason}")
                if cause in EVIDENCE_CAUSES:
                    # Out of rotation already (STOPPING), not yet signalled: the stacks show
                    # the hang itself, and recovery waits for them at most EVIDENCE_TIMEOUT_S.
                    path = await take_evidence(self.name, self._proc, self._procs, cause=cause, reason=reason)
                    if path is not None:
                        self._ledger.incident(str(path))
                        self._publish()
            await self._terminate(quick=True)
        if verdict.give_up:
            self._gave_up = True
            self._acting = False
            why = f"{reason}; {verdict.budget}, giving up (llm-supervisor start {self.name} retries)"
            self._to(S.FATAL, why)
            return
        count, delay_s = verdict.failures, verdict.backoff_s
        # A start that ran out of memory waits for the policy's turn (bounded): it decides
        # whether the next spawn runs a batch step down, and a 0 s backoff would not let it.
        oom_step = self._start_failed_oom and self._ladder.step < len(self._spec.ladder)
        wait_s = max(delay_s, POLICY_TURN_S) if oom_step else delay_s
        self._acting = False
        self._to(S.BACKOFF, f"{reason}; failure {count}/{policy.max_failures}, restarting in {wait_s:.1f} s")
        deadline = aio.now() + wait_s
        # An operator's restart during the backoff means "try now"; so does the policy's step.
        while (left := deadline - aio.now()) > 0 and self._wants_start() and self._desired.restart is None:
            if oom_step and not self._start_failed_oom and aio.now() >= deadline - wait_s + delay_s:
                break
            await self._pause(left)
        if self._wants_start():
            self._ledger.restarted(cause)

    def _wants_start(self) -> bool:
        return self._desired.run and not self._desired.final

    # ---- helpers ----

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

    def _exit_text(self, proc: EngineProcess) -> str:
        assert proc.exit_status is not None
        return proc.exit_status.describe()

    def _record_exit(self, proc: EngineProcess) -> None:
        """An exit nobody asked for: what it was, and when (`status` shows "crashed ... ago")."""
        self._ledger.exited(self._exit_text(proc), now=aio.now())

    def _on_phase(self, phase: str) -> None:
        if self._ledger.state is S.STARTING and later_phase(self._start_phase, phase):
            self._start_phase = phase
            self._publish()

    def _on_oom(self) -> None:
        if self._ledger.state is S.STARTING and not self._start_failed_oom:
            self._start_failed_oom = True
            self._publish()
