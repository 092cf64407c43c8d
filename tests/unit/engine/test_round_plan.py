"""The observation round's plan (engine/round_plan.py): one row per decision, pure, no loop.

Defaults of the engine below: canary_interval_s 2, metrics_interval_s 4, health_timeout_s 5,
hang_probe_late_s 1. Each row changes what it is about from a round that asks nothing: a
canary sent 1 s ago, /metrics read 1 s ago, no heartbeat, an empty window.
"""

from __future__ import annotations

from typing import Any

import pytest

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.detectors import DetectorConfig, new_window
from llmsupervisor.engine.round_plan import (
    METRICS_DUE_EARLY_S,
    RoundPlan,
    canary_after_sweep,
    may_ask,
    metrics_phase,
    plan_round,
)
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcSample
from tests.lib.engine_fakes import metrics
from tests.lib.hang_rounds import API, CORE, WORKER, sweep

NOW = 100.0
SPEC = EngineSpec(name="e1", model="m", gpus=(), port=8001)
IDLE = StepBeat(pid=1, scheduled=9, done=9, scheduled_s=90.0, done_s=90.0, work=0, longest_step_s=0.01)
BUSY = StepBeat(pid=1, scheduled=9, done=9, scheduled_s=99.9, done_s=99.9, work=5, longest_step_s=0.01)
UNDER_WAY = StepBeat(pid=1, scheduled=10, done=9, scheduled_s=99.9, done_s=99.0, work=0, longest_step_s=0.01)
BEFORE, MOVED = metrics(steps=100), metrics(steps=200)
COUNTERS_MOVED = {"previous_metrics": BEFORE, "last_metrics": MOVED}
COUNTERS_STILL = {"previous_metrics": MOVED, "last_metrics": MOVED}


def window_of(*beats: StepBeat) -> ObservationWindow:
    """Rounds a second apart up to NOW - 1, the last with each of ``beats`` in turn."""
    window = new_window(SPEC.detectors)
    for i, beat in enumerate(beats):
        window.append(Observation(engine="e1", at_s=NOW - len(beats) + i, heartbeat=beat))
    return window


def plan(spec: EngineSpec = SPEC, **given: Any) -> RoundPlan:
    """The plan at NOW of a round that, unless ``given`` says, has nothing due."""
    args: dict[str, Any] = {
        "in_rotation": True,
        "window": window_of(),
        "start_beat": None,
        "beat_moved": False,
        "previous_metrics": None,
        "last_metrics": None,
        "last_canary_s": NOW - 1.0,
        "last_metrics_s": NOW - 1.0,
    }
    return plan_round(spec, NOW, **(args | given))


def spec_of(**fields: Any) -> EngineSpec:
    return EngineSpec(name="e1", model="m", gpus=(), port=8001, **fields)


@pytest.mark.parametrize(
    ("spec", "given", "expected"),
    [
        # Nothing due: a busy engine's round is /health and the sweep, together.
        pytest.param(SPEC, {}, {"canary": False, "sweep_first": False, "metrics": False}, id="nothing-due"),
        # The canary, canary_interval_s after the last one ended.
        pytest.param(SPEC, {"last_canary_s": NOW - 2.0}, {"canary": True}, id="canary-due"),
        pytest.param(SPEC, {"last_canary_s": NOW - 1.9}, {"canary": False}, id="canary-not-yet"),
        # Never out of rotation (drained, held, shedding), nor for a model with no canary.
        pytest.param(
            SPEC,
            {"in_rotation": False, "last_canary_s": NOW - 60, "start_beat": IDLE},
            {"canary": False, "sweep_first": False},
            id="out-of-rotation",
        ),
        pytest.param(
            spec_of(canary="none"),
            {"last_canary_s": NOW - 60, "start_beat": IDLE},
            {"canary": False, "sweep_first": False},
            id="canary-kind-none",
        ),
        # Progress holds the canary back: the heartbeat's steps moved since the last round...
        pytest.param(
            SPEC,
            {"last_canary_s": NOW - 60, "beat_moved": True, "start_beat": BUSY},
            {"canary": False, "progressing": True, "sweep_first": False},
            id="heartbeat-moved",
        ),
        # ... or vLLM's counters moved while the heartbeat says work is held...
        pytest.param(
            SPEC,
            {"last_canary_s": NOW - 60, "start_beat": BUSY, **COUNTERS_MOVED},
            {"canary": False, "progressing": True, "idle": False},
            id="counters-moved-busy",
        ),
        # ... but not counters that still move after the last request, once nothing is held.
        pytest.param(
            SPEC,
            {"last_canary_s": NOW - 60, "start_beat": IDLE, **COUNTERS_MOVED},
            {"canary": True, "progressing": False, "idle": True},
            id="counters-moved-idle",
        ),
        pytest.param(
            SPEC,
            {"last_canary_s": NOW - 60, "start_beat": BUSY, **COUNTERS_STILL},
            {"canary": True, "progressing": False},
            id="counters-still",
        ),
        # An idle engine with no canary due is swept first (and asked if that sweep shows it busy).
        pytest.param(SPEC, {"start_beat": IDLE}, {"idle": True, "sweep_first": True}, id="idle-sweep-first"),
        # Even while its last steps moved (a Worker that began to spin as a load ended).
        pytest.param(
            SPEC,
            {"start_beat": IDLE, "beat_moved": True},
            {"progressing": True, "sweep_first": True},
            id="idle-moved-sweep-first",
        ),
        # A canary due goes without a sweep first: the probes and the sweep together.
        pytest.param(
            SPEC,
            {"start_beat": IDLE, "last_canary_s": NOW - 2.0},
            {"canary": True, "sweep_first": False},
            id="idle-canary-due",
        ),
        pytest.param(SPEC, {"start_beat": BUSY}, {"idle": False, "sweep_first": False}, id="busy"),
        pytest.param(SPEC, {"start_beat": UNDER_WAY}, {"idle": False}, id="step-under-way"),
        # The heartbeat as the round begins, not the window's newest (the last round's)...
        pytest.param(
            SPEC,
            {"start_beat": IDLE, "window": window_of(BUSY)},
            {"idle": True, "start_beat": IDLE},
            id="idle-now-busy-before",
        ),
        # ... which decides where the heartbeat was not read now, or could not be.
        pytest.param(
            SPEC, {"window": window_of(IDLE)}, {"idle": True, "start_beat": None}, id="idle-by-window"
        ),
        pytest.param(
            SPEC,
            {"start_beat": ProbeFailure("error", "gone"), "window": window_of(IDLE, BUSY)},
            {"idle": False, "start_beat": None},
            id="unread-busy-by-window",
        ),
        pytest.param(SPEC, {}, {"idle": False}, id="no-heartbeat-not-idle"),
        # /metrics: due metrics_interval_s after the last read, METRICS_DUE_EARLY_S early.
        pytest.param(
            SPEC,
            {"last_metrics_s": NOW - 4.0 + METRICS_DUE_EARLY_S},
            {"metrics": True, "metrics_from_s": NOW},
            id="metrics-due-early",
        ),
        pytest.param(
            SPEC,
            {"last_metrics_s": NOW - 3.4},
            {"metrics": False, "metrics_from_s": NOW - 3.4},
            id="metrics-not-yet",
        ),
        # The first read places the engine at its own phase of the interval.
        pytest.param(
            SPEC,
            {"last_metrics_s": None},
            {"metrics": True, "metrics_from_s": NOW - 4.0 * metrics_phase("e1")},
            id="metrics-first-read",
        ),
        # The round waits hang_probe_late_s for /health, never more than health_timeout_s.
        pytest.param(SPEC, {}, {"timeout_s": 5.0, "late_s": 1.0, "begun_s": NOW}, id="late-default"),
        pytest.param(
            spec_of(health_timeout_s=0.5), {}, {"timeout_s": 0.5, "late_s": 0.5}, id="late-at-most-timeout"
        ),
        pytest.param(
            spec_of(detectors=DetectorConfig(hang_probe_late_s=0.05)),
            {},
            {"late_s": 0.05},
            id="late-configured",
        ),
    ],
)
def test_plan_round(spec: EngineSpec, given: dict[str, Any], expected: dict[str, Any]) -> None:
    got = plan(spec, **given)
    assert {name: getattr(got, name) for name in expected} == pytest.approx(expected)


