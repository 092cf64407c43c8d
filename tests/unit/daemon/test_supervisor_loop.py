"""The daemon's reconcile loop over eight runners with fake processes and a scripted server, on
virtual time (tests/lib/virtual_time.py): what one tick costs it, counted, not timed."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec, SupervisorConfig, SupervisorSettings
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.supervisor import Supervisor
from llmsupervisor.engine.commands import Desired
from llmsupervisor.notify import Notifier
from llmsupervisor.probes.fake_gpu import FakeGpu
from tests.lib.engine_fakes import FakeProcesses, FakeSweeper, ServerScript
from tests.lib.supervisor_run import stopped
from tests.lib.virtual_time import VirtualTimeLoop, run_virtual

ENGINES = 8


def config(tmp_path: Path) -> SupervisorConfig:
    engines = tuple(
        EngineSpec(
            name=f"e{i}",
            model="m",
            port=8000 + i,
            gpus=(),
            command=("vllm-fake",),
            start_timeout_s=60.0,
            gpu_release_timeout_s=0.0,
        )
        for i in range(ENGINES)
    )
    settings = SupervisorSettings(state_dir=tmp_path / "state", tick_interval_s=2.0)
    return SupervisorConfig(path=tmp_path / "config.yaml", supervisor=settings, engines=engines)


async def all_ready(sup: Supervisor) -> None:
    while not all(s.state is EngineState.READY for s in sup.fleet.statuses()):
        seen = sup.fleet.changes.version
        await aio.wait_any(sup.fleet.changes.wait(seen), timeout_s=600)


async def started(tmp_path: Path, sweeper: FakeSweeper) -> tuple[Supervisor, asyncio.Task[None]]:
    """Eight engines READY under the daemon's loop, over fake processes and a scripted server."""
    procs = FakeProcesses(state_dir=tmp_path)
    server = ServerScript(procs)
    sup = Supervisor(
        config(tmp_path),
        notifier=Notifier(environ={}),
        gpu_reader=FakeGpu(),
        procs=procs,
        http_for=server.http_for,
        sweeper=sweeper,
    )
    for spec in sup.config.engines:
        sup.fleet.add(spec)
    loop = asyncio.create_task(sup._loop())
    await all_ready(sup)
    return sup, loop


class ReadySeen(Notifier):
    """Records READY=1 (systemd's end of a unit's start) with its status line."""

    def __init__(self) -> None:
        super().__init__(environ={})
        self.ready_lines: list[str] = []

    def ready(self, status: str) -> bool:
        self.ready_lines.append(status)
        return True


def test_startup_completes_with_engines_an_operator_holds_out(tmp_path: Path) -> None:
    """READY=1 waited for every enabled engine to be READY or failed: one held stopped (STOPPED)
    or drained (DRAINING) across the daemon's restart never is, and systemd's start never ended.
    It waits for the engines meant to serve and not held by the operator (engine/status.py)."""
    holds = {"e0": Desired(run=False), "e1": Desired(run=True, held=True)}

    async def scenario() -> tuple[list[str], dict[str, EngineState]]:
        procs = FakeProcesses(state_dir=tmp_path)
        notifier = ReadySeen()
        sup = Supervisor(
            config(tmp_path),
            notifier=notifier,
            gpu_reader=FakeGpu(),
            procs=procs,
            http_for=ServerScript(procs).http_for,
            sweeper=FakeSweeper(cpu_per_s=0.01),
        )
        for spec in sup.config.engines:
            sup.fleet.add(spec, desired=holds.get(spec.name))
        loop = asyncio.create_task(sup._loop())
        await asyncio.sleep(120)
        states = {s.name: s.state for s in sup.fleet.statuses()}
        await stopped(sup, loop)
        return notifier.ready_lines, states

    ready_lines, states = run_virtual(scenario())
    assert states["e0"] is EngineState.STOPPED and states["e1"] is EngineState.DRAINING
    assert all(states[f"e{i}"] is EngineState.READY for i in range(2, ENGINES))
    assert len(ready_lines) == 1 and ready_lines[0].startswith("6/8 engines ready"), ready_lines


