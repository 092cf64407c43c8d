"""The observer's part in finding hangs fast (issue 25): a late /health ends the round's wait
for it and for /metrics, a miss brings a second process sweep, and the heartbeat is read after
the round's probes."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.observe import Observation, check_timed_out
from llmsupervisor.detectors import DetectorConfig
from llmsupervisor.engine.observer import OVERDUE_AFTER_S, NoGpus, Observer, second_sweep_at
from llmsupervisor.probes import PROBE_ERRORS, ProbeErrors, ProbeFailure
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcInfo, ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics
from llmsupervisor.probes.vllm_plugin.llmsupervisor_step_heartbeat import Heartbeat
from tests.lib.engine_fakes import FakeSweeper, metrics
from tests.lib.virtual_time import run_virtual


@dataclass
class FrozenApiServer:
    """An API server that answers nothing: each probe waits out the deadline it was given."""

    deadlines_s: dict[str, float] = field(default_factory=dict)

    async def _wait(self, what: str, timeout_s: float) -> HttpCheck:
        self.deadlines_s[what] = timeout_s
        await asyncio.sleep(timeout_s)
        return HttpCheck(ok=False, detail="timed out", latency_s=timeout_s, failure="timeout")

    async def health(self, *, timeout_s: float) -> HttpCheck:
        return await self._wait("health", timeout_s)

    async def canary(self, *, timeout_s: float) -> HttpCheck:
        return await self._wait("canary", timeout_s)

    async def metrics(self, *, timeout_s: float) -> EngineMetrics | ProbeFailure:
        self.deadlines_s["metrics"] = timeout_s
        await asyncio.sleep(3600)  # would hold the round for its whole deadline
        raise AssertionError("not reached")


def spec_of(**fields: Any) -> EngineSpec:
    """Engine e1 on port 8001, no GPU, with ``fields`` (deadlines, intervals, detectors)."""
    return EngineSpec(name="e1", model="m", gpus=(), port=8001, **fields)


class Leader:
    """The spawned API server, as far as a round reads it (its group)."""

    pid = pgid = 4100


@dataclass
class CountingSweeper(FakeSweeper):
    fresh: list[float | None] = field(default_factory=list)

    async def sample(
        self, pgid: int, *, timeout_s: float, fresh_after_s: float | None = None
    ) -> ProcSample | ProbeFailure:
        self.fresh.append(fresh_after_s)
        return await super().sample(pgid, timeout_s=timeout_s, fresh_after_s=fresh_after_s)


def observer_of(spec: EngineSpec, http: object, sweeper: object, tmp_path: Path) -> Observer:
    """An observer of ``spec`` over scripted HTTP and sweeps, reading the heartbeat in ``tmp_path``."""
    return Observer(
        spec,
        incarnation_started_s=0.0,
        http=http,  # type: ignore[arg-type]
        gpus=NoGpus(),
        sweeper=sweeper,  # type: ignore[arg-type]
        heartbeat_path=tmp_path / "beat",
    )


def test_a_frozen_api_server_costs_a_round_hang_probe_late_s_not_health_timeout_s(tmp_path: Path) -> None:
    spec = spec_of(
        health_timeout_s=30.0,
        live_canary_timeout_s=0.05,
        canary_interval_s=0.0,
        detectors=DetectorConfig(hang_probe_late_s=0.05),
    )
    Heartbeat(str(tmp_path / "beat")).on_schedule(0)
    http = FrozenApiServer()
    sweeper = CountingSweeper()

    async def one_round() -> None:
        observer = Observer(
            spec,
            incarnation_started_s=0.0,
            http=http,  # type: ignore[arg-type]
            gpus=NoGpus(),
            sweeper=sweeper,
            heartbeat_path=tmp_path / "beat",
        )
        obs = await observer.round(Leader())  # type: ignore[arg-type]
        assert check_timed_out(obs.health)
        assert http.deadlines_s["health"] == 0.05  # hang_probe_late_s, not health_timeout_s
        assert isinstance(obs.metrics, ProbeFailure) and "late" in obs.metrics.detail
        # /health asked again at once: two misses in one round for the front rule.
        assert check_timed_out(obs.health_after)
        # The miss brought a second sweep, from after the probes.
        assert isinstance(obs.proc_after, ProcSample) and sweeper.fresh[-1] is not None
        assert isinstance(obs.heartbeat, StepBeat) and obs.heartbeat.pending

    asyncio.run(asyncio.wait_for(one_round(), timeout=60))


class AnsweringApiServer:
    async def health(self, *, timeout_s: float) -> HttpCheck:
        return HttpCheck(ok=True, detail="HTTP 200", latency_s=0.001, status_code=200)

    async def canary(self, *, timeout_s: float) -> HttpCheck:
        return HttpCheck(ok=True, detail="completed", latency_s=0.001, status_code=200)

    async def metrics(self, *, timeout_s: float) -> EngineMetrics | ProbeFailure:
        return ProbeFailure("connect", "not scripted")


def test_an_overdue_step_brings_a_second_sweep_and_a_second_heartbeat_read(tmp_path: Path) -> None:
    # Work held and no step back for OVERDUE_AFTER_S: the round sweeps again at least
    # hang_cpu_min_span_s after its first sweep, so the hang rules have a span of the stuck
    # engine's CPU this round.
    spec = spec_of(
        detectors=DetectorConfig(hang_cpu_min_span_s=0.01, hang_spin_after_s=0.01),
    )
    beat = Heartbeat(str(tmp_path / "beat"))
    beat.on_schedule(8)
    beat.on_done(8)  # 8 requests held, the last step back now
    sweeper = CountingSweeper()

    async def rounds() -> None:
        observer = Observer(
            spec,
            incarnation_started_s=0.0,
            http=AnsweringApiServer(),  # type: ignore[arg-type]
            gpus=NoGpus(),
            sweeper=sweeper,
            heartbeat_path=tmp_path / "beat",
        )
        await asyncio.sleep(OVERDUE_AFTER_S + 0.05)  # overdue
        obs = await observer.round(Leader())  # type: ignore[arg-type]
        assert isinstance(obs.proc, ProcSample) and isinstance(obs.proc_after, ProcSample)
        assert obs.proc.at_s is not None and obs.proc_after.at_s is not None
        assert obs.proc_after.at_s - obs.proc.at_s >= 0.01
        beat.on_schedule(8)
        beat.on_done(8)  # a step back: not overdue, one sweep
        obs = await observer.round(Leader())  # type: ignore[arg-type]
        assert obs.proc_after is None

    asyncio.run(asyncio.wait_for(rounds(), timeout=60))


def test_the_second_sweep_waits_for_the_spin_bound_but_never_past_hang_spin_after_s() -> None:
    cfg = DetectorConfig()  # hang_cpu_min_span_s 1, hang_spin_after_s 2
    beat = StepBeat(pid=1, scheduled=9, done=9, scheduled_s=100.0, done_s=100.0, work=8, longest_step_s=0.01)
    assert second_sweep_at(beat, 100.4, 100.3, cfg) is None  # not overdue yet
    # Swept at 100.6: the span's floor (101.6) is before the spin bound (102.0): wait for that.
    assert second_sweep_at(beat, 100.7, 100.6, cfg) == pytest.approx(102.05)
    # Swept at 103: the floor (104) is the later.
    assert second_sweep_at(beat, 103.1, 103.0, cfg) == pytest.approx(104.05)
    # A learned bound of 40 s: never more than hang_spin_after_s after the sweep.
    slow = StepBeat(pid=1, scheduled=9, done=9, scheduled_s=100.0, done_s=100.0, work=8, longest_step_s=10.0)
    assert second_sweep_at(slow, 111.0, 111.0, cfg) == pytest.approx(113.05)
    # Nothing held: nothing overdue.
    idle = StepBeat(pid=1, scheduled=9, done=9, scheduled_s=100.0, done_s=100.0, work=0, longest_step_s=0.01)
    assert second_sweep_at(idle, 110.0, 110.0, cfg) is None
    # An idle engine's canary step, scheduled at 200 long after the last step done (100): the
    # spin bound runs from 200, so the second sweep waits for it (202), not 1 s (201).
    canary = StepBeat(
        pid=1, scheduled=10, done=9, scheduled_s=200.0, done_s=100.0, work=1, longest_step_s=0.01
    )
    assert second_sweep_at(canary, 201.0, 200.0, cfg) == pytest.approx(202.05)


def test_a_stopped_process_in_the_round_s_sweep_is_not_asked_again(tmp_path: Path) -> None:
    # The stopped rule decides in this round from its first sweep; asking /health again would
    # only hold the round (and the finding) another hang_probe_late_s.
    spec = spec_of(
        health_timeout_s=30.0,
        live_canary_timeout_s=0.05,
        canary_interval_s=3600.0,
        detectors=DetectorConfig(hang_probe_late_s=0.05),
    )
    http = FrozenApiServer()

    async def one_round() -> None:
        observer = Observer(
            spec,
            incarnation_started_s=0.0,
            http=http,  # type: ignore[arg-type]
            gpus=NoGpus(),
            sweeper=CountingSweeper(stopped=True),
        )
        obs = await observer.round(Leader())  # type: ignore[arg-type]
        assert check_timed_out(obs.health) and obs.health_after is None

    asyncio.run(asyncio.wait_for(one_round(), timeout=60))


class Switch:
    """The engine's HTTP as the test has it now: ``now`` is swapped between rounds."""

    def __init__(self, now: object) -> None:
        self.now = now

    def __getattr__(self, name: str) -> object:
        return getattr(self.now, name)


