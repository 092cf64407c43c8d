"""A hang suspected at its first sign (detectors/hang/suspect.py): the load balancer's cue, seconds
before a HANG rule proves it and the daemon kills the engine."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.detectors import DetectorConfig, detect_hang, new_window
from llmsupervisor.detectors.hang.suspect import hang_suspected
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.host import ProcInfo, ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics, parse_metrics
from tests.lib.paths import FIXTURES

CFG = DetectorConfig()
OK = HttpCheck(ok=True, detail="completed", latency_s=0.04, status_code=200)
HEALTH_OK = HttpCheck(ok=True, detail="HTTP 200", latency_s=0.002, status_code=200)
TIMEOUT = HttpCheck(ok=False, detail="timed out (ReadTimeout)", latency_s=5.0, failure="timeout")
METRICS_TIMEOUT = ProbeFailure("timeout", "GET /metrics: no answer within 5 s")


def ob(t: float, **kw: Any) -> Observation:
    return Observation(engine="e", at_s=t, **kw)


def win(observations: list[Observation]) -> ObservationWindow:
    w = new_window(CFG)
    for o in observations:
        w.append(o)
    return w


_BUSY = parse_metrics((FIXTURES / "metrics" / "vllm-0.32.0-cpu.txt").read_text())  # vLLM 0.32's own


def busy(steps: int) -> EngineMetrics:
    assert isinstance(_BUSY, EngineMetrics)
    return replace(_BUSY, iterations_total=steps, generation_tokens_total=4 * steps, requests_running=8)


def group(at_s: float, *, stopped: bool) -> ProcSample:
    """An engine's API server and EngineCore as a sweep at ``at_s`` saw them."""
    procs = (
        ProcInfo(pid=4100, title="vllm serve", rss_bytes=1, cpu_seconds=1.0, status="sleeping", zombie=False),
        ProcInfo(
            pid=4101,
            title="VLLM::EngineCore",
            rss_bytes=1,
            cpu_seconds=5.0,
            status="stopped" if stopped else "running",
            zombie=False,
        ),
    )
    return ProcSample(
        pgid=4100,
        processes=procs,
        rss_bytes_total=2,
        cpu_seconds_total=6.0,
        process_count=2,
        zombie_count=0,
        at_s=at_s,
    )


MISS = replace(TIMEOUT, latency_s=1.0)


def test_a_missed_canary_is_suspected_at_once_and_proved_only_later() -> None:
    # A spinning engine: its counters stand still, its canaries miss, it burns CPU (no stopped
    # process, no idle CPU): only the deadline rule proves it, after hang_after_s.
    obs = [ob(0.0, metrics=busy(10), canary=OK), ob(2.0, metrics=busy(10), canary=MISS)]
    window = win(obs)
    assert hang_suspected(window, 2.0, CFG) == "a canary got no answer in 1.0 s"
    assert detect_hang(window, 2.0, CFG) is None


def test_a_stopped_process_is_suspected_in_its_first_sweep() -> None:
    obs = [
        ob(0.0, metrics=busy(10), canary=OK, proc=group(0.0, stopped=False)),
        ob(2.0, metrics=busy(10), health=HEALTH_OK, proc=group(2.0, stopped=True)),
    ]
    window = win(obs)
    reason = hang_suspected(window, 2.0, CFG)
    assert reason is not None and "stopped" in reason
    assert detect_hang(window, 2.0, CFG) is None  # one sweep is not proof yet


def test_the_next_sign_of_life_clears_it() -> None:
    miss = [ob(0.0, metrics=busy(10), canary=OK), ob(2.0, metrics=busy(10), canary=MISS)]
    assert hang_suspected(win([*miss, ob(4.0, canary=OK)]), 4.0, CFG) is None
    # Counters that moved by the newest reading: alive, whatever timed out in the same round.
    moved = ob(4.0, metrics=busy(20), canary=MISS)
    assert hang_suspected(win([*miss, moved]), 4.0, CFG) is None


def test_a_slow_health_or_metrics_on_a_busy_host_is_not_a_suspicion() -> None:
    obs = [
        ob(0.0, metrics=busy(10), canary=OK),
        ob(2.0, metrics=METRICS_TIMEOUT, health=TIMEOUT),
        ob(4.0, health=HEALTH_OK, proc=group(3.9, stopped=False)),
    ]
    assert hang_suspected(win(obs), 4.0, CFG) is None


def test_an_old_miss_says_nothing_about_now() -> None:
    obs = [ob(0.0, metrics=busy(10), canary=MISS)]
    assert hang_suspected(win(obs), CFG.stale_after_s + 1.0, CFG) is None
