"""Detectors and the finding tracker: windows in, finding or none out; time is an argument.

Windows are built from the real probe types: ``EngineMetrics`` parsed from the captured vLLM
0.32 bodies and varied with ``dataclasses.replace``, ``GpuSample`` from ``nominal_sample``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import pytest

from llmsupervisor.core.observe import Observation, ObservationWindow, check_timed_out
from llmsupervisor.detectors import (
    DEFAULT_CLEAR_S,
    DEFAULT_SUSTAIN_S,
    DETECTORS,
    DetectorConfig,
    Finding,
    FindingKind,
    FindingTracker,
    Severity,
    TrackerUpdate,
    baseline_has_traffic,
    detect_all,
    detect_foreign_gpu_memory,
    detect_gpu_fault,
    detect_gpu_lost,
    detect_hang,
    detect_kv_pressure,
    detect_memory_growth,
    detect_nvml_lost,
    detect_power_throttle,
    detect_preemption_storm,
    detect_prefix_cache_degradation,
    detect_stall,
    detect_thermal,
    detect_throughput_degradation,
    detect_ttft_degradation,
    new_window,
    span_stats,
)
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuProcess, GpuSample
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.host import ProcInfo, ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics, Histogram, parse_metrics
from tests.lib.paths import FIXTURES

K = FindingKind
CFG = DetectorConfig()
ENGINE = "gpu0"
MIB = 1024 * 1024
GIB = 1024 * MIB
FIXTURES = FIXTURES / "metrics"


def _parsed(name: str) -> EngineMetrics:
    m = parse_metrics((FIXTURES / name).read_text())
    assert isinstance(m, EngineMetrics)
    return m


BUSY = _parsed("vllm-0.32.0-cpu.txt")  # 8 running, 306 steps, 1080 generated tokens
IDLE = _parsed("vllm-0.32.0-cpu-idle.txt")  # before the first request: every counter 0

OK = HttpCheck(ok=True, detail="completed", latency_s=0.04, status_code=200)
HEALTH_OK = HttpCheck(ok=True, detail="HTTP 200", latency_s=0.002, status_code=200)
TIMEOUT = HttpCheck(ok=False, detail="timed out (ReadTimeout)", latency_s=5.0, failure="timeout")
REFUSED = HttpCheck(ok=False, detail="connection refused", latency_s=0.001, failure="connect")
HTTP_500 = HttpCheck(ok=False, detail="HTTP 500: boom", latency_s=0.01, status_code=500, failure="http")
METRICS_TIMEOUT = ProbeFailure("timeout", "GET /metrics: no answer within 5 s")
METRICS_REFUSED = ProbeFailure("connect", "GET /metrics: ConnectError")
ENGINE_PIDS = frozenset({4100, 4101, 4102})


def ob(t: float, **kw: Any) -> Observation:
    return Observation(engine=ENGINE, at_s=t, **kw)


def win(observations: Iterable[Observation], cfg: DetectorConfig = CFG) -> ObservationWindow:
    w = new_window(cfg)
    for o in observations:
        w.append(o)
    return w


def busy(steps: int, *, running: int = 8, waiting: int = 0, **changes: Any) -> EngineMetrics:
    """The captured busy engine, with its step and token counters moved to ``steps``."""
    return replace(
        BUSY,
        iterations_total=steps,
        generation_tokens_total=steps * 4,
        prompt_tokens_total=714 + steps,
        requests_running=running,
        requests_waiting=waiting,
        **changes,
    )


def idle(steps: int = 0, **changes: Any) -> EngineMetrics:
    return replace(
        IDLE, iterations_total=steps, generation_tokens_total=steps, prompt_tokens_total=steps, **changes
    )


def gpu(index: int = 0, **changes: Any) -> GpuSample:
    return nominal_sample(index, **changes)


def times(start: float, stop: float, step: float) -> list[float]:
    out, t = [], start
    while t <= stop + 1e-9:
        out.append(t)
        t += step
    return out


def replay(observations: Iterable[Observation], cfg: DetectorConfig = CFG) -> list[TrackerUpdate]:
    """What the loop does each tick: append, detect with now = the tick, track."""
    window, tracker = new_window(cfg), FindingTracker(cfg)
    updates = []
    for o in observations:
        window.append(o)
        updates.append(tracker.update(detect_all(window, o.at_s, cfg), o.at_s))
    return updates


def opened(updates: Iterable[TrackerUpdate]) -> list[Finding]:
    return [f for u in updates for f in u.opened]


def opened_at(observations: list[Observation], updates: list[TrackerUpdate]) -> list[float]:
    return [o.at_s for o, u in zip(observations, updates, strict=True) for _ in u.opened]


def num(finding: Finding, key: str) -> float:
    value = finding.evidence[key]
    assert isinstance(value, int | float), value
    return value


# --- Observation and ObservationWindow -----------------------------------------------------------


def test_observation_defaults_are_unknown_and_gpus_read_only() -> None:
    o = ob(1.0, gpus={0: gpu()})
    assert (o.metrics, o.health, o.canary, o.proc) == (None, None, None, None)
    assert o.gpu_events == () and o.engine_pids == frozenset()
    with pytest.raises(TypeError):
        o.gpus[1] = gpu(1)  # type: ignore[index]


def test_window_bounds_by_count_and_age() -> None:
    w = ObservationWindow(max_count=5, max_age_s=100.0)
    for t in times(0, 90, 10):
        w.append(ob(t))
    assert [o.at_s for o in w] == [50, 60, 70, 80, 90]
    w = ObservationWindow(max_count=100, max_age_s=25.0)
    for t in times(0, 90, 10):
        w.append(ob(t))
    assert [o.at_s for o in w] == [70, 80, 90]
    assert len(w) == 3 and w
    latest = w.latest()
    assert latest is not None and latest.at_s == 90
    assert [o.at_s for o in w.since(75)] == [80, 90]
    assert [o.at_s for o in w.since(80)] == [80, 90]
    assert w.since(1000) == ()
    assert [o.at_s for o in reversed(w)] == [90, 80, 70]


def test_window_rejects_the_past_and_other_engines() -> None:
    w = ObservationWindow()
    assert w.latest() is None and not w
    w.append(ob(10))
    with pytest.raises(ValueError, match="older"):
        w.append(ob(9))
    with pytest.raises(ValueError, match="window of 'gpu0'"):
        w.append(Observation(engine="gpu1", at_s=11))
    assert len(w) == 1


def test_window_pins_a_baseline_that_outlives_the_ring() -> None:
    # The rule approves spans whose first observation is at t >= 30 (standing in for "traffic").
    w = ObservationWindow(
        max_count=1000, max_age_s=50.0, baseline_s=40.0, baseline_accept=lambda obs: obs[0].at_s >= 30
    )
    for t in times(0, 200, 10):
        w.append(ob(t))
    assert w.baseline is not None
    assert [o.at_s for o in w.baseline] == [30, 40, 50, 60, 70]
    assert w.since(0)[0].at_s == 150  # the ring moved on; the baseline stayed


def test_window_computes_baseline_stats_once_per_pinned_baseline() -> None:
    calls: list[tuple[Observation, ...]] = []

    def first_at(baseline: tuple[Observation, ...]) -> float:
        calls.append(baseline)
        return baseline[0].at_s

    def count(baseline: tuple[Observation, ...]) -> int:
        return len(baseline)

    w = ObservationWindow(max_count=1000, max_age_s=50.0, baseline_s=40.0)
    w.append(ob(0))
    assert w.baseline_stats(first_at) is None and calls == []  # nothing pinned: nothing computed
    for t in times(10, 200, 10):
        w.append(ob(t))
    assert w.baseline_stats(first_at) == 0 and w.baseline_stats(first_at) == 0
    assert calls == [w.baseline]  # once, on the pinned baseline
    assert w.baseline_stats(count) == 5  # another computation is not served the first's answer
    assert w.baseline_stats(first_at) == 0 and len(calls) == 2


def test_new_window_covers_the_longest_lookback() -> None:
    w = new_window(CFG)
    assert w.max_age_s >= CFG.memory_window_s == CFG.lookback_s


@pytest.mark.parametrize(
    ("result", "timed_out"),
    [(TIMEOUT, True), (REFUSED, False), (HTTP_500, False), (OK, False), (None, False)],
)
def test_check_timed_out(result: HttpCheck | None, timed_out: bool) -> None:
    assert check_timed_out(result) is timed_out


# --- HANG ----------------------------------------------------------------------------------------


def _sigstop_idle(miss_times: Iterable[float]) -> list[Observation]:
    # docs/vllm-notes.md §7: the worker stopped; /health 200 in 2 ms, /metrics stale at 0 running.
    misses = set(miss_times)
    out = [ob(0, metrics=idle(5), health=HEALTH_OK, canary=OK)]
    for t in times(2, 14, 2):
        out.append(ob(t, metrics=idle(6), health=HEALTH_OK, canary=TIMEOUT if t in misses else None))
    return out


HANG_CASES: list[tuple[str, list[Observation], float, bool]] = [
    ("sigstop: idle gauges, 2 canary misses, 12 s without life", _sigstop_idle([8, 12]), 12, True),
    ("one canary miss is not a hang", _sigstop_idle([12]), 12, False),
    ("2 misses but only 8 s since the last sign of life", _sigstop_idle([6, 8]), 8, False),
    (
        "busy: canary misses but the step counter advances",
        [ob(t, metrics=busy(int(t)), health=HEALTH_OK, canary=TIMEOUT) for t in times(0, 300, 5)],
        300,
        False,
    ),
    (
        "work queued, counters frozen, canary missing: under hang_after_s",
        [ob(0, metrics=busy(100), canary=OK)] + [ob(t, metrics=busy(100), canary=TIMEOUT) for t in (5, 10)],
        10,
        False,
    ),
    (
        "work queued, counters frozen, canary missing: past hang_after_s",
        [ob(0, metrics=busy(100), canary=OK)]
        + [ob(t, metrics=busy(100), canary=TIMEOUT) for t in (5, 10, 15)],
        15,
        True,
    ),
    (
        "API server wedged: /metrics and /health time out (evidence, not unknown)",
        [ob(0, metrics=busy(100))]
        + [ob(t, metrics=METRICS_TIMEOUT, health=TIMEOUT) for t in times(10, 130, 10)],
        130,
        True,
    ),
    (
        "refused connections are the crash path, not a hang",
        [ob(0, metrics=idle(5), canary=OK)]
        + [ob(t, metrics=METRICS_REFUSED, health=REFUSED, canary=REFUSED) for t in times(10, 200, 10)],
        200,
        False,
    ),
    (
        "canary answering HTTP 500 is not a deadline miss",
        [ob(t, metrics=idle(5), canary=HTTP_500) for t in times(0, 200, 10)],
        200,
        False,
    ),
    (
        "idle and frozen with no canary run: healthy idle",
        [ob(t, metrics=idle(5), health=HEALTH_OK) for t in times(0, 600, 10)],
        600,
        False,
    ),
]


@pytest.mark.parametrize(("name", "observations", "now", "fires"), HANG_CASES, ids=[c[0] for c in HANG_CASES])
def test_hang(name: str, observations: list[Observation], now: float, fires: bool) -> None:
    finding = detect_hang(win(observations), now, CFG)
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.kind is K.HANG and finding.severity is Severity.CRITICAL
        assert num(finding, "misses") >= CFG.hang_min_misses


def test_sigstop_hang_found_within_15_s_while_health_is_200() -> None:
    observations = _sigstop_idle([8, 12])
    assert all(o.health is not None and o.health.ok for o in observations)
    assert opened_at(observations, replay(observations)) == [12]  # within 15 s of the stop
    finding = detect_hang(win(observations), 12, CFG)
    assert finding is not None
    assert finding.since_s == 2  # the last reading whose counters moved (the canary's own step)
    assert finding.evidence["requests_in_flight"] == 0
    assert finding.evidence["last_miss"] == "canary"


def test_hang_clears_when_the_engine_moves_again() -> None:
    observations = _sigstop_idle([8, 12]) + [ob(16, metrics=idle(7), canary=OK)]
    assert detect_hang(win(observations), 16, CFG) is None


def test_hang_counts_time_from_the_window_start_without_any_sign_of_life() -> None:
    # The window shows nothing earlier than its first observation, so 2 misses 4 s apart on a
    # fresh window are not yet 10 s "frozen".
    observations = [ob(100, metrics=idle(5), canary=TIMEOUT), ob(104, metrics=idle(5), canary=TIMEOUT)]
    assert detect_hang(win(observations), 104, CFG) is None
    assert detect_hang(win(observations), 110, CFG) is not None


# --- HANG from /proc: a stopped process, a canary missed with no CPU used (issue 16) ----------

API, CORE, WORKER = 4100, 4101, 4102


def group(
    at_s: float, cpu_s: dict[int, float], *, stopped: frozenset[int] = frozenset(), pgid: int = API
) -> ProcSample:
    """A vLLM engine's group (API server, EngineCore, Worker) as the sweep at ``at_s`` saw it."""
    titles = {API: "vllm serve", CORE: "VLLM::EngineCore", WORKER: "VLLM::Worker_TP0"}
    infos = tuple(
        ProcInfo(
            pid=pid,
            title=titles[pid],
            rss_bytes=GIB,
            cpu_seconds=cpu,
            status="stopped" if pid in stopped else "sleeping",
            zombie=False,
        )
        for pid, cpu in sorted(cpu_s.items())
    )
    return ProcSample(
        pgid=pgid,
        processes=infos,
        rss_bytes_total=GIB * len(infos),
        cpu_seconds_total=sum(cpu_s.values()),
        process_count=len(infos),
        zombie_count=0,
        at_s=at_s,
    )


