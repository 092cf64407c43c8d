"""The monitor's side of `gpu release` (issue 36 point 8; daemon/gpu_release.py): NVML closed on
purpose, with ``nvmlShutdown`` (nvml.h has no call that lets go of one GPU), and opened again at
the take-back with the same retry as at boot. The real reader over the pynvml-level fake."""

from __future__ import annotations

import asyncio
from typing import Any

import pynvml
import pytest

from llmsupervisor import aio
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml, fake_uuid
from llmsupervisor.probes.gpu_readings import GpuSample
from llmsupervisor.probes.gpus import GpuMonitor
from llmsupervisor.probes.nvml import NvmlReader
from tests.lib.virtual_nvml import VirtualNvml, inline_nvml
from tests.lib.virtual_time import run_virtual


def test_release_closes_nvml_and_take_back_opens_it_again_events_and_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Released: NVML shut down (no reference left, no event set), every GPU reads "released"
    with why, health says so with the window's end, and the UUIDs stay known. Taken back while
    the GPU still refuses to initialise: the boot's retry, with its reason; then open, sampled,
    its events registered again and delivered."""
    inline_nvml(monkeypatch)
    fake = VirtualNvml([FakeDevice(fake_uuid(0)), FakeDevice(fake_uuid(1))])

    async def go() -> dict[str, Any]:
        monitor = GpuMonitor(NvmlReader(fake, pids_visible=True), interval_s=2.0)
        await monitor.start()
        seen: dict[str, Any] = {"bus": monitor.pci_bus_id(1), "opens": monitor.opens_total}
        until_s = aio.now() + 300
        await monitor.release("released by alice for the reset of GPU 1", until_s=until_s)
        await aio.wait_any(timeout_s=10)
        seen.update(
            initialised=fake.initialised,
            sets=[s.freed for s in fake.sets],
            health=monitor.health(),
            sample=monitor.samples_for([0])[0],
            gpus=monitor.gpus_by_index(),
            latest=dict(monitor.latest),
            until_s=until_s,
        )
        fake.init_error = pynvml.NVML_ERROR_UNKNOWN  # the GPU still coming back from its reset
        monitor.take_back()
        monitor.take_back()  # a second take-back while it opens: one open loop, not two
        await aio.wait_any(timeout_s=1)
        seen["reopening"] = monitor.health()
        fake.init_error = None
        while not isinstance(monitor.latest.get(1), GpuSample):
            await aio.wait_any(timeout_s=0.5)
        seen.update(
            after=monitor.health(), opens_after=monitor.opens_total, initialised_after=fake.initialised
        )
        fake.xid(1, 48)
        while not (events := monitor.take_events([1])):
            await aio.wait_any(timeout_s=0.5)
        seen["events"] = events
        await monitor.close()
        return seen

    seen = run_virtual(go())
    assert seen["bus"] == "00000000:19:00.0"
    assert seen["initialised"] == 0 and all(seen["sets"])
    health = seen["health"]
    assert not health.up and health.reason == "released" and "alice" in (health.detail or "")
    assert health.next_try_s == seen["until_s"]
    sample = seen["sample"]
    assert isinstance(sample, ProbeFailure) and sample.kind == "released"
    assert seen["gpus"] == {0: fake_uuid(0), 1: fake_uuid(1)} and seen["latest"] == {}
    assert seen["reopening"].reason == "init_failed"
    assert seen["after"].up and seen["opens_after"] == seen["opens"] + 1 and seen["initialised_after"] == 1
    assert [(e.index, e.xid) for e in seen["events"]] == [(1, 48)]


def test_nvml_shutdown_is_refused_without_an_init() -> None:
    """nvml.h: nvmlShutdown answers UNINITIALIZED when NVML was not initialised; the fake too, so
    a double close would show."""
    fake = FakeNvml([FakeDevice(fake_uuid(0))])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlShutdown()


def test_the_fake_reset_refuses_while_nvml_holds_the_gpu() -> None:
    """nvidia-smi(1), -r: refused while any process holds the GPU; once NVML let go, the GPU
    comes back with no recovery action and no pending remap."""
    fake = FakeNvml([FakeDevice(fake_uuid(0), remapped_rows=(0, 0, 1, 0))])
    fake.devices[0].fields[pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] = (pynvml.NVML_SUCCESS, 1)
    reader = NvmlReader(fake, pids_visible=True)
    reader.open()
    with pytest.raises(RuntimeError, match="in use"):
        fake.reset(0)
    reader.close()
    fake.reset(0)
    reader.open()
    sample = reader.sample(fake_uuid(0))
    reader.close()
    assert sample.recovery_action == 0 and sample.remap_pending is False


def test_a_sample_names_its_pci_bus_id() -> None:
    fake = FakeNvml([FakeDevice(fake_uuid(0), pci_bus_id="00000000:9A:00.0")])
    reader = NvmlReader(fake, pids_visible=True)
    reader.open()
    assert reader.sample(fake_uuid(0)).pci_bus_id == "00000000:9A:00.0"
    reader.close()


def test_a_file_gpu_says_who_holds_it_and_is_waited_on_again_after_a_close(tmp_path: Any) -> None:
    """``--fake-gpu``'s file: FILE.held while NVML is initialised (the system test's nvidia-smi -r
    looks at it); and an event set made after a close is waited on (it used to time out at once
    for ever after the first set was freed)."""
    import json

    from llmsupervisor.probes.fake_nvml import FileNvml

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"gpus": [{"index": 0}], "events": []}))
    fake = FileNvml(path)
    reader = NvmlReader(fake, pids_visible=True)
    reader.open()
    assert fake.held_path.exists()
    reader.close()
    assert not fake.held_path.exists()
    reader.open()
    path.write_text(json.dumps({"gpus": [{"index": 0}], "events": [{"id": 1, "gpu": 0, "xid": 13}]}))
    event = asyncio.run(asyncio.to_thread(reader.wait_event, 2000))
    reader.close()
    assert event is not None and event.xid == 13
