"""EngineRunner with fake processes and a scripted server, on virtual time.

Each test drives one runner through commands and reads only what it publishes (its statuses),
as the daemon does. Minutes of engine time pass in milliseconds (tests/lib/virtual_time.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest

from llmsupervisor import aio
from llmsupervisor.core.findings import FindingKind
from llmsupervisor.engine.commands import Hold, ResetPrefixCache, Restart, Shed, Start, StepTo, Stop
from llmsupervisor.engine.http import _success
from llmsupervisor.engine.ledger import History, Ledger
from llmsupervisor.engine.observer import canary_deadline_s
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuSample
from tests.lib.engine_fakes import metrics
from tests.lib.held_disk import HeldDisk
from tests.lib.runner_harness import Harness, S, ready_as, run, spec


def test_start_reaches_ready_with_a_first_incarnation(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        status = await h.state(S.READY)
        assert status.incarnation is not None and status.incarnation.number == 1
        assert status.in_rotation and status.pid == h.procs.spawned[0].pid
        assert "--port" in h.procs.spawned[0].argv
        assert h.states == [S.STOPPED, S.STARTING, S.READY]
        await h.close()
        assert h.states[-2:] == [S.STOPPING, S.STOPPED]
        assert h.procs.spawned[0].signals[0] == ("main", signal.SIGTERM)  # vLLM drains on this one

    run(scenario)


def test_crash_is_restarted_at_once_then_backs_off_then_gives_up(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(max_failures=3))
        for n in range(3):
            await h.until(ready_as(n + 1))
            h.procs.live[-1].exit(code=0)  # vLLM exits 0 when its engine core dies: still a crash
        status = await h.state(S.FATAL)
        assert status.failures == 3 and "giving up" in status.state_reason
        assert status.restarts_by_reason == {"crash": 2}
        backoffs = [s.state_reason for s in h.changes.published if s.state is S.BACKOFF]
        assert "restarting in 0.0 s" in backoffs[0]  # the first failure: at once
        assert "restarting in 0.0 s" not in backoffs[-1]
        # An operator's start resets the budget and tries again.
        h.send(Start())
        await h.until(lambda s: s.state is S.READY and s.failures == 0)
        await h.close()

    run(scenario)


def test_planned_restart_drains_first_and_counts_its_cause(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        h.server.metrics = metrics(running=2)
        h.send(Restart(cause="operator", reason="asked"))
        await h.state(S.DRAINING)
        drained_at = aio.now()
        await asyncio.sleep(10)
        assert h.procs.spawned[0].signals == []  # requests still in flight: no signal yet
        h.server.metrics = metrics(running=0)
        status = await h.until(ready_as(2))
        assert status.restarts_by_reason == {"operator": 1}
        assert h.procs.spawned[0].signals[0] == ("main", signal.SIGTERM)
        assert aio.now() - drained_at >= 10
        assert h.states == [
            S.STOPPED,
            S.STARTING,
            S.READY,
            S.DRAINING,
            S.STOPPING,
            S.STOPPED,
            S.STARTING,
            S.READY,
        ]
        await h.close()

    run(scenario)


def test_stop_during_start_is_immediate(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(start_timeout_s=1200))
        h.server.ready_after_s = 600
        await h.state(S.STARTING)
        await asyncio.sleep(5)
        asked = aio.now()
        h.send(Stop())
        await h.state(S.STOPPED)
        assert aio.now() - asked < 5
        assert len(h.procs.spawned) == 1 and not h.procs.live
        await h.close()

    run(scenario)


def test_restart_during_start_abandons_the_start_and_starts_again_at_once(tmp_path: Path) -> None:
    """An operator's restart of a STARTING engine used to wait for the whole start to finish and
    then restart it: two full model loads for one command."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(start_timeout_s=1200))
        h.server.ready_after_s = 600
        await h.state(S.STARTING)
        await asyncio.sleep(30)
        asked = aio.now()
        h.send(Restart(cause="operator", reason="asked"))
        await h.until(lambda s: len(h.procs.spawned) == 2)
        assert aio.now() - asked < 5  # not after the 600 s load
        assert h.procs.spawned[0].returned
        await h.state(S.READY)
        assert aio.now() - asked < 600 + 10
        assert h.status.restarts_by_reason == {"operator": 1}
        await h.close()

    run(scenario)


