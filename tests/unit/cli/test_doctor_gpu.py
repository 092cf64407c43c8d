"""``doctor``'s GPU health lines (``check_gpu_health``, issue 36: M4, L6, L10): the real reader
over the pynvml-level fake (``probes/fake_nvml.py``), whose constants, structs and error classes
are nvidia-ml-py's. Each reading tolerates NVMLError_NotSupported, as nvml.h documents it for
each call."""

from __future__ import annotations

from pathlib import Path

import pynvml
import yaml

from llmsupervisor import doctor
from llmsupervisor.config import SupervisorConfig, load_config
from llmsupervisor.doctor import DoctorCheck, GpuReport, Level
from llmsupervisor.probes.fake_gpu import FakeGpu
from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml
from llmsupervisor.probes.nvml import NvmlReader
from tests.lib.daemon import fake_engine, free_port


def config(tmp_path: Path, gpus: list[int]) -> SupervisorConfig:
    path = tmp_path / "config.yaml"
    settings = {"state_dir": str(tmp_path / "state"), "http_listen": f"127.0.0.1:{free_port()}"}
    engines = [fake_engine("a", free_port(), gpus=gpus)]
    path.write_text(yaml.safe_dump({"supervisor": settings, "engines": engines}, sort_keys=False))
    return load_config(path)


def health(fake: FakeNvml, cfg: SupervisorConfig) -> list[DoctorCheck]:
    report = GpuReport()
    doctor.check_nvml(NvmlReader(fake), cfg, report=report)
    return doctor.check_gpu_health(report, cfg)


def by_name(checks: list[DoctorCheck]) -> dict[str, list[DoctorCheck]]:
    out: dict[str, list[DoctorCheck]] = {}
    for check in checks:
        out.setdefault(check.name, []).append(check)
    return out


def test_a_healthy_r580_sxm_box(tmp_path: Path) -> None:
    sxm = [FakeDevice(f"GPU-{i}", nvlink_states=(1,) * 18, pcie_replay_count=i) for i in range(2)]
    checks = health(FakeNvml(sxm), config(tmp_path, [0]))
    assert all(c.level is Level.OK for c in checks), checks
    named = by_name(checks)
    assert named["gpu driver"][0].detail == "580.159.04 (branch r580_00), NVML 13.580.159.04"
    assert "recovery action read (field 230) on GPU 0,1" in named["gpu verdicts"][0].detail
    assert named["gpu persistence"][0].detail == "on (GPU 0,1)"
    assert named["gpu ecc"][0].detail == "enabled"
    assert named["gpu compute mode"][0].detail == "default"
    assert named["gpu nvlink"][0].detail == "GPU 0: 18/18 active; GPU 1: 18/18 active"
    assert named["gpu pcie replays"][0].detail.startswith("GPU 0: 0, GPU 1: 1 since the driver loaded")


def test_an_r550_box_says_its_faults_are_judged_by_the_xid_catalogue(tmp_path: Path) -> None:
    # R535 and R550 (the long-term branches): no field 230 and no duration counters.
    fake = FakeNvml([FakeDevice("GPU-0", fields={})])
    fake.driver_version = "550.127.05"
    named = by_name(health(fake, config(tmp_path, [0])))
    (driver,) = named["gpu driver"]
    assert driver.level is Level.WARN and driver.detail.startswith("550.127.05: before R565")
    (mode,) = named["gpu verdicts"]
    assert mode.level is Level.WARN and "catalogue fallback on GPU 0" in mode.detail


