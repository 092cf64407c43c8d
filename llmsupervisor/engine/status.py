"""What an engine publishes: one immutable ``EngineStatus``, the only way anyone reads it.

The runner builds a new status after every step (a state change, an observation round, a
command or a report taken) with the pure ``build_status`` below, on its own task only, and swaps
one reference; a runner whose task died gets its last status from ``died``, which the fleet
calls. The daemon's reconcile loop, the status file, the exporter and the HTTP endpoints all
read that value, never the runner. What an engine is meant to do is read through three
properties only, ``meant_to_serve``, ``held_by_operator`` and ``running``: the policy, `--all`,
/readyz, the exporter and the operator's commands all ask them. Text in it (reasons, exits) is
as its source wrote it: it is redacted where it leaves the daemon (redact.py).

An ``Incarnation`` is one spawn of the engine. Everything that belongs to a spawn (its pid, the
batch step it was started with, when it turned READY, its scheduled-restart due time) lives
here and is replaced whole at the next spawn, so nothing of one incarnation can leak into the
next (the policy saw a READY engine carrying the last incarnation's due time: defect D2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.state import SERVING, EngineState
from llmsupervisor.detectors import Finding, FindingKind
from llmsupervisor.detectors.load import ServedLoad
from llmsupervisor.engine.commands import Desired
from llmsupervisor.engine.ledger import Ledger, RestartRecord
from llmsupervisor.engine.output import OutputSeen, later_phase

# Findings after which a READY engine answers nothing: out of rotation before the kill.
_UNRESPONSIVE: frozenset[FindingKind] = frozenset({FindingKind.HANG, FindingKind.STALL})


@dataclass(frozen=True, slots=True, kw_only=True)
class Incarnation:
    number: int  # 1 for the first spawn of this runner, +1 per spawn
    pid: int
    pgid: int
    step: int  # the batch-size ladder step its flags were rendered with
    started_s: float  # spawn time (loop clock)
    ready_since_s: float | None = None
    scheduled_due_s: float | None = None  # restart_every_h: when this incarnation is due


def turned_ready(
    inc: Incarnation, spec: EngineSpec, *, now: float, uniform: Callable[[float, float], float]
) -> Incarnation:
    """The incarnation as it turns READY at ``now``, with its scheduled-restart due time
    (``restart_every_h``, spread by up to ``restart_jitter_s``, drawn with ``uniform``)."""
    due_s = None
    if spec.restart_every_h is not None:
        due_s = now + spec.restart_every_h * 3600.0 + uniform(0.0, spec.restart_jitter_s)
    return replace(inc, ready_since_s=now, scheduled_due_s=due_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLoad:
    """How loaded a serving engine is, from its last observation rounds: what an autoscaler or a
    load balancer's weight reads (daemon/exporter.py, daemon/agent.py). None: vLLM did not say."""

    requests_running: int | None = None
    requests_waiting: int | None = None  # the queue
    kv_usage_ratio: float | None = None  # 0..1
    ttft_p95_s: float | None = None  # over the last LOAD_WINDOW_S; None without requests in it


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStatus:
    name: str
    spec: EngineSpec
    state: EngineState
    state_reason: str
    state_since_s: float
    state_changes_total: int = 0
    incarnation: Incarnation | None = None  # the live spawn, if any
    # What the engine was asked to do (Desired), as far as others need to know.
    wants_run: bool = True
    held: bool = False
    shed: str | None = None
    final: bool = False
    # An action is in flight (a restart pending or under way, a cache reset, a stop of a
    # serving engine): the policy leaves the engine alone until it is done.
    busy: bool = False
    findings: tuple[Finding, ...] = ()
    # Why a hang is suspected (detectors/hang/suspect.py), before a finding proves it; None otherwise.
    suspect: str | None = None
    ladder_step: int = 0  # the running incarnation's step; without one, the next spawn's
    ladder_steps: int = 0
    start_failed_oom: bool = False  # the last start ran out of memory
    # While STARTING: how far the start has come (engine/output.py START_PHASES), else None.
    start_phase: str | None = None
    prefix_reset_supported: bool | None = None  # None: not tried yet
    restarts_total: int = 0
    restarts_by_reason: Mapping[str, int] = field(default_factory=dict)  # by cause (policy RESTART_CAUSES)
    failures: int = 0  # failures counted against the crash-loop budget now
    last_exit: str | None = None
    last_exit_at_s: float | None = None  # when (loop clock) the engine last exited unasked
    last_failure: str | None = None
    last_error_line: str | None = None  # what the engine printed before the last failure (ledger.py)
    canary_latency_s: float | None = None
    # Canaries that answered since the runner began (readiness ones too): the engine's own
    # request counters include them, so whoever reads those counters can take them out.
    canary_requests_total: int = 0
    # Since when (loop clock) the engine is meant to serve and does not; None while it serves or
    # an operator holds it out (``down_since``).
    down_since_s: float | None = None
    served: ServedLoad | None = None  # what clients got over the last minute, canaries excluded
    commands_taken: int = 0  # how many commands the runner has folded in so far
    rounds_total: int = 0  # observation rounds so far, and how long the last one took
    last_round_s: float = 0.0
    incidents_total: int = 0  # hang/stall evidence kept (engine/evidence.py)
    last_incident: str | None = None
    last_restart: RestartRecord | None = None  # cause, reason, when, incident (`describe`)
    task_failed: str | None = None  # set by the fleet when the runner's task died of a bug
    load: EngineLoad | None = None  # while observed (READY and the states after it)

    # ---- the three words of intent: every reader asks these, nobody re-derives them ----

    @property
    def meant_to_serve(self) -> bool:
        """Whether the engine is one of this run's serving engines: ``enabled`` in the config, or
        started by hand (`start`, `restart`) for this run of the daemon whatever ``enabled`` says;
        not stopped for good (shutdown, removed). An operator's drain or stop does not end it, it
        holds the engine out (``held_by_operator``); a stop of a disabled engine gives it back to
        the config's word. The policy acts on these engines and counts them against its bounds;
        `--all` names them."""
        return not self.final and (self.spec.enabled or self.wants_run)

    @property
    def held_by_operator(self) -> bool:
        """An operator holds the engine out of service: drained (`drain`), stopped (`stop`, or
        for good), or disabled in the config and not started by hand. Such an engine is not
        expected in rotation: no alert on it being down, /readyz does not wait for it."""
        return self.held or not self.wants_run

    @property
    def running(self) -> bool:
        """It runs or is on its way to: asked to run, neither stopped nor given up (FATAL).
        An operator's `restart` restarts such an engine and starts any other."""
        return self.wants_run and self.state not in (EngineState.STOPPED, EngineState.FATAL)

    @property
    def in_rotation(self) -> bool:
        """Whether a load balancer should send this engine traffic: READY, and no hang suspected
        or found. A hung engine is killed only after its stacks are taken; until then every
        request sent to it waits for nothing, while its peers would answer it."""
        return self.state is EngineState.READY and self.task_failed is None and self.unresponsive is None

    @property
    def unresponsive(self) -> str | None:
        """Why a READY engine should get no new requests though it still runs: a hang or stall
        found (the restart follows within a tick), or a hang suspected; None otherwise."""
        broken = next((f for f in self.findings if f.kind in _UNRESPONSIVE), None)
        if broken is not None:
            return f"{broken.kind.value}: {broken.summary}"
        if self.suspect is not None:
            return f"hang suspected: {self.suspect}"
        return None

    @property
    def ready_since_s(self) -> float | None:
        """Since when the engine is in rotation (the load balancer needs a moment to notice)."""
        return self.state_since_s if self.state is EngineState.READY else None

    @property
    def pid(self) -> int | None:
        return self.incarnation.pid if self.incarnation is not None else None


