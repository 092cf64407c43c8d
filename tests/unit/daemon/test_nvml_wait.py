"""Which engines wait for NVML at start, and until when (daemon/nvml_wait.py), and what placement
does while NVML is not open or left a GPU out (daemon/placement.py; issue 36, H1 and M5); which
wait for their GPUs' NVSwitch fabric (M6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsupervisor.config import EngineSpec, SupervisorConfig, SupervisorSettings
from llmsupervisor.daemon.nvml_wait import FabricWait, NvmlWait, fabric_wait_reason, waits_for_nvml
from llmsupervisor.daemon.placement import index_gaps, resolve_gpus
from llmsupervisor.probes.gpu_readings import (
    FABRIC_COMPLETED,
    FABRIC_IN_PROGRESS,
    FABRIC_NOT_STARTED,
    FABRIC_NOT_SUPPORTED,
    GpuFabric,
)

UUID = "GPU-00000000-1111-2222-3333-444444444444"
BY_INDEX = EngineSpec(name="idx", model="m", port=8000, gpus=(1,))
BY_UUID = EngineSpec(name="uu", model="m", port=8001, gpus=(), gpu_uuids=(UUID,))
NO_GPU = EngineSpec(name="cpu", model="m", port=8002, gpus=())


def test_only_engines_named_by_gpu_index_wait() -> None:
    assert waits_for_nvml(BY_INDEX)
    assert not waits_for_nvml(BY_UUID) and not waits_for_nvml(NO_GPU)


def test_the_wait_ends_when_nvml_opens_or_nvml_wait_s_after_the_start() -> None:
    wait = NvmlWait(300.0, started_s=1000.0)
    why = wait.admit(BY_INDEX, nvml_open=False, now=1010.0)
    assert why is not None and "waiting for NVML" in why and "at most 290 s more" in why
    assert wait.admit(BY_UUID, nvml_open=False, now=1010.0) is None
    assert wait.admit(BY_INDEX, nvml_open=True, now=1010.0) is None  # NVML open: no wait
    assert wait.due(nvml_open=False, now=1200.0) == []
    assert wait.due(nvml_open=False, now=1300.0) == ["idx"] and wait.waiting == {}
    # After the wait (an engine a reload adds, say), nothing waits any more.
    assert wait.admit(BY_INDEX, nvml_open=False, now=1301.0) is None
    again = NvmlWait(300.0, started_s=1000.0)
    again.admit(BY_INDEX, nvml_open=False, now=1000.0)
    assert again.due(nvml_open=True, now=1001.0) == ["idx"]


def test_nvml_wait_s_0_never_waits() -> None:
    assert NvmlWait(0.0, started_s=1000.0).admit(BY_INDEX, nvml_open=False, now=1000.0) is None


def config(*engines: EngineSpec) -> SupervisorConfig:
    return SupervisorConfig(path=Path("c.yaml"), supervisor=SupervisorSettings(), engines=engines)


def test_without_nvml_nothing_is_resolved_or_refused() -> None:
    blind = resolve_gpus(config(BY_INDEX, BY_UUID), {}, (), nvml_open=False)
    assert blind.engines == (BY_INDEX, BY_UUID)  # by UUID: enabled, unresolved, CUDA takes the UUID


def test_a_gpu_nvml_left_out_refuses_the_engines_named_by_an_index_at_or_above_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert index_gaps([1, 2, 4]) == [0, 3] and index_gaps([]) == [] and index_gaps([0, 1]) == []
    on_0 = EngineSpec(name="zero", model="m", port=8003, gpus=(0,))
    on_3 = EngineSpec(name="three", model="m", port=8004, gpus=(3,))
    placed = {
        s.name: s for s in resolve_gpus(config(BY_INDEX, on_0, on_3), {UUID: 1, "GPU-x": 3}, ()).engines
    }
    # NVML lists GPUs 1 and 3 (0 and 2 were left out at open): CUDA's 1 may be NVML's 3, and the
    # board an engine on GPU 0 gets is CUDA's 0, which may be NVML's 1.
    assert not placed["idx"].enabled and not placed["zero"].enabled and not placed["three"].enabled
    assert (
        "engine idx not started: NVML cannot read GPU(s) [0], at or below its GPU indices [1]" in caplog.text
    )
    assert "engine three not started: NVML cannot read GPU(s) [0, 2]" in caplog.text
    # By UUID the engine gets the board itself.
    by_uuid = resolve_gpus(config(BY_UUID), {UUID: 1, "GPU-x": 3}, ()).engines[0]
    assert by_uuid.enabled and by_uuid.gpus == (1,)


def test_an_engine_waits_for_its_gpus_fabric_and_leaves_the_wait_when_it_completes() -> None:
    """Issue 36, M6: an engine on a GPU whose NVSwitch fabric is not registered waits, with why;
    GPUs outside a fabric, or whose fabric was not read, hold nothing back."""
    not_started, in_progress = GpuFabric(state=FABRIC_NOT_STARTED), GpuFabric(state=FABRIC_IN_PROGRESS)
    done = GpuFabric(state=FABRIC_COMPLETED)
    two = EngineSpec(name="two", model="m", port=8005, gpus=(0, 1))
    assert fabric_wait_reason(two, {}) is None  # NVML cannot say: nothing waits
    assert fabric_wait_reason(two, {0: done, 1: GpuFabric(state=FABRIC_NOT_SUPPORTED)}) is None
    why = fabric_wait_reason(two, {0: not_started, 1: not_started})
    assert why is not None and why.startswith(
        "fabric not ready on GPU 0,1: fabric manager not running? (registration not started;"
        " systemctl status nvidia-fabricmanager)"
    )
    assert "CUDA fails with error 802" in why
    failed = fabric_wait_reason(
        two, {0: done, 1: GpuFabric(state=FABRIC_COMPLETED, status=999, status_name="Unknown")}
    )
    assert failed is not None and failed.startswith(
        "fabric not ready on GPU 1: registration failed (Unknown)"
    )

    wait = FabricWait()
    assert wait.admit(BY_INDEX, {1: done}) is None and wait.waiting == {}
    assert wait.admit(BY_INDEX, {1: not_started}) is not None and set(wait.waiting) == {"idx"}
    specs = {"idx": BY_INDEX}
    assert wait.due(specs, {1: in_progress}) == []
    assert "registration in progress" in wait.waiting["idx"]  # the reason follows the state
    assert wait.due(specs, {1: done}) == ["idx"] and wait.waiting == {}
    wait.admit(BY_INDEX, {1: not_started})
    assert wait.due({}, {1: not_started}) == [] and wait.waiting == {}  # removed from the config
