"""The reconcile step: statuses in, commands out, with nothing re-entering.

    fleet statuses ──► PolicyMemory.observe ──► view_of ──► policy.decide ──► ActionExecutor
                                                                                  │
                                                  runner inboxes ◄── commands ◄───┘

It runs on the daemon's own turn (a tick, or a runner's "changed"), never inside a runner's
step, so the policy always sees whole statuses. Level-triggered: a lost change is seen on the
next pass.

A reload's roll is decided here like any planned action: an engine whose running spec is not
the config's has ``config_pending`` in its view, and the policy's ``CONFIG_RESTART`` carries the
config's spec to it, counted against ``max_unavailable`` with the commands still pending.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.findings import Severity
from llmsupervisor.core.policy import ActionKind, EngineView, FleetRules, decide
from llmsupervisor.core.policy_memory import EngineMemory, PolicyMemory, Seen
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.actions import ActionExecutor
from llmsupervisor.engine.status import EngineStatus

log = logging.getLogger("llmsupervisor")


PolicyKey = tuple[object, ...]


def policy_key(status: EngineStatus) -> PolicyKey:
    """What of a status the policy and its memory read, so that a publish that changed none of
    it (an observation round: latencies, counters, a finding's evidence) needs no reconcile.

    Findings by kind, severity and start, not their evidence or summary (rewritten every round);
    ``commands_taken`` because the fleet's ``pending`` reads it; the spec by identity (a reload
    makes a new one). Time-driven decisions (schedules, cooldowns, calm periods) are the tick's.
    """
    return (
        status.state,
        status.state_since_s,
        status.state_changes_total,
        status.incarnation,
        status.wants_run,
        status.held,
        status.shed,
        status.final,
        status.busy,
        tuple((f.kind, f.severity, f.since_s) for f in status.findings),
        status.ladder_step,
        status.start_failed_oom,
        status.prefix_reset_supported,
        status.commands_taken,
        id(status.spec),
    )


def spec_pending(status: EngineStatus, target: EngineSpec | None) -> bool:
    """The engine runs another spec than the config names for it (a reload changed it)."""
    return target is not None and status.spec is not target and status.spec != target


def roll_due(status: EngineStatus, target: EngineSpec | None) -> bool:
    """The policy will restart this engine onto ``target``, the config's spec for it
    (``CONFIG_RESTART``): it runs (a stopped one takes a new spec at once), on another spec, and
    ``target`` does not disable it (a reload stops an engine it disables instead)."""
    disables = target is not None and status.spec.enabled and not target.enabled
    return status.running and not disables and spec_pending(status, target)


def view_of(
    status: EngineStatus,
    memory: EngineMemory,
    *,
    pending: bool = False,
    target: EngineSpec | None = None,
    rolled: bool = False,
) -> EngineView:
    """What the policy knows of one engine: its status, and the policy's own memory of it.
    ``target``: the spec the config names for it; ``rolled``: a config restart gave it that one."""
    inc = status.incarnation
    return EngineView(
        name=status.name,
        state=status.state,
        meant_to_serve=status.meant_to_serve,
        ready_since_s=status.ready_since_s,
        findings=status.findings,
        busy=status.busy or pending,
        held_out=status.held_by_operator,
        ladder_step=status.ladder_step,
        ladder_steps=status.ladder_steps,
        ladder_changed_s=memory.ladder_changed_s,
        step_cause_seen_s=memory.step_cause_seen_s,
        action_times_s=tuple(memory.action_times_s),
        scheduled_due_s=inc.scheduled_due_s if inc is not None else None,
        start_failed_oom=status.start_failed_oom,
        prefix_reset_at_s=memory.prefix_reset_at_s,
        prefix_reset_supported=status.prefix_reset_supported,
        config_pending=spec_pending(status, target),
        config_rolled=rolled,
        rules=status.spec.rules,
    )


class Reconciler:
    def __init__(self, memory: PolicyMemory, executor: ActionExecutor) -> None:
        self.memory = memory
        self.executor = executor
        self._waiting_logged: dict[tuple[str, str], str] = {}  # (engine, kind) -> the last "waits" line
        # Engine -> the spec a config restart gave it, until it is READY on it (or the config
        # names another): while such an engine fails, the roll halts (core/policy.py).
        self._rolled: dict[str, EngineSpec] = {}
        self.roll_halted_by: tuple[str, ...] = ()

    def __call__(
        self,
        statuses: Sequence[EngineStatus],
        *,
        now: float,
        minute_of_day: int,
        fleet: FleetRules,
        pending: Callable[[str], bool] = lambda name: False,
        specs: Mapping[str, EngineSpec] | None = None,
    ) -> None:
        """``specs``: the config's spec of each engine, which the policy rolls engines to (None:
        no roll, as in tests of other rules)."""
        targets: Mapping[str, EngineSpec] = specs if specs is not None else {}
        self._forget_rolls(statuses, targets)
        self.memory.observe(
            (
                Seen(
                    name=s.name,
                    incarnation=s.incarnation.number if s.incarnation is not None else None,
                    # A report-only finding (INFO: SW thermal, the power cap) is no step-down
                    # cause: the calm that steps the ladder back up counts through it.
                    finding_kinds=frozenset(f.kind for f in s.findings if f.severity is not Severity.INFO),
                    ladder_step=s.ladder_step,
                )
                for s in statuses
            ),
            now,
        )
        decision = decide(
            [
                view_of(
                    s,
                    self.memory.of(s.name),
                    pending=pending(s.name),
                    target=targets.get(s.name),
                    rolled=s.name in self._rolled,
                )
                for s in statuses
            ],
            now,
            minute_of_day=minute_of_day,
            fleet=fleet,
        )
        if decision.roll_halted_by != self.roll_halted_by:
            if decision.roll_halted_by:
                log.error(
                    "config roll halted: %s failed to start on the new config; the engines not yet "
                    "rolled keep their old config (fix the config and reload, or start the engine)",
                    ", ".join(decision.roll_halted_by),
                    extra={"event": "reload"},
                )
            else:
                log.info("config roll goes on", extra={"event": "reload"})
            self.roll_halted_by = decision.roll_halted_by
        waiting: dict[tuple[str, str], str] = {}
        for held in decision.deferred:
            line = f"{held.kind} ({held.reason}) waits: {held.why}"
            # By engine and kind: a config restart and a schedule may both wait on one engine.
            key = (held.engine, held.kind.value)
            waiting[key] = line
            if self._waiting_logged.get(key) != line:
                log.info("%s", line, extra={"engine": held.engine, "event": "action"})
        self._waiting_logged = waiting
        for action in decision.actions:
            self.memory.record(action, now, wall_s=time.time())
            if action.kind is ActionKind.CONFIG_RESTART:
                spec = targets[action.engine]
                self._rolled[action.engine] = spec
                self.executor.apply(action, spec=spec)
            else:
                self.executor.apply(action)

    def _forget_rolls(self, statuses: Sequence[EngineStatus], targets: Mapping[str, EngineSpec]) -> None:
        """A rolled engine leaves the record once READY on its new spec (the roll succeeded for
        it), when the config names another spec (a reload: a new roll), or when it is gone."""
        by_name = {s.name: s for s in statuses}
        for name, spec in list(self._rolled.items()):
            s = by_name.get(name)
            target = targets.get(name)
            if (
                s is None
                or (target is not spec and target != spec)  # equal: a reload of the same file
                or (s.state is EngineState.READY and not spec_pending(s, spec))
            ):
                del self._rolled[name]
