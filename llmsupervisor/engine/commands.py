"""What an engine is told, and what it should be doing: commands in, one ``Desired`` value.

Everyone who wants something of an engine (the operator through the control socket, the policy
through the action executor, a reload, the daemon's shutdown) sends it a ``Command``. The runner
folds its inbox into one ``Desired`` with the pure ``apply`` below, on its own task, between two
of its steps, so no caller ever sees or changes an engine half-way through a step.

    command              what it changes of Desired
    ───────────────────────────────────────────────────────────────────────────────────────
    Start()              run; ends an operator hold and the policy's shedding (defect D1)
    Stop(final)          not run; final: never again (daemon shutdown, engine removed)
    Restart(...)         a restart is pending (merged with one already pending); a new spec
                         waits for the stop, so the drain talks to the old address (D4).
                         It does NOT set run: a stopped engine stays stopped (D5)
    Respec(spec)         a new spec for an engine that is not running (reload): applied at
                         once, starts nothing
    Hold(on)             the operator's drain: out of rotation until Hold(False) or Start
    Shed(reason|None)    the policy's load shedding: out of rotation while reason holds
    Escalate()           a stop in progress becomes quick (second SIGINT)

``StepTo``, ``ResetPrefixCache`` and ``Note`` change no desired state: the runner carries them
out (the next spawn's batch step, a cache reset on the running engine, a new reason for an
engine the daemon keeps stopped while it waits for NVML or its GPUs' fabric) and publishes the
result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.findings import Blame


@dataclass(frozen=True, slots=True)
class Start:
    pass


@dataclass(frozen=True, slots=True)
class Stop:
    final: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    cause: str  # metric label: operator, config_change, scheduled, step_down, hang, ...
    reason: str  # for the log
    drain: bool = True  # False: stop at once (nothing in a hung engine can finish)
    failure: bool = False  # a broken engine: counts against the crash-loop budget, with backoff
    spec: EngineSpec | None = None  # applied between the stop and the next start
    # A hang's finding: the process it blames (its evidence, core/findings.py), which decides
    # whether the API server is cut before the stacks are taken (engine/evidence.py).
    blame: Blame | None = None


@dataclass(frozen=True, slots=True)
class Respec:
    spec: EngineSpec


@dataclass(frozen=True, slots=True)
class Hold:
    on: bool


@dataclass(frozen=True, slots=True)
class Shed:
    reason: str | None


@dataclass(frozen=True, slots=True)
class StepTo:
    step: int
    reason: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    reason: str


@dataclass(frozen=True, slots=True)
class Escalate:
    pass


@dataclass(frozen=True, slots=True)
class Note:
    reason: str  # why a stopped engine waits now; ignored once it was asked to run


Command = Start | Stop | Restart | Respec | Hold | Shed | StepTo | ResetPrefixCache | Escalate | Note


@dataclass(frozen=True, slots=True, kw_only=True)
class Desired:
    run: bool
    final: bool = False  # daemon shutdown or engine removed: never start again
    held: bool = False  # operator drain
    shed: str | None = None  # policy: out of rotation while this holds
    restart: Restart | None = None  # pending until the next spawn (which is that restart)
    spec: EngineSpec | None = None  # a new spec, applied while no process runs
    quick: bool = False  # stops skip the drain and shorten the ladder

    @property
    def wants_run(self) -> bool:
        """Asked to run, and not stopped for good."""
        return self.run and not self.final

    @property
    def interrupts(self) -> bool:
        """A stop or a restart is asked: what the engine is doing now should end."""
        return not self.wants_run or self.restart is not None


def merge(pending: Restart | None, new: Restart) -> Restart:
    """One restart at a time: a second request joins the pending one. The more urgent wins
    (no drain over drain, a failure over a planned restart); the newest spec wins."""
    if pending is None:
        return new
    urgent = new if (not new.drain, new.failure) > (not pending.drain, pending.failure) else pending
    return replace(urgent, spec=new.spec or pending.spec)


def apply(d: Desired, cmd: Command) -> Desired:
    """The one way Desired changes. Pure; tests/unit/engine/test_commands.py tables it."""
    match cmd:
        case Stop(final=final):
            return replace(d, run=False, final=d.final or final, restart=None)
        case Start():
            return d if d.final else replace(d, run=True, held=False, shed=None)
        case Restart():
            if d.final:
                return d
            spec = cmd.spec or d.spec
            return replace(d, restart=merge(d.restart, cmd), spec=spec)
        case Respec(spec=spec):
            return replace(d, spec=spec)
        case Hold(on=on):
            return replace(d, held=on)
        case Shed(reason=reason):
            return replace(d, shed=reason)
        case Escalate():
            return replace(d, quick=True)
        case StepTo() | ResetPrefixCache() | Note():
            return d
    raise AssertionError(f"unknown command {cmd!r}")  # pragma: no cover


def restart_taken(d: Desired) -> Desired:
    """The runner has begun the pending restart: one that arrives from now on is another."""
    return replace(d, restart=None)


def spec_taken(d: Desired) -> Desired:
    """The runner has applied the pending spec (no process was running)."""
    return replace(d, spec=None)
