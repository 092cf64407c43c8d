"""The real reader (``NvmlReader``) over the pynvml-level fake (``fake_gpu.FakeNvml``), whose
constants, structs and error classes are the installed nvidia-ml-py module's (issue 23)."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from llmsupervisor.probes import gpu_readings, nvml
from llmsupervisor.probes.fake_nvml import GIB, MIB, FakeDevice, FakeNvml, FileNvml
from llmsupervisor.probes.gpu_readings import GpuLost
from llmsupervisor.probes.nvml import NvmlReader


def reader(*devices: FakeDevice, missing: tuple[str, ...] = (), pids_visible: bool = True) -> NvmlReader:
    r = NvmlReader(FakeNvml(devices, missing=missing), pids_visible=pids_visible)
    r.open()
    return r


def test_the_fake_is_built_from_the_real_binding() -> None:
    fake = FakeNvml()
    assert fake.NVMLError_NoPermission is pynvml.NVMLError_NoPermission
    assert fake.nvmlMemory_v2 == pynvml.nvmlMemory_v2 == 0x02000028
    assert fake.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION == nvml.FI_GPU_RECOVERY_ACTION == 230
    assert (nvml.FI_SW_THERMAL_NS, nvml.FI_HW_THERMAL_NS, nvml.FI_HW_POWER_BRAKE_NS) == (
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
    )
    assert gpu_readings.RECOVERY_ACTIONS[pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET] == "gpu_reset"
    assert gpu_readings.RECOVERY_ACTIONS[pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET] == "drain_and_reset"
    assert nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    assert nvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX == pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX
    assert pynvml.nvmlEventTypeFatalPoisonError == gpu_readings.EVENT_FATAL_POISON
    assert pynvml.nvmlEventTypeGpuRecoveryAction == gpu_readings.EVENT_GPU_RECOVERY_ACTION
    assert pynvml.nvmlEventTypeDramRetirementFailure == gpu_readings.EVENT_DRAM_RETIREMENT_FAILURE


def test_idle_memory_is_0_used_with_reserved_on_its_own() -> None:
    # v2 leaves driver-reserved memory out of used, as nvidia-smi does (the lent H100 showed
    # 0.5/80 GB with v1).
    sample = reader(FakeDevice("GPU-a")).sample("GPU-a")
    assert sample.memory_used_bytes == 0
    assert sample.memory_reserved_bytes == 512 * MIB
    assert sample.memory_total_bytes == 80 * GIB


def test_memory_falls_back_to_v1_where_the_driver_lacks_the_v2_symbol() -> None:
    r = reader(FakeDevice("GPU-a", memory_used=10 * GIB), missing=("nvmlDeviceGetMemoryInfo_v2",))
    for _ in range(2):  # the v2 key is remembered as missing; v1 still answers
        sample = r.sample("GPU-a")
        assert sample.memory_used_bytes == 10 * GIB + 512 * MIB  # v1: reserved included
        assert sample.memory_reserved_bytes is None


def test_no_permission_on_the_process_list_still_reads_the_rest() -> None:
    dev = FakeDevice(
        "GPU-a",
        temperature_c=71,
        errors={"nvmlDeviceGetComputeRunningProcesses": pynvml.NVML_ERROR_NO_PERMISSION},
    )
    sample = reader(dev).sample("GPU-a")
    assert sample.processes is None
    assert sample.temperature_c == 71 and sample.sm_clock_mhz == 1980
    assert sample.ecc_uncorrected_volatile == 0 and sample.recovery_action == 0
    assert sample.unread == ("processes: NVMLError_NoPermission",)


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_GPU_IS_LOST])
def test_reset_required_and_gpu_is_lost_are_faults_not_probe_warnings(code: int) -> None:
    r = reader(FakeDevice("GPU-a", errors={"nvmlDeviceGetPowerUsage": code}))
    with pytest.raises(GpuLost):
        r.sample("GPU-a")


def test_recovery_action_is_read_per_field_return_code() -> None:
    dev = FakeDevice("GPU-a")
    dev.fields[230] = (pynvml.NVML_SUCCESS, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    dev.fields[270] = (pynvml.NVML_SUCCESS, 7_000_000_000)
    dev.fields.pop(269)  # an older driver: that field answers NotSupported in its own entry
    sample = reader(dev).sample("GPU-a")
    assert sample.recovery_action == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert sample.hw_thermal_ns == sample.thermal_throttle_ns == 7_000_000_000
    assert sample.sw_thermal_ns is None
    old = FakeDevice("GPU-b", fields={})
    assert reader(old).sample("GPU-b").recovery_action is None


@pytest.mark.parametrize(
    ("driver", "counters"), [("580.159.04", True), ("575.57.08", False), ("550.127.05", False)]
)
def test_the_duration_counters_are_read_on_r580_and_later_only(driver: str, counters: bool) -> None:
    """Issue 36 (L2): the NVML change log for R575 to R580 renumbered
    NVML_FI_DEV_CLOCKS_EVENT_REASON_*; before R580, ids 269-271 are power-smoothing fields
    (the 12.9 header). Field 230 is asked for on every driver."""
    dev = FakeDevice("GPU-a")
    dev.fields.update({269: (0, 3_000_000_000), 270: (0, 2), 271: (0, 5)})
    fake = FakeNvml([dev])
    fake.driver_version = driver
    r = NvmlReader(fake)
    r.open()
    sample = r.sample("GPU-a")
    assert (sample.sw_thermal_ns is not None) is counters
    assert (sample.power_brake_ns is not None) is counters
    assert sample.recovery_action == 0
    assert r.driver().major == int(driver.split(".")[0])


def test_remapped_rows_thresholds_and_mig() -> None:
    dev = FakeDevice("GPU-a", remapped_rows=(0, 1, 0, 1), mig_mode=(1, 1))
    sample = reader(dev).sample("GPU-a")
    assert sample.remap_failed is True and sample.remap_pending is False
    assert (sample.slowdown_temperature_c, sample.max_operating_temperature_c) == (90, 87)
    assert sample.mig_enabled is True
    assert reader(FakeDevice("GPU-b", mig_mode=None)).sample("GPU-b").mig_enabled is None


def test_a_board_without_thresholds_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    # Issue 36 (L3): the threshold API may answer NotSupported on newer boards; say so once.
    r = reader(FakeDevice("GPU-a", thresholds={}))
    for _ in range(3):
        sample = r.sample("GPU-a")
    assert (sample.slowdown_temperature_c, sample.max_operating_temperature_c) == (None, None)
    assert caplog.text.count("GPU GPU-a reports no slowdown temperature") == 1


def test_every_supported_event_type_acted_on_is_registered() -> None:
    fake = FakeNvml([FakeDevice("GPU-a"), FakeDevice("GPU-b", supported_events=0x8 | 0x2)])
    NvmlReader(fake).open()
    on_a = {bit for i, bit in fake.registered if i == 0}
    assert on_a == {0x1, 0x2, 0x8, 0x200, 0x400, 0x800, 0x1000, 0x2000, 0x4000, 0x8000}
    assert {bit for i, bit in fake.registered if i == 1} == {0x2, 0x8}  # the intersection


def test_the_reader_says_which_event_types_it_registered_per_gpu() -> None:
    # What bench/gpu_proof.py check 5 reports against the GPU's supported mask.
    fake = FakeNvml([FakeDevice("GPU-a", supported_events=0x8 | 0x2 | 0x4), FakeDevice("GPU-b")])
    r = NvmlReader(fake, event_types=0x8 | 0x4000)
    r.open()
    assert r.registered_events() == {"GPU-a": 0x8, "GPU-b": 0x8 | 0x4000}


def test_the_fake_answers_the_facts_a_gpu_run_reports() -> None:
    fake = FakeNvml([FakeDevice("GPU-a"), FakeDevice("GPU-b", pci_bus_id="00000000:9A:00.0")])
    fake.nvmlInit()
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlDeviceGetPciInfo(h0).busId == "00000000:18:00.0"  # the binding decodes char arrays
    assert fake.nvmlDeviceGetPciInfo(h1).busId == "00000000:9A:00.0"
    assert isinstance(fake.nvmlSystemGetDriverVersion(), str)
    assert fake.nvmlDeviceGetMarginTemperature(h0) == 45
    fake.devices[1].margin_temperature_c = None
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMarginTemperature(h1)


def test_an_xid_event_carries_the_recovery_action_read_after_it() -> None:
    fake = FakeNvml([FakeDevice("GPU-a"), FakeDevice("GPU-b")])
    r = NvmlReader(fake)
    r.open()
    fake.devices[1].fields[230] = (pynvml.NVML_SUCCESS, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    fake.xid(1, 48)
    event = r.wait_event(100)
    assert event is not None
    assert (event.index, event.uuid, event.kind, event.xid) == (1, "GPU-b", "xid", 48)
    assert event.recovery_action == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert r.wait_event(10) is None  # NVMLError_Timeout: nothing happened


def test_a_recovery_action_event_carries_field_230_not_its_data() -> None:
    """Issue 36 (L1): nvml.h, nvmlEventData_t.eventData: "Stores Xid error ... in the event of
    nvmlEventTypeXidCriticalError, eventData is 0 for any other event". So the new action is
    read from field 230 when the event arrives."""
    fake = FakeNvml([FakeDevice("GPU-a")])
    r = NvmlReader(fake)
    r.open()
    fake.recovery_action_changed(0, pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
    event = r.wait_event(100)
    assert event is not None and event.xid is None and event.kind == "gpu_recovery_action"
    assert event.recovery_action == pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    # The fake keeps nvml.h's rule: data given for a non-XID event is dropped, as the driver's is 0.
    fake.push_event(0, pynvml.nvmlEventTypeGpuRecoveryAction, 7)
    again = r.wait_event(100)
    assert again is not None and again.recovery_action == pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    # A driver that cannot say (field 230 unsupported): unread, never taken from the data.
    fake.devices[0].fields.pop(230)
    fake.push_event(0, pynvml.nvmlEventTypeGpuRecoveryAction)
    unread = r.wait_event(100)
    assert unread is not None and unread.recovery_action is None


def test_doctor_facts_are_read_each_on_its_own() -> None:
    """Issue 36 (L10): persistence, ECC and compute mode, PCIe replays, NVLink and whether field
    230 answers, each NotSupported-tolerant; the driver's version and branch."""
    sxm = FakeDevice("GPU-a", nvlink_states=(1,) * 17 + (0,), pcie_replay_count=3)
    pcie = FakeDevice(
        "GPU-b", persistence_mode=None, ecc_mode=(1, 0), compute_mode=3, pcie_replay_count=None, fields={}
    )
    fake = FakeNvml([sxm, pcie])
    r = NvmlReader(fake)
    r.open()
    a, b = r.facts("GPU-a"), r.facts("GPU-b")
    assert (a.persistence_mode, a.ecc_enabled, a.ecc_pending, a.compute_mode) == (True, True, True, 0)
    assert (a.nvlinks_active, a.nvlinks, a.pcie_replay_count) == (17, 18, 3)
    assert a.recovery_action_supported is True and a.unread == ()
    assert (b.persistence_mode, b.ecc_enabled, b.ecc_pending, b.compute_mode) == (None, True, False, 3)
    assert (b.nvlinks_active, b.nvlinks, b.pcie_replay_count) == (None, None, None)
    assert b.recovery_action_supported is False
    driver = r.driver()
    assert (driver.version, driver.branch, driver.major) == ("580.159.04", "r580_00", 580)
    # Before R560 there is no nvmlSystemGetDriverBranch: the branch is None, the rest stands.
    old = FakeNvml([FakeDevice("GPU-c")])
    old.driver_version = "550.127.05"
    r_old = NvmlReader(old)
    r_old.open()
    assert (r_old.driver().branch, r_old.driver().major) == (None, 550)
    # A call that fails otherwise is named, and the other facts still read.
    sxm.errors["nvmlDeviceGetComputeMode"] = pynvml.NVML_ERROR_UNKNOWN
    failed = r.facts("GPU-a")
    assert failed.compute_mode is None and failed.persistence_mode is True
    assert failed.unread == ("GetComputeMode: NVMLError_Unknown",)