def test_restart_during_backoff_starts_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(backoff_initial_s=300, backoff_max_s=300))
        for n in (1, 2):
            await h.until(ready_as(n))
            h.procs.live[-1].exit(code=1)
            await h.published(lambda s: s.state is S.BACKOFF)
        assert h.status.state is S.BACKOFF  # the second failure waits
        asked = aio.now()
        h.send(Restart(cause="operator", reason="asked"))
        await h.state(S.STARTING)
        assert aio.now() - asked < 1
        await h.close()

    run(scenario)


def test_config_restart_drains_on_the_old_port_and_starts_on_the_new(tmp_path: Path) -> None:
    """Defect D4: the new spec was applied before the drain, which then polled the new port."""

    async def scenario() -> None:
        old = spec(port=8000)
        h = Harness(tmp_path, old)
        await h.state(S.READY)
        h.server.metrics = metrics(running=1)
        h.server.calls.clear()
        h.send(Restart(cause="config_change", reason="config changed", spec=replace(old, port=8001)))
        await h.state(S.DRAINING)
        await asyncio.sleep(8)
        h.server.metrics = metrics(running=0)
        await h.until(lambda s: s.state is S.READY and s.spec.port == 8001)
        drain_urls = {url for what, url in h.server.calls if what == "metrics"}
        assert "http://127.0.0.1:8000" in drain_urls
        assert "--port" in h.procs.spawned[1].argv and "8001" in h.procs.spawned[1].argv
        assert h.procs.spawned[0].signals[0] == ("main", signal.SIGTERM)
        await h.close()

    run(scenario)


def test_a_restart_of_a_stopped_engine_applies_its_spec_and_leaves_it_stopped(tmp_path: Path) -> None:
    """Defect D5: a reload that changed a stopped engine's spec started it."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        h.send(Stop())
        await h.state(S.STOPPED)
        h.send(Restart(cause="config_change", reason="config changed", spec=spec(port=8002)))
        await h.until(lambda s: s.spec.port == 8002)
        await asyncio.sleep(60)
        assert h.status.state is S.STOPPED and len(h.procs.spawned) == 1
        h.send(Start())
        status = await h.state(S.READY)
        assert "8002" in h.procs.spawned[1].argv and status.spec.port == 8002
        await h.close()

    run(scenario)


def test_crash_loop_budget_counts_failed_slow_starts_outside_the_window(tmp_path: Path) -> None:
    """Every start fails after 10 minutes: no three failures ever fall within the 15-minute
    window, yet the engine never serves; it must reach FATAL after max_failures."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(start_timeout_s=600, max_failures=3, failure_window_s=900))
        h.server.ready_after_s = 10_000  # never ready
        status = await h.state(S.FATAL, timeout_s=6 * 3600)
        assert status.failures == 3
        assert len(h.procs.spawned) == 3
        await h.close()

    run(scenario)


@pytest.mark.parametrize("broken", ["record", "cache_dir"])
def test_a_full_or_read_only_state_dir_fails_the_start_not_the_runner(tmp_path: Path, broken: str) -> None:
    """Defect D7: an OSError from the state dir crashed the runner task."""

    async def scenario() -> None:
        state_dir = tmp_path / "state"
        state_dir.mkdir()
        if broken == "cache_dir":
            (state_dir / "engines").write_text("not a directory")
        h = Harness(
            state_dir,
            spec(max_failures=2),
            record_error=OSError(28, "No space left on device") if broken == "record" else None,
        )
        status = await h.state(S.FATAL)
        assert not h.task.done()
        assert "cannot" in (status.last_failure or "")
        assert not h.procs.live  # a spawned process whose group could not be recorded is stopped
        await h.close()

    run(scenario)


