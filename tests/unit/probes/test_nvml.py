"""NVML reader: the real binding on this GPU-less host, fake bindings of new and old drivers, the
threaded wrapper's timeouts, and the scripted FakeGpu.

Fake bindings are ``SimpleNamespace`` objects that borrow the real module's constants and
``NVMLError_*`` classes and stub the functions (docs/host-notes.md §1.9); nothing patches ``sys.modules``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from llmsupervisor.errors import NvmlUnavailable, SupervisorError
from llmsupervisor.probes import ProbeFailure, gpu_readings, gpu_threads, nvml
from llmsupervisor.probes.fake_gpu import FakeGpu, nominal_sample
from llmsupervisor.probes.gpu_readings import (
    CLOCK_EVENT_REASONS,
    EVENT_KINDS,
    GpuEvent,
    GpuLost,
    GpuProcess,
    GpuSample,
    decode_clock_event_reasons,
)
from llmsupervisor.probes.gpu_threads import ThreadedGpuReader
from llmsupervisor.probes.nvml import NvmlReader

UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000")


def err(code: int) -> Exception:
    exc: Exception = pynvml.NVMLError(code)
    return exc


def unstamped(event: GpuEvent | None) -> GpuEvent | None:
    """The event with its receipt time zeroed, to compare with an expected one."""
    return None if event is None else replace(event, at_s=0)


def handle(index: int) -> Any:
    # Real handles are ctypes pointers; event data carries a different object for the same device.
    return ctypes.cast(ctypes.c_void_p(0x1000 + index), pynvml.c_nvmlDevice_t)


def fake_binding(
    *, old_driver: bool = False, supported_events: tuple[int, ...] = (0xF, 0)
) -> SimpleNamespace:
    """A binding for a 2-GPU host. ``old_driver`` lacks the new names, as a pre-R535 driver does."""
    calls: Counter[str] = Counter()
    events: list[Any] = []
    registered: list[tuple[int, int]] = []

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        return call

    def missing(*args: Any) -> Any:
        raise err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def index_of(h: Any) -> int:
        return int(ctypes.cast(h, ctypes.c_void_p).value or 0) - 0x1000

    def processes(h: Any) -> list[Any]:
        return [
            SimpleNamespace(pid=4242, usedGpuMemory=70 * 1024**3),
            SimpleNamespace(pid=77, usedGpuMemory=None),
        ]

    def mismatch(h: Any) -> Any:
        raise pynvml.NVMLLibraryMismatchError(
            "Unversioned function called and the pyNVML version does not match"
        )

    def wait(event_set: Any, timeout_ms: int) -> Any:
        if not events:
            raise err(pynvml.NVML_ERROR_TIMEOUT)
        return events.pop(0)

    def not_supported(*args: Any) -> Any:
        raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    temperature = lambda h, sensor: 67  # noqa: E731
    reasons = lambda h: 0x4 | 0x20  # noqa: E731
    functions: dict[str, Callable[..., Any]] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": handle,
        "nvmlDeviceGetUUID": lambda h: UUIDS[index_of(h)],
        "nvmlDeviceGetName": lambda h: "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetTemperatureV": missing if old_driver else temperature,
        "nvmlDeviceGetTemperature": temperature,
        "nvmlDeviceGetPowerUsage": lambda h: 350500,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700000,
        "nvmlDeviceGetClockInfo": lambda h, t: {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[t],
        "nvmlDeviceGetCurrentClocksEventReasons": missing if old_driver else reasons,
        "nvmlDeviceGetCurrentClocksThrottleReasons": reasons,
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(
            total=80 * 1024**3, used=75 * 1024**3, free=5 * 1024**3
        ),
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=97, memory=41),
        "nvmlDeviceGetTotalEccErrors": not_supported,  # a board without ECC
        "nvmlDeviceGetComputeRunningProcesses": mismatch if old_driver else processes,
        "nvmlDeviceGetComputeRunningProcesses_v2": processes,
        "nvmlEventSetCreate": lambda: "event-set",
        "nvmlDeviceGetSupportedEventTypes": lambda h: supported_events[index_of(h)],
        "nvmlDeviceRegisterEvents": lambda h, mask, s: registered.append((index_of(h), mask)),
        "nvmlEventSetWait": wait,
        "nvmlEventSetFree": lambda s: None,
        # GPU 0 on NUMA node 0 (CPUs 0-3 and 64, past the first 64-bit word), GPU 1: not supported.
        "nvmlDeviceGetCpuAffinity": lambda h, words: (
            [0xF, 0x1][:words] if index_of(h) == 0 else not_supported()
        ),
    }
    borrowed = {k: v for k, v in vars(pynvml).items() if k.startswith("NVML")}
    ns = SimpleNamespace(**borrowed, **{name: counted(name, fn) for name, fn in functions.items()})
    ns.calls = calls
    ns.events = events
    ns.registered = registered
    return ns


def _driver_answers() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


# These read the real module's no-driver path: on a GPU host (the gpu tier's machine) the
# driver answers, and tests/host/test_gpu_placement.py reads the real GPU instead.
without_a_driver = pytest.mark.skipif(_driver_answers(), reason="an NVIDIA driver answers NVML here")


@without_a_driver
def test_real_module_on_a_host_without_a_driver() -> None:
    init_calls = 0

    def counting_init() -> None:
        nonlocal init_calls
        init_calls += 1
        pynvml.nvmlInit()

    real = SimpleNamespace(**vars(pynvml))
    real.nvmlInit = counting_init
    reader = NvmlReader(real)
    with pytest.raises(NvmlUnavailable) as first:
        reader.open()
    assert first.value.reason == "library_not_found"
    assert isinstance(first.value, SupervisorError)
    assert "libnvidia-ml.so.1" in str(first.value)
    with pytest.raises(NvmlUnavailable) as second:
        reader.open()
    assert second.value.reason == "library_not_found"
    assert init_calls == 2  # tried again: a driver may load after the daemon (GpuMonitor paces it)
    reader.close()  # no nvmlShutdown without a successful init (it would raise Uninitialized)


@without_a_driver
def test_default_reader_imports_the_binding() -> None:
    with pytest.raises(NvmlUnavailable, match="library_not_found"):
        NvmlReader().open()


@without_a_driver
def test_threaded_reader_reports_no_driver_once_while_the_reason_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> tuple[dict[str, int], dict[str, int], ProbeFailure | Any, Any]:
        gpu = ThreadedGpuReader(NvmlReader(pynvml))
        first = await gpu.open()
        second = await gpu.open()
        sample = await gpu.sample(UUIDS[0])
        event = await gpu.wait_event(10)
        await gpu.close()
        assert gpu.unavailable is not None and gpu.unavailable.reason == "library_not_found"
        return first, second, sample, event

    with caplog.at_level(logging.WARNING, logger=gpu_threads.__name__):
        first, second, sample, event = asyncio.run(go())
    assert first == second == {}
    assert isinstance(sample, ProbeFailure) and sample.kind == "nvml"
    assert event is None
    warnings = [r for r in caplog.records if "NVML unavailable" in r.getMessage()]
    assert len(warnings) == 1
    assert "no GPU telemetry until it opens" in warnings[0].getMessage()


def test_constants_match_the_binding() -> None:
    assert nvml.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert (nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM) == (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM)
    assert nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    assert nvml.NVML_VOLATILE_ECC == pynvml.NVML_VOLATILE_ECC
    new_and_old = {
        "gpu_idle": "GpuIdle",
        "applications_clocks": "ApplicationsClocksSetting",
        "sw_power_cap": "SwPowerCap",
        "hw_slowdown": "HwSlowdown",
        "sync_boost": "SyncBoost",
        "sw_thermal": "SwThermalSlowdown",
        "hw_thermal": "HwThermalSlowdown",
        "hw_power_brake": "HwPowerBrakeSlowdown",
        "display_clocks": "DisplayClockSetting",
    }
    by_name = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}
    for ours, theirs in new_and_old.items():
        assert by_name[ours] == getattr(pynvml, f"nvmlClocksThrottleReason{theirs}")
        assert by_name[ours] == getattr(pynvml, f"nvmlClocksEventReason{theirs}")
    # Only under the old prefix, and gone from nvidia-ml-py 13.610 (seen on the gpu tier's
    # machine): the bits are the driver's, our table keeps them.
    for ours, theirs in {"board_limit": "BoardLimit", "reliability": "Reliability"}.items():
        for prefix in ("nvmlClocksThrottleReason", "nvmlClocksEventReason"):
            if hasattr(pynvml, prefix + theirs):
                assert by_name[ours] == getattr(pynvml, prefix + theirs)
    assert pynvml.nvmlEventTypeXidCriticalError == gpu_readings.EVENT_XID
    assert pynvml.nvmlEventTypeDoubleBitEccError == gpu_readings.EVENT_DOUBLE_BIT_ECC
    assert pynvml.nvmlEventTypeGpuUnavailableError == gpu_readings.EVENT_GPU_UNAVAILABLE
    assert set(EVENT_KINDS) | {0} >= {
        getattr(pynvml, n)
        for n in dir(pynvml)
        if n.startswith("nvmlEventType") and n not in ("nvmlEventTypeAll",)
    }


def test_gpu_is_lost_error_is_its_own_class_and_unhashable() -> None:
    exc = pynvml.NVMLError(15)
    assert type(exc) is pynvml.NVMLError_GpuIsLost
    assert pynvml.NVML_ERROR_GPU_IS_LOST == 15
    with pytest.raises(TypeError, match="unhashable"):
        hash(exc)


EXPECTED_SAMPLE = GpuSample(
    index=0,
    uuid=UUIDS[0],
    name="NVIDIA H100 80GB HBM3",
    temperature_c=67,
    power_w=350.5,
    power_limit_w=700.0,
    sm_clock_mhz=1980,
    mem_clock_mhz=2619,
    clock_event_reasons=0x24,
    memory_used_bytes=75 * 1024**3,
    memory_total_bytes=80 * 1024**3,
    utilization_gpu_pct=97,
    ecc_uncorrected_volatile=None,
    processes=(GpuProcess(4242, 70 * 1024**3), GpuProcess(77, None)),
)


@pytest.mark.parametrize("old_driver", [False, True], ids=["new-driver", "old-driver"])
def test_new_and_old_drivers_give_the_same_sample(old_driver: bool) -> None:
    lib = fake_binding(old_driver=old_driver)
    reader = NvmlReader(lib)
    assert reader.open() == {UUIDS[0]: 0, UUIDS[1]: 1}
    first = reader.sample(UUIDS[0])
    assert first == EXPECTED_SAMPLE
    assert first.clock_event_reason_names == {"sw_power_cap", "sw_thermal"}
    assert reader.sample(UUIDS[1]).index == 1
    if old_driver:
        # The new name is tried once; after FunctionNotFound the reader goes to the old one.
        assert lib.calls["nvmlDeviceGetTemperatureV"] == 1
        assert lib.calls["nvmlDeviceGetTemperature"] == 2
        assert lib.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1
        assert lib.calls["nvmlDeviceGetComputeRunningProcesses"] == 1
        assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2
    else:
        assert lib.calls["nvmlDeviceGetTemperature"] == 0
        assert lib.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 0
        assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 0
    reader.close()
    assert (lib.calls["nvmlInit"], lib.calls["nvmlShutdown"], lib.calls["nvmlEventSetFree"]) == (1, 1, 1)


def test_a_gpu_that_cannot_be_read_at_open_is_left_out_and_the_others_keep_their_index() -> None:
    lib = fake_binding()
    uuid_of = lib.nvmlDeviceGetUUID

    def uuid_or_lost(h: Any) -> Any:
        if ctypes.cast(h, ctypes.c_void_p).value == 0x1000:  # GPU 0 fell off the bus
            raise err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return uuid_of(h)

    lib.nvmlDeviceGetUUID = uuid_or_lost
    reader = NvmlReader(lib)
    assert reader.open() == {UUIDS[1]: 1}  # NVML's index, not a position
    assert reader.sample(UUIDS[1]).index == 1
    reader.close()


def test_a_binding_older_than_the_new_names_falls_back_too() -> None:
    lib = fake_binding()
    del lib.nvmlDeviceGetTemperatureV  # an old nvidia-ml-py release
    reader = NvmlReader(lib)
    reader.open()
    assert reader.sample(UUIDS[0]).temperature_c == 67


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "library_not_found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "reboot_pending"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no_permission"),
        (pynvml.NVML_ERROR_UNKNOWN, "init_failed"),
    ],
)
def test_init_errors_map_to_nvml_unavailable(code: int, reason: str) -> None:
    lib = fake_binding()

    def fail() -> None:
        raise err(code)

    lib.nvmlInit = fail
    with pytest.raises(NvmlUnavailable) as info:
        NvmlReader(lib).open()
    assert info.value.reason == reason


def test_gpu_lost_during_a_sample() -> None:
    lib = fake_binding()

    def lost(h: Any) -> Any:
        raise err(pynvml.NVML_ERROR_GPU_IS_LOST)

    lib.nvmlDeviceGetPowerUsage = lost
    reader = NvmlReader(lib)
    reader.open()
    with pytest.raises(GpuLost) as info:
        reader.sample(UUIDS[1])
    assert info.value.uuid == UUIDS[1]

    async def go() -> GpuSample | ProbeFailure:
        gpu = ThreadedGpuReader(reader)
        await gpu.open()
        return await gpu.sample(UUIDS[1])

    failure = asyncio.run(go())
    assert isinstance(failure, ProbeFailure) and failure.kind == "gpu_lost"


def test_one_failing_reading_loses_only_that_reading() -> None:
    # Issue 23: an NVMLError_Unknown on the memory call used to abort the whole sample.
    lib = fake_binding()

    def unknown(*args: Any) -> Any:
        raise err(pynvml.NVML_ERROR_UNKNOWN)

    lib.nvmlDeviceGetMemoryInfo = unknown

    async def go() -> GpuSample | ProbeFailure:
        gpu = ThreadedGpuReader(NvmlReader(lib))
        await gpu.open()
        return await gpu.sample(UUIDS[0])

    sample = asyncio.run(go())
    assert isinstance(sample, GpuSample)
    assert sample.temperature_c == 67 and sample.memory_used_bytes is None
    assert sample.unread == ("memory: NVMLError_Unknown",)


def test_nvml_errors_on_every_reading_surface_as_a_probe_failure() -> None:
    lib = fake_binding()

    def unknown(*args: Any) -> Any:
        raise err(pynvml.NVML_ERROR_UNKNOWN)

    for name in dir(lib):
        if name.startswith("nvmlDeviceGet") and name not in (
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetName",
        ):
            setattr(lib, name, unknown)

    async def go() -> GpuSample | ProbeFailure:
        gpu = ThreadedGpuReader(NvmlReader(lib))
        await gpu.open()
        return await gpu.sample(UUIDS[0])

    failure = asyncio.run(go())
    assert isinstance(failure, ProbeFailure)
    assert failure.kind == "nvml"
    assert "NVMLError_Unknown" in failure.detail


def test_xid_events_registered_per_device_within_the_supported_mask() -> None:
    # GPU 0 supports single/double-bit ECC, pstate and XID; GPU 1 supports nothing.
    lib = fake_binding(supported_events=(0xF, 0))
    reader = NvmlReader(lib)
    reader.open()
    # SBE, DBE and XID are acted on; P-state (0x4) is not, so it is not registered. One type per call.
    assert lib.registered == [
        (0, gpu_readings.EVENT_SINGLE_BIT_ECC),
        (0, gpu_readings.EVENT_DOUBLE_BIT_ECC),
        (0, gpu_readings.EVENT_XID),
    ]
    assert reader.wait_event(1000) is None  # NVML's timeout is "no event"
    lib.events.append(SimpleNamespace(device=handle(0), eventType=0x8, eventData=79))
    lib.events.append(SimpleNamespace(device=handle(0), eventType=0x2, eventData=0))
    lib.events.append(SimpleNamespace(device=handle(5), eventType=0x8, eventData=999))
    before = time.monotonic()
    assert unstamped(reader.wait_event(1000)) == GpuEvent(index=0, uuid=UUIDS[0], kind="xid", xid=79, at_s=0)
    assert unstamped(reader.wait_event(1000)) == GpuEvent(
        index=0, uuid=UUIDS[0], kind="double_bit_ecc", xid=None, at_s=0
    )
    last = reader.wait_event(1000)
    assert unstamped(last) == GpuEvent(
        index=None, uuid=None, kind="xid", xid=gpu_readings.XID_UNKNOWN, at_s=0
    )
    assert last is not None and before <= last.at_s <= time.monotonic()  # stamped as it left NVML
    reader.close()


def test_no_supported_event_types_means_no_event_set() -> None:
    lib = fake_binding(supported_events=(0, 0))
    reader = NvmlReader(lib)
    reader.open()
    assert lib.registered == []
    assert lib.calls["nvmlEventSetFree"] == 1
    started = time.monotonic()
    assert reader.wait_event(20) is None  # paces the caller like a real wait
    assert time.monotonic() - started >= 0.015
    assert lib.calls["nvmlEventSetWait"] == 0


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0, set()),
        (0x1, {"gpu_idle"}),
        (0x4, {"sw_power_cap"}),
        (0x8 | 0x40 | 0x80, {"hw_slowdown", "hw_thermal", "hw_power_brake"}),
        (0x2 | 0x10 | 0x20 | 0x100, {"applications_clocks", "sync_boost", "sw_thermal", "display_clocks"}),
        (0x1 << 40, set()),  # a bit from a future driver
    ],
)
def test_clock_event_reason_bits(mask: int, names: set[str]) -> None:
    assert decode_clock_event_reasons(mask) == names


def test_threaded_reader_times_out_and_never_stacks_calls_on_a_stuck_gpu() -> None:
    fake = FakeGpu.nominal(2)
    stuck, healthy = "GPU-fake-0000", "GPU-fake-0001"

    async def go() -> None:
        gpu = ThreadedGpuReader(fake, call_timeout_s=0.2)
        assert await gpu.open() == {stuck: 0, healthy: 1}
        fake.hang(stuck)
        try:
            first = await gpu.sample(stuck)
            assert isinstance(first, ProbeFailure) and first.kind == "timeout"
            assert "within 0.2 s" in first.detail
            assert gpu.outstanding_for_tests() == {stuck}
            again = await gpu.sample(stuck)
            assert isinstance(again, ProbeFailure) and again.kind == "timeout"
            assert "still running" in again.detail
            assert fake.calls[stuck] == 1  # no second thread started for the stuck GPU
            both = await gpu.sample_all()
            assert isinstance(both[stuck], ProbeFailure)
            assert both[healthy] == nominal_sample(1)  # the other GPU is unaffected
        finally:
            fake.release(stuck)
        for _ in range(200):  # the stuck call returns; its slot frees
            if not gpu.outstanding_for_tests():
                break
            await asyncio.sleep(0.005)
        assert await gpu.sample(stuck) == nominal_sample(0)
        assert fake.calls[stuck] == 2
        await gpu.close()
        assert fake.closed

    asyncio.run(go())


def test_fake_gpu_replays_its_script_then_holds_the_last_item() -> None:
    uuid = "GPU-fake-0000"
    hot = nominal_sample(0, temperature_c=92, clock_event_reasons=0x40)
    fake = FakeGpu({uuid: [nominal_sample(0), hot]})
    fake.script(uuid, GpuLost(uuid, "fell off the bus"))
    assert fake.open() == {uuid: 0}
    assert fake.sample(uuid).temperature_c == 40
    assert fake.sample(uuid).clock_event_reason_names == {"hw_thermal"}
    for _ in range(2):  # a lost GPU stays lost
        with pytest.raises(GpuLost):
            fake.sample(uuid)


def test_fake_gpu_events_through_the_threaded_reader() -> None:
    event = GpuEvent(index=0, uuid="GPU-fake-0000", kind="xid", xid=48, at_s=0.0)
    fake = FakeGpu.nominal(1)

    async def go() -> list[Any]:
        gpu = ThreadedGpuReader(fake)
        await gpu.open()
        quiet = await gpu.wait_event(10)
        fake.push_event(event)
        seen = await gpu.wait_event(1000)
        await gpu.close()
        return [quiet, seen]

    assert asyncio.run(go()) == [None, event]


def test_fake_gpu_can_play_a_host_without_nvml(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeGpu(unavailable=NvmlUnavailable("driver_not_loaded", "the NVIDIA kernel module is not loaded"))

    async def go() -> list[dict[str, int]]:
        gpu = ThreadedGpuReader(fake)
        opened = [await gpu.open(), await gpu.open()]
        await gpu.close()
        return opened

    with caplog.at_level(logging.WARNING, logger=gpu_threads.__name__):
        assert asyncio.run(go()) == [{}, {}]
    assert fake.calls["open"] == 2  # each open tries again
    assert len([r for r in caplog.records if "driver_not_loaded" in r.getMessage()]) == 1


def test_cpu_affinity_decodes_the_bitmask_and_not_supported_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 128)  # two 64-bit words
    reader = NvmlReader(fake_binding())
    reader.open()
    assert reader.cpu_affinity(UUIDS[0]) == frozenset({0, 1, 2, 3, 64})
    assert reader.cpu_affinity(UUIDS[1]) is None


def test_fake_gpus_report_cpu_affinity_through_the_monitor(tmp_path: Path) -> None:
    from llmsupervisor.probes.fake_gpu import FileGpu
    from llmsupervisor.probes.gpus import GpuMonitor

    path = tmp_path / "gpus.json"
    path.write_text('{"gpus": [{"index": 0, "cpus": "0-1"}, {"index": 1}]}')

    async def main() -> dict[int, frozenset[int]]:
        monitor = GpuMonitor(FileGpu(path), interval_s=60)
        await monitor.start()
        try:
            return await monitor.gpu_cpus()
        finally:
            await monitor.close()

    assert asyncio.run(main()) == {0: frozenset({0, 1})}
    fake = FakeGpu(cpus={"GPU-a": frozenset({2})})
    assert fake.cpu_affinity("GPU-a") == frozenset({2}) and fake.cpu_affinity("GPU-b") is None