@dataclass(frozen=True, slots=True, kw_only=True)
class StartProgress:
    """How far the current start has come: replaced whole at each spawn, changed by ``seen``."""

    phase: str | None = None  # engine/output.py START_PHASES; only ever moves forward
    failed_oom: bool = False  # the engine's output said it ran out of memory


def seen(progress: StartProgress, report: OutputSeen) -> StartProgress:
    """A start's progress after a line of the engine's output (the runner folds only while
    STARTING). Pure; returns ``progress`` itself when the line changes nothing."""
    if report.oom and not progress.failed_oom:
        progress = replace(progress, failed_oom=True)
    if report.phase is not None and later_phase(progress.phase, report.phase):
        progress = replace(progress, phase=report.phase)
    return progress


@dataclass(slots=True, kw_only=True)
class Tally:
    """The runner's own counters: counted on its task only, copied into each status."""

    canary_latency_s: float | None = None  # the readiness canary's, then the last live one's
    canary_requests_total: int = 0
    commands_taken: int = 0
    rounds_total: int = 0
    last_round_s: float = 0.0

    def count_canary(self) -> None:
        """A canary answered (readiness or live): the engine's own request counters include it."""
        self.canary_requests_total += 1


class ObserverView(Protocol):
    """What a status reads of the live incarnation's observer (engine/observer.py)."""

    findings: tuple[Finding, ...]
    suspect: str | None  # why a hang is suspected (detectors/hang/suspect.py), before a finding
    served: ServedLoad | None
    canary_latency_s: float | None

    def load(self) -> EngineLoad | None: ...