def _sigstopped_worker(
    stop_s: float, until_s: float, *, step_s: float = 2.0, canaries: bool = True
) -> list[Observation]:
    """An idle engine whose worker is stopped at ``stop_s``: /health 200, /metrics stale at 0,
    every canary from then on missing a 1 s deadline (none run without ``canaries``); a sweep
    per tick, taken as the round starts."""
    out = []
    for t in times(0, until_s, step_s):
        stopped = frozenset({WORKER}) if t >= stop_s else frozenset()
        cpu = {API: 1.0 + 0.01 * t, CORE: 5.0, WORKER: 5.0}  # the API server answers /health
        canary = OK if t < stop_s else replace(TIMEOUT, latency_s=1.0) if canaries else None
        out.append(
            ob(t, metrics=idle(5), health=HEALTH_OK, canary=canary, proc=group(t - 1.0, cpu, stopped=stopped))
        )
    return out


def test_stopped_worker_and_a_missed_canary_are_a_hang_in_one_round() -> None:
    observations = _sigstopped_worker(stop_s=5.0, until_s=30.0)
    # The round ending at 6 swept at 5 (stopped) and sent its canary then: it missed. Found 1 s
    # after the stop, where the deadline rule needed 10 s and two misses.
    assert opened_at(observations, replay(observations)) == [6]
    finding = detect_hang(win(observations), 6, CFG)
    assert finding is not None and finding.evidence["rule"] == "stopped"
    assert finding.evidence["stopped_pid"] == WORKER and num(finding, "misses") == 1


def test_stopped_worker_is_a_hang_within_two_sweeps_while_health_is_200() -> None:
    observations = _sigstopped_worker(stop_s=5.0, until_s=30.0, canaries=False)
    # No canary (the counters were moving): sweeps at 5 and 7 (observations at 6 and 8) both
    # show it stopped, 2 s apart: found at 8, 3 s after the stop.
    assert opened_at(observations, replay(observations)) == [8]
    finding = detect_hang(win(observations), 8, CFG)
    assert finding is not None
    assert finding.evidence["rule"] == "stopped"
    assert finding.evidence["stopped_pid"] == WORKER
    assert finding.evidence["stopped_process"] == "VLLM::Worker_TP0"
    assert finding.since_s == 5  # the first sweep that saw it stopped


def test_stopped_engine_core_is_a_hang_even_with_the_canary_answering() -> None:
    # A stopped process runs nothing, whatever else answers (a data-parallel peer, a cached
    # reply): the rule needs no deadline miss.
    observations = [
        ob(t, metrics=idle(5), canary=OK, proc=group(t, {API: 1.0, CORE: 2.0}, stopped=frozenset({CORE})))
        for t in (0, 2)
    ]
    finding = detect_hang(win(observations), 2, CFG)
    assert finding is not None and finding.evidence["rule"] == "stopped"
    assert finding.evidence["stopped_pid"] == CORE


@pytest.mark.parametrize(
    ("name", "samples", "fires"),
    [
        ("stopped in one sweep only", [({CORE: 2.0}, set()), ({CORE: 2.0}, {CORE})], False),
        ("stopped twice but 0.5 s apart", [({CORE: 2.0}, {CORE}), ({CORE: 2.0}, {CORE})], False),
        # A tracer (py-spy) stops the process for each sample; it runs in between.
        ("stopped at each sweep but running between", [({CORE: 2.0}, {CORE}), ({CORE: 2.5}, {CORE})], False),
        ("the stopped process was not in the older sweep", [({}, set()), ({CORE: 2.0}, {CORE})], False),
    ],
)
def test_stopped_rule_needs_the_same_still_process_in_two_sweeps(
    name: str, samples: list[tuple[dict[int, float], set[int]]], fires: bool
) -> None:
    step_s = 0.5 if "0.5 s" in name else 2.0
    observations = [
        ob(i * step_s, metrics=idle(5), proc=group(i * step_s, {API: 1.0, **cpu}, stopped=frozenset(stopped)))
        for i, (cpu, stopped) in enumerate(samples)
    ]
    now = observations[-1].at_s
    assert (detect_hang(win(observations), now, CFG) is not None) is fires


def test_canary_missed_while_the_engine_used_no_cpu_is_a_hang_after_one_miss() -> None:
    # A deadlocked EngineCore (no SIGSTOP, state "sleeping"): the canary misses its deadline and
    # no process of the group computes anything meanwhile.
    cpu = {API: 1.0, CORE: 40.0, WORKER: 80.0}
    observations = [
        ob(0, metrics=idle(5), health=HEALTH_OK, canary=OK, proc=group(0, cpu)),
        ob(3, metrics=idle(5), health=HEALTH_OK, canary=replace(TIMEOUT, latency_s=1.0), proc=group(2, cpu)),
        ob(5, metrics=idle(5), health=HEALTH_OK, proc=group(4.5, {**cpu, API: 1.02})),
    ]
    assert opened_at(observations, replay(observations)) == [5]
    finding = detect_hang(win(observations), 5, CFG)
    assert finding is not None and finding.evidence["rule"] == "cpu_idle"
    assert num(finding, "misses") == 1 and num(finding, "cpu_span_s") == 2.5
    assert num(finding, "cpu_ratio") == pytest.approx(0.008)


