"""The reconcile step: statuses in, commands out, with nothing re-entering.

    fleet statuses ──► PolicyMemory.observe ──► view_of ──► policy.decide ──► ActionExecutor
                                                                                  │
                                                  runner inboxes ◄── commands ◄───┘

It runs on the daemon's own turn (a tick, or a runner's "changed"), never inside a runner's
step, so the policy always sees whole statuses. Level-triggered: a lost change is seen on the
next pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from llmsupervisor.core.policy import EngineView, FleetRules, decide
from llmsupervisor.core.policy_memory import EngineMemory, PolicyMemory, Seen
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


def view_of(status: EngineStatus, memory: EngineMemory, *, pending: bool = False) -> EngineView:
    """What the policy knows of one engine: its status, and the policy's own memory of it."""
    inc = status.incarnation
    return EngineView(
        name=status.name,
        state=status.state,
        enabled=status.spec.enabled,
        ready_since_s=status.ready_since_s,
        findings=status.findings,
        busy=status.busy or pending,
        held_out=status.held,
        ladder_step=status.ladder_step,
        ladder_steps=status.ladder_steps,
        ladder_changed_s=memory.ladder_changed_s,
        step_cause_seen_s=memory.step_cause_seen_s,
        action_times_s=tuple(memory.action_times_s),
        scheduled_due_s=inc.scheduled_due_s if inc is not None else None,
        start_failed_oom=status.start_failed_oom,
        prefix_reset_at_s=memory.prefix_reset_at_s,
        prefix_reset_supported=status.prefix_reset_supported,
        rules=status.spec.rules,
    )


class Reconciler:
    def __init__(self, memory: PolicyMemory, executor: ActionExecutor) -> None:
        self.memory = memory
        self.executor = executor
        self._waiting_logged: dict[str, str] = {}  # engine -> the last "waits" line logged

    def __call__(
        self,
        statuses: Sequence[EngineStatus],
        *,
        now: float,
        minute_of_day: int,
        fleet: FleetRules,
        pending: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self.memory.observe(
            (
                Seen(
                    name=s.name,
                    incarnation=s.incarnation.number if s.incarnation is not None else None,
                    finding_kinds=frozenset(f.kind for f in s.findings),
                    ladder_step=s.ladder_step,
                )
                for s in statuses
            ),
            now,
        )
        decision = decide(
            [view_of(s, self.memory.of(s.name), pending=pending(s.name)) for s in statuses],
            now,
            minute_of_day=minute_of_day,
            fleet=fleet,
        )
        waiting: dict[str, str] = {}
        for held in decision.deferred:
            line = f"{held.kind} ({held.reason}) waits: {held.why}"
            waiting[held.engine] = line
            if self._waiting_logged.get(held.engine) != line:
                log.info("%s", line, extra={"engine": held.engine, "event": "action"})
        self._waiting_logged = waiting
        for action in decision.actions:
            self.memory.record(action, now, wall_s=time.time())
            self.executor.apply(action)