def down_since(previous_s: float | None, status: EngineStatus, *, now: float) -> float | None:
    """Since when the engine is meant to serve and does not: None while it serves (READY,
    SHEDDING) or an operator holds it (drained, stopped, disabled). A hold's end starts the
    clock again, so the alert on a down engine counts from then (packaging/prometheus)."""
    if status.held_by_operator or status.state in (EngineState.READY, EngineState.SHEDDING):
        return None
    return now if previous_s is None else previous_s


def _with_down_since(status: EngineStatus, previous_s: float | None, *, now: float) -> EngineStatus:
    """``status`` carrying ``down_since`` from ``previous_s``: itself where that is no change."""
    since_s = down_since(previous_s, status, now=now)
    return status if since_s == status.down_since_s else replace(status, down_since_s=since_s)


def build_status(
    spec: EngineSpec,
    *,
    now: float,
    ledger: Ledger,
    desired: Desired,
    incarnation: Incarnation | None,
    next_step: int,
    start: StartProgress,
    observer: ObserverView | None,
    tally: Tally,
    resetting: bool,
    reset_supported: bool | None,
    acting: bool,
    down_since_s: float | None,
) -> EngineStatus:
    """The one status of an engine, from what its runner holds. Pure: it writes nothing.
    ``next_step``: the batch step the next spawn would take; ``acting``: a stop, restart or
    failure is being carried out; ``resetting``: a prefix-cache reset is under way;
    ``down_since_s``: the last status's (``down_since`` carries it on)."""
    d, state = desired, ledger.state
    stop_pending = state in SERVING and not d.wants_run
    status = EngineStatus(
        name=spec.name,
        spec=spec,
        **ledger.facts(now=now, policy=spec.restart_policy),
        incarnation=incarnation,
        wants_run=d.wants_run,
        held=d.held,
        shed=d.shed,
        final=d.final,
        busy=d.restart is not None or resetting or stop_pending or acting,
        findings=observer.findings if observer is not None else (),
        suspect=observer.suspect if observer is not None else None,
        ladder_step=incarnation.step if incarnation is not None else next_step,
        ladder_steps=len(spec.ladder),
        start_failed_oom=start.failed_oom,
        start_phase=start.phase if state is EngineState.STARTING else None,
        prefix_reset_supported=reset_supported,
        canary_latency_s=observer.canary_latency_s if observer is not None else tally.canary_latency_s,
        canary_requests_total=tally.canary_requests_total,
        down_since_s=down_since_s,
        served=observer.served if observer is not None else None,
        commands_taken=tally.commands_taken,
        rounds_total=tally.rounds_total,
        last_round_s=tally.last_round_s,
        load=observer.load() if observer is not None else None,
    )
    return _with_down_since(status, down_since_s, now=now)


def died(status: EngineStatus, ledger: Ledger, *, now: float) -> EngineStatus:
    """The status of an engine whose runner task died of a bug, from its last one and its ledger
    after ``Ledger.runner_died``: the fleet publishes it until a successor runs (daemon/fleet.py).
    Out of rotation (``task_failed``), no incarnation and no findings (nobody observes it), busy
    (the policy leaves it to its successor)."""
    dead = replace(
        status,
        **ledger.facts(now=now, policy=status.spec.restart_policy),
        incarnation=None,
        findings=(),
        busy=True,
        task_failed=ledger.history.last_failure,
    )
    return _with_down_since(dead, status.down_since_s, now=now)