def test_an_exec_failure_is_a_failed_start(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(
            tmp_path, spec(max_failures=1), exec_error=FileNotFoundError(2, "No such file or directory")
        )
        status = await h.state(S.FATAL)
        assert "cannot execute" in (status.last_failure or "")
        await h.close()

    run(scenario)


def test_drain_then_start_of_a_shed_engine(tmp_path: Path) -> None:
    """Defect D1: SHEDDING, an operator drain, then `start` raised IllegalTransition DRAINING ->
    SHEDDING, killed the runner task and cold-loaded the model."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        h.send(Shed("kv pressure"))
        await h.state(S.SHEDDING)
        h.send(Hold(True))
        await h.state(S.DRAINING)
        h.send(Start())
        await h.state(S.READY)
        h.send(Shed("kv pressure"))  # the policy sheds it again
        await h.state(S.SHEDDING)
        assert not h.task.done()
        assert len(h.procs.spawned) == 1  # no restart at any point
        await h.close()

    run(scenario)


def test_a_ready_incarnation_is_published_with_its_own_due_time(tmp_path: Path) -> None:
    """Defect D2: READY was published (and the policy run) before the new incarnation's
    scheduled-restart due time was set, so the policy saw the previous one's, long past."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(restart_every_h=0.5, restart_jitter_s=0.0))
        for n in (1, 2):
            await h.until(ready_as(n))
            h.send(Restart(cause="scheduled", reason="due"))
        await h.until(ready_as(3))
        for s in h.changes.published:
            if s.state is S.READY:
                assert s.incarnation is not None and s.incarnation.scheduled_due_s is not None
                assert s.incarnation.scheduled_due_s > s.state_since_s  # never the last one's
                assert s.incarnation.ready_since_s is not None
        await h.close()

    run(scenario)


class RecordingGpus:
    def __init__(self) -> None:
        self.since: list[float | None] = []

    def samples_for(self, gpus: Iterable[int]) -> dict[int, GpuSample | ProbeFailure]:
        return {}

    def take_events(self, gpus: Iterable[int], since_s: float | None = None) -> tuple[GpuEvent, ...]:
        self.since.append(since_s)
        return ()


def test_gpu_events_are_asked_for_since_the_incarnation_began(tmp_path: Path) -> None:
    """Defect D8: XIDs received during the previous incarnation's stop were replayed into the
    new one. The observer asks only for events since its incarnation was spawned."""

    async def scenario() -> None:
        gpus = RecordingGpus()
        h = Harness(tmp_path, spec(), gpus=gpus)
        first = await h.state(S.READY)
        await asyncio.sleep(10)
        h.send(Restart(cause="operator", reason="asked"))
        second = await h.until(ready_as(2))
        await asyncio.sleep(10)
        assert first.incarnation is not None and second.incarnation is not None
        assert set(gpus.since) == {first.incarnation.started_s, second.incarnation.started_s}
        await h.close()

    run(scenario)


def test_oom_at_start_is_published_and_the_step_applies_to_the_next_spawn(tmp_path: Path) -> None:
    async def scenario() -> None:
        ladder = ({"max-num-seqs": 16},)
        h = Harness(tmp_path, spec(ladder=ladder, backoff_initial_s=30))
        await h.state(S.READY)
        h.procs.live[-1].exit(code=1)  # first failure: restart at once
        await h.state(S.STARTING)
        proc = h.procs.live[-1]
        proc.say("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        await h.until(lambda s: s.start_failed_oom)
        proc.exit(code=1)
        status = await h.state(S.BACKOFF)
        assert status.start_failed_oom and status.ladder_step == 0
        h.send(StepTo(1, "oom_at_start"))  # what the policy sends for it
        status = await h.until(ready_as(3))
        assert status.ladder_step == 1 and not status.start_failed_oom
        assert "--max-num-seqs" in h.procs.spawned[-1].argv
        await h.close()

    run(scenario)


def test_output_and_prefix_reset_reach_the_status_through_the_runner_task_only(tmp_path: Path) -> None:
    """Issue 22: the output readers and a prefix-cache reset run as their own tasks; they report
    to the runner's inbox, and the runner publishes what they saw from its own task, at its next
    wait. Before, they called the runner back and published from their tasks."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(ladder=({"max-num-seqs": 16},)))
        h.server.ready_after_s = 1e9  # a long load: the runner waits in its readiness polls
        await h.state(S.STARTING)
        proc = h.procs.live[-1]
        proc.say("INFO 05-01 12:00:00 [default_loader.py:262] Loading weights took 3.2 seconds")
        proc.say("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        status = await h.until(lambda s: s.start_failed_oom and s.start_phase == "compiling")
        assert status.state is S.STARTING
        h.server.ready_after_s = 0.0
        await h.state(S.READY)
        assert h.status.prefix_reset_supported is None
        h.send(ResetPrefixCache("test"))
        await h.until(lambda s: s.prefix_reset_supported is True and not s.busy)
        assert ("reset_prefix_cache", spec().base_url) in h.server.calls
        await h.close()
        assert h.changes.publishers and all(task is h.task for task in h.changes.publishers)

    run(scenario)


def test_the_published_batch_step_is_the_running_process_step(tmp_path: Path) -> None:
    """A step change waits for the restart: until the new process runs, the status shows the
    step the running process was started with."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(ladder=({"max-num-seqs": 16},)))
        await h.state(S.READY)
        h.server.metrics = metrics(running=1)
        h.send(StepTo(1, "thermal"), Restart(cause="step_down", reason="thermal"))
        await h.state(S.DRAINING)
        assert h.status.ladder_step == 0 and h.status.busy
        h.server.metrics = metrics(running=0)
        status = await h.until(ready_as(2))
        assert status.ladder_step == 1
        for s in h.changes.published:
            if s.incarnation is not None:
                assert s.ladder_step == s.incarnation.step
        await h.close()

    run(scenario)


def test_a_step_down_on_a_held_disk_drains_at_once_and_lands_on_disk_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI, stop 30: the ladder step was saved (two fsyncs) on the loop; a busy disk held it
    about 7 s, every load balancer check of the daemon timed out, and HAProxy had no server left
    for a second (1,894 requests got 503). The step now goes to disk in a thread: the runner
    drains while the disk still holds the write."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(ladder=({"max-num-seqs": 16},)))
        await h.state(S.READY)
        disk = HeldDisk(monkeypatch)
        h.server.metrics = metrics(running=1)
        h.send(StepTo(1, "thermal"), Restart(cause="step_down", reason="thermal"))
        await h.state(S.DRAINING)  # before the disk answered: on the loop, the fsync would wait 30 s
        assert await asyncio.to_thread(disk.entered.wait, 30)  # the save is under way, held
        disk.release()
        h.server.metrics = metrics(running=0)
        status = await h.until(ready_as(2))
        assert status.ladder_step == 1
        await h.close()

    run(scenario)
    saved = tmp_path.glob("**/engines/*/ladder.json")
    assert [json.loads(p.read_text())["step"] for p in saved] == [1]


def test_hung_canary_does_not_hold_a_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(live_canary_timeout_s=300, canary_interval_s=1))
        await h.state(S.READY)
        h.server.canary_hangs = True
        await asyncio.sleep(5)
        asked = aio.now()
        h.send(Restart(cause="hang", reason="hung", drain=False, failure=True))
        await h.published(lambda s: s.state is S.BACKOFF)
        assert aio.now() - asked < 5
        await h.close()

    run(scenario)


def hang_findings(h: Harness) -> list[str]:
    """The rule of every HANG finding the runner published, in order."""
    return [
        str(f.evidence["rule"]) for s in h.changes.published for f in s.findings if f.kind is FindingKind.HANG
    ]


def test_stopped_engine_process_is_found_hung_within_5_s(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        await asyncio.sleep(7)
        assert hang_findings(h) == []
        frozen_s = aio.now()
        h.sweeper.stopped = True  # SIGSTOP: the canary still answers here (a fake server)
        await h.published(lambda s: any(f.kind is FindingKind.HANG for f in s.findings))
        assert aio.now() - frozen_s <= 5.0  # virtual time: the tick, the sweeps, the rule
        assert set(hang_findings(h)) == {"stopped"}
        await h.close()

    run(scenario)


def test_canary_missed_with_no_cpu_used_is_found_hung_within_5_s(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        h.sweeper.cpu_per_s = 0.01  # idle: the API server answering /health
        await h.state(S.READY)
        await asyncio.sleep(7)
        frozen_s = aio.now()
        h.server.canary_hangs = True  # a deadlocked core: no answer, no CPU
        h.sweeper.cpu_per_s = 0.0
        await h.published(lambda s: any(f.kind is FindingKind.HANG for f in s.findings))
        assert aio.now() - frozen_s <= 5.0
        assert hang_findings(h)[0] == "cpu_idle"
        await h.close()

    run(scenario)


def test_long_prefill_is_not_called_hung(tmp_path: Path) -> None:
    """One long step: requests running, counters frozen, every canary queued behind it and
    missing its (learned, 1 s) deadline, the engine computing: no finding before hang_after_s."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        await asyncio.sleep(5)
        h.server.metrics = metrics(running=1, steps=50)
        h.server.canary_hangs = True
        h.sweeper.cpu_per_s = 1.0
        await asyncio.sleep(11)
        assert hang_findings(h) == []
        h.server.metrics = metrics(running=1, steps=51)  # the step ends
        h.server.canary_hangs = False
        await asyncio.sleep(30)
        assert hang_findings(h) == []
        await h.close()

    run(scenario)


@pytest.mark.parametrize(("metrics_interval_s", "per_health"), [(4.0, 0.5), (0.0, 1.0)])
def test_metrics_body_is_read_less_often_than_health(
    tmp_path: Path, metrics_interval_s: float, per_health: float
) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(metrics_interval_s=metrics_interval_s))
        await h.state(S.READY)
        h.server.calls.clear()
        await asyncio.sleep(60)
        health = sum(1 for what, _ in h.server.calls if what == "health")
        scrapes = sum(1 for what, _ in h.server.calls if what == "metrics")
        assert health >= 28  # every 2 s round
        assert abs(scrapes - per_health * health) <= 1
        await h.close()

    run(scenario)


def test_live_canary_deadline_is_learned_within_its_bounds() -> None:
    s = spec(live_canary_timeout_s=3.0, live_canary_min_timeout_s=1.0, live_canary_timeout_factor=4.0)
    assert canary_deadline_s([], s) == 3.0  # nothing learned yet: the ceiling
    assert canary_deadline_s([0.02, 0.05, 0.03], s) == 1.0  # 4 x 50 ms: the floor
    assert canary_deadline_s([0.02, 0.5], s) == 2.0  # 4 x the slowest
    assert canary_deadline_s([2.0], s) == 3.0  # never above the ceiling
    # A ceiling set below the floor's default is a fixed deadline, as before it was learned.
    assert canary_deadline_s([0.01], spec(live_canary_timeout_s=0.5)) == 0.5


def test_engine_dead_health_restarts(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        h.server.health_status = 503
        status = await h.published(lambda s: s.state is S.BACKOFF)
        assert "engine core is dead" in status.state_reason
        h.server.health_status = 200
        status = await h.until(ready_as(2))
        assert status.restarts_by_reason == {"engine_dead": 1}
        await h.close()

    run(scenario)


def test_history_carries_over_to_a_successor_runner(tmp_path: Path) -> None:
    async def scenario() -> None:
        history = History(restarts_total=4, restarts_by_reason={"crash": 4})
        h = Harness(tmp_path, spec(), ledger=Ledger("e", now=aio.now(), history=history))
        status = await h.state(S.READY)
        assert status.restarts_total == 4
        await h.close()

    run(scenario)


@pytest.mark.parametrize(
    ("body", "success"),
    [
        ('{"success": true}', True),
        ('{"success": false}', False),
        ("", True),
        ('{"detail": "false alarm"}', True),
    ],
)
def test_prefix_reset_reads_the_success_field(body: str, success: bool) -> None:
    """Defect D12: any body containing "false" was read as a refusal."""
    assert _success(body) is success


def test_the_down_clock_runs_only_while_the_engine_is_meant_to_serve_and_does_not(tmp_path: Path) -> None:
    """The LlmSupervisorEngineDown alert reads it (llmsupervisor_engine_down_seconds): a start
    counts, an operator's hold or stop does not, and a hold's end starts the clock afresh."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        starting = await h.published(lambda s: s.state is S.STARTING)
        assert starting.down_since_s is not None
        ready = await h.state(S.READY)
        assert ready.down_since_s is None
        h.send(Shed("kv pressure"))
        assert (await h.state(S.SHEDDING)).down_since_s is None  # alive, out of rotation on purpose
        h.send(Hold(True))
        assert (await h.state(S.DRAINING)).down_since_s is None
        h.send(Stop())
        assert (await h.state(S.STOPPED)).down_since_s is None
        await asyncio.sleep(600)
        h.send(Start())
        restarting = await h.published(lambda s: s.state is S.STARTING)
        assert restarting.down_since_s is not None and aio.now() - restarting.down_since_s < 60
        await h.state(S.READY)
        h.procs.spawned[-1].exit(code=1)
        crashed = await h.published(lambda s: s.state is not S.READY)
        assert crashed.down_since_s is not None
        assert (await h.state(S.READY)).down_since_s is None
        await h.close()

    run(scenario)


def test_what_an_engine_prints_while_the_daemon_stops_it_is_shutdown_output(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM logs EngineDeadError at ERROR on a clean drain: during a planned restart that is
    INFO, marked as shutdown output (issue 26, point 2); a crash's last words keep their level."""
    dead = "ERROR 11-23 [async_llm.py:906] AsyncLLM output_handler failed. EngineDeadError"

    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        h.send(Restart(cause="operator", reason="asked"))
        await h.state(S.STOPPING)
        h.procs.spawned[0].say(dead)
        h.procs.spawned[0].say("nanobind: leaked 3 instances!", stderr=True)
        await h.until(ready_as(2))
        h.procs.spawned[1].say("ERROR 11-23 [core.py:1] EngineCore failed: boom")
        await asyncio.sleep(0.1)
        h.procs.spawned[1].exit(code=1)
        await h.until(ready_as(3))
        await h.close()

    with caplog.at_level(logging.INFO, logger="llmsupervisor.engine.output"):
        run(scenario)
    forwarded = [r for r in caplog.records if r.name == "llmsupervisor.engine.output"]
    stopping = [(r.levelno, r.getMessage()) for r in forwarded if getattr(r, "engine_shutdown", False)]
    assert (logging.INFO, dead) in stopping
    assert (logging.INFO, "nanobind: leaked 3 instances!") in stopping
    crash = [r for r in forwarded if "boom" in r.getMessage()]
    assert [r.levelno for r in crash] == [logging.ERROR]
    assert not getattr(crash[0], "engine_shutdown", False)
    assert all(r.levelno <= logging.INFO for r in forwarded if getattr(r, "engine_shutdown", False))


def test_a_crash_loop_says_what_the_engine_printed_and_a_restart_keeps_its_cause(tmp_path: Path) -> None:
    """ "exited with code 1" alone did not say why (issue 26, point 3): the reason ends with the
    engine's last error line; the status carries the last restart's cause and reason."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(max_failures=5))
        await h.state(S.READY)
        proc = h.procs.live[-1]
        proc.say("ERROR 11-23 [core.py:1] EngineCore failed to start.")
        proc.say("Traceback (most recent call last):", stderr=True)
        proc.say('  File "x.py", line 1, in <module>', stderr=True)
        proc.say("ValueError: head_dim 16 is not supported", stderr=True)
        proc.say("INFO 11-23 bye")
        await asyncio.sleep(0.1)
        proc.exit(code=1)
        status = await h.until(ready_as(2))
        assert status.last_failure is not None
        assert status.last_failure.endswith(
            "exited with code 1 unexpectedly: ValueError: head_dim 16 is not supported"
        )
        assert status.last_restart is not None and status.last_restart.cause == "crash"
        assert status.last_restart.reason == status.last_failure
        h.send(Restart(cause="operator", reason="asked"))
        status = await h.until(ready_as(3))
        assert status.last_restart is not None
        assert (status.last_restart.cause, status.last_restart.reason) == ("operator", "asked")


def test_an_engine_out_of_rotation_gets_no_canary_and_one_back_in_gets_one_at_once(tmp_path: Path) -> None:
    """Issue 26 (8): the daemon's canary kept going to a drained engine, where a drain counted it
    as "1 requests in flight"; out of rotation, a hang hurts no user."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(canary_interval_s=1))
        await h.state(S.READY)
        await asyncio.sleep(5)
        canaries = [c for c in h.server.calls if c[0] == "canary"]
        assert canaries  # in rotation: canaries go
        h.send(Hold(True))
        await h.state(S.DRAINING)
        sent_before = len([c for c in h.server.calls if c[0] == "canary"])
        await asyncio.sleep(20)
        assert len([c for c in h.server.calls if c[0] == "canary"]) == sent_before
        assert any(c[0] == "health" for c in h.server.calls[-3:])  # still observed
        h.send(Hold(False))
        await h.state(S.READY)
        await asyncio.sleep(2.5)  # the first round back: one tick
        assert len([c for c in h.server.calls if c[0] == "canary"]) > sent_before
        await h.close()

    run(scenario)


def test_requests_running_counts_users_not_the_daemons_canary(tmp_path: Path) -> None:
    """Issue 26 (8): vLLM counts the canary in num_requests_running while it runs; the status
    (and a drain's "requests in flight") counts only users' requests."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(canary_interval_s=1))
        h.server.canary_delay_s = 0.5  # still running when /metrics answers
        h.server.metrics = metrics(running=1)  # ... and counted there by vLLM
        await h.state(S.READY)
        await h.published(lambda s: s.load is not None and s.rounds_total >= 3)
        assert h.status.load is not None and h.status.load.requests_running == 0
        h.server.metrics = metrics(running=3)  # two users and the canary
        await asyncio.sleep(5)
        assert h.status.load is not None and h.status.load.requests_running == 2
        h.send(Hold(True))  # out of rotation: no canary, every running request is a user's
        await h.state(S.DRAINING)
        await asyncio.sleep(5)
        assert h.status.load is not None and h.status.load.requests_running == 3
        await h.close()

    run(scenario)


def test_a_stop_of_a_fatal_engine_is_recorded_and_start_still_retries(tmp_path: Path) -> None:
    """Issue 39 (3): `stop` on a FATAL engine answered "already stopped" and left it FATAL, so
    `status` kept alerting on an engine the operator had put away. It is STOPPED now, and
    `start` still gets its failure budget back."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec(max_failures=1))
        await h.until(ready_as(1))
        h.procs.live[-1].exit(code=1)
        await h.state(S.FATAL)
        h.send(Stop())
        status = await h.state(S.STOPPED)
        assert not status.running and status.held_by_operator and status.incarnation is None
        assert status.state_reason == "stop requested: stopped (it had given up)"
        h.send(Start())
        await h.until(lambda s: s.state is S.READY and s.failures == 0)
        await h.close()

    run(scenario)


def test_back_in_rotation_the_reason_says_ready_and_the_event_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 39 (4): "drain cancelled: back in rotation" stayed the READY engine's reason for as
    long as it served. The reason describes the present; the transition's log line, why."""

    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        await h.state(S.READY)
        h.send(Hold(True))
        await h.state(S.DRAINING)
        h.send(Start())
        status = await h.state(S.READY)
        assert status.state_reason == "ready"
        await h.close()

    with caplog.at_level(logging.INFO, logger="llmsupervisor"):
        run(scenario)
    assert "DRAINING -> READY: drain cancelled: back in rotation" in caplog.text
