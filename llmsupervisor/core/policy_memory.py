"""What the policy remembers between decisions, kept by the daemon (its one writer).

The policy (core/policy.py) is a pure function of views; what it must remember (which automatic
actions it took and when, when the ladder last changed, when a step-down cause was last seen,
whether the cheap prefix-cache repair was tried during the current degradation) lives here, not
in the engine runners: a runner knows its engine, not the policy's reasons.

``observe`` reads each reconcile's statuses; ``record`` each action taken. The prefix-reset
attempt belongs to an incarnation and is forgotten when a new one appears.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from llmsupervisor.core.findings import FindingKind
from llmsupervisor.core.policy import DEGRADATION, HOUR_S, STEP_DOWN_CAUSES, Action, ActionKind

_STEP_DOWN_KINDS = frozenset(STEP_DOWN_CAUSES)
_DEGRADATION_KINDS = frozenset(DEGRADATION)


@dataclass(frozen=True, slots=True, kw_only=True)
class Seen:
    """What ``observe`` needs of one engine's status."""

    name: str
    incarnation: int | None
    finding_kinds: frozenset[FindingKind]
    ladder_step: int


@dataclass(slots=True)
class EngineMemory:
    action_times_s: list[float] = field(default_factory=list)  # rate-limited actions, last hour
    actions_total: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, reason) -> n
    last_action_at: dict[str, float] = field(default_factory=dict)  # kind -> wall-clock time
    ladder_changed_s: float | None = None
    step_cause_seen_s: float | None = None
    prefix_reset_at_s: float | None = None
    incarnation: int | None = None


class PolicyMemory:
    def __init__(self) -> None:
        self._engines: dict[str, EngineMemory] = {}

    def of(self, name: str) -> EngineMemory:
        return self._engines.setdefault(name, EngineMemory())

    def observe(self, seen: Iterable[Seen], now: float) -> None:
        names = set()
        for s in seen:
            names.add(s.name)
            m = self.of(s.name)
            if s.incarnation is not None and s.incarnation != m.incarnation:
                m.incarnation = s.incarnation
                m.prefix_reset_at_s = None  # a new incarnation gets the cheap repair again
            if s.finding_kinds & _STEP_DOWN_KINDS:
                m.step_cause_seen_s = now
            if not s.finding_kinds & _DEGRADATION_KINDS:
                m.prefix_reset_at_s = None  # the next degradation tries the cheap repair again
            if s.ladder_step > 0 and m.ladder_changed_s is None:
                m.ladder_changed_s = now  # resumed from the state dir: calm is counted from now
        for gone in set(self._engines) - names:
            del self._engines[gone]

    def record(self, action: Action, now: float, *, wall_s: float) -> None:
        m = self.of(action.engine)
        kind = action.kind
        key = (kind.value, action.reason)
        m.actions_total[key] = m.actions_total.get(key, 0) + 1
        m.last_action_at[kind.value] = wall_s
        # Shedding follows its finding's hysteresis, a broken engine's restarts are bounded by
        # the failure budget, and a config restart is the operator's: none counts toward the
        # rate limit (core/policy.py).
        if kind not in (ActionKind.SHED, ActionKind.UNSHED, ActionKind.CONFIG_RESTART) and not action.failure:
            m.action_times_s = [t for t in m.action_times_s if now - t < HOUR_S] + [now]
        if kind in (ActionKind.STEP_DOWN, ActionKind.STEP_UP):
            m.ladder_changed_s = now
        if kind is ActionKind.RESET_PREFIX_CACHE:
            m.prefix_reset_at_s = now