def test_observation_rounds_do_not_each_reconcile_the_fleet(tmp_path: Path) -> None:
    """Every round publishes a status and wakes the loop: eight engines, eight wakes a tick.
    A publish that changes nothing the policy reads costs no reconcile (it cost a full one, plus
    a walk over every engine, each: O(engines^2) a tick)."""

    async def scenario() -> tuple[int, int, int]:
        sup, loop = await started(tmp_path, FakeSweeper(cpu_per_s=0.01))
        await asyncio.sleep(10)
        rounds0 = sum(s.rounds_total for s in sup.fleet.statuses())
        reconciles0, ticks0 = sup.reconciles_total, sup.ticks_total
        await asyncio.sleep(120)
        rounds = sum(s.rounds_total for s in sup.fleet.statuses()) - rounds0
        reconciles, ticks = sup.reconciles_total - reconciles0, sup.ticks_total - ticks0
        await stopped(sup, loop)
        return rounds, reconciles, ticks

    rounds, reconciles, ticks = run_virtual(scenario())
    assert rounds >= ENGINES * 50  # every engine observed about every 2 s
    assert ticks >= 55
    # One reconcile per tick for the decisions time makes; none per round.
    assert reconciles <= ticks + 2, (rounds, reconciles, ticks)


def test_a_finding_reconciles_at_once_not_at_the_next_tick(tmp_path: Path) -> None:
    async def scenario() -> tuple[float, float]:
        sweeper = FakeSweeper(cpu_per_s=0.01)
        sup, loop = await started(tmp_path, sweeper)
        await asyncio.sleep(10)
        sweeper.stopped = True  # every engine's process stopped: HANG, and the policy restarts
        found_s = restarted_s = None
        while restarted_s is None:
            await asyncio.sleep(0.01)
            acted = any(s.restarts_by_reason.get("hang") for s in sup.fleet.statuses()) or any(
                s.state is EngineState.STOPPING for s in sup.fleet.statuses()
            )
            # A hang's kill is SIGKILL at once (engine/evidence.py): found, acted on and its
            # finding closed may all fall within one 10 ms poll.
            if found_s is None and (acted or any(s.findings for s in sup.fleet.statuses())):
                found_s = aio.now()
            if acted:
                restarted_s = aio.now()
        sweeper.stopped = False
        await stopped(sup, loop)
        assert found_s is not None
        return found_s, restarted_s

    found_s, restarted_s = run_virtual(scenario())
    assert restarted_s - found_s < 0.5  # not the next tick's reconcile, 2 s later


