"""One engine's lifecycle facts, and their only writer.

``Lifecycle.to`` is the one place an engine's state changes: it checks the edge against
``core.state.EDGES`` (an illegal edge raises, it is a bug), logs the change with its reason, and
counts it. Restart counters and the last exit and failure live here too, so that a runner that
dies of a bug can hand them to its successor (the fleet keeps the history: defect D6).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmsupervisor.core.restarts import FailureHistory
from llmsupervisor.core.state import EngineState, StateChange, transition

log = logging.getLogger("llmsupervisor.engine")

_WARN_STATES = frozenset({EngineState.BACKOFF, EngineState.FATAL})


@dataclass(slots=True, kw_only=True)
class History:
    """What survives the runner itself: counters and the crash-loop budget."""

    restarts_total: int = 0
    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    state_changes_total: int = 0
    failures: FailureHistory = field(default_factory=FailureHistory)
    last_exit: str | None = None
    last_exit_at_s: float | None = None  # loop clock
    last_failure: str | None = None
    incarnations: int = 0
    incidents_total: int = 0  # hang/stall evidence files written (engine/evidence.py)
    last_incident: str | None = None  # the newest one's path


class Lifecycle:
    def __init__(self, name: str, *, now: float, history: History | None = None) -> None:
        self.name = name
        self.history = history or History()
        self.state = EngineState.STOPPED
        self.since_s = now
        self.reason = "not started"

    def to(self, state: EngineState, reason: str, *, now: float) -> StateChange:
        change = transition(self.name, self.state, state, reason=reason, now=now)
        level = logging.WARNING if state in _WARN_STATES else logging.INFO
        log.log(
            level,
            "%s -> %s: %s",
            self.state,
            state,
            reason,
            extra={"engine": self.name, "event": "transition", "to_state": state.value},
        )
        self.state, self.since_s, self.reason = state, now, reason
        self.history.state_changes_total += 1
        return change

    def count_restart(self, cause: str) -> None:
        self.history.restarts_total += 1
        self.history.restarts_by_reason[cause] = self.history.restarts_by_reason.get(cause, 0) + 1
