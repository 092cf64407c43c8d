"""The daemon's loop on virtual time over the real NVML reader and the pynvml-level fake
(``probes/fake_nvml.py``: nvidia-ml-py's constants, structs and error classes): what a warm GPU
and an XID on a driver without the recovery action lead to, end to end (issue 36: M1, M4).

The reader's calls run inline on the loop (a thread would answer in real time while virtual time
runs ahead); the event wait returns at once and takes half a virtual second, so that an XID
pushed into the fake reaches the daemon as it would from NVML."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec, SupervisorConfig, SupervisorSettings
from llmsupervisor.core.findings import FindingKind, Severity
from llmsupervisor.core.node_condition import NodeCondition
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.requests import Request
from llmsupervisor.daemon.supervisor import Supervisor
from llmsupervisor.engine.status import EngineStatus
from llmsupervisor.notify import Notifier
from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml
from llmsupervisor.probes.gpu_threads import ThreadedGpuReader
from llmsupervisor.probes.nvml import NvmlReader
from tests.lib.engine_fakes import FakeProcesses, FakeSweeper, ServerScript
from tests.lib.virtual_time import run_virtual

SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown


class LoopNvml(FakeNvml):
    """The fake on virtual time: the event wait never blocks, and each GPU's duration counters
    (fields 269/270, ns) run at ``share`` of the loop's clock while ``running`` names them."""

    def __init__(self, devices: list[FakeDevice]) -> None:
        super().__init__(devices)
        self.running: dict[int, tuple[int, float]] = {}  # field id -> (share, since), GPU 0
        self._counted: dict[int, float] = {}

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        return super().nvmlEventSetWait(event_set, 0)

    def run_counter(self, field_id: int, share: float) -> None:
        self.running[field_id] = (int(share * 1e9), asyncio.get_running_loop().time())

    def nvmlDeviceGetFieldValues(self, h: Any, field_ids: list[int]) -> Any:
        now = asyncio.get_running_loop().time()
        dev = self.devices[0]
        for field_id, (rate_ns, since) in self.running.items():
            ret, value = dev.fields.get(field_id, (pynvml.NVML_SUCCESS, 0))
            last = self._counted.get(field_id, since)
            dev.fields[field_id] = (ret, value + int(rate_ns * (now - last)))
            self._counted[field_id] = now
        return super().nvmlDeviceGetFieldValues(h, field_ids)


