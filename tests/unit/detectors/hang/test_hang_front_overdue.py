"""The hang rules of the API server's loop (``front``) and of a Worker's step past the bound
its tokens give (``overdue``), issue 25; each with the busy engine it must not mistake for a hung
one.

Virtual time, observations built by hand as the observer makes them: a sweep as the round
starts, /health asked again at once after a late answer (``health_after``), a second sweep
after a miss or an overdue step, the heartbeat read after the round's probes. The engine is vLLM
0.32's process group: the API server (the group leader), EngineCore, Worker.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from llmsupervisor.core.observe import Observation, describe
from llmsupervisor.detectors import DetectorConfig, detect_hang, new_window
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcSample
from tests.lib.hang_rounds import API, CORE, WORKER, Engine, sweep

CFG = DetectorConfig()
HEALTH_OK = HttpCheck(ok=True, detail="HTTP 200", latency_s=0.002, status_code=200)
LATE = HttpCheck(ok=False, detail="timed out (ReadTimeout)", latency_s=1.0, failure="timeout")


def first_hang(
    observations: Iterable[Observation], cfg: DetectorConfig = CFG
) -> tuple[float, dict[str, object]] | None:
    """When the hang detector first fires and its evidence, replaying the rounds; each round
    decides as it ends (after its second sweep, if it took one), as the observer does."""
    w = new_window(cfg)
    for obs in observations:
        w.append(obs)
        decided_s = max(obs.at_s, obs.proc_after.at_s or 0.0) if obs.proc_after is not None else obs.at_s
        finding = detect_hang(w, decided_s, cfg)
        if finding is not None:
            return decided_s, dict(finding.evidence)
    return None


# ---- front: the API server's loop held ----

IDLE = {API: 0.02, CORE: 0.0, WORKER: 0.0}


def front_rounds(
    hang_s: float,
    until_s: float,
    api_rate: float,
    *,
    api_status: str = "sleeping",
    admitting: bool = False,
    late_before: bool = False,
    loop_rate: float | None = None,
    api_status_after: str | None = None,
) -> list[Observation]:
    """An idle engine; from ``hang_s`` on its API server answers no /health (a round waits 1 s,
    asks again, waits 1 s, then sweeps again) and uses ``api_rate`` of a core; ``admitting``: the
    scheduler is still handed requests (a loaded API server); ``loop_rate``: its main thread's
    share of that, read by the sweep (None: not read); ``api_status_after``: its state in a late
    round's second sweep, if not ``api_status``. A round every 2 s after the last ended."""
    engine, loop, out, t, added = Engine(), Engine(), [], 0.0, 0

    def at(t: float, rate: dict[int, float], status: dict[int, str]) -> ProcSample:
        if loop_rate is None:
            return sweep(t, engine.run(t, rate), status)
        main = loop.run(t, {API: loop_rate if rate[API] == api_rate else rate[API]})
        return sweep(t, engine.run(t, rate), status, main_thread_cpu_s={API: main[API]})

    while t <= until_s:
        held = t >= hang_s or late_before
        rate = {API: api_rate, CORE: 0.0, WORKER: 0.0} if held else IDLE
        first = at(t, rate, {API: api_status} if held else {})
        if admitting or not held:
            added += 5  # a loaded API server admits requests; before the hang, canaries too
        beat = StepBeat(
            pid=CORE, scheduled=100, done=100, scheduled_s=0.0, done_s=0.0, work=0, longest_step_s=0.05,
            added=added,
        )  # fmt: skip
        if not held:
            out.append(Observation(engine="e1", at_s=t + 0.01, health=HEALTH_OK, proc=first, heartbeat=beat))
            t += 2.01
            continue
        second = at(t + 2.0, rate, {API: api_status_after or api_status})
        out.append(
            Observation(
                engine="e1",
                at_s=t + 1.0,
                health=LATE,
                health_after=LATE,
                proc=first,
                proc_after=second,
                heartbeat=replace(beat, added=added + 5) if admitting else beat,  # read again at the end
                heartbeat_at_miss=beat,  # read as the probes ended
            )
        )
        t += 4.0
    return out


def detection_time_s(obs_list: list[Observation], hang_s: float) -> tuple[float, dict[str, object]] | None:
    found = first_hang(obs_list)
    return None if found is None else (found[0] - hang_s, found[1])


def test_a_deadlocked_api_server_is_front_within_one_late_round() -> None:
    # Its loop's thread waits on a lock (a blocking call in a coroutine): asleep, no CPU.
    found = detection_time_s(front_rounds(hang_s=10.0, until_s=30.0, api_rate=0.0), 10.0)
    assert found is not None
    took_s, evidence = found
    assert evidence["rule"] == "front" and evidence["front"] == "deadlocked"
    assert evidence["hung_role"] == "api_server" and evidence["hung_pid"] == API
    assert took_s <= 2.1  # the round's two misses, 2 s (the round began as the hang did here)