def _long_prefill(cpu_per_s: float, until_s: float) -> list[Observation]:
    """One huge prompt in one step (chunked prefill off): requests running, no step or token
    counter moving, every canary queued behind it and missing; the core and worker computing at
    ``cpu_per_s`` of a core each."""
    out = [
        ob(0, metrics=busy(100, running=1), canary=OK, proc=group(0, {API: 1.0, CORE: 10.0, WORKER: 10.0}))
    ]
    for t in times(2, until_s, 2):
        cpu = {API: 1.0 + 0.01 * t, CORE: 10.0 + cpu_per_s * t, WORKER: 10.0 + cpu_per_s * t}
        out.append(
            ob(
                t,
                metrics=busy(100, running=1),
                canary=replace(TIMEOUT, latency_s=1.0),
                proc=group(t - 0.5, cpu),
            )
        )
    return out


def test_long_prefill_burning_cpu_is_not_a_hang() -> None:
    # Busy, not dead: the counters stand still and every canary misses, but the engine computes.
    observations = _long_prefill(cpu_per_s=0.9, until_s=10)
    assert opened(replay(observations)) == []
    # Past hang_after_s the deadline rule still applies (an engine that spins while hung burns
    # CPU as well): a single step longer than that needs hang_after_s raised.
    observations = _long_prefill(cpu_per_s=0.9, until_s=14)
    assert [f.evidence["rule"] for f in opened(replay(observations))] == ["deadlines"]


def test_the_same_stretch_with_no_cpu_used_is_a_hang_in_seconds() -> None:
    observations = _long_prefill(cpu_per_s=0.0, until_s=10)
    assert opened_at(observations, replay(observations)) == [4]
    assert [f.evidence["rule"] for f in opened(replay(observations))] == ["cpu_idle"]


def test_cpu_rule_needs_sweeps_around_the_miss() -> None:
    cpu = {API: 1.0, CORE: 40.0}
    miss = replace(TIMEOUT, latency_s=1.0)
    # No sweep after the miss yet: unknown.
    observations = [
        ob(0, metrics=idle(5), canary=OK, proc=group(0, cpu)),
        ob(3, metrics=idle(5), canary=miss, proc=group(0, cpu)),
    ]
    assert detect_hang(win(observations), 3, CFG) is None
    # Sweeps only 0.4 s apart around it: too short to say the engine did nothing.
    observations = [
        ob(0, metrics=idle(5), canary=OK, proc=group(0, cpu)),
        ob(3, metrics=idle(5), canary=replace(miss, latency_s=0.2), proc=group(2.8, cpu)),
        ob(3.3, metrics=idle(5), proc=group(3.2, cpu)),
    ]
    assert detect_hang(win(observations), 3.3, CFG) is None
    # Sweeps without times (an older sampler) are not read.
    observations = [
        ob(0, metrics=idle(5), canary=OK, proc=replace(group(0, cpu), at_s=None)),
        ob(3, metrics=idle(5), canary=miss, proc=replace(group(2, cpu), at_s=None)),
        ob(5, metrics=idle(5), proc=replace(group(4.5, cpu), at_s=None)),
    ]
    assert detect_hang(win(observations), 5, CFG) is None


# --- STALL ---------------------------------------------------------------------------------------

STALL_CASES: list[tuple[str, list[Observation], float, bool]] = [
    (
        "work queued, counters frozen 60 s",
        [ob(t, metrics=busy(50, running=4, waiting=2)) for t in times(0, 60, 5)],
        60,
        True,
    ),
    (
        "frozen only 55 s",
        [ob(t, metrics=busy(50, running=4, waiting=2)) for t in times(0, 55, 5)],
        55,
        False,
    ),
    ("counters advancing", [ob(t, metrics=busy(int(t), running=4)) for t in times(0, 120, 5)], 120, False),
    ("idle and frozen", [ob(t, metrics=idle(5)) for t in times(0, 120, 5)], 120, False),
    (
        "KV livelock: waiting, nothing running (docs/vllm-notes.md §9 #5)",
        [ob(t, metrics=busy(50, running=0, waiting=3, kv_usage_ratio=0.0)) for t in times(0, 70, 10)],
        70,
        True,
    ),
    (
        "a failed scrape in the middle neither breaks nor proves anything",
        [ob(t, metrics=busy(50, running=4) if t != 30 else METRICS_TIMEOUT) for t in times(0, 60, 10)],
        60,
        True,
    ),
    (
        "the last reading is stale: unknown",
        [ob(t, metrics=busy(50, running=4)) for t in times(0, 60, 10)]
        + [ob(t, metrics=METRICS_REFUSED) for t in times(70, 100, 10)],
        100,
        False,
    ),
    (
        "an idle reading in the stretch breaks it",
        [ob(t, metrics=busy(50, running=4 if t != 30 else 0)) for t in times(0, 80, 10)],
        80,
        False,
    ),
]


@pytest.mark.parametrize(
    ("name", "observations", "now", "fires"), STALL_CASES, ids=[c[0] for c in STALL_CASES]
)
def test_stall(name: str, observations: list[Observation], now: float, fires: bool) -> None:
    finding = detect_stall(win(observations), now, CFG)
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.kind is K.STALL and num(finding, "frozen_s") >= CFG.stall_after_s
        # Said once (the kind is printed before it: not "stall: stalled: ..."), in whole seconds.
        assert "in flight and no step or token progress for " in finding.summary
        assert not finding.summary.startswith("stall") and finding.summary.endswith("0 s")


# --- KV_PRESSURE and PREEMPTION_STORM ------------------------------------------------------------

KV_CASES: list[tuple[list[float | None], bool]] = [
    ([0.5, 0.88], True),  # at the threshold
    ([0.5, 0.87], False),  # below it, never crossed
    ([0.9, 0.85], True),  # in the band after crossing: still pressure (hysteresis)
    ([0.9, 0.80], True),  # 0.80 >= 0.9 * 0.88 = 0.792
    ([0.9, 0.78], False),  # below 0.792: cleared
    ([0.9, 0.78, 0.85], False),  # back into the band from below: not re-raised
    ([0.9, 0.78, 0.85, 0.89], True),
    ([0.95, None], True),  # unknown now: the last known reading stands
    ([None, None], False),
]


@pytest.mark.parametrize(("usages", "fires"), KV_CASES)
def test_kv_pressure(usages: list[float | None], fires: bool) -> None:
    observations = [ob(10.0 * i, metrics=busy(i, kv_usage_ratio=u)) for i, u in enumerate(usages)]
    now = 10.0 * (len(usages) - 1)
    finding = detect_kv_pressure(win(observations), now, CFG)
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.severity is Severity.WARNING
        assert finding.evidence["threshold_ratio"] == 0.88


def test_kv_pressure_since_is_the_crossing() -> None:
    usages = [0.3, 0.9, 0.85, 0.95]
    observations = [ob(10.0 * i, metrics=busy(i, kv_usage_ratio=u)) for i, u in enumerate(usages)]
    finding = detect_kv_pressure(win(observations), 30, CFG)
    assert finding is not None and finding.since_s == 10 and finding.evidence["kv_usage_peak_ratio"] == 0.95


PREEMPTION_CASES: list[tuple[str, list[tuple[float, int | None]], bool]] = [
    ("20 in a minute", [(t, int(t / 3)) for t in times(0, 60, 10)], True),
    ("5 in a minute", [(t, int(t / 12)) for t in times(0, 60, 10)], False),
    ("a jump over 10 s is too short for a rate", [(0, 0), (10, 50)], False),
    ("counter reset (restart)", [(0, 500), (30, 510), (60, 3)], False),
    ("unknown family (V0)", [(t, None) for t in times(0, 60, 10)], False),
]


@pytest.mark.parametrize(("name", "series", "fires"), PREEMPTION_CASES, ids=[c[0] for c in PREEMPTION_CASES])
def test_preemption_storm(name: str, series: list[tuple[float, int | None]], fires: bool) -> None:
    observations = [ob(t, metrics=busy(int(t), preemptions_total=p)) for t, p in series]
    finding = detect_preemption_storm(win(observations), series[-1][0], CFG)
    assert (finding is not None) is fires
    if finding is not None:
        assert num(finding, "preemptions_per_min") >= CFG.preemptions_per_min_threshold
        threshold = CFG.preemptions_per_min_threshold
        assert finding.summary.endswith(f" preemptions a minute (threshold {threshold:g})")
        assert "storm" not in finding.summary  # the kind says it


# --- DEGRADATION_* -------------------------------------------------------------------------------

TTFT_LES = (0.1, 0.2, 0.25, 0.3, 0.5, 1.0)


@dataclass
class Sim:
    """Cumulative vLLM counters for a scripted load, ticking every ``step_s``."""

    t: float = 0.0
    step_s: float = 10.0
    generated: int = 0
    finished: int = 0
    steps: int = 0
    queries: int = 0
    hits: int = 0
    ttft: dict[float, int] = field(default_factory=lambda: dict.fromkeys(TTFT_LES, 0))

    def tick(
        self,
        *,
        running: int = 4,
        tokens_per_s_per_running: float = 10.0,
        requests: int = 5,
        ttft_le: float = 0.2,
        hit_ratio: float = 0.5,
        canary: bool = False,
    ) -> Observation:
        self.t += self.step_s
        self.generated += round(tokens_per_s_per_running * running * self.step_s)
        self.steps += 10 if running else 0
        self.finished += requests + (1 if canary else 0)
        self.ttft[ttft_le] += requests + (1 if canary else 0)
        queries = 1000 if requests else 0
        self.queries += queries
        self.hits += round(queries * hit_ratio)
        cumulative, total = [], 0
        for le in TTFT_LES:
            total += self.ttft[le]
            cumulative.append((le, total))
        cumulative.append((float("inf"), total))
        metrics = replace(
            BUSY,
            requests_running=running,
            requests_waiting=0,
            iterations_total=self.steps,
            generation_tokens_total=self.generated,
            prompt_tokens_total=self.queries,
            prefix_cache_queries_total=self.queries,
            prefix_cache_hits_total=self.hits,
            request_success_total_by_reason=MappingProxyType({"length": self.finished}),
            ttft_seconds=Histogram(buckets=tuple(cumulative), sum=0.0, count=total),
        )
        return ob(self.t, metrics=metrics, canary=OK if canary else None)

    def run(self, seconds: float, **load: Any) -> list[Observation]:
        return [self.tick(**load) for _ in range(round(seconds / self.step_s))]