def test_host_pids_are_marked_when_the_daemon_is_in_its_own_pid_namespace() -> None:
    dev = FakeDevice("GPU-a", processes=[(4242, 70 * GIB)])
    sample = reader(dev, pids_visible=False).sample("GPU-a")
    assert sample.processes == (gpu_readings.GpuProcess(4242, 70 * GIB),)
    assert sample.pids_visible is False


def test_pid_namespace_detection_reads_the_namespace_inode(tmp_path: Path) -> None:
    assert nvml.in_host_pid_namespace(str(tmp_path / "absent")) is True  # unknowable: assume host
    assert nvml.in_host_pid_namespace(str(tmp_path)) is False  # any other inode


def test_the_fake_gpu_file_drives_the_real_reader(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(
        json.dumps(
            {
                "gpus": [
                    {"index": 0, "uuid": "GPU-x", "temperature_c": 91, "clock_event_reasons": ["hw_thermal"]},
                    {"index": 2, "errors": {"nvmlDeviceGetComputeRunningProcesses": "NoPermission"}},
                ],
                "events": [{"id": 1, "gpu": 2, "xid": 31}],
            }
        )
    )
    r = NvmlReader(FileNvml(path))
    assert r.open() == {"GPU-x": 0, "GPU-fake-0002": 2}  # index 1 unreadable: left out
    hot = r.sample("GPU-x")
    assert hot.temperature_c == 91 and hot.clock_event_reason_names == {"hw_thermal"}
    assert r.sample("GPU-fake-0002").unread == ("processes: NVMLError_NoPermission",)
    event = r.wait_event(1000)
    assert event is not None and (event.index, event.xid) == (2, 31)
    r.close()