def test_a_stop_while_metrics_was_read_is_found_in_that_round_though_steps_came_before_it(
    tmp_path: Path,
) -> None:
    # The API server stopped while the round read /metrics, after /health answered: the round's
    # sweep is taken again at the miss (went late), and the steps done since the last round are
    # life, so the miss alone proves nothing. The stopped rule needs sweeps hang_stopped_after_s
    # apart: the second one waits for that, and the hang is found in this round, not the next
    # (a real-vLLM run: 5.0 s).
    spec = spec_of(
        health_timeout_s=30.0,
        canary_interval_s=3600.0,
        metrics_interval_s=0.01,  # read in both rounds
        detectors=DetectorConfig(hang_probe_late_s=0.05, hang_stopped_after_s=0.3),
    )
    beat = Heartbeat(str(tmp_path / "beat"))
    beat.on_schedule(2)
    beat.on_done(2)
    sweeper = CountingSweeper()
    http = Switch(AnsweringApiServer())

    async def two_rounds() -> None:
        observer = observer_of(spec, http, sweeper, tmp_path)
        await observer.round(Leader())  # type: ignore[arg-type]
        assert not observer.findings
        beat.on_schedule(2)
        beat.on_done(2)  # steps until the stop
        http.now, sweeper.stopped = HeldAfterHealth(), True
        obs = await observer.round(Leader())  # type: ignore[arg-type]
        assert isinstance(obs.proc, ProcSample) and obs.proc.at_s is not None
        assert obs.proc_after is not None and obs.proc_after.at_s is not None
        assert obs.proc_after.at_s - obs.proc.at_s >= 0.3
        assert [finding.evidence["rule"] for finding in observer.findings] == ["stopped"]

    asyncio.run(asyncio.wait_for(two_rounds(), timeout=10))