def test_a_deadlocked_api_server_whose_io_threads_still_run_is_front_by_its_main_thread() -> None:
    # Under load its ZMQ I/O threads (no GIL) go on receiving the engine's tokens, 15 % of a core,
    # while the main thread, where the loop runs, waits on the GIL at none (issue 25: 8 s by the
    # whole process's CPU). Read the main thread's, and it is one late round.
    found = detection_time_s(front_rounds(hang_s=10.0, until_s=30.0, api_rate=0.15, loop_rate=0.0), 10.0)
    assert found is not None
    took_s, evidence = found
    assert evidence["rule"] == "front" and evidence["front"] == "deadlocked"
    assert took_s <= 2.1
    # Without the main thread's reading (an older sweep), the process's 15 % is no deadlock.
    found = first_hang(front_rounds(hang_s=10.0, until_s=30.0, api_rate=0.15))
    assert found is None or found[1]["rule"] != "front"


def test_a_deadlocked_api_server_caught_runnable_by_one_sweep_is_still_front() -> None:
    # Its main thread waits on the GIL and wakes every switch interval to ask for it: a sweep
    # may catch it runnable, at no CPU. Asleep in the other sweep, it is deadlocked (a real-vLLM
    # run had this one found by the frozen rule instead, the API server's stack lost).
    found = detection_time_s(
        front_rounds(hang_s=10.0, until_s=30.0, api_rate=0.0, loop_rate=0.0, api_status_after="running"), 10.0
    )
    assert found is not None
    took_s, evidence = found
    assert evidence["rule"] == "front" and evidence["front"] == "deadlocked"
    assert took_s <= 2.1


def test_a_loop_waiting_on_a_thread_that_burns_a_core_is_not_deadlocked() -> None:
    # The main thread asleep, but another thread of the process burns a core: the loop waits on
    # work (the spinning case's, which needs the heartbeat to show nothing admitted), not a lock.
    obs = front_rounds(hang_s=10.05, until_s=40.0, api_rate=1.0, loop_rate=0.0, admitting=True)
    found = first_hang(obs)
    assert found is None or found[1]["rule"] != "front"


def test_a_loaded_api_server_whose_loop_computes_is_not_deadlocked() -> None:
    # Late /health, the process at 15 % and its main thread computing most of it: a slow loop.
    obs = front_rounds(hang_s=10.05, until_s=40.0, api_rate=0.15, loop_rate=0.12, admitting=True)
    found = first_hang(obs)
    assert found is None or found[1]["rule"] != "front"


def test_a_spinning_api_server_that_admits_nothing_is_front() -> None:
    found = detection_time_s(
        front_rounds(hang_s=10.0, until_s=30.0, api_rate=1.0, api_status="running"), 10.0
    )
    assert found is not None
    took_s, evidence = found
    assert evidence["rule"] == "front" and evidence["front"] == "spinning"
    assert took_s <= 2.1


def test_a_loaded_api_server_that_still_admits_requests_is_not_front() -> None:
    # Late /health from an API server at full CPU, still handing the scheduler requests: load.
    obs = front_rounds(hang_s=10.05, until_s=40.0, api_rate=1.0, api_status="running", admitting=True)
    found = first_hang(obs)
    assert found is None or found[1]["rule"] != "front"


def test_an_api_server_starved_of_cpu_is_not_deadlocked() -> None:
    # No CPU, but runnable: it waits for a core on a saturated host, not on a lock.
    obs = front_rounds(hang_s=10.05, until_s=40.0, api_rate=0.0, api_status="running")
    found = first_hang(obs)
    assert found is None or found[1]["rule"] != "front"  # the deadline rule's, 12 s on


def test_one_late_health_is_not_front() -> None:
    engine = Engine()
    first = sweep(0.0, engine.run(0.0, IDLE), {})
    second = sweep(2.0, engine.run(2.0, {API: 0.0}), {})
    beat = StepBeat(pid=CORE, scheduled=1, done=1, scheduled_s=0.0, done_s=0.0, work=0, longest_step_s=0.05)
    obs = [
        Observation(
            engine="e1",
            at_s=1.0,
            health=LATE,
            health_after=HEALTH_OK,
            proc=first,
            proc_after=second,
            heartbeat=beat,
        )
    ]
    assert first_hang(obs) is None


# ---- overdue: a Worker's step past the bound its tokens give ----

DECODE = {API: 0.3, CORE: 0.4, WORKER: 1.5}  # the Worker's OpenMP threads compute
WORKER_SPIN = {API: 0.05, CORE: 0.05, WORKER: 1.0}  # one thread of the Worker loops