@pytest.fixture
def inline_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    def inline(self: ThreadedGpuReader, key: str, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle() -> None:
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

        if key == "events":
            loop.call_later(0.5, settle)  # an event wait takes time, as NVML's does
        else:
            settle()
        return fut

    monkeypatch.setattr(ThreadedGpuReader, "_start", inline)


def engine(tmp_path: Path) -> tuple[EngineSpec, SupervisorConfig]:
    spec = EngineSpec(
        name="a",
        model="m",
        port=8000,
        gpus=(0,),
        command=("vllm-fake",),
        start_timeout_s=60.0,
        gpu_release_timeout_s=0.0,
        args={"max-num-seqs": 64},
        ladder=({"max-num-seqs": 16},),
        action_cooldown_s=0.0,
    )
    settings = SupervisorSettings(state_dir=tmp_path / "state", tick_interval_s=2.0)
    return spec, SupervisorConfig(path=tmp_path / "config.yaml", supervisor=settings, engines=(spec,))


class Daemon:
    """The supervisor's loop over ``fake``, one engine on GPU 0."""

    def __init__(self, tmp_path: Path, fake: FakeNvml) -> None:
        procs = FakeProcesses(state_dir=tmp_path)
        self.spec, config = engine(tmp_path)
        self.sup = Supervisor(
            config,
            notifier=Notifier(environ={}),
            gpu_reader=NvmlReader(fake),
            procs=procs,
            http_for=ServerScript(procs).http_for,
            sweeper=FakeSweeper(cpu_per_s=0.01),
        )
        self.findings: set[tuple[FindingKind, Severity]] = set()

    @property
    def status(self) -> EngineStatus:
        (status,) = self.sup.fleet.statuses()
        return status

    async def start(self) -> None:
        await self.sup.gpu_monitor.start()
        self.sup.fleet.add(self.spec)
        self.loop = asyncio.create_task(self.sup._loop())
        while self.status.state is not EngineState.READY:
            seen = self.sup.fleet.changes.version
            await aio.wait_any(self.sup.fleet.changes.wait(seen), timeout_s=600)

    async def run_for(self, seconds: float) -> None:
        for _ in range(int(seconds / 2)):
            await asyncio.sleep(2)
            self.findings |= {(f.kind, f.severity) for f in self.status.findings}

    async def stop(self) -> None:
        self.sup.submit(Request.SHUTDOWN)
        await self.loop
        self.sup.fleet.stop_all()
        await asyncio.wait_for(asyncio.gather(*self.sup.fleet.all_tasks()), 600)
        await self.sup.status_file.flush()
        await self.sup.gpu_monitor.close()


def test_a_warm_gpu_with_only_sw_thermal_is_reported_not_restarted(
    tmp_path: Path, inline_reader: None
) -> None:
    """87 C (an H100 SXM's max operating temperature), the clock-event mask showing SW thermal
    and the power cap, the SW thermal counter (field 269) running 80 % of the time: Boost holding
    the GPU at its limit under load. At 45 s and after ten minutes: no restart, no ladder step,
    THERMAL INFO only. The control: HW thermal for the same time steps the ladder down."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        fake = LoopNvml([FakeDevice("GPU-fake-0000")])
        d = Daemon(tmp_path, fake)
        await d.start()
        first = d.status.incarnation
        dev = fake.devices[0]
        dev.temperature_c, dev.clock_event_reasons, dev.power_mw = 87, SW_THERMAL | SW_POWER_CAP, 690_000
        fake.run_counter(pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN, 0.8)
        await d.run_for(46)
        at_45 = {"restarts": d.status.restarts_total, "step": d.status.ladder_step, "found": set(d.findings)}
        await d.run_for(600)
        warm = {
            "restarts": d.status.restarts_total,
            "step": d.status.ladder_step,
            "same_incarnation": d.status.incarnation == first,
            "found": set(d.findings),
        }
        # The control: HW thermal (the bit and field 270) steps the ladder down.
        dev.clock_event_reasons = HW_THERMAL
        fake.run_counter(pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN, 0.8)
        await d.run_for(180)
        hot = {"step": d.status.ladder_step, "causes": dict(d.status.restarts_by_reason)}
        await d.stop()
        return at_45, warm, hot

    at_45, warm, hot = run_virtual(scenario())
    assert at_45["restarts"] == 0 and at_45["step"] == 0
    assert warm == {
        "restarts": 0,
        "step": 0,
        "same_incarnation": True,
        "found": {(FindingKind.THERMAL, Severity.INFO), (FindingKind.POWER_THROTTLE, Severity.INFO)},
    }
    assert hot["step"] == 1 and hot["causes"] == {"step_down": 1}, hot


def test_xid_62_without_field_230_takes_the_gpu_out_at_once_with_no_restart(
    tmp_path: Path, inline_reader: None
) -> None:
    """An R550 driver: no field 230, no duration counters. XID 62 (PMU halt) is RESET_GPU in
    NVIDIA's XID catalogue: the GPU gets the node condition on the tick the event arrives, its
    engine is stopped, not restarted, and stays stopped."""

    async def scenario() -> dict[str, Any]:
        fake = LoopNvml([FakeDevice("GPU-fake-0000", fields={})])
        fake.driver_version = "550.127.05"
        d = Daemon(tmp_path, fake)
        await d.start()
        assert d.sup.gpu_monitor.latest[0].recovery_action is None  # type: ignore[union-attr]
        fake.xid(0, 62)
        for _ in range(10):  # a few ticks
            await asyncio.sleep(2)
            if d.sup.marks.conditions:
                break
        conditions = d.sup.marks.conditions
        await d.run_for(300)
        after = {
            "state": d.status.state,
            "restarts": d.status.restarts_total,
            "by_reason": dict(d.status.restarts_by_reason),
            "conditions": [(c.gpu, c.uuid, c.verdict) for c in conditions],
            "reason": conditions[0].reason if conditions else "",
            "marks": d.sup.marks.counts,
        }
        await d.stop()
        return after

    after = run_virtual(scenario())
    assert after["conditions"] == [(0, "GPU-fake-0000", "reset")]
    assert "xid 62 on GPU 0 (no recovery action; NVIDIA's XID catalogue: RESET_GPU)" in after["reason"]
    assert after["state"] is EngineState.STOPPED
    assert after["restarts"] == 0 and after["by_reason"] == {}
    assert after["marks"] == {0: 1}


def test_an_xid_the_catalogue_gives_no_fix_for_needs_a_look_not_a_restart_loop(
    tmp_path: Path, inline_reader: None
) -> None:
    """XID 61 (UNEXPECTED_ERR_REPORT_ISSUE) on a driver without field 230: "unknown" is a look,
    the condition at once, the engine stopped: never restarted onto a GPU nobody judged."""

    async def scenario() -> tuple[EngineState, int, list[str]]:
        fake = LoopNvml([FakeDevice("GPU-fake-0000", fields={})])
        fake.driver_version = "550.127.05"
        d = Daemon(tmp_path, fake)
        await d.start()
        fake.xid(0, 61)
        await d.run_for(120)
        result = d.status.state, d.status.restarts_total, [c.verdict for c in d.sup.marks.conditions]
        await d.stop()
        return result

    state, restarts, verdicts = run_virtual(scenario())
    assert (state, restarts, verdicts) == (EngineState.STOPPED, 0, ["unknown"])


def test_with_field_230_an_xid_with_action_none_restarts_and_counts(
    tmp_path: Path, inline_reader: None
) -> None:
    """The same XID 62 where the driver reads the recovery action NONE (R565+): the GPU's own
    verdict decides, a restart and a mark, no condition. The control for the tests above."""

    async def scenario() -> tuple[int, list[NodeCondition], dict[int, int]]:
        fake = LoopNvml([FakeDevice("GPU-fake-0000")])
        d = Daemon(tmp_path, fake)
        await d.start()
        fake.xid(0, 62)
        await d.run_for(120)
        result = (
            d.status.restarts_by_reason.get("gpu_fault", 0),
            list(d.sup.marks.conditions),
            d.sup.marks.counts,
        )
        await d.stop()
        return result

    restarts, conditions, marks = run_virtual(scenario())
    assert (restarts, conditions, marks) == (1, [], {0: 1})
