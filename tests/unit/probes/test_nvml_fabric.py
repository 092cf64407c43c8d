"""The NVSwitch fabric state (issue 36, M6): the real reader (``NvmlReader``) over the pynvml-level
fake, whose fabric calls follow nvml.h's ``nvmlDeviceGetGpuFabricInfoV`` (the caller's versioned
struct filled, NOT_SUPPORTED on a GPU outside a fabric, ``status`` to be read only once the state
is COMPLETED), with nvidia-ml-py's own constants and structs (docs/gpu.md, "The NVSwitch fabric")."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pynvml
import pytest

from llmsupervisor.daemon.exporter import gpu_metric_values
from llmsupervisor.probes import gpu_readings
from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml, FileNvml
from llmsupervisor.probes.gpu_readings import GpuFabric
from llmsupervisor.probes.nvml import NvmlReader

NOT_STARTED = (pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED, pynvml.NVML_SUCCESS)
IN_PROGRESS = (pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, pynvml.NVML_SUCCESS)
COMPLETED = (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS)
FAILED = (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_ERROR_TIMEOUT)


def read(fabric: tuple[int, int] | None, *, missing: tuple[str, ...] = ()) -> tuple[FakeNvml, NvmlReader]:
    fake = FakeNvml([FakeDevice("GPU-a", fabric=fabric)], missing=missing)
    reader = NvmlReader(fake, pids_visible=True)
    reader.open()
    return fake, reader


def test_the_states_are_the_bindings() -> None:
    assert gpu_readings.FABRIC_STATES == {
        pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "not_supported",
        pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not_started",
        pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in_progress",
        pynvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
    }
    # The versioned struct is v2's, and carries its version from construction.
    assert pynvml.c_nvmlGpuFabricInfoV_t is pynvml.c_nvmlGpuFabricInfo_v2_t
    assert pynvml.c_nvmlGpuFabricInfoV_t().version == pynvml.nvmlGpuFabricInfo_v2


@pytest.mark.parametrize(
    ("fabric", "state", "problem"),
    [
        (
            NOT_STARTED,
            "not_started",
            "fabric manager not running? (registration not started; systemctl status",
        ),
        (IN_PROGRESS, "in_progress", "registration in progress"),
        (COMPLETED, "completed", None),
        (FAILED, "completed", "registration failed (Timeout); see Fabric Manager's log"),
        ((pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, pynvml.NVML_SUCCESS), "not_supported", None),
    ],
)
def test_each_state_is_read_with_its_status(fabric: tuple[int, int], state: str, problem: str | None) -> None:
    _, reader = read(fabric)
    got = reader.sample("GPU-a").fabric
    assert got is not None and got.state_name == state and got.status == fabric[1]
    assert (got.problem is None) if problem is None else (got.problem or "").startswith(problem)
    assert got.on_nvswitch is (state != "not_supported")


def test_a_completed_state_with_a_failed_status_is_a_failure_and_the_status_is_named() -> None:
    # nvml.h: status "Must be checked only if state returns complete": a failed registration.
    _, reader = read(FAILED)
    got = reader.sample("GPU-a").fabric
    assert got == GpuFabric(state=3, status=pynvml.NVML_ERROR_TIMEOUT, status_name="Timeout")
    assert got.failed and not got.pending
    # A status on a state that is not COMPLETED is not read as a failure.
    assert GpuFabric(state=2, status=pynvml.NVML_ERROR_TIMEOUT).problem == (
        "registration in progress (Fabric Manager is setting up the NVLink fabric)"
    )


def test_a_gpu_outside_a_fabric_answers_not_supported_once() -> None:
    # nvml.h: NVML_ERROR_NOT_SUPPORTED "If device doesn't support gpu fabric" (a PCIe board,
    # anything before Hopper): no fabric, nothing unread, and it is not asked again.
    fake, reader = read(None)
    for _ in range(3):
        sample = reader.sample("GPU-a")
        assert sample.fabric is None and sample.unread == ()
    assert fake.calls["nvmlDeviceGetGpuFabricInfoV"] == 1


def test_a_driver_without_the_versioned_call_is_read_through_the_old_one() -> None:
    fake, reader = read(IN_PROGRESS, missing=("nvmlDeviceGetGpuFabricInfoV",))
    for _ in range(2):
        got = reader.sample("GPU-a").fabric
        assert got is not None and got.state_name == "in_progress"
    assert fake.calls["nvmlDeviceGetGpuFabricInfoV"] == 1  # FunctionNotFound, remembered
    assert fake.calls["nvmlDeviceGetGpuFabricInfo"] == 2


def test_a_failed_reading_is_unread_and_tried_again() -> None:
    fake, reader = read(NOT_STARTED)
    fake.devices[0].errors["nvmlDeviceGetGpuFabricInfoV"] = pynvml.NVML_ERROR_NO_PERMISSION
    sample = reader.sample("GPU-a")
    assert sample.fabric is None and sample.unread == ("fabric: NVMLError_NoPermission",)
    del fake.devices[0].errors["nvmlDeviceGetGpuFabricInfoV"]
    got = reader.sample("GPU-a").fabric
    assert got is not None and got.state_name == "not_started"


def test_the_state_moves_as_fabric_manager_comes_up() -> None:
    fake, reader = read(NOT_STARTED)
    seen = []
    for fabric in (NOT_STARTED, IN_PROGRESS, COMPLETED):
        fake.devices[0].fabric = fabric
        got = reader.sample("GPU-a").fabric
        assert got is not None
        seen.append((got.state_name, got.problem is None))
    assert seen == [("not_started", False), ("in_progress", False), ("completed", True)]


def test_the_fake_fills_the_callers_struct_by_reference_as_the_c_call_does() -> None:
    fake = FakeNvml([FakeDevice("GPU-a", fabric=IN_PROGRESS)])
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.c_nvmlGpuFabricInfoV_t()
    assert fake.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info)) == pynvml.NVML_SUCCESS
    assert (info.state, info.status) == IN_PROGRESS
    with pytest.raises(TypeError, match="by reference"):
        fake.nvmlDeviceGetGpuFabricInfoV(handle, pynvml.c_nvmlGpuFabricInfoV_t())
    stale = pynvml.c_nvmlGpuFabricInfoV_t()
    stale.version = 1
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        fake.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(stale))
    old = pynvml.c_nvmlGpuFabricInfo_t()
    fake.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(old))
    assert (old.state, old.status) == IN_PROGRESS


def test_the_fake_gpu_file_sets_the_fabric(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    gpus: list[dict[str, object]] = [
        {"index": 0, "fabric": "not_started"},
        {"index": 1, "fabric": {"state": "completed", "status": "Unknown"}},
        {"index": 2},
    ]
    path.write_text(json.dumps({"gpus": gpus}))
    reader = NvmlReader(FileNvml(path), pids_visible=True)
    uuids = reader.open()
    fabrics = {reader.sample(u).index: reader.sample(u).fabric for u in uuids}
    assert fabrics[0] == GpuFabric(state=1, status=0)
    assert fabrics[1] == GpuFabric(state=3, status=pynvml.NVML_ERROR_UNKNOWN, status_name="Unknown")
    assert fabrics[2] is None
    gpus[0]["fabric"] = "completed"  # Fabric Manager started: the file is read again per sample
    path.write_text(json.dumps({"gpus": gpus}))
    uuid0 = next(u for u, i in uuids.items() if i == 0)
    assert reader.sample(uuid0).fabric == GpuFabric(state=3, status=0)


def test_fabric_ready_is_exported_for_nvswitch_gpus_only() -> None:
    fake = FakeNvml([FakeDevice(f"GPU-{i}", fabric=f) for i, f in enumerate((NOT_STARTED, COMPLETED, None))])
    reader = NvmlReader(fake, pids_visible=True)
    uuids = reader.open()
    values = gpu_metric_values({i: reader.sample(u) for u, i in uuids.items()})
    assert values[0]["fabric_ready"] == 0.0 and values[1]["fabric_ready"] == 1.0
    assert "fabric_ready" not in values[2]