def _degradation(**current: Any) -> tuple[ObservationWindow, float]:
    sim = Sim()
    observations = sim.run(610)  # the baseline: 10 min at steady load, pinned at t=610
    observations += sim.run(600, **current)
    return win(observations), sim.t


DEGRADATION_CASES: list[tuple[str, dict[str, Any], set[FindingKind]]] = [
    ("same as the baseline", {}, set()),
    ("throughput per running request halved", {"tokens_per_s_per_running": 5.0}, {K.DEGRADATION_THROUGHPUT}),
    ("throughput at 75 %: within the factor", {"tokens_per_s_per_running": 7.5}, set()),
    (
        "3x the load and half the per-request speed: not comparable",
        {"running": 12, "tokens_per_s_per_running": 5.0},
        set(),
    ),
    ("TTFT p95 2.5x", {"ttft_le": 0.5}, {K.DEGRADATION_TTFT}),
    ("TTFT p95 1.27x: within the factor", {"ttft_le": 0.25}, set()),
    ("prefix hit rate 0.5 -> 0.2", {"hit_ratio": 0.2}, {K.DEGRADATION_PREFIX_CACHE}),
    ("prefix hit rate 0.5 -> 0.4", {"hit_ratio": 0.4}, set()),
    ("too few requests to compare TTFT", {"ttft_le": 0.5, "requests": 0}, set()),
]
DEGRADATION_DETECTORS = {
    K.DEGRADATION_THROUGHPUT: detect_throughput_degradation,
    K.DEGRADATION_TTFT: detect_ttft_degradation,
    K.DEGRADATION_PREFIX_CACHE: detect_prefix_cache_degradation,
}


@pytest.mark.parametrize(
    ("name", "current", "expected"), DEGRADATION_CASES, ids=[c[0] for c in DEGRADATION_CASES]
)
def test_degradation(name: str, current: dict[str, Any], expected: set[FindingKind]) -> None:
    window, now = _degradation(**current)
    assert window.baseline_span == (10, 610)
    fired = {kind for kind, detect in DEGRADATION_DETECTORS.items() if detect(window, now, CFG) is not None}
    assert fired == expected


def test_degradation_evidence() -> None:
    window, now = _degradation(tokens_per_s_per_running=5.0)
    finding = detect_throughput_degradation(window, now, CFG)
    assert finding is not None
    assert finding.evidence["baseline_tokens_per_s_per_running"] == pytest.approx(10.0, rel=0.05)
    assert finding.evidence["ratio"] == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize(
    ("current", "kind", "words"),
    [
        ({"tokens_per_s_per_running": 5.0}, K.DEGRADATION_THROUGHPUT, ("at similar load", "preemptions")),
        ({"ttft_le": 0.5}, K.DEGRADATION_TTFT, ("at similar load", "queueing for KV blocks")),
        ({"hit_ratio": 0.2}, K.DEGRADATION_PREFIX_CACHE, ("baseline 50%", "evicted")),
    ],
)
def test_degradation_says_what_drifted_not_fragmentation(
    current: dict[str, Any], kind: FindingKind, words: tuple[str, ...]
) -> None:
    """Issue 26: an operator who suspects "KV fragmentation" reads what really drifted, at equal
    load (docs/fragmentation.md)."""
    window, now = _degradation(**current)
    finding = DEGRADATION_DETECTORS[kind](window, now, CFG)
    assert finding is not None
    assert all(word in finding.summary for word in words), finding.summary
    assert "fragment" not in finding.summary


def test_span_stats_are_reused_only_for_the_very_same_observations() -> None:
    # Two windows of the same engine, read in turn as two incarnations would be: each answer is
    # its own window's, each window keeping its own baseline's stats.
    slow, now = _degradation(tokens_per_s_per_running=5.0)
    same, same_now = _degradation()
    assert now == same_now
    for _ in range(2):
        assert detect_throughput_degradation(slow, now, CFG) is not None
        assert detect_throughput_degradation(same, now, CFG) is None
    # A later now reads a shorter recent span: computed afresh, not served from the last one.
    assert detect_throughput_degradation(slow, now + 10, CFG) is not None


def test_baseline_waits_for_traffic_and_ignores_canaries() -> None:
    sim = Sim()
    observations = sim.run(600, running=0, requests=0, canary=True)  # idle but for canaries
    window = win(observations)
    assert window.baseline_span is None
    for o in sim.run(700):
        window.append(o)
    assert window.baseline_span is not None
    assert window.baseline_span[0] >= 600 - 0.2 * CFG.degradation_baseline_s


def test_no_baseline_no_degradation() -> None:
    sim = Sim(step_s=60.0)
    window = win(sim.run(1800, requests=1))  # 10 requests per 10 min: fewer than 20
    assert window.baseline_span is None
    assert all(d(window, sim.t, CFG) is None for d in DEGRADATION_DETECTORS.values())


# --- THERMAL and POWER_THROTTLE ------------------------------------------------------------------

GPU_CASES: list[tuple[str, dict[str, Any], Severity | None, Severity | None]] = [
    ("nominal", {}, None, None),
    ("90 C, the board's slowdown threshold", {"temperature_c": 90}, Severity.WARNING, None),
    # Issue 23: 87 C is an H100 SXM's normal boost ceiling; with no slowdown bit it is no finding.
    ("87 C, no slowdown bit", {"temperature_c": 87}, None, None),
    ("95 C on a board without thresholds", {"temperature_c": 95, "slowdown_temperature_c": None}, None, None),
    # Issue 36 (M1): SW thermal is Boost holding the max operating temperature: reported, INFO.
    ("sw_thermal", {"clock_event_reasons": 0x20}, Severity.INFO, None),
    ("sw_thermal at 87 C", {"clock_event_reasons": 0x20, "temperature_c": 87}, Severity.INFO, None),
    ("sw_thermal and hw_thermal", {"clock_event_reasons": 0x60}, Severity.WARNING, None),
    ("hw_thermal", {"clock_event_reasons": 0x40}, Severity.WARNING, None),
    ("hw_slowdown alone", {"clock_event_reasons": 0x8}, Severity.WARNING, None),
    ("hw_slowdown from the power brake", {"clock_event_reasons": 0x88}, None, Severity.WARNING),
    ("sw_power_cap alone: INFO", {"clock_event_reasons": 0x4}, None, Severity.INFO),
    ("power brake and power cap", {"clock_event_reasons": 0x84}, None, Severity.WARNING),
    ("idle, applications clocks, sync boost", {"clock_event_reasons": 0x13}, None, None),
    ("readings not supported", {"temperature_c": None, "clock_event_reasons": None}, None, None),
]