def test_a_standing_verdict_and_a_failed_remap_fail_the_engines_gpu(tmp_path: Path) -> None:
    reset = FakeDevice("GPU-0")
    reset.fields[230] = (pynvml.NVML_SUCCESS, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    remap = FakeDevice("GPU-1", remapped_rows=(0, 1, 0, 1))
    pending = FakeDevice("GPU-2", remapped_rows=(1, 0, 1, 0))
    named = by_name(health(FakeNvml([reset, remap, pending]), config(tmp_path, [0, 1])))
    assert [(c.level, c.detail.split(":")[0]) for c in named["gpu 0"]] == [
        (Level.FAIL, "recovery action gpu_reset stands")
    ]
    (failed,) = named["gpu 1"]
    assert failed.level is Level.FAIL and "field diagnostic" in failed.detail and "RMA" in failed.detail
    assert "gpu clear" not in failed.detail  # L6: permanent; no reset clears it
    assert named["gpu 2"] == [DoctorCheck("gpu 2", Level.WARN, "a row remap waits for the next GPU reset")]


def test_settings_the_daemon_relies_on(tmp_path: Path) -> None:
    odd = FakeDevice(
        "GPU-0",
        persistence_mode=0,
        ecc_mode=(0, 1),
        compute_mode=pynvml.NVML_COMPUTEMODE_PROHIBITED,
        nvlink_states=(1,) * 16 + (0, 0),
    )
    other = FakeDevice("GPU-1", compute_mode=pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    named = by_name(health(FakeNvml([odd, other]), config(tmp_path, [0])))
    (persistence,) = named["gpu persistence"]
    assert persistence.level is Level.WARN and "persistence mode off on GPU 0" in persistence.detail
    (ecc,) = named["gpu ecc"]
    assert ecc.level is Level.WARN and "ECC off on GPU 0" in ecc.detail and "next reset" in ecc.detail
    modes = named["gpu compute mode"]
    assert [(c.level, c.detail.split(":")[0]) for c in modes] == [
        (Level.FAIL, "GPU 0 is prohibited"),  # the engine's GPU: no CUDA context there
        (Level.WARN, "GPU 1 is exclusive_process"),
    ]
    (links,) = named["gpu nvlink"]
    assert links.level is Level.WARN and "GPU 0: 16/18 active" in links.detail


def test_readings_the_board_does_not_support_are_left_out(tmp_path: Path) -> None:
    # A PCIe board without NVLink; persistence, ECC, compute mode and replays NotSupported.
    bare = FakeDevice(
        "GPU-0", persistence_mode=None, ecc_mode=None, compute_mode=None, pcie_replay_count=None
    )
    named = by_name(health(FakeNvml([bare]), config(tmp_path, [0])))
    assert set(named) == {"gpu driver", "gpu verdicts", "gpu fabric"}
    assert [c.detail for c in named["gpu fabric"]] == ["not an NVSwitch system (GPU 0)"]


def test_a_reader_that_cannot_inspect_gives_the_verdict_mode_only(tmp_path: Path) -> None:
    # The sample-level double has no driver or facts (GpuInspector): what samples say stands.
    report = GpuReport()
    doctor.check_nvml(FakeGpu.nominal(1), config(tmp_path, [0]), report=report)
    checks = doctor.check_gpu_health(report, None)
    assert [c.name for c in checks] == ["gpu verdicts"] and "catalogue fallback" in checks[0].detail
    assert doctor.check_gpu_health(GpuReport(), None) == []  # no NVML: nothing to say


def test_the_nvswitch_fabric_per_gpu(tmp_path: Path) -> None:
    """Issue 36, M6: each GPU's NVSwitch fabric (nvmlDeviceGetGpuFabricInfoV). Registered, or no
    fabric at all, is OK; Fabric Manager not running FAILs, naming the unit; a registration in
    progress WARNs; one that completed with an error FAILs, naming the error."""
    completed = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    devices = [
        FakeDevice("GPU-0"),  # NOT_SUPPORTED: a PCIe board, or no NVSwitch
        FakeDevice("GPU-1", fabric=(completed, pynvml.NVML_SUCCESS)),
        FakeDevice("GPU-2", fabric=(pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED, pynvml.NVML_SUCCESS)),
        FakeDevice("GPU-3", fabric=(pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, pynvml.NVML_SUCCESS)),
        FakeDevice("GPU-4", fabric=(completed, pynvml.NVML_ERROR_UNKNOWN)),
    ]
    fabric = [
        (c.level, c.detail)
        for c in health(FakeNvml(devices), config(tmp_path, [2]))
        if c.name == "gpu fabric"
    ]
    assert fabric[:2] == [
        (Level.OK, "not an NVSwitch system (GPU 0)"),
        (Level.OK, "registered on GPU 1"),
    ]
    (l2, d2), (l3, d3), (l4, d4) = fabric[2:]
    assert l2 is Level.FAIL and d2.startswith(
        "GPU 2: fabric manager not running? (registration not started; systemctl status"
        " nvidia-fabricmanager); CUDA cannot start there (error 802, system not yet initialized)"
    )
    assert l3 is Level.WARN and d3.startswith("GPU 3: fabric not ready yet: registration in progress")
    assert l4 is Level.FAIL and d4.startswith(
        "GPU 4: registration failed (Unknown); see Fabric Manager's log"
    )
    # A box outside any NVSwitch fabric says so once, as OK.
    plain = health(FakeNvml([FakeDevice("GPU-0"), FakeDevice("GPU-1")]), config(tmp_path, [0]))
    assert [(c.level, c.detail) for c in plain if c.name == "gpu fabric"] == [
        (Level.OK, "not an NVSwitch system (GPU 0,1)")
    ]