def test_a_reload_and_a_due_schedule_never_take_two_engines_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect E1: the reload's roll decided capacity on its own, blind to the commands the
    policy had sent and the runner not yet taken, so a config roll and a scheduled restart could
    take two engines out with max_unavailable=1. A reload with two changed engines, at the very
    moment a third one's scheduled restart is due: every publish sees at most one engine that is
    not READY, and all three end up restarted (two on their new spec)."""
    base = config(tmp_path)
    c = dataclasses.replace(base.engines[2], restart_every_h=0.01, restart_jitter_s=0.0)  # 36 s
    current = dataclasses.replace(base, engines=(base.engines[0], base.engines[1], c))
    changed = tuple(dataclasses.replace(e, args={"max-num-seqs": 8}) for e in current.engines[:2])
    new = dataclasses.replace(current, engines=(*changed, c))
    monkeypatch.setattr("llmsupervisor.daemon.reload.load_config", lambda path: new)

    async def scenario() -> tuple[int, list[str]]:
        procs = FakeProcesses(state_dir=tmp_path)
        server = ServerScript(procs)
        sup = Supervisor(
            current,
            notifier=Notifier(environ={}),
            gpu_reader=FakeGpu(),
            procs=procs,
            http_for=server.http_for,
            sweeper=FakeSweeper(cpu_per_s=0.01),
        )
        for spec in sup.config.engines:
            sup.fleet.add(spec)
        most_out = 0
        publish = sup.fleet.changes.set

        def counted(name: str | None = None) -> None:  # every runner publish passes here
            nonlocal most_out
            out = sum(1 for s in sup.fleet.statuses() if s.state is not EngineState.READY)
            most_out = max(most_out, out)
            publish(name)

        loop = asyncio.create_task(sup._loop())
        await all_ready(sup)
        inc = sup.fleet.status("e2").incarnation  # type: ignore[union-attr]
        assert inc is not None and inc.scheduled_due_s is not None
        await asyncio.sleep(inc.scheduled_due_s - aio.now())  # the schedule is due now
        sup.fleet.changes.set = counted  # type: ignore[method-assign]
        reply = await sup.reload()
        assert reply["rolling"] == ["e0", "e1"]
        while not (
            all(s.state is EngineState.READY for s in sup.fleet.statuses())
            and all(s.spec == t for s, t in zip(sup.fleet.statuses(), new.engines, strict=True))
            and sup.fleet.status("e2").restarts_by_reason.get("scheduled")  # type: ignore[union-attr]
        ):
            seen = sup.fleet.changes.version
            await aio.wait_any(sup.fleet.changes.wait(seen), timeout_s=600)
        sup.fleet.changes.set = publish  # type: ignore[method-assign]  # the shutdown stops them all
        causes = [
            reason
            for s in sup.fleet.statuses()
            for reason, n in s.restarts_by_reason.items()
            for _ in range(n)
        ]
        await stopped(sup, loop)
        return most_out, sorted(causes)

    most_out, causes = run_virtual(scenario())
    assert most_out == 1
    assert causes[:3] == ["config_change", "config_change", "scheduled"]


@pytest.mark.parametrize("pids_visible", [False, True])
def test_container_pids_raise_no_foreign_finding_on_the_engines_own_gpu(
    tmp_path: Path, pids_visible: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: NVML reports host PIDs. In a pod without hostPID the engine's own EngineCore
    (host PID 987654, never a PID the daemon's /proc shows) holds 70 GiB on its GPU: that is not
    foreign memory. The real reader over the pynvml-level fake; two minutes of virtual time, past
    the finding's 60 s sustain. With the PIDs visible (bare metal) the same process is foreign:
    the control that the scenario reaches the detector."""
    from llmsupervisor.probes import ProbeFailure
    from llmsupervisor.probes.fake_nvml import GIB, FakeDevice, FakeNvml
    from llmsupervisor.probes.gpu_threads import ThreadedGpuReader
    from llmsupervisor.probes.nvml import NvmlReader

    threaded = ThreadedGpuReader._start

    def inline(self: ThreadedGpuReader, key: str, fn: Any) -> asyncio.Future[Any]:
        # The reader's calls run inline, not in threads: a thread answers in real time while
        # virtual time runs ahead to the call's deadline (tests/lib/virtual_time.py). The event
        # wait blocks for its timeout, so it keeps its thread.
        if key == "events":
            return threaded(self, key, fn)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn())
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    monkeypatch.setattr(ThreadedGpuReader, "_start", inline)

    async def scenario() -> set[str]:
        procs = FakeProcesses(state_dir=tmp_path)
        server = ServerScript(procs)
        device = FakeDevice("GPU-fake-0000", processes=[(987654, 70 * GIB)], memory_used=70 * GIB)
        reader = NvmlReader(FakeNvml([device]), pids_visible=pids_visible)
        spec = dataclasses.replace(config(tmp_path).engines[0], gpus=(0,))
        sup = Supervisor(
            dataclasses.replace(config(tmp_path), engines=(spec,)),
            notifier=Notifier(environ={}),
            gpu_reader=reader,
            procs=procs,
            http_for=server.http_for,
            sweeper=FakeSweeper(cpu_per_s=0.01),
        )
        await sup.gpu_monitor.start()
        sup.fleet.add(spec)
        loop = asyncio.create_task(sup._loop())
        await all_ready(sup)
        kinds: set[str] = set()
        for _ in range(60):
            await asyncio.sleep(2)
            kinds |= {f.kind.value for s in sup.fleet.statuses() for f in s.findings}
            if "foreign_gpu_memory" in kinds:
                break
        # The detector saw the process both ways: the reader had sampled it.
        sample = sup.gpu_monitor.latest.get(0)
        assert sample is not None and not isinstance(sample, ProbeFailure), sample
        await stopped(sup, loop)
        await sup.gpu_monitor.close()
        return kinds

    kinds = run_virtual(scenario())
    assert ("foreign_gpu_memory" in kinds) is pids_visible, kinds


def test_a_tick_that_runs_late_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """CI, stop 30: a blocking call held the loop about 7 s and every balancer check of the
    daemon timed out, with nothing in the daemon's log to say so."""

    async def scenario() -> None:
        sup, loop = await started(tmp_path, FakeSweeper(cpu_per_s=0.01))
        await asyncio.sleep(10)
        assert "loop ran" not in caplog.text
        virtual = asyncio.get_running_loop()
        assert isinstance(virtual, VirtualTimeLoop)
        virtual.hold(7.0)  # a 7 s call on the loop: no callback ran meanwhile
        await asyncio.sleep(0.1)
        await stopped(sup, loop)

    with caplog.at_level(logging.WARNING, logger="llmsupervisor"):
        run_virtual(scenario())
    late = [r.getMessage() for r in caplog.records if "loop ran" in r.getMessage()]
    assert len(late) == 1 and float(late[0].split()[4]) > 5.0, late