@pytest.mark.parametrize(("name", "changes", "thermal", "power"), GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_thermal_and_power(
    name: str, changes: dict[str, Any], thermal: Severity | None, power: Severity | None
) -> None:
    observations = [ob(t, gpus={0: gpu(0), 1: gpu(1, **changes)}) for t in times(0, 60, 10)]
    window = win(observations)
    t_finding = detect_thermal(window, 60, CFG)
    p_finding = detect_power_throttle(window, 60, CFG)
    assert (t_finding and t_finding.severity) == thermal
    assert (p_finding and p_finding.severity) == power
    for finding in (t_finding, p_finding):
        if finding is not None:
            assert finding.evidence["gpus"] == "1" and finding.since_s == 0


def test_thermal_from_the_duration_counters_over_the_sustain_time() -> None:
    # 8 s of every 10 s in HW thermal slowdown (field 270), with no bit set at sample time.
    def throttled(t: float) -> GpuSample:
        return gpu(temperature_c=80, clock_event_reasons=0x0, hw_thermal_ns=int(t * 0.8e9))

    observations = [ob(t, gpus={0: throttled(t)}) for t in times(0, 120, 10)]
    finding = detect_thermal(win(observations), 120, CFG)
    assert finding is not None and finding.since_s == 10  # the first interval with a delta
    assert finding.severity is Severity.WARNING and finding.evidence["rules"] == "hw_thermal"
    [first] = opened(replay(observations))
    assert first.kind is K.THERMAL


def test_sw_thermal_time_alone_is_reported_never_a_step_cause() -> None:
    # Issue 36 (M1): 8 s of every 10 s in SW thermal slowdown (field 269) at 87 C, the bit set:
    # Boost holding the max operating temperature. INFO, however long.
    def warm(t: float) -> GpuSample:
        return gpu(temperature_c=87, clock_event_reasons=0x20 | 0x4, sw_thermal_ns=int(t * 0.8e9))

    observations = [ob(t, gpus={0: warm(t)}) for t in times(0, 600, 10)]
    finding = detect_thermal(win(observations), 600, CFG)
    assert finding is not None and finding.severity is Severity.INFO
    assert "normal under sustained load, no action" in finding.summary
    assert {f.severity for f in opened(replay(observations)) if f.kind is K.THERMAL} == {Severity.INFO}


def test_one_instantaneous_thermal_bit_with_flat_counters_is_not_thermal() -> None:
    # The mask caught hw_thermal at one instant; the duration counters did not move: not throttled.
    observations = [ob(t, gpus={0: gpu(hw_thermal_ns=5_000)}) for t in times(0, 50, 10)]
    observations.append(ob(60, gpus={0: gpu(clock_event_reasons=0x40, hw_thermal_ns=5_000)}))
    assert detect_thermal(win(observations), 60, CFG) is None


@pytest.mark.parametrize(
    ("name", "counter"),
    [
        ("a counter that falls", lambda t: int(1e12 - t * 1e9)),
        ("a counter that rises faster than time", lambda t: int(t * 5e9)),
    ],
)
def test_a_counter_that_is_no_duration_gives_way_to_the_bit(name: str, counter: Any) -> None:
    """Issue 36 (L2): ids 269-271 are power-smoothing fields on R575 drivers. Values that cannot
    be a duration (falling, or rising faster than the wall clock) are not read as one: the
    clock-event bit decides, here hw_thermal held."""
    observations = [
        ob(t, gpus={0: gpu(clock_event_reasons=0x40, hw_thermal_ns=counter(t))}) for t in times(0, 60, 10)
    ]
    finding = detect_thermal(win(observations), 60, CFG)
    assert finding is not None and finding.severity is Severity.WARNING and finding.since_s == 0
    quiet = [ob(t, gpus={0: gpu(hw_thermal_ns=counter(t))}) for t in times(0, 60, 10)]
    assert detect_thermal(win(quiet), 60, CFG) is None


def test_the_power_brake_is_judged_by_its_duration_where_the_driver_counts_it() -> None:
    """Issue 36 (L5): field 271 is the brake's time. Braked 9 s of every 10 s with no bit at
    sample time: a run; the bit at one instant with a flat counter: none."""
    braked = [ob(t, gpus={0: gpu(power_brake_ns=int(t * 0.9e9))}) for t in times(0, 120, 10)]
    finding = detect_power_throttle(win(braked), 120, CFG)
    assert finding is not None and finding.severity is Severity.WARNING and finding.since_s == 10
    assert [f.severity for f in opened(replay(braked)) if f.kind is K.POWER_THROTTLE] == [Severity.WARNING]
    flicker = [ob(t, gpus={0: gpu(power_brake_ns=7)}) for t in times(0, 50, 10)]
    flicker.append(ob(60, gpus={0: gpu(clock_event_reasons=0x80, power_brake_ns=7)}))
    assert detect_power_throttle(win(flicker), 60, CFG) is None
    # The bit alone (a driver without the counter) still needs the sustain time to open.
    once = [ob(t, gpus={0: gpu(clock_event_reasons=0x80 if t == 60 else 0x1)}) for t in times(0, 300, 10)]
    assert [f for f in opened(replay(once)) if f.kind is K.POWER_THROTTLE] == []


def test_a_thermal_temperature_is_used_only_where_the_board_reports_no_threshold() -> None:
    cfg = DetectorConfig(thermal_temperature_c=85)
    no_threshold = [
        ob(t, gpus={0: gpu(temperature_c=86, slowdown_temperature_c=None)}) for t in times(0, 60, 10)
    ]
    assert detect_thermal(win(no_threshold), 60, cfg) is not None
    with_threshold = [ob(t, gpus={0: gpu(temperature_c=86)}) for t in times(0, 60, 10)]
    assert detect_thermal(win(with_threshold), 60, cfg) is None  # the board says 90


def test_thermal_needs_sustain_a_single_hot_sample_does_not_open() -> None:
    hot = {90.0}
    observations = [ob(t, gpus={0: gpu(temperature_c=92 if t in hot else 60)}) for t in times(0, 300, 10)]
    updates = replay(observations)
    assert detect_thermal(win(observations[:10]), 90, CFG) is not None  # raw: yes
    assert opened(updates) == []  # tracked: never opened


def test_thermal_sustained_opens_once_and_clears_once() -> None:
    observations = [
        ob(t, gpus={0: gpu(temperature_c=92 if 100 <= t < 300 else 60)}) for t in times(0, 600, 10)
    ]
    updates = replay(observations)
    [first] = opened(updates)
    assert first.kind is K.THERMAL and first.since_s == 100
    assert opened_at(observations, updates) == [160]
    closes = [(o.at_s, f) for o, u in zip(observations, updates, strict=True) for f in u.closed]
    assert [t for t, _ in closes] == [300 + DEFAULT_CLEAR_S[K.THERMAL]]


def test_a_failed_nvml_read_neither_raises_nor_clears_thermal() -> None:
    failed = ProbeFailure("timeout", "no answer from NVML within 5 s")
    observations = [ob(0, gpus={0: gpu(temperature_c=92)}), ob(10, gpus={0: failed})]
    assert detect_thermal(win(observations), 10, CFG) is not None  # the last known reading stands
    assert detect_thermal(win(observations), 10 + CFG.stale_after_s, CFG) is None  # then unknown
    assert detect_thermal(win([ob(0, gpus={0: failed})]), 0, CFG) is None


# --- GPU_FAULT, GPU_LOST, NVML_LOST --------------------------------------------------------------


def xid(n: int, index: int = 0, at_s: float = 0.0) -> GpuEvent:
    return GpuEvent(index=index, uuid=f"GPU-fake-{index:04d}", kind="xid", xid=n, at_s=at_s)


def event(kind: str, index: int = 0, at_s: float = 0.0) -> GpuEvent:
    return GpuEvent(index=index, uuid=f"GPU-fake-{index:04d}", kind=kind, xid=None, at_s=at_s)


FAULT_CASES: list[tuple[str, list[Observation], Severity | None, bool]] = [
    ("XID 48 (double-bit ECC)", [ob(0, gpus={0: gpu()}, gpu_events=(xid(48),))], Severity.CRITICAL, False),
    ("XID 13 is the engine's, not a GPU fault", [ob(0, gpu_events=(xid(13),))], Severity.INFO, False),
    ("XID 31, 43, 45, 68", [ob(0, gpu_events=tuple(xid(n) for n in (31, 43, 45, 68)))], Severity.INFO, False),
    ("XID 63 is recorded only", [ob(0, gpu_events=(xid(63),))], Severity.INFO, False),
    ("XID 13 with XID 94", [ob(0, gpu_events=(xid(13), xid(94)))], Severity.CRITICAL, False),
    ("unknown XID 999", [ob(0, gpu_events=(xid(999),))], Severity.CRITICAL, False),
    ("double-bit ECC event", [ob(0, gpu_events=(event("double_bit_ecc"),))], Severity.CRITICAL, False),
    ("XID 79: fell off the bus", [ob(0, gpu_events=(xid(79),))], None, True),
    ("GPU unavailable event", [ob(0, gpu_events=(event("gpu_unavailable"),))], None, True),
    (
        "uncorrected ECC count rising",
        [ob(0, gpus={0: gpu(ecc_uncorrected_volatile=3)}), ob(10, gpus={0: gpu(ecc_uncorrected_volatile=5)})],
        Severity.CRITICAL,
        False,
    ),
    (
        "uncorrected ECC count steady",
        [ob(t, gpus={0: gpu(ecc_uncorrected_volatile=3)}) for t in times(0, 60, 10)],
        None,
        False,
    ),
    (
        "no ECC on this board",
        [ob(t, gpus={0: gpu(ecc_uncorrected_volatile=None)}) for t in times(0, 60, 10)],
        None,
        False,
    ),
    (
        "an XID older than the lookback",
        [ob(0, gpu_events=(xid(48),)), ob(400, gpus={0: gpu()})],
        None,
        False,
    ),
    ("one gpu_lost probe failure", [ob(0, gpus={0: ProbeFailure("gpu_lost", "GPU is lost")})], None, False),
    (
        "gpu_lost twice in a row",
        [ob(t, gpus={0: ProbeFailure("gpu_lost", "GPU is lost")}) for t in (0, 2)],
        None,
        True,
    ),
    (
        "gpu_lost, then the GPU answers",
        [
            ob(0, gpus={0: ProbeFailure("gpu_lost", "GPU is lost")}),
            ob(2, gpus={0: gpu()}),
            ob(4, gpus={0: ProbeFailure("gpu_lost", "GPU is lost")}),
        ],
        None,
        False,
    ),
]


@pytest.mark.parametrize(
    ("name", "observations", "fault", "lost"), FAULT_CASES, ids=[c[0] for c in FAULT_CASES]
)
def test_gpu_fault_and_lost(
    name: str, observations: list[Observation], fault: Severity | None, lost: bool
) -> None:
    window, now = win(observations), observations[-1].at_s
    f = detect_gpu_fault(window, now, CFG)
    assert (f and f.severity) == fault
    assert (detect_gpu_lost(window, now, CFG) is not None) is lost


def act(n: int, action: int | None, index: int = 0) -> GpuEvent:
    """XID ``n`` with the recovery action read just after it (None: field 230 unreadable)."""
    return replace(xid(n, index), recovery_action=action)


VERDICT_CASES: list[tuple[str, list[Observation], Severity | None, str | None]] = [
    ("XID 13: the app's", [ob(0, gpus={0: gpu()}, gpu_events=(act(13, 0),))], Severity.INFO, None),
    ("XID 31: the app's", [ob(0, gpus={0: gpu()}, gpu_events=(act(31, 0),))], Severity.INFO, None),
    ("XID 43: the app's", [ob(0, gpus={0: gpu()}, gpu_events=(act(43, 0),))], Severity.INFO, None),
    (
        "XID 109 with action NONE: the app's",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(109, 0),))],
        Severity.INFO,
        None,
    ),
    # Issue 36 (M4): without field 230, the catalogue's RESET_GPU is not waved through as the
    # device plugin's application XID: a look.
    (
        "XID 109, no field 230",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(109, None),))],
        Severity.CRITICAL,
        "0=unknown",
    ),
    ("XID 92: info", [ob(0, gpus={0: gpu()}, gpu_events=(act(92, None),))], Severity.INFO, None),
    (
        "XID 94, action NONE",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(94, 0),))],
        Severity.CRITICAL,
        "0=restart",
    ),
    (
        "XID 94, no field 230",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(94, None),))],
        Severity.CRITICAL,
        "0=restart",
    ),
    (
        "XID 8, no field 230",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(8, None),))],
        Severity.CRITICAL,
        "0=restart",
    ),
    ("XID 48, GPU_RESET", [ob(0, gpus={0: gpu()}, gpu_events=(act(48, 1),))], Severity.CRITICAL, "0=reset"),
    (
        "XID 48, no field 230",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(48, None),))],
        Severity.CRITICAL,
        "0=reset",
    ),
    (
        "XID 95, no field 230",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(95, None),))],
        Severity.CRITICAL,
        "0=reset",
    ),
    (
        "XID 119, no field 230",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(119, None),))],
        Severity.CRITICAL,
        "0=reset",
    ),
    (
        "XID 48, action NONE",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(48, 0),))],
        Severity.CRITICAL,
        "0=restart",
    ),
    (
        "XID 61, no field 230",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(61, None),))],
        Severity.CRITICAL,
        "0=unknown",
    ),
    (
        "XID 61, then a sample reads NONE",
        [ob(0, gpus={0: gpu()}, gpu_events=(act(61, None),)), ob(2, gpus={0: gpu(recovery_action=0)})],
        Severity.CRITICAL,
        "0=restart",
    ),
    (
        "double-bit ECC event",
        [ob(0, gpus={0: gpu()}, gpu_events=(event("double_bit_ecc"),))],
        Severity.CRITICAL,
        "0=reset",
    ),
    ("a standing recovery action", [ob(0, gpus={0: gpu(recovery_action=2)})], Severity.CRITICAL, "0=reset"),
    ("a failed row remap", [ob(0, gpus={0: gpu(remap_failed=True)})], Severity.CRITICAL, "0=field_diag"),
    ("a pending row remap", [ob(0, gpus={0: gpu(remap_pending=True)})], Severity.INFO, None),
    ("recovery action NONE", [ob(0, gpus={0: gpu(recovery_action=0)})], None, None),
]


