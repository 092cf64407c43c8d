"""GpuMonitor: samples and failures keyed by each GPU's true NVML index, over a scripted FakeGpu."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from llmsupervisor.daemon.exporter import gpu_metric_values
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.fake_gpu import FakeGpu, nominal_sample
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuLost
from llmsupervisor.probes.gpus import GpuMonitor


async def until(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not true within {timeout_s} s")


def test_samples_go_to_the_gpus_true_index_when_one_is_missing_from_nvml() -> None:
    # NVML could not read GPU 0 at open and left it out: it lists indices 1 and 2 only.
    cool = nominal_sample(1)
    hot = nominal_sample(2, temperature_c=92, clock_event_reasons=0x40)
    fake = FakeGpu({cool.uuid: [cool], hot.uuid: [hot]})

    async def go() -> None:
        monitor = GpuMonitor(fake, interval_s=0.05)
        await monitor.start()
        try:
            await until(lambda: monitor.latest)
            assert monitor.samples_for([0]) == {}  # the engine on GPU 0 gets nothing
            assert monitor.samples_for([1]) == {1: cool}
            assert monitor.samples_for([2]) == {2: hot}
            assert set(gpu_metric_values(monitor.latest)) == {1, 2}
        finally:
            await monitor.close()

    asyncio.run(go())


def test_a_failed_sample_goes_to_the_gpus_true_index() -> None:
    lost = nominal_sample(2)
    fake = FakeGpu({"GPU-fake-0001": [nominal_sample(1)], lost.uuid: [lost]})
    fake.script(lost.uuid, GpuLost(lost.uuid, "fell off the bus"))

    async def go() -> None:
        monitor = GpuMonitor(fake, interval_s=0.01)
        await monitor.start()
        try:
            await until(lambda: isinstance(monitor.latest.get(2), ProbeFailure))
            failure = monitor.samples_for([2])[2]
            assert isinstance(failure, ProbeFailure) and failure.kind == "gpu_lost"
            assert monitor.samples_for([1]) == {1: nominal_sample(1)}
            assert monitor.samples_for([0]) == {}
        finally:
            await monitor.close()

    asyncio.run(go())


def xid(n: int, index: int) -> GpuEvent:
    # at_s is the reader's stamp; the monitor stamps again on receipt, with the loop's clock.
    return GpuEvent(index=index, uuid=f"GPU-fake-{index:04d}", kind="xid", xid=n, at_s=0.0)


def test_take_events_since_drops_events_received_before_an_incarnation_started() -> None:
    fake = FakeGpu.nominal(2)

    async def received(monitor: GpuMonitor, *events: GpuEvent) -> None:
        # Events arrive in order: once the marker on GPU 1 is in, so is everything before it.
        marker = xid(31, 1)
        for event in (*events, marker):
            fake.push_event(event)
        await until(lambda: monitor.take_events([1]))

    async def go() -> None:
        monitor = GpuMonitor(fake, interval_s=0.05)
        await monitor.start()
        try:
            await received(monitor, xid(79, 0))  # during the old incarnation's stop
            started_s = asyncio.get_running_loop().time()  # the new incarnation starts
            await asyncio.sleep(0.01)
            await received(monitor, xid(48, 0))
            (event,) = monitor.take_events([0], since_s=started_s)
            assert (event.index, event.xid) == (0, 48)
            assert event.at_s >= started_s  # stamped on receipt, with the loop's clock
            assert monitor.take_events([0]) == ()  # taken once; the old XID 79 was dropped

            await received(monitor, xid(13, 0))
            (kept,) = monitor.take_events([0])  # without since_s, everything received
            assert kept.xid == 13
        finally:
            await monitor.close()

    asyncio.run(go())