@dataclass
class IdleButBusySweeper:
    """The API server at rest and a Worker burning a core: an idle engine that spins."""

    async def sample(
        self, pgid: int, *, timeout_s: float, fresh_after_s: float | None = None
    ) -> ProcSample | ProbeFailure:
        now = aio.now()
        infos = (
            ProcInfo(
                pid=pgid, title="vllm serve", rss_bytes=1, cpu_seconds=1.0, status="sleeping", zombie=False
            ),
            ProcInfo(
                pid=pgid + 2,
                title="VLLM::Worker",
                rss_bytes=1,
                cpu_seconds=now,
                status="running",
                zombie=False,
            ),
        )
        return ProcSample(
            pgid=pgid,
            processes=infos,
            rss_bytes_total=2,
            cpu_seconds_total=1.0 + now,
            process_count=2,
            zombie_count=0,
            at_s=now,
        )


class CountingCanaries(AnsweringApiServer):
    def __init__(self) -> None:
        self.canaries = 0

    async def canary(self, *, timeout_s: float) -> HttpCheck:
        self.canaries += 1
        return await super().canary(timeout_s=timeout_s)


def test_an_idle_engine_that_burns_cpu_is_asked_in_the_round_that_sees_it(tmp_path: Path) -> None:
    # The round's sweep is taken before its probes when the heartbeat says idle and no canary
    # is due: a Worker spinning with nothing to do gets its canary this round, not the next.
    spec = spec_of(canary_interval_s=3600.0)
    Heartbeat(str(tmp_path / "beat"))  # idle: nothing held, nothing under way
    http = CountingCanaries()

    async def two_rounds() -> None:
        observer = observer_of(spec, http, IdleButBusySweeper(), tmp_path)
        await observer.round(Leader())  # type: ignore[arg-type]
        assert http.canaries == 0  # one sweep: no span yet
        await asyncio.sleep(0.2)
        obs = await observer.round(Leader())  # type: ignore[arg-type]
        assert http.canaries == 1 and obs.canary is not None and obs.canary.ok

    asyncio.run(asyncio.wait_for(two_rounds(), timeout=60))