@pytest.mark.parametrize(
    ("name", "observations", "severity", "verdicts"), VERDICT_CASES, ids=[c[0] for c in VERDICT_CASES]
)
def test_gpu_fault_verdicts(
    name: str, observations: list[Observation], severity: Severity | None, verdicts: str | None
) -> None:
    finding = detect_gpu_fault(win(observations), observations[-1].at_s, CFG)
    assert (finding and finding.severity) == severity
    assert (finding and finding.evidence.get("verdicts")) == verdicts


def test_no_foreign_finding_in_a_container_with_its_own_pid_namespace() -> None:
    # NVML's host PID 4242 is the engine's EngineCore; the daemon sees it as, say, PID 17.
    procs = (GpuProcess(4242, 70 * GIB),)
    observations = [
        ob(t, gpus={0: gpu(processes=procs, pids_visible=False)}, engine_pids=frozenset({1, 17}))
        for t in times(0, 60, 10)
    ]
    assert detect_foreign_gpu_memory(win(observations), 60, CFG) is None
    visible = [
        ob(t, gpus={0: gpu(processes=procs)}, engine_pids=frozenset({1, 17})) for t in times(0, 60, 10)
    ]
    assert detect_foreign_gpu_memory(win(visible), 60, CFG) is not None


def test_gpu_fault_evidence_and_event_opens_at_once() -> None:
    observations = [ob(t, gpus={0: gpu()}) for t in times(0, 20, 10)]
    observations.append(ob(30, gpus={0: gpu()}, gpu_events=(xid(13), xid(48))))
    updates = replay(observations)
    [finding] = opened(updates)  # on the tick the event arrived: an event is not a noisy sample
    assert finding.severity is Severity.CRITICAL and finding.since_s == 30
    assert finding.evidence["xids"] == "13,48" and finding.evidence["count"] == 2
    # The GPUs of the critical faults only (13 is the engine's): a node condition goes on those.
    assert finding.evidence["gpus"] == "0"
    assert updates[-1].opened == [finding]


NVML_CASES: list[tuple[str, dict[int, GpuSample | ProbeFailure], bool]] = [
    ("every GPU failing", {0: ProbeFailure("nvml", "NVMLError_Unknown"), 1: ProbeFailure("nvml", "x")}, True),
    (
        "one GPU's calls stuck",
        {0: gpu(0), 1: ProbeFailure("timeout", "no answer from NVML within 5 s")},
        True,
    ),
    ("no NVML on this host (empty)", {}, False),
    ("all answering", {0: gpu(0), 1: gpu(1)}, False),
    ("a lost GPU is GPU_LOST's", {0: ProbeFailure("gpu_lost", "lost")}, False),
]


@pytest.mark.parametrize(("name", "gpus", "fires"), NVML_CASES, ids=[c[0] for c in NVML_CASES])
def test_nvml_lost(name: str, gpus: dict[int, GpuSample | ProbeFailure], fires: bool) -> None:
    observations = [ob(0, gpus={0: gpu(0), 1: gpu(1)}), ob(10, gpus=gpus)]
    finding = detect_nvml_lost(win(observations), 10, CFG)
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.since_s == 10


# --- MEMORY_GROWTH -------------------------------------------------------------------------------


def proc(rss_bytes: int, pgid: int = 4100) -> ProcSample:
    info = ProcInfo(
        pid=pgid,
        title="VLLM::EngineCore",
        rss_bytes=rss_bytes,
        cpu_seconds=1.0,
        status="sleeping",
        zombie=False,
    )
    return ProcSample(
        pgid=pgid,
        processes=(info,),
        rss_bytes_total=rss_bytes,
        cpu_seconds_total=1.0,
        process_count=1,
        zombie_count=0,
    )


def _rss(
    fn: Callable[[float], float], *, start: float = 0, until: float = 1800, step: float = 60, pgid: int = 4100
) -> list[Observation]:
    return [ob(t, proc=proc(round(fn(t)), pgid)) for t in times(start, until, step)]