def test_engines_read_metrics_at_their_own_phase() -> None:
    phases = {metrics_phase(f"gpu{i}") for i in range(8)}
    assert len(phases) == 8 and all(0 <= p < 1 for p in phases)
    assert metrics_phase("gpu0") == metrics_phase("gpu0")  # the same in every run: not hash()


@pytest.mark.parametrize(
    ("in_rotation", "canary", "asks"),
    [(True, "auto", True), (False, "auto", False), (True, "none", False), (True, "embedding", True)],
)
def test_may_ask(in_rotation: bool, canary: str, asks: bool) -> None:
    assert may_ask(spec_of(canary=canary), in_rotation=in_rotation) is asks


def swept_now(worker_cpu_s: float, api_cpu_s: float = 10.0) -> ProcSample:
    """The round's own sweep, at NOW."""
    return sweep(NOW, {API: api_cpu_s, CORE: 20.0, WORKER: worker_cpu_s})


def swept_window(*rounds: tuple[float, float]) -> ObservationWindow:
    """Rounds at (time, Worker's CPU seconds) with an idle heartbeat and a sweep each."""
    window = new_window(SPEC.detectors)
    for at_s, worker_cpu_s in rounds:
        cpu = {API: 10.0, CORE: 20.0, WORKER: worker_cpu_s}
        window.append(Observation(engine="e1", at_s=at_s, heartbeat=IDLE, proc=sweep(at_s, cpu)))
    return window


@pytest.mark.parametrize(
    ("window", "swept", "asks"),
    [
        # An idle engine whose Worker burned a core between the window's sweep and this one.
        pytest.param(swept_window((98.0, 30.0)), swept_now(32.0), True, id="spins"),
        pytest.param(swept_window((98.0, 30.0)), swept_now(30.0), False, id="rests"),
        # The API server's CPU is its own (it answers /health and renders /metrics): not a spin.
        pytest.param(swept_window((98.0, 30.0)), swept_now(30.0, api_cpu_s=12.0), False, id="api-only"),
        # No fresh sweep: the window's two newest, here a spin.
        pytest.param(
            swept_window((97.0, 30.0), (99.0, 32.0)), ProbeFailure("error", "EMFILE"), True, id="failed-sweep"
        ),
        pytest.param(swept_window(), swept_now(32.0), False, id="one-sweep"),
    ],
)
def test_canary_after_sweep(window: ObservationWindow, swept: Any, asks: bool) -> None:
    first = plan(window=window, start_beat=IDLE)
    assert first.sweep_first
    assert canary_after_sweep(first, swept, window, SPEC.detectors) is asks


def test_canary_after_sweep_asks_nothing_of_a_busy_engine() -> None:
    window = swept_window((98.0, 30.0))
    busy = plan(window=window, start_beat=BUSY)
    assert not canary_after_sweep(busy, swept_now(32.0), window, SPEC.detectors)