class CountersStillMoving(CountingCanaries):
    """/metrics whose step counter moved since the last read: the load that just ended."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    async def metrics(self, *, timeout_s: float) -> EngineMetrics | ProbeFailure:
        self.steps += 100
        return metrics(steps=self.steps)


def test_an_idle_engine_that_burns_cpu_is_asked_though_its_counters_moved_last_interval(
    tmp_path: Path,
) -> None:
    # /metrics is read a metrics_interval_s apart, so its counters "move" for up to two
    # intervals after the last request. The heartbeat says nothing is held: a canary queues
    # behind nothing, and a Worker that began to spin as the load ended is asked at once
    # (issue 25: 9 s unasked in the real-vLLM table).
    spec = spec_of(canary_interval_s=3600.0, metrics_interval_s=0.0)
    Heartbeat(str(tmp_path / "beat"))  # idle: nothing held, nothing under way
    http = CountersStillMoving()

    async def three_rounds() -> None:
        observer = observer_of(spec, http, IdleButBusySweeper(), tmp_path)
        for _ in range(3):
            await observer.round(Leader())  # type: ignore[arg-type]
            await asyncio.sleep(0.2)
        # The counters moved between each two reads, and each round with a span asks all the same.
        assert http.steps == 300 and http.canaries == 2

    asyncio.run(asyncio.wait_for(three_rounds(), timeout=60))


@pytest.mark.parametrize(("held", "canaries"), [(0, 3), (5, 2)])
def test_counters_that_still_move_hold_the_canary_back_only_while_the_heartbeat_holds_work(
    tmp_path: Path, held: int, canaries: int
) -> None:
    # A canary is due every round. /metrics read every round, its counters moving from the
    # second read on. Idle by the heartbeat: the counters are the last request's lag, and the
    # canary goes (an engine that deadlocked as its load ended is asked at once). Work held:
    # the canary would queue behind it, and waits.
    spec = spec_of(canary_interval_s=0.0, metrics_interval_s=0.0)
    beat = Heartbeat(str(tmp_path / "beat"))
    beat.on_schedule(held)
    beat.on_done(held)
    http = CountersStillMoving()

    async def three_rounds() -> None:
        observer = observer_of(spec, http, FakeSweeper(), tmp_path)
        for _ in range(3):
            await observer.round(Leader())  # type: ignore[arg-type]
        assert http.steps == 300 and http.canaries == canaries

    asyncio.run(asyncio.wait_for(three_rounds(), timeout=60))


def test_the_idle_test_reads_the_heartbeat_as_the_round_begins_not_the_last_round_s(tmp_path: Path) -> None:
    # The last round read the engine busy (5 requests held); its load has since ended, and its
    # Worker burns a core. The round reads the heartbeat before deciding, so the canary goes now,
    # not a round later (issue 25: a spin that began as the load ended, found in 5.5 s).
    spec = spec_of(canary_interval_s=3600.0)
    beat = Heartbeat(str(tmp_path / "beat"))
    beat.on_schedule(5)
    beat.on_done(5)
    http = CountingCanaries()

    async def two_rounds() -> None:
        observer = observer_of(spec, http, IdleButBusySweeper(), tmp_path)
        first = await observer.round(Leader())  # type: ignore[arg-type]
        assert isinstance(first.heartbeat, StepBeat) and first.heartbeat.work == 5
        beat.on_schedule(0)  # the last step: nothing held after it
        beat.on_done(0)
        await asyncio.sleep(0.2)
        await observer.round(Leader())  # type: ignore[arg-type]
        assert http.canaries == 1

    asyncio.run(asyncio.wait_for(two_rounds(), timeout=60))


@dataclass
class HeldAfterHealth(FrozenApiServer):
    """An API server whose loop is held just after it answered the round's first /health: the
    /metrics read that started with it waits, and so does every /health after."""

    healths: int = 0

    async def health(self, *, timeout_s: float) -> HttpCheck:
        self.healths += 1
        if self.healths == 1:
            return HttpCheck(ok=True, detail="HTTP 200", latency_s=0.001, status_code=200)
        return await self._wait("health", timeout_s)


def test_a_loop_held_after_health_answered_does_not_hold_the_round_for_metrics(tmp_path: Path) -> None:
    # /health answered, /metrics did not: the round asks /health again hang_probe_late_s on, and
    # that miss ends the /metrics wait (not health_timeout_s) and is the round's first miss, so
    # the front rule has its two misses in this round (issue 25: a 9 s API server deadlock).
    spec = spec_of(
        health_timeout_s=30.0,
        canary_interval_s=3600.0,
        detectors=DetectorConfig(hang_probe_late_s=0.05),
    )
    Heartbeat(str(tmp_path / "beat"))
    http = HeldAfterHealth()

    async def one_round() -> None:
        observer = observer_of(spec, http, CountingSweeper(), tmp_path)
        obs = await observer.round(Leader())  # type: ignore[arg-type]
        assert http.deadlines_s["metrics"] == 30.0  # /metrics keeps its deadline while /health answers
        assert isinstance(obs.metrics, ProbeFailure) and "went late" in obs.metrics.detail
        assert check_timed_out(obs.health) and check_timed_out(obs.health_after)
        assert http.healths == 3  # the round's, the one asked while /metrics was read, again

    asyncio.run(asyncio.wait_for(one_round(), timeout=10))


def test_a_loop_held_after_health_answered_is_front_in_that_round(tmp_path: Path) -> None:
    # The round's first sweep was taken before the loop was held, and front's span must begin no
    # earlier than its first miss: the round sweeps again at the miss, so the span across the
    # second /health miss is there this round, not a round later (a real-vLLM run: 7 s).
    spec = spec_of(
        health_timeout_s=30.0,
        canary_interval_s=3600.0,
        detectors=DetectorConfig(hang_probe_late_s=0.5, hang_front_after_s=0.9, hang_cpu_min_span_s=0.4),
    )
    Heartbeat(str(tmp_path / "beat"))
    sweeper = CountingSweeper()

    async def one_round() -> None:
        observer = observer_of(spec, HeldAfterHealth(), sweeper, tmp_path)
        obs = await observer.round(Leader())  # type: ignore[arg-type]
        assert isinstance(obs.proc, ProcSample) and obs.proc_after is not None
        assert obs.proc.at_s is not None and obs.proc_after.at_s is not None
        assert obs.proc.at_s >= obs.at_s and obs.proc_after.at_s - obs.proc.at_s >= 0.4
        assert [f.kind.value for f in observer.findings] == ["hang"]
        assert observer.findings[0].evidence["rule"] == "front"

    asyncio.run(asyncio.wait_for(one_round(), timeout=10))


class OutOfDescriptors:
    """/health and the canary raise, as a connect does when the daemon has no descriptor left."""

    async def health(self, *, timeout_s: float) -> HttpCheck:
        raise OSError(errno.EMFILE, "Too many open files")

    async def canary(self, *, timeout_s: float) -> HttpCheck:
        raise OSError(errno.EMFILE, "Too many open files")

    async def metrics(self, *, timeout_s: float) -> EngineMetrics | ProbeFailure:
        return ProbeFailure("connect", "not scripted")


@pytest.fixture
def probe_errors() -> Iterator[ProbeErrors]:
    PROBE_ERRORS.reset()
    yield PROBE_ERRORS
    PROBE_ERRORS.reset()


def test_an_http_probe_that_raises_is_a_failed_check_counted_once_under_its_name(
    tmp_path: Path, probe_errors: ProbeErrors
) -> None:
    # The round's one catch-all gives /health and the canary their own shape (E6): a failed
    # check of kind "error", which is not a miss, so nothing is asked again.
    spec = spec_of(canary_interval_s=0.0)

    async def one_round() -> Observation:
        observer = observer_of(spec, OutOfDescriptors(), FakeSweeper(), tmp_path)
        return await observer.round(Leader())  # type: ignore[arg-type]

    obs = run_virtual(one_round())
    for check in (obs.health, obs.canary):
        assert isinstance(check, HttpCheck) and check.failure == "error" and "EMFILE" in check.detail
    assert obs.health_after is None and obs.proc_after is None
    assert probe_errors.totals() == {("health", "EMFILE"): 1, ("canary", "EMFILE"): 1}


class FrozenCanary(AnsweringApiServer):
    """/health answers; the canary waits out its deadline (a frozen EngineCore)."""

    async def canary(self, *, timeout_s: float) -> HttpCheck:
        return await FrozenApiServer().canary(timeout_s=timeout_s)


def test_the_second_sweep_after_a_stopped_process_waits_on_the_loop_s_clock(tmp_path: Path) -> None:
    # A missed canary and a process stopped: the second sweep waits until hang_stopped_after_s
    # after the first (at most health_timeout_s after the probes): 20 s, on virtual time.
    spec = spec_of(
        canary_interval_s=0.0,
        health_timeout_s=30.0,
        detectors=DetectorConfig(hang_stopped_after_s=20.0),
    )

    async def one_round() -> Observation:
        observer = observer_of(spec, FrozenCanary(), FakeSweeper(stopped=True), tmp_path)
        return await observer.round(Leader())  # type: ignore[arg-type]

    obs = run_virtual(one_round())
    assert check_timed_out(obs.canary) and obs.health_after is None
    assert isinstance(obs.proc, ProcSample) and isinstance(obs.proc_after, ProcSample)
    assert obs.proc.at_s is not None and obs.proc_after.at_s is not None
    assert obs.proc_after.at_s - obs.proc.at_s == pytest.approx(20.0)