def step_rounds(
    hang_s: float,
    until_s: float,
    *,
    tokens: int = 8,
    per_token_s: float = 0.005,
    gpus: bool = False,
    after: dict[int, float] = WORKER_SPIN,
) -> list[Observation]:
    """Decode steps of ``tokens`` tokens every few ms until ``hang_s``; then one step of
    ``tokens`` never comes back while the Worker uses ``after``'s CPU. A round every 2 s; while a
    step is overdue the observer sweeps again 1 s after the round's first sweep."""
    engine, out, done, done_s = Engine(), [], 0, 0.0
    t = 0.0
    while t <= until_s:
        stuck = t > hang_s
        first = sweep(t, engine.run(t, after if stuck else DECODE), {})
        if not stuck:
            done, done_s = done + 400, t
        beat = StepBeat(
            pid=CORE, scheduled=done + 1, done=done, scheduled_s=min(done_s, hang_s),
            done_s=min(done_s, hang_s), work=8, longest_step_s=0.05, tokens_pending=tokens,
            per_token_s=per_token_s,
        )  # fmt: skip
        second = sweep(t + 1.0, engine.run(t + 1.0, after if stuck else DECODE), {}) if stuck else None
        out.append(
            Observation(
                engine="e1",
                at_s=t + 1.0 if stuck else t + 0.01,
                health=HEALTH_OK,
                proc=first,
                proc_after=second,
                heartbeat=beat,
                gpus={0: nominal_sample(0)} if gpus else {},
            )
        )
        t += 2.0
    return out


def test_a_spinning_worker_under_load_is_overdue_within_five_seconds() -> None:
    found = first_hang(step_rounds(hang_s=10.0, until_s=40.0))
    assert found is not None
    at_s, evidence = found
    assert evidence["rule"] == "overdue" and evidence["hung_role"] == "worker"
    assert at_s - 10.0 <= 5.0  # the 2 s floor (the decode step's own bound is 0.2 s), then a span


def test_a_long_prefill_gets_a_long_bound() -> None:
    # 400 tokens at 10 ms a token (the slowest seen): a 16 s bound; the Worker computes it for
    # 12 s, which is slow, but not past the bound.
    obs = step_rounds(hang_s=10.0, until_s=22.0, tokens=400, per_token_s=0.01, after=DECODE)
    assert first_hang(obs) is None


def test_a_gpu_engine_s_busy_worker_is_left_to_the_deadline_rule() -> None:
    # A GPU Worker can spend CPU seconds on a step that is not hung (Triton compiling a kernel).
    found = first_hang(step_rounds(hang_s=10.0, until_s=20.0, gpus=True))
    assert found is None or found[1]["rule"] != "overdue"


def test_a_step_of_unknown_size_is_left_to_the_deadline_rule() -> None:
    found = first_hang(step_rounds(hang_s=10.0, until_s=20.0, tokens=0, per_token_s=0.0))
    assert found is None or found[1]["rule"] != "overdue"


def test_a_worker_spinning_on_an_idle_engine_s_canary_is_overdue_not_frozen() -> None:
    # Seen on the real CPU build: the canary's step went to the Worker, which spun. The Worker's
    # poll allowance runs from the last step *done* (long ago), so its CPU now is not a poll,
    # and the engine is not "frozen at 99.9 % of a core".
    engine, out = Engine(), []
    for t in (0.0, 2.0, 4.0, 6.0, 8.0):
        beat = StepBeat(
            pid=CORE, scheduled=4, done=4, scheduled_s=0.0, done_s=0.0, work=0, longest_step_s=0.05
        )
        proc = sweep(t, engine.run(t, IDLE), {})
        out.append(Observation(engine="e1", at_s=t + 0.01, health=HEALTH_OK, proc=proc, heartbeat=beat))
    for t in (10.0, 12.0, 14.0, 16.0):
        beat = StepBeat(
            pid=CORE, scheduled=5, done=4, scheduled_s=10.0, done_s=0.0, work=1, longest_step_s=0.05,
            tokens_pending=3, per_token_s=0.01,
        )  # fmt: skip
        spin = {API: 0.02, CORE: 0.0, WORKER: 0.999}  # EngineCore waits on the Worker's answer
        first = sweep(t, engine.run(t, spin), {})
        second = sweep(t + 1.0, engine.run(t + 1.0, spin), {})
        out.append(
            Observation(
                engine="e1", at_s=t + 0.01, health=HEALTH_OK, proc=first, proc_after=second, heartbeat=beat
            )
        )
    found = first_hang(out)
    assert found is not None
    at_s, evidence = found
    assert evidence["rule"] == "overdue" and at_s - 10.0 <= 4.1


def test_a_round_is_described_in_one_line_for_the_debug_log() -> None:
    # What explains a hang found late: each probe's outcome and time, each process's CPU (the
    # leader's main thread after a slash, a state other than asleep in parentheses), the beat.
    obs = front_rounds(hang_s=0.0, until_s=0.0, api_rate=0.2, loop_rate=0.0, api_status="running")[0]
    line = describe(obs)
    assert line.startswith("round@1.00:")
    assert " health=timeout 1.000s health_again=timeout 1.000s" in line
    assert f" sweep@0.00=[{API}:10.00/10.00(running),{CORE}:20.00,{WORKER}:30.00]" in line
    assert f" sweep_after@2.00=[{API}:10.40/10.00(running)," in line
    assert " beat=done 100@0.00 scheduled 100@0.00 work 0 added 0 bound 0.050s" in line
    assert "\n" not in line
