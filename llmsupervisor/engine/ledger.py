"""One engine's ledger: its state and every fact that outlives a runner, with one writer.

The state (and why, and since when), the counters (restarts by cause, state changes, spawns,
incidents), the last exit and failure, and the crash-loop budget live here and change only
through the methods below:

    method                 what it records
    ─────────────────────────────────────────────────────────────────────────────────────────
    to(state, reason)      a state change: checked against core.state.EDGES (an illegal edge
                           raises: it is a bug), logged with its reason, counted
    note(reason)           a new reason in the same state (a start waiting for a held port)
    spawned()              a new incarnation; returns its number
    reached_ready()        READY: failures before it no longer count as "in a row"
    settled(ready_since)   READY for stable_after_s: the budget is reset
    exited(text)           an exit nobody asked for, and when
    failed(reason)         a failure against the budget -> Verdict (backoff_s, or give_up), and
                           the error line the engine printed before it, if it exited by itself
    reset_budget(why)      a clean slate: an operator's start of a FATAL engine (which ends
                           ``gave_up``), or READY for stable_after_s
    restarted(cause)       a restart by cause (the restarts metric), and the last one's
                           cause, reason, time and incident file (`describe`)
    incident(path)         hang/stall evidence kept (engine/evidence.py)
    runner_died(exc)       the runner's task died of a bug (daemon/fleet.py): a failure, and
                           the state it leaves walks EDGES like any other change

The runner writes it from its own task; when that task dies, the fleet calls ``runner_died``
and hands the same ledger to the successor, so counters and budget carry over (defect D6) and
nothing else writes an engine's facts (review 3, E2/E3). ``facts`` is what a status shows of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llmsupervisor.core.findings import counted
from llmsupervisor.core.restarts import (
    FailureHistory,
    RestartPolicy,
    backoff_delay_s,
    is_crash_loop,
    should_reset,
)
from llmsupervisor.core.state import EDGES, EngineState, StateChange, transition

log = logging.getLogger("llmsupervisor.engine")

S = EngineState
_WARN_STATES = frozenset({S.BACKOFF, S.FATAL})


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartRecord:
    """The last restart: why (a cause of the policy's RESTART_CAUSES and the reason in words),
    when (loop clock) and the hang/stall evidence kept for it, if any."""

    cause: str
    reason: str | None = None
    at_s: float | None = None
    incident: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class History:
    """The counters and budget, as one immutable value: only the ledger replaces it."""

    restarts_total: int = 0
    restarts_by_reason: Mapping[str, int] = field(default_factory=dict)
    state_changes_total: int = 0
    failures: FailureHistory = field(default_factory=FailureHistory)
    last_exit: str | None = None
    last_exit_at_s: float | None = None  # loop clock
    last_failure: str | None = None
    # The error line the engine's own runtime printed before the last failure, when it exited by
    # itself (engine/output.py): `python3: can't open file ...`, a traceback's last line.
    last_error_line: str | None = None
    incarnations: int = 0
    incidents_total: int = 0  # hang/stall evidence files written (engine/evidence.py)
    last_incident: str | None = None  # the newest one's path
    last_restart: RestartRecord | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What a failure leaves: restart after ``backoff_s``, or give up (FATAL)."""

    failures: int  # counted against the budget now, this one included
    give_up: bool
    backoff_s: float  # 0 for the first failure in the window: one crash is not a loop
    budget: str  # why the budget is spent ("3 failures in a row without becoming ready")

    def give_up_reason(self, reason: str, engine: str) -> str:
        return f"{reason}; {self.budget}, giving up (llm-supervisor start {engine} retries)"

    def backoff_reason(self, reason: str, policy: RestartPolicy, wait_s: float) -> str:
        return f"{reason}; failure {self.failures}/{policy.max_failures}, restarting in {wait_s:.1f} s"


def start_reason(state: EngineState, last_failure: str | None, step: int, steps: int) -> str:
    """Why a start begins: the first (or an operator's) or a restart after a failure."""
    reason = "start" if state in (S.STOPPED, S.FATAL) else f"restart after: {last_failure}"
    return f"{reason} at ladder step {step}/{steps}" if step else reason


def rotation_reason(state: EngineState, target: EngineState, shed: str | None) -> str:
    """Why a serving engine moves to ``target`` (core.state.rotation_target)."""
    if target is S.DRAINING:
        return "drain requested: out of rotation until started again"
    if target is S.SHEDDING:
        return f"shedding load: {shed}"
    if state is S.DRAINING:
        return "drain cancelled: back in rotation"
    return "load shedding over: back in rotation"


class Ledger:
    def __init__(
        self, name: str, *, now: float, history: History | None = None, reason: str = "not started"
    ) -> None:
        self.name = name
        self._history = history or History()
        self._state = S.STOPPED
        self._since_s = now
        self._reason = reason  # why it is STOPPED before its first start (a GPU condition, say)
        self._gave_up = False

    # ---- reading ----

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def since_s(self) -> float:
        return self._since_s

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def gave_up(self) -> bool:
        """FATAL, and no operator ``start`` taken since (``reset_budget``): the runner waits."""
        return self._gave_up

    @property
    def history(self) -> History:
        return self._history

    def failures(self, now: float, policy: RestartPolicy) -> int:
        return self._history.failures.count(now, policy)

    def facts(self, *, now: float, policy: RestartPolicy) -> dict[str, Any]:
        """The ledger's part of an ``EngineStatus`` (its field names). Reasons quote errors and
        command lines as they were: they are redacted where they leave the daemon (redact.py)."""
        h = self._history
        return {
            "state": self._state,
            "state_reason": self._reason,
            "state_since_s": self._since_s,
            "state_changes_total": h.state_changes_total,
            "restarts_total": h.restarts_total,
            "restarts_by_reason": dict(h.restarts_by_reason),
            "failures": h.failures.count(now, policy),
            "last_exit": h.last_exit,
            "last_exit_at_s": h.last_exit_at_s,
            "last_failure": h.last_failure,
            "last_error_line": h.last_error_line,
            "incidents_total": h.incidents_total,
            "last_incident": h.last_incident,
            "last_restart": h.last_restart,  # redacted where it leaves the daemon (redact.py)
        }

    # ---- writing: the only place ----

    def to(self, state: EngineState, reason: str, *, now: float) -> StateChange:
        change = transition(self.name, self._state, state, reason=reason, now=now)
        level = logging.WARNING if state in _WARN_STATES else logging.INFO
        log.log(
            level,
            "%s -> %s: %s",
            self._state,
            state,
            reason,
            extra={"engine": self.name, "event": "transition", "to_state": state.value},
        )
        # The status says what is (READY is "ready"); why it became so ("drain cancelled") is the
        # event's, else it would linger for as long as the engine serves (issue 39).
        self._state, self._since_s, self._reason = state, now, "ready" if state is S.READY else reason
        self._gave_up = self._gave_up or state is S.FATAL
        self._history = replace(self._history, state_changes_total=self._history.state_changes_total + 1)
        return change

    def note(self, reason: str) -> None:
        """A new reason for the state the engine is in, no change of state (a start that waits
        for a port someone else holds says who, at each look)."""
        self._reason = reason

    def spawned(self) -> int:
        self._history = replace(self._history, incarnations=self._history.incarnations + 1)
        return self._history.incarnations

    def reached_ready(self) -> None:
        self._history = replace(self._history, failures=self._history.failures.reached_ready())

    def exited(self, text: str, *, now: float) -> None:
        self._history = replace(self._history, last_exit=text, last_exit_at_s=now)

    def reset_budget(self, why: str) -> None:
        if self._history.failures != FailureHistory():
            log.info("%s: the failure budget is reset", why, extra={"engine": self.name})
        self._history = replace(self._history, failures=self._history.failures.reset())
        self._gave_up = False

    def settled(self, ready_since_s: float | None, *, now: float, policy: RestartPolicy) -> None:
        """READY for ``stable_after_s``: the failures before no longer count."""
        if self._history.failures.times_s and should_reset(ready_since_s, now, policy):
            self.reset_budget(f"ready for {now - (ready_since_s or 0.0):.0f} s")

    def restarted(
        self, cause: str, *, reason: str | None = None, now: float | None = None, incident: str | None = None
    ) -> None:
        h = self._history
        by_reason = {**h.restarts_by_reason, cause: h.restarts_by_reason.get(cause, 0) + 1}
        last = RestartRecord(cause=cause, reason=reason, at_s=now, incident=incident)
        self._history = replace(
            h, restarts_total=h.restarts_total + 1, restarts_by_reason=by_reason, last_restart=last
        )

    def incident(self, path: str) -> None:
        h = self._history
        self._history = replace(h, incidents_total=h.incidents_total + 1, last_incident=path)

    def failed(
        self,
        reason: str,
        error_line: str | None = None,
        *,
        now: float,
        policy: RestartPolicy,
        draw: Callable[[], float] = lambda: 0.5,
    ) -> Verdict:
        """A failure against the crash-loop budget. ``draw`` (a random number in [0, 1)) spreads
        the backoff; it is called only when there is one. ``error_line``: what the engine printed
        last before it exited by itself (``reason`` quotes it), None for any other failure."""
        failures = self._history.failures.record(now, policy)
        self._history = replace(
            self._history, last_failure=reason, last_error_line=error_line, failures=failures
        )
        count = failures.count(now, policy)
        in_a_row = failures.unready >= policy.max_failures
        budget = (
            f"{counted(count, 'failure')} in a row without becoming ready"
            if in_a_row
            else f"{counted(count, 'failure')} within {policy.window_s:g} s"
        )
        # One failure of an engine that was running is not a loop: waiting only adds downtime
        # (a crash, a hang, a GPU fault alike). The backoff starts with the second failure.
        backoff_s = 0.0 if count == 1 else backoff_delay_s(count - 1, policy, draw())
        return Verdict(
            failures=count, give_up=is_crash_loop(failures, now, policy), backoff_s=backoff_s, budget=budget
        )

    def runner_died(
        self, exc: BaseException | None, *, now: float, policy: RestartPolicy, give_up: bool = False
    ) -> Verdict:
        """The runner's task ended of a bug (``exc``) or for no reason (None): a failure like any
        other, and the state it leaves is BACKOFF (replaced soon) or FATAL (``give_up``, or the
        budget spent), by an edge of EDGES. Where the table has no such edge, the state stays:
        a STOPPED engine stays STOPPED (nobody asked it to run; its successor keeps it stopped),
        a BACKOFF or FATAL one stays so; the reason says what happened either way."""
        reason = f"runner task died: {exc!r}" if exc is not None else "runner task ended"
        verdict = self.failed(reason, now=now, policy=policy)
        verdict = replace(verdict, give_up=verdict.give_up or give_up)
        target = S.FATAL if verdict.give_up else S.BACKOFF
        why = reason if verdict.give_up else f"{reason}; replacing the runner"
        if target in EDGES[self._state]:
            self.to(target, why, now=now)
        else:
            log.warning("%s: %s", self._state, why, extra={"engine": self.name})
            self._reason = why
        return verdict