_NOISE = random.Random(3)
NOISE = [_NOISE.uniform(-400, 400) * MIB for _ in range(64)]
MEMORY_CASES: list[tuple[str, list[Observation], bool]] = [
    ("1 GiB/h steady", _rss(lambda t: 3 * GIB + t / 3600 * GIB), True),
    ("1 GiB/h with noise", _rss(lambda t: 3 * GIB + t / 3600 * GIB + NOISE[int(t // 60)] / 4), True),
    ("100 MiB/h: under the threshold", _rss(lambda t: 3 * GIB + t / 3600 * 100 * MIB), False),
    ("noise without slope", _rss(lambda t: 3 * GIB + NOISE[int(t // 60)]), False),
    ("one spike at the end", _rss(lambda t: 3 * GIB + (5 * GIB if t == 1800 else 0)), False),
    ("too short a span", _rss(lambda t: 3 * GIB + t * MIB, until=600), False),
    ("too few samples", _rss(lambda t: 3 * GIB + t / 3600 * GIB, step=300), False),
    (
        # Across both, a 3 GiB step up would fit a steep line; the new one alone spans too little.
        "a restart in the window: only the new incarnation counts",
        _rss(lambda t: 1 * GIB, until=900) + _rss(lambda t: 4 * GIB, start=960, pgid=5000),
        False,
    ),
]


@pytest.mark.parametrize(("name", "observations", "fires"), MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_memory_growth(name: str, observations: list[Observation], fires: bool) -> None:
    finding = detect_memory_growth(win(observations), observations[-1].at_s, CFG)
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.evidence["slope_mib_per_h"] == pytest.approx(1024, rel=0.1)


def test_memory_growth_ignores_failed_sweeps() -> None:
    observations = _rss(lambda t: 3 * GIB + t / 3600 * GIB)
    observations = [
        o if i % 3 != 1 else replace(o, proc=ProbeFailure("timeout", "sweep"))
        for i, o in enumerate(observations)
    ]
    assert detect_memory_growth(win(observations), 1800, CFG) is not None


# --- FOREIGN_GPU_MEMORY --------------------------------------------------------------------------

FOREIGN_CASES: list[tuple[str, tuple[GpuProcess, ...] | None, frozenset[int], bool]] = [
    (
        "the engine's own processes",
        (GpuProcess(4101, 70 * GIB), GpuProcess(4102, 512 * MIB)),
        ENGINE_PIDS,
        False,
    ),
    ("an orphan holding 2 GiB", (GpuProcess(4101, 70 * GIB), GpuProcess(999, 2 * GIB)), ENGINE_PIDS, True),
    ("a foreign process under the threshold", (GpuProcess(999, 100 * MIB),), ENGINE_PIDS, False),
    ("memory per process unknown", (GpuProcess(999, None),), ENGINE_PIDS, False),
    ("process list unknown", None, ENGINE_PIDS, False),
    ("engine PIDs unknown", (GpuProcess(999, 2 * GIB),), frozenset(), False),
]


@pytest.mark.parametrize(("name", "procs", "pids", "fires"), FOREIGN_CASES, ids=[c[0] for c in FOREIGN_CASES])
def test_foreign_gpu_memory(
    name: str, procs: tuple[GpuProcess, ...] | None, pids: frozenset[int], fires: bool
) -> None:
    observations = [ob(t, gpus={0: gpu(processes=procs)}, engine_pids=pids) for t in times(0, 60, 10)]
    finding = detect_foreign_gpu_memory(win(observations), 60, CFG)
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.evidence["pids"] == "999" and finding.evidence["used_mib"] == 2048


# --- a single noisy sample never opens a finding -------------------------------------------------

Bad = Callable[[float], bool]  # is the fault present at this tick?
Scenario = Callable[[float, Bad], Observation]
TICKS = times(0, 400, 5)


def _kv(t: float, bad: Bad) -> Observation:
    return ob(t, metrics=busy(int(t), running=2, kv_usage_ratio=0.95 if bad(t) else 0.3))


def _hot(t: float, bad: Bad) -> Observation:
    return ob(t, gpus={0: gpu(temperature_c=95 if bad(t) else 60)})


def _brake(t: float, bad: Bad) -> Observation:
    return ob(t, gpus={0: gpu(clock_event_reasons=0x88 if bad(t) else 0x1)})


def _cap(t: float, bad: Bad) -> Observation:
    return ob(t, gpus={0: gpu(clock_event_reasons=0x4 if bad(t) else 0x1)})


def _foreign(t: float, bad: Bad) -> Observation:
    procs = (GpuProcess(4101, 70 * GIB),) + ((GpuProcess(999, 2 * GIB),) if bad(t) else ())
    return ob(t, gpus={0: gpu(processes=procs)}, engine_pids=ENGINE_PIDS)


def _nvml(t: float, bad: Bad) -> Observation:
    return ob(t, gpus={0: ProbeFailure("nvml", "NVMLError_Unknown") if bad(t) else gpu()})


def _lost(t: float, bad: Bad) -> Observation:
    return ob(t, gpus={0: ProbeFailure("gpu_lost", "lost") if bad(t) else gpu()})


def _canary(t: float, bad: Bad) -> Observation:
    return ob(t, metrics=idle(3), health=HEALTH_OK, canary=TIMEOUT if bad(t) else OK)


def _metrics_timeout(t: float, bad: Bad) -> Observation:
    if bad(t):
        return ob(t, metrics=METRICS_TIMEOUT, health=TIMEOUT)
    return ob(t, metrics=idle(int(t)), health=HEALTH_OK)


def _preempt(t: float, bad: Bad) -> Observation:
    # A fault tick is a burst of 100 preemptions; the counter keeps them afterwards.
    total = 100 * sum(1 for s in TICKS if s <= t and bad(s))
    return ob(t, metrics=busy(int(t), preemptions_total=total))


NOISY: list[tuple[str, Scenario, FindingKind]] = [
    ("kv", _kv, K.KV_PRESSURE),
    ("thermal", _hot, K.THERMAL),
    ("power brake", _brake, K.POWER_THROTTLE),
    ("power cap", _cap, K.POWER_THROTTLE),
    ("foreign", _foreign, K.FOREIGN_GPU_MEMORY),
    ("nvml", _nvml, K.NVML_LOST),
    ("gpu lost", _lost, K.GPU_LOST),
    ("canary", _canary, K.HANG),
    ("metrics timeout", _metrics_timeout, K.HANG),
    ("preemption burst", _preempt, K.PREEMPTION_STORM),
]


@pytest.mark.parametrize(("name", "scenario", "kind"), NOISY, ids=[c[0] for c in NOISY])
def test_a_single_noisy_sample_never_opens(name: str, scenario: Scenario, kind: FindingKind) -> None:
    single = [scenario(t, lambda s: s == 100) for t in TICKS]
    assert opened(replay(single)) == []
    # The same fault held opens the finding: the scenario has teeth.
    held = [scenario(t, lambda s: s >= 100) for t in TICKS]
    kinds = {f.kind for f in opened(replay(held))}
    assert kind in kinds


def test_a_single_frozen_reading_is_not_a_stall() -> None:
    steps = [int(t) if t != 100 else 95 for t in times(0, 400, 5)]  # 100 repeats 95's value
    observations = [ob(t, metrics=busy(s, running=4)) for t, s in zip(times(0, 400, 5), steps, strict=True)]
    assert opened(replay(observations)) == []


def test_every_sampled_kind_has_a_sustain_or_needs_several_readings() -> None:
    # Kinds with sustain 0 must be ones whose detector already needs several readings (hang,
    # stall, GPU lost from probes) or reads discrete events (GPU fault).
    instant = {kind for kind, s in DEFAULT_SUSTAIN_S.items() if s == 0}
    assert instant == {K.HANG, K.STALL, K.GPU_FAULT, K.GPU_LOST}
    assert set(DEFAULT_SUSTAIN_S) == set(DEFAULT_CLEAR_S) == set(FindingKind) == set(DETECTORS)


# --- FindingTracker ------------------------------------------------------------------------------


def finding(
    kind: FindingKind = K.KV_PRESSURE,
    severity: Severity = Severity.WARNING,
    since_s: float = 0.0,
    **ev: float | str,
) -> Finding:
    return Finding(
        engine=ENGINE, kind=kind, severity=severity, evidence=ev, since_s=since_s, summary=str(kind)
    )


def drive(
    tracker: FindingTracker, script: Iterable[tuple[float, list[Finding]]]
) -> dict[float, TrackerUpdate]:
    return {now: tracker.update(raw, now) for now, raw in script}


def test_tracker_sustain_opens_once_after_the_hold() -> None:
    cfg = DetectorConfig(sustain_s={K.KV_PRESSURE: 60.0}, clear_s={K.KV_PRESSURE: 120.0})
    updates = drive(FindingTracker(cfg), ((t, [finding(since_s=t, u=t)]) for t in times(0, 100, 10)))
    assert [t for t, u in updates.items() if u.opened] == [60]
    assert all(not u.active for t, u in updates.items() if t < 60)
    [first] = updates[60].opened
    assert first.since_s == 0  # when the run began, not when it opened
    assert updates[100].active[0].evidence["u"] == 100  # the active one carries this tick's evidence
    assert updates[100].active[0].since_s == 0


def test_tracker_a_gap_before_the_hold_starts_over() -> None:
    cfg = DetectorConfig(sustain_s={K.KV_PRESSURE: 60.0})
    script = [(t, [finding()] if t != 50 else []) for t in times(0, 120, 10)]
    updates = drive(FindingTracker(cfg), script)
    assert [t for t, u in updates.items() if u.opened] == [120]  # 60 + 60 after the gap at 50


def test_tracker_hysteresis_a_blip_does_not_close_and_clear_closes_once() -> None:
    cfg = DetectorConfig(sustain_s={K.KV_PRESSURE: 0.0}, clear_s={K.KV_PRESSURE: 120.0})
    present = {0, 10, 20, 150}  # open at 0; absent 30..140 (110 s < 120); back at 150; then gone
    script = [(t, [finding()] if t in present else []) for t in times(0, 400, 10)]
    updates = drive(FindingTracker(cfg), script)
    assert [t for t, u in updates.items() if u.opened] == [0]
    assert [t for t, u in updates.items() if u.closed] == [160 + 120]
    assert all(u.active for t, u in updates.items() if t < 280)
    assert not updates[280].active


def test_tracker_zero_sustain_and_zero_clear() -> None:
    cfg = DetectorConfig(sustain_s={K.GPU_FAULT: 0.0}, clear_s={K.GPU_FAULT: 0.0})
    tracker = FindingTracker(cfg)
    f = finding(K.GPU_FAULT, Severity.CRITICAL, since_s=5)
    assert tracker.update([f], 5).opened == [f]
    assert tracker.update([f], 6).opened == []
    assert tracker.update([], 7).closed == [f]
    assert tracker.active == []


def test_tracker_keys_by_severity_an_escalation_opens_the_higher_one() -> None:
    cfg = DetectorConfig(sustain_s={K.POWER_THROTTLE: 0.0}, clear_s={K.POWER_THROTTLE: 30.0})
    tracker = FindingTracker(cfg)
    info = finding(K.POWER_THROTTLE, Severity.INFO)
    warning = finding(K.POWER_THROTTLE, Severity.WARNING)
    assert tracker.update([info], 0).opened == [info]
    u = tracker.update([warning], 10)
    assert u.opened == [warning] and u.closed == []
    u = tracker.update([warning], 40)
    assert u.closed == [info] and u.active == [warning]


def test_tracker_keeps_engines_apart() -> None:
    tracker = FindingTracker(DetectorConfig(sustain_s={K.STALL: 0.0}, clear_s={K.STALL: 0.0}))
    a = finding(K.STALL)
    b = replace(a, engine="gpu1")
    assert tracker.update([a, b], 0).opened == [a, b]
    u = tracker.update([b], 1)
    assert u.closed == [a] and u.active == [b]


def test_config_merges_partial_timings_and_validates() -> None:
    cfg = DetectorConfig(sustain_s={K.HANG: 5.0})
    assert cfg.sustain_s[K.HANG] == 5.0 and cfg.sustain_s[K.THERMAL] == DEFAULT_SUSTAIN_S[K.THERMAL]
    assert cfg.kv_usage_clear_below_ratio == pytest.approx(0.792)
    with pytest.raises(ValueError):
        DetectorConfig(sustain_s={K.HANG: -1.0})
    with pytest.raises(ValueError):
        DetectorConfig(kv_usage_threshold_ratio=1.5)


def test_detect_all_runs_every_detector_and_reads_no_future() -> None:
    observations = [
        ob(
            t,
            metrics=busy(50, running=4, kv_usage_ratio=0.95),
            gpus={0: gpu(temperature_c=95, processes=(GpuProcess(999, 2 * GIB),))},
            engine_pids=ENGINE_PIDS,
        )
        for t in times(0, 60, 10)
    ]
    window = win(observations)
    kinds = [f.kind for f in detect_all(window, 60, CFG)]
    assert kinds == [K.STALL, K.KV_PRESSURE, K.THERMAL, K.FOREIGN_GPU_MEMORY]
    # An observation stamped after `now` is not read.
    assert [f.kind for f in detect_all(window, 50, CFG)] == [K.KV_PRESSURE, K.THERMAL, K.FOREIGN_GPU_MEMORY]
    assert detect_all(win([]), 0, CFG) == []


def test_evidence_is_read_only() -> None:
    f = finding(u=1.0)
    with pytest.raises(TypeError):
        f.evidence["u"] = 2.0  # type: ignore[index]


# --- A full window, thinned (issue 16): the same findings at a fraction of the memory -----------


def _long_run(minutes: int, *, step_s: float = 2.0) -> list[Observation]:
    """``minutes`` of a busy engine at the loop's rate: traffic that pins a baseline, a throughput
    drop after half of it, RSS growing 2 GiB/h, a GPU; every probe filled in."""
    sim = Sim(step_s=step_s)
    out = []
    rss = 8 * GIB
    for i in range(int(minutes * 60 / step_s)):
        slow = i * step_s > minutes * 30
        o = sim.tick(tokens_per_s_per_running=5.0 if slow else 10.0, requests=1, canary=i % 7 == 0)
        rss += round(2 * GIB * step_s / 3600)
        sample = replace(group(o.at_s, {API: 1.0 + i, CORE: 2.0 + i, WORKER: 3.0 + i}), rss_bytes_total=rss)
        out.append(replace(o, health=HEALTH_OK, proc=sample, gpus={0: gpu()}))
    return out


def test_thinned_window_finds_what_the_whole_window_finds() -> None:
    whole = ObservationWindow(
        max_count=4096,
        max_age_s=CFG.lookback_s + 2 * CFG.stale_after_s,
        baseline_s=CFG.degradation_baseline_s,
        baseline_accept=lambda obs: baseline_has_traffic(obs, CFG),
    )
    thinned = new_window(CFG)
    found_whole, found_thinned = [], []
    for i, o in enumerate(_long_run(50)):
        whole.append(o)
        thinned.append(o)
        if i % 15 == 0:
            found_whole.append([(f.kind, f.severity, f.since_s) for f in detect_all(whole, o.at_s, CFG)])
            found_thinned.append([(f.kind, f.severity, f.since_s) for f in detect_all(thinned, o.at_s, CFG)])
    assert found_thinned == found_whole
    kinds = {kind for tick in found_whole for kind, _, _ in tick}
    assert {K.MEMORY_GROWTH, K.DEGRADATION_THROUGHPUT} <= kinds  # the long-lookback detectors ran
    # Older observations are kept as their time and process totals only.
    old = next(iter(thinned))
    assert old.metrics is None and old.gpus == {} and isinstance(old.proc, ProcSample)
    assert old.proc.processes == () and old.proc.rss_bytes_total > 8 * GIB
    assert [o.at_s for o in thinned] == [o.at_s for o in whole]
    assert thinned.baseline is None and thinned.baseline_span == (whole.baseline_span or ())


def test_window_thins_only_past_its_horizon_and_keeps_its_bounds() -> None:
    w = ObservationWindow(max_count=50, max_age_s=100.0, thin_after_s=20.0)
    for t in times(0, 200, 2):
        w.append(ob(t, metrics=idle(int(t)), proc=proc(GIB)))
    assert len(w) == 50 and [o.at_s for o in w] == times(102, 200, 2)
    whole = [o for o in w if o.metrics is not None]
    assert [o.at_s for o in whole] == times(180, 200, 2)  # at or after newest - thin_after_s
    assert all(o.proc is not None and o.metrics is None for o in w if o.at_s < 180)
    assert [o.at_s for o in w.since(170)] == times(170, 200, 2)
    assert [o.at_s for o in reversed(w)] == times(102, 200, 2)[::-1]
    latest = w.latest()
    assert latest is not None and latest.at_s == 200


def test_pinned_baseline_is_kept_as_its_statistics() -> None:
    w = new_window(CFG)
    sim = Sim(step_s=2.0)
    for _ in range(400):  # 800 s of traffic: the first 600 s are pinned
        w.append(sim.tick())
    assert w.baseline is None  # the observations are not kept
    assert w.baseline_span is not None and w.baseline_span[1] - w.baseline_span[0] >= 600
    stats = w.baseline_stats(span_stats)
    assert stats is not None and stats.requests is not None and stats.requests >= 20


# --- Every value the validator accepts runs (issue 28 #3) ----------------------------------------


def _edge_values(name: str) -> list[Any]:
    """The extremes check-config accepts for a DetectorConfig field (of each item for the lists
    and the per-kind seconds): its lowest, just above an open lowest, and its highest."""
    b = DetectorConfig.bounds(name)
    lo, hi = b["lo"], b["hi"] if b["hi"] is not None else 1e12
    if b["integer"]:
        return [lo + 1 if b["lo_open"] else lo, int(hi) - 1 if b["hi_open"] else int(hi)]
    low = [math.nextafter(lo, math.inf), lo + 1e-9] if b["lo_open"] else [lo, math.nextafter(lo, math.inf)]
    return [*low, math.nextafter(hi, -math.inf) if b["hi_open"] else hi]


def _edge_config(name: str, value: Any) -> DetectorConfig:
    changes: dict[str, Any] = {name: value}
    if name in ("sustain_s", "clear_s"):
        changes[name] = dict.fromkeys(FindingKind, value)
    if name.startswith("xid_"):
        changes[name] = frozenset({value})
    if name == "hang_cpu_min_span_s":  # hang_cpu_max_span_s must be at least it
        changes["hang_cpu_max_span_s"] = max(value, CFG.hang_cpu_max_span_s)
    if name == "hang_cpu_max_span_s":
        changes["hang_cpu_min_span_s"] = min(value, CFG.hang_cpu_min_span_s)
    return DetectorConfig(**changes)


def _everything_happens() -> list[Observation]:
    """Five minutes of an engine that serves, preempts, fills its KV cache, heats up, grows,
    gets an XID, hangs with a stopped worker, and has readings a nanosecond apart."""
    out: list[Observation] = []
    for i, t in enumerate([*times(0, 300, 1.0), 300.000000001, 300.000000002]):
        serving = t < 200
        metrics = busy(i if serving else 200, kv_usage_ratio=min(1.0, t / 150), preemptions_total=i * 3)
        cpu = {API: 1.0 + t, CORE: 5.0 + (t if serving else 200), WORKER: 5.0}
        proc = group(t, cpu, stopped=frozenset() if serving else frozenset({WORKER}))
        proc = replace(proc, rss_bytes_total=GIB + int(t) * 10 * MIB)
        canary = OK if serving else replace(TIMEOUT, latency_s=1.0)
        events = (xid(79, at_s=t),) if i == 250 else (xid(13, at_s=t),) if i == 100 else ()
        out.append(
            ob(
                t,
                metrics=metrics if i % 7 else METRICS_TIMEOUT,
                health=HEALTH_OK if serving else TIMEOUT,
                canary=canary,
                proc=proc,
                gpus={0: gpu(temperature_c=40 + i // 3)},
                gpu_events=events,
                engine_pids=ENGINE_PIDS,
            )
        )
    return out


EDGE_CASES = [(f.name, v) for f in dataclasses.fields(DetectorConfig) for v in _edge_values(f.name)]


@pytest.mark.parametrize(("name", "value"), EDGE_CASES, ids=[f"{n}={v!r:.12}" for n, v in EDGE_CASES])
def test_every_accepted_extreme_runs(name: str, value: Any) -> None:
    """Each extreme check-config accepts builds a DetectorConfig, a window and a tracker, and the
    detectors run over a busy, failing engine without raising (degradation_baseline_s: 0 crashed
    every engine task with "baseline_s must be positive")."""
    cfg = _edge_config(name, value)
    replay(_everything_happens(), cfg)


def test_the_extremes_are_the_validators() -> None:
    """_edge_values takes the bounds the validator uses: just outside each is refused."""
    with pytest.raises(ValueError, match="degradation_baseline_s"):
        DetectorConfig(degradation_baseline_s=0)
    with pytest.raises(ValueError, match="memory_min_samples"):
        DetectorConfig(memory_min_samples=2)
    with pytest.raises(ValueError, match="hang_cpu_idle_ratio"):
        DetectorConfig(hang_cpu_idle_ratio=1.0)


@pytest.mark.parametrize("end", [0, -1], ids=["all-lowest", "all-highest"])
def test_every_field_at_its_extreme_at_once_runs(end: int) -> None:
    """All seven lookbacks at their lowest at once crashed the window ("max_age_s must be
    positive"); every field at its lowest, or its highest, together."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(DetectorConfig):
        value = _edge_values(f.name)[end]
        if f.name in ("sustain_s", "clear_s"):
            changes[f.name] = dict.fromkeys(FindingKind, value)
        elif f.name.startswith("xid_"):
            changes[f.name] = frozenset({value})
        else:
            changes[f.name] = value
    changes["hang_cpu_max_span_s"] = max(changes["hang_cpu_max_span_s"], changes["hang_cpu_min_span_s"])
    replay(_everything_happens(), DetectorConfig(**changes))
