"""Engine states and the one table of legal transitions.

::

                 start                 checks pass
    STOPPED ───────────► STARTING ─────────────────► READY ◄──────┐
       ▲  ▲                │  │                      │  │        │ drain cancelled
       │  │   stop         │  │ failed start         │  │ drain  │
       │  └── STOPPING ◄───┘  │ (exit, timeout,      │  ▼        │
       │        ▲  ▲  │       │  canary, port held)  │ DRAINING ─┘
       │        │  │  │       ▼                      │  │
       │        │  │  └──► BACKOFF ◄── crash ────────┘  │
       │        │  └────────  │  ▲                      │
       │        └─────────────┼──┼──────────────────────┘ stop
       │                      │  │ failure budget spent
       └──── stop ─────── FATAL ◄┘ (operator `start` leaves it)

READY <-> SHEDDING: out of rotation while the engine is overloaded (KV-cache pressure), back in
once it clears; no restart. SHEDDING behaves like READY otherwise (it may drain, stop, crash).
STOPPING ends in STOPPED (asked for), BACKOFF (a restart after a failure) or FATAL.
Every change goes through ``transition()``, which logs it with its reason; the exporter
publishes the state as one series per state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from llmsupervisor.errors import IllegalTransition


class EngineState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    SHEDDING = "shedding"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FATAL = "fatal"

    def __str__(self) -> str:
        return self.name


S = EngineState
EDGES: Final[Mapping[EngineState, frozenset[EngineState]]] = {
    S.STOPPED: frozenset({S.STARTING}),
    # STARTING -> FATAL: a failed start that spends the failure budget.
    S.STARTING: frozenset({S.READY, S.BACKOFF, S.STOPPING, S.FATAL}),
    S.READY: frozenset({S.SHEDDING, S.DRAINING, S.STOPPING, S.BACKOFF, S.FATAL}),
    S.SHEDDING: frozenset({S.READY, S.DRAINING, S.STOPPING, S.BACKOFF, S.FATAL}),
    # DRAINING -> BACKOFF: the engine died while draining.
    S.DRAINING: frozenset({S.READY, S.STOPPING, S.BACKOFF, S.FATAL}),
    S.STOPPING: frozenset({S.STOPPED, S.BACKOFF, S.FATAL}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED, S.FATAL}),
    S.FATAL: frozenset({S.STARTING, S.STOPPED}),
}

# The states of a serving engine, between which rotation moves it without a restart.
SERVING: Final = frozenset({S.READY, S.SHEDDING, S.DRAINING})


@dataclass(frozen=True, slots=True)
class StateChange:
    engine: str
    from_state: EngineState
    to_state: EngineState
    reason: str
    at_s: float  # monotonic


def check_transition(engine: str, from_state: EngineState, to_state: EngineState) -> None:
    if to_state not in EDGES[from_state]:
        raise IllegalTransition(engine, from_state, to_state)


def transition(
    engine: str, from_state: EngineState, to_state: EngineState, *, reason: str, now: float
) -> StateChange:
    """Validate one edge and describe it; the caller applies and logs it."""
    check_transition(engine, from_state, to_state)
    return StateChange(engine, from_state, to_state, reason, now)


def rotation_target(state: EngineState, *, held: bool, shed: str | None) -> EngineState | None:
    """The next state toward what the operator's hold and the policy's shedding ask of a serving
    engine; None when it is there (or not serving). The operator's hold wins over shedding.
    DRAINING -> SHEDDING is not an edge, so a drained engine that must shed goes through READY
    (the step the old code skipped: defect D1)."""
    if state not in SERVING:
        return None
    want = S.DRAINING if held else S.SHEDDING if shed is not None else S.READY
    if state is want:
        return None
    return want if want in EDGES[state] else S.READY
