"""Commands x desired state, and rotation over the transition table: pure tables."""

from __future__ import annotations

import itertools

import pytest

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.state import EDGES, SERVING, EngineState, rotation_target
from llmsupervisor.engine.commands import (
    Desired,
    Escalate,
    Hold,
    Note,
    ResetPrefixCache,
    Respec,
    Restart,
    Shed,
    Start,
    StepTo,
    Stop,
    apply,
    merge,
)

S = EngineState
SPEC = EngineSpec(name="a", model="m", gpus=(0,), port=8000)
OPERATOR = Restart(cause="operator", reason="asked")
HANG = Restart(cause="hang", reason="hung", drain=False, failure=True)


@pytest.mark.parametrize(
    ("before", "cmd", "after"),
    [
        (Desired(run=True), Stop(), Desired(run=False)),
        (Desired(run=True), Stop(final=True), Desired(run=False, final=True)),
        (Desired(run=False, final=True), Start(), Desired(run=False, final=True)),
        # D1: Start ends the operator's hold and the policy's shedding at once.
        (Desired(run=False, held=True, shed="kv"), Start(), Desired(run=True)),
        # D5: a restart does not start a stopped engine; its spec waits for the next start.
        (
            Desired(run=False),
            Restart(cause="config_change", reason="c", spec=SPEC),
            Desired(run=False, restart=Restart(cause="config_change", reason="c", spec=SPEC), spec=SPEC),
        ),
        (Desired(run=False, final=True), OPERATOR, Desired(run=False, final=True)),
        (Desired(run=True, restart=OPERATOR), Stop(), Desired(run=False)),
        (Desired(run=False), Respec(SPEC), Desired(run=False, spec=SPEC)),
        (Desired(run=True), Hold(True), Desired(run=True, held=True)),
        (Desired(run=True, held=True), Hold(False), Desired(run=True)),
        (Desired(run=True), Shed("kv"), Desired(run=True, shed="kv")),
        (Desired(run=True, shed="kv"), Shed(None), Desired(run=True)),
        (Desired(run=True), Escalate(), Desired(run=True, quick=True)),
        (Desired(run=True), StepTo(1, "x"), Desired(run=True)),
        (Desired(run=True), ResetPrefixCache("x"), Desired(run=True)),
        (Desired(run=False), Note("waits for its GPUs' fabric"), Desired(run=False)),
    ],
)
def test_apply(before: Desired, cmd: object, after: Desired) -> None:
    assert apply(before, cmd) == after  # type: ignore[arg-type]


def test_restarts_merge_the_more_urgent_wins_and_the_newest_spec() -> None:
    assert merge(None, OPERATOR) == OPERATOR
    assert merge(OPERATOR, HANG) == HANG
    assert merge(HANG, OPERATOR) == HANG
    with_spec = Restart(cause="config_change", reason="c", spec=SPEC)
    assert merge(HANG, with_spec).spec == SPEC
    assert merge(with_spec, OPERATOR).spec == SPEC


@pytest.mark.parametrize("state", sorted(SERVING, key=str), ids=str)
@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("shed", [None, "kv"])
def test_rotation_only_walks_edges_and_ends_where_asked(
    state: EngineState, held: bool, shed: str | None
) -> None:
    seen = [state]
    while (nxt := rotation_target(seen[-1], held=held, shed=shed)) is not None:
        assert nxt in EDGES[seen[-1]]
        seen.append(nxt)
        assert len(seen) < 4
    assert seen[-1] is (S.DRAINING if held else S.SHEDDING if shed else S.READY)


@pytest.mark.parametrize("state", [s for s in EngineState if s not in SERVING], ids=str)
def test_rotation_leaves_engines_that_do_not_serve_alone(state: EngineState) -> None:
    assert rotation_target(state, held=True, shed="kv") is None


def test_d1_drain_then_start_of_a_shed_engine_walks_legal_edges() -> None:
    """Defect D1: SHEDDING, then an operator drain, then `start`: DRAINING -> SHEDDING is no edge.
    Start clears the shedding with the hold, so the engine goes back to READY; had the policy
    shed it again, it would go through READY."""
    d = Desired(run=True, shed="kv")
    state = S.SHEDDING
    for cmd in (Hold(True), Start()):
        d = apply(d, cmd)
        while (nxt := rotation_target(state, held=d.held, shed=d.shed)) is not None:
            assert nxt in EDGES[state]
            state = nxt
    assert state is S.READY
    d = apply(d, Shed("kv"))
    path: list[EngineState] = [state]
    for _ in itertools.count():
        nxt = rotation_target(path[-1], held=d.held, shed=d.shed)
        if nxt is None:
            break
        path.append(nxt)
    assert path == [S.READY, S.SHEDDING]
