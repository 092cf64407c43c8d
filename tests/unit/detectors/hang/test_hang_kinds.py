"""The hang rules that read the step heartbeat (issue 25): frozen, spinning, and a stopped API
server found in one round; each with the busy engine it must not mistake for a hung one.

Virtual time: every observation is built by hand, as the observer would make it (a sweep as
the round starts, the heartbeat read after the round's probes, a second sweep after a miss).
The engine is vLLM 0.32's process group: the API server (the group leader), EngineCore, Worker.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import pytest

from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.detectors import DetectorConfig, detect_hang, new_window
from llmsupervisor.detectors.config import DetectorConfig as _Cfg
from llmsupervisor.detectors.hang.steps import idle_but_busy
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcSample
from tests.lib.hang_rounds import API, CORE, WORKER, Engine, sweep

CFG = DetectorConfig()
OK = HttpCheck(ok=True, detail="completed", latency_s=0.04, status_code=200)
HEALTH_OK = HttpCheck(ok=True, detail="HTTP 200", latency_s=0.002, status_code=200)
MISS = HttpCheck(ok=False, detail="timed out (ReadTimeout)", latency_s=1.0, failure="timeout")
assert _Cfg is DetectorConfig


def beat(
    done: int, done_s: float, *, work: int = 8, pending: bool = True, longest_s: float = 0.05
) -> StepBeat:
    return StepBeat(
        pid=CORE,
        scheduled=done + (1 if pending else 0),
        done=done,
        scheduled_s=done_s,
        done_s=done_s,
        work=work,
        longest_step_s=longest_s,
    )


LOADED = {API: 0.3, CORE: 0.4, WORKER: 1.5}  # a decode batch: the Worker's OpenMP threads compute
FROZEN = {API: 0.01, CORE: 0.0, WORKER: 0.0}  # a deadlock: every thread blocked
SPIN = {API: 0.01, CORE: 1.0, WORKER: 0.0}  # EngineCore's main thread loops; no step for the Worker


def rounds(
    hang_s: float,
    until_s: float,
    after: dict[int, float],
    *,
    before: dict[int, float] = LOADED,
    tick_s: float = 2.0,
    steps_after: bool = False,
    longest_s: float = 0.05,
    gpus: bool = False,
) -> list[Observation]:
    """An engine under load (steps every few ms) until ``hang_s``, then ``after``'s CPU and (unless
    ``steps_after``) no further step; a round every ``tick_s``, its sweep as it starts, the
    heartbeat after its probes (no canary: under load the counters move until the hang)."""
    engine, out, done, done_s = Engine(), [], 0, 0.0
    for t in [i * tick_s for i in range(int(until_s / tick_s) + 1)]:
        proc = sweep(t, engine.run(t, before if t <= hang_s else after))
        if t <= hang_s or steps_after:
            done, done_s = done + 400, t
        else:
            done_s = min(done_s, hang_s)
        out.append(
            Observation(
                engine="e1",
                at_s=t + 0.01,
                health=HEALTH_OK,
                proc=proc,
                heartbeat=beat(done, done_s, longest_s=longest_s),
                gpus={0: nominal_sample(0)} if gpus else {},
            )
        )
    return out


def first_hang(observations: Iterable[Observation], cfg: DetectorConfig = CFG) -> tuple[float, str] | None:
    """When the hang detector first fires, replaying the rounds, and by which rule."""
    w = new_window(cfg)
    for obs in observations:
        w.append(obs)
        finding = detect_hang(w, obs.at_s, cfg)
        if finding is not None:
            return obs.at_s, str(finding.evidence["rule"])
    return None


def test_a_deadlocked_engine_core_under_load_is_frozen_within_two_rounds() -> None:
    found = first_hang(rounds(hang_s=10.0, until_s=30.0, after=FROZEN))
    assert found is not None
    at_s, rule = found
    assert rule == "frozen" and at_s - 10.0 <= 4.1  # the sweeps at 12 and 14 bracket the stillness


def test_a_spinning_engine_core_under_load_is_spinning_within_the_learned_bound() -> None:
    found = first_hang(rounds(hang_s=10.0, until_s=30.0, after=SPIN))
    assert found is not None
    at_s, rule = found
    assert rule == "spinning" and at_s - 10.0 <= 4.1


def test_the_spin_bound_is_learned_from_the_engines_own_longest_step() -> None:
    # Steps of up to 1.5 s (long prefill chunks): a step is overdue only after 4 x 1.5 = 6 s.
    found = first_hang(rounds(hang_s=10.0, until_s=30.0, after=SPIN, longest_s=1.5))
    assert found is not None and found[1] == "spinning" and found[0] - 10.0 >= 6.0


def test_steps_that_continue_are_never_a_hang_whatever_the_cpu() -> None:
    # A long chunked prefill: vLLM's token counters stand still (no step emits output), the
    # heartbeat counts every chunk. The Worker computes; EngineCore may be busy or idle.
    for after in (LOADED, SPIN, FROZEN):
        assert first_hang(rounds(hang_s=10.0, until_s=60.0, after=after, steps_after=True)) is None


def test_one_long_step_computed_by_the_worker_is_not_a_hang() -> None:
    # No step completes for 10 s (one huge step, chunked prefill off), EngineCore waits on it,
    # the Worker computes: neither frozen nor spinning (the deadline rule is the backstop, and it
    # needs missed deadlines, none here).
    long_step = {API: 0.01, CORE: 0.9, WORKER: 1.8}
    assert first_hang(rounds(hang_s=10.0, until_s=20.0, after=long_step)) is None


def test_on_a_gpu_host_the_spin_rule_waits_for_the_deadline_rule() -> None:
    # A hung kernel and a long prefill look alike to /proc on a GPU host (the Worker spin-waits on
    # the GPU either way): no spinning rule without a compute oracle.
    assert first_hang(rounds(hang_s=10.0, until_s=30.0, after=SPIN, gpus=True)) is None


def test_waiting_on_io_defers_the_frozen_rule() -> None:
    observations = rounds(hang_s=10.0, until_s=30.0, after=FROZEN)
    observations = [
        replace(
            o,
            proc=replace(o.proc, processes=tuple(replace(p, status="disk-sleep") for p in o.proc.processes)),
        )
        if o.at_s > 10.0 and isinstance(o.proc, ProcSample)
        else o
        for o in observations
    ]
    assert first_hang(observations) is None


def idle_round(
    t: float, cpu_before: dict[int, float], cpu_after: dict[int, float], *, canary: HttpCheck
) -> Observation:
    """An idle engine's round: the sweep as it starts, the canary sent with it, the heartbeat
    read after it (no step scheduled since 0), a second sweep after a miss."""
    missed = canary.failure == "timeout"
    return Observation(
        engine="e1",
        at_s=t + canary.latency_s,
        health=HEALTH_OK,
        canary=canary,
        proc=sweep(t, cpu_before),
        proc_after=sweep(t + canary.latency_s + 0.01, cpu_after) if missed else None,
        heartbeat=beat(50, 1.0, work=0, pending=False),
    )


@pytest.mark.parametrize(
    ("core_rate", "worker_rate", "rule"),
    [(0.0, 0.0, "frozen"), (1.0, 0.0, "spinning"), (1.0, 1.0, None)],
    ids=["deadlocked", "spinning", "computing"],
)
def test_an_idle_engine_that_does_not_pick_up_the_canary_is_found_in_that_round(
    core_rate: float, worker_rate: float, rule: str | None
) -> None:
    cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
    first = idle_round(0.0, cpu, cpu, canary=OK)
    after = {API: 10.01, CORE: 20.0 + core_rate * 1.01, WORKER: 30.0 + worker_rate * 1.01}
    miss = idle_round(2.0, cpu, after, canary=MISS)
    found = first_hang([first, miss])
    assert (found[1] if found else None) == rule


def test_an_idle_engine_busy_with_nothing_asked_is_not_a_hang() -> None:
    # EngineCore busy while idle, but no canary waits and the heartbeat holds nothing: no work
    # is outstanding, so there is nothing it fails to do (the canary will ask).
    cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
    observations = [
        replace(idle_round(t, cpu, cpu, canary=OK), proc=sweep(t, {**cpu, CORE: 20.0 + t}))
        for t in (0.0, 2.0, 4.0, 6.0)
    ]
    assert first_hang(observations) is None


def test_the_canary_picked_up_late_is_not_a_spin() -> None:
    # The canary missed, but a step was scheduled after it was sent: the engine is stepping.
    cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
    miss = idle_round(2.0, cpu, {**cpu, CORE: 21.0}, canary=MISS)
    late = replace(miss, heartbeat=replace(beat(50, 1.0, work=0, pending=True), scheduled_s=2.5))
    assert first_hang([idle_round(0.0, cpu, cpu, canary=OK), late]) is None


def test_a_stopped_api_server_with_a_late_health_is_found_in_one_round() -> None:
    # /health late (the round waited hang_probe_late_s): the sweep as the round began and the one
    # after the miss both show the API server stopped, its CPU time unchanged.
    cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
    late = replace(MISS, detail="timed out (ReadTimeout)")
    stopped = {API: "stopped"}
    first = Observation(engine="e1", at_s=0.01, health=HEALTH_OK, proc=sweep(0.0, cpu))
    miss = Observation(
        engine="e1",
        at_s=3.0,
        health=late,
        proc=sweep(2.0, cpu, status=stopped),
        proc_after=sweep(3.01, cpu, status=stopped),
    )
    found = first_hang([first, miss])
    assert found == (3.0, "stopped")


def test_without_a_heartbeat_the_old_rules_apply() -> None:
    # An older vLLM: no heartbeat, so neither new rule; the spin is left to the deadline rule.
    observations = [replace(o, heartbeat=None) for o in rounds(hang_s=10.0, until_s=30.0, after=SPIN)]
    assert first_hang(observations) is None  # no deadline misses either: nothing to go on


@pytest.mark.parametrize(
    ("worker_s", "rule"), [(0.5, "frozen"), (1.0, None)], ids=["poll", "more than the poll"]
)
def test_the_workers_poll_after_the_last_step_is_not_compute(worker_s: float, rule: str | None) -> None:
    # vLLM's Worker polls for its next step for hang_worker_poll_s (1 s) after the last one: the
    # round after a deadlock at 10 sees it still polling from 10.5 to 11, then asleep. Within
    # that allowance the engine is frozen; more Worker CPU than the poll is compute.
    cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
    stuck = beat(400, 10.0)
    observations = [
        Observation(engine="e1", at_s=8.5, health=HEALTH_OK, proc=sweep(8.5, cpu), heartbeat=beat(300, 8.5)),
        Observation(
            engine="e1",
            at_s=11.55,
            health=HEALTH_OK,
            proc=sweep(10.5, cpu),
            proc_after=sweep(11.55, {**cpu, WORKER: 30.0 + worker_s}),
            heartbeat=stuck,
        ),
    ]
    found = first_hang(observations)
    assert (found[1] if found else None) == rule


def test_a_canary_held_up_by_a_busy_api_server_is_not_a_frozen_engine() -> None:
    # The canary missed and no step was scheduled for it, but the API server was busy meanwhile
    # (its event loop, not the engine core): not frozen (the API server counts when only a
    # canary waits), and not spinning (the core is idle).
    cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
    miss = idle_round(2.0, cpu, {**cpu, API: 11.0}, canary=MISS)
    assert first_hang([idle_round(0.0, cpu, cpu, canary=OK), miss]) is None


def test_an_idle_engine_burning_cpu_is_asked_at_once() -> None:
    cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
    quiet = [idle_round(0.0, cpu, cpu, canary=OK), idle_round(2.0, cpu, cpu, canary=OK)]
    assert not idle_but_busy(new_window_of(quiet), 2.1, CFG)
    busy = [idle_round(0.0, cpu, cpu, canary=OK), idle_round(2.0, {**cpu, CORE: 22.0}, cpu, canary=OK)]
    assert idle_but_busy(new_window_of(busy), 2.1, CFG)
    # Work held: the engine is busy with it, not idle.
    held = [replace(o, heartbeat=beat(50, 1.0, work=3, pending=False)) for o in busy]
    assert not idle_but_busy(new_window_of(held), 2.1, CFG)


def new_window_of(observations: Iterable[Observation]) -> ObservationWindow:
    w = new_window(CFG)
    for o in observations:
        w.append(o)
    return w


def test_a_hang_finding_reads_for_a_person() -> None:
    """Issue 39 (5): "hang: hung: ...", "1 deadline misses" and raw floats
    (``cpu_span_s=1.1096497670000645``) in `events` and `describe` read like debug output. The
    summary says it once, in the right number; the evidence, as the log line and `events` show
    it, is rounded with units; the values as measured stay in the finding (and `events --json`)."""
    import re

    from llmsupervisor.core.findings import evidence_text

    w = new_window(CFG)
    finding = None
    for obs in rounds(hang_s=10.0, until_s=30.0, after=FROZEN):
        w.append(obs)
        finding = finding or detect_hang(w, obs.at_s, CFG)
    assert finding is not None
    assert not finding.summary.startswith(("hang", "hung")), finding.summary
    assert re.search(r"\b1 deadline misses\b|\b1 requests\b", finding.summary) is None, finding.summary
    assert re.search(r"\d\.\d{4,}", finding.summary) is None, finding.summary
    shown = evidence_text(finding.evidence)
    assert re.search(r"\d\.\d{4,}", shown) is None and "=" not in shown, shown
    assert "rule frozen" in shown and " s," in shown, shown
    assert finding.evidence["rule"] == "frozen" and "cpu_span_s" in finding.evidence  # kept as measured
