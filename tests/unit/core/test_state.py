"""The engine state table: every (from, to) pair is either an edge of EDGES or IllegalTransition."""

from __future__ import annotations

import itertools
from collections import deque

import pytest

from llmsupervisor.core.state import (
    EDGES,
    EngineState,
    StateChange,
    check_transition,
    transition,
)
from llmsupervisor.errors import IllegalTransition, SupervisorError

S = EngineState
ALL_PAIRS = list(itertools.product(EngineState, repeat=2))


def reachable(start: EngineState) -> set[EngineState]:
    seen = {start}
    queue = deque([start])
    while queue:
        for nxt in EDGES[queue.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


@pytest.mark.parametrize(("from_state", "to_state"), ALL_PAIRS, ids=[f"{a}->{b}" for a, b in ALL_PAIRS])
def test_transition(from_state: EngineState, to_state: EngineState) -> None:
    if to_state in EDGES[from_state]:
        change = transition("a", from_state, to_state, reason="because", now=12.5)
        assert change == StateChange("a", from_state, to_state, "because", 12.5)
        check_transition("a", from_state, to_state)
    else:
        with pytest.raises(IllegalTransition) as info:
            transition("a", from_state, to_state, reason="because", now=12.5)
        assert isinstance(info.value, SupervisorError)
        assert (info.value.engine, info.value.from_state, info.value.to_state) == ("a", from_state, to_state)
        assert str(info.value) == f"engine a: illegal transition {from_state.name} -> {to_state.name}"
        with pytest.raises(IllegalTransition):
            check_transition("a", from_state, to_state)


def test_the_table_covers_every_state() -> None:
    assert set(EDGES) == set(EngineState)
    for from_state, targets in EDGES.items():
        assert targets <= set(EngineState)
        assert from_state not in targets, f"{from_state} has a self-loop"


def test_expected_edges() -> None:
    # The table as the module docstring draws it.
    assert dict(EDGES) == {
        S.STOPPED: {S.STARTING},
        S.STARTING: {S.READY, S.BACKOFF, S.STOPPING, S.FATAL},
        S.READY: {S.SHEDDING, S.DRAINING, S.STOPPING, S.BACKOFF, S.FATAL},
        S.SHEDDING: {S.READY, S.DRAINING, S.STOPPING, S.BACKOFF, S.FATAL},
        S.DRAINING: {S.READY, S.STOPPING, S.BACKOFF, S.FATAL},
        S.STOPPING: {S.STOPPED, S.BACKOFF, S.FATAL},
        S.BACKOFF: {S.STARTING, S.STOPPED, S.FATAL},
        S.FATAL: {S.STARTING, S.STOPPED},
    }


def test_every_state_is_reachable_from_stopped() -> None:
    assert reachable(S.STOPPED) == set(EngineState)
    assert S.FATAL in reachable(S.STOPPED)


@pytest.mark.parametrize("state", list(EngineState), ids=str)
def test_stopped_is_reachable_from_every_state(state: EngineState) -> None:
    assert S.STOPPED in reachable(state) or state is S.STOPPED


# States in which the engine has (or may have) live processes.
PROCESS_STATES = frozenset({S.STARTING, S.READY, S.SHEDDING, S.DRAINING, S.STOPPING})


@pytest.mark.parametrize("state", sorted(PROCESS_STATES, key=str), ids=str)
def test_a_running_engine_is_stopped_through_stopping(state: EngineState) -> None:
    # Processes may be alive: an operator's stop goes through STOPPING, never straight to STOPPED.
    if state is S.STOPPING:
        assert S.STOPPED in EDGES[state]
    else:
        assert S.STOPPING in EDGES[state]
        assert S.STOPPED not in EDGES[state]


def test_only_stopping_ends_in_stopped_while_processes_may_live() -> None:
    into_stopped = {a for a, targets in EDGES.items() if S.STOPPED in targets}
    assert into_stopped == {S.STOPPING, S.BACKOFF, S.FATAL}
    assert into_stopped & PROCESS_STATES == {S.STOPPING}


def test_state_str_is_its_name() -> None:
    assert [str(s) for s in EngineState] == [s.name for s in EngineState]
    assert EngineState("fatal") is S.FATAL
