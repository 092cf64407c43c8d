"""The wait for GPU memory after a stop (engine/stopping.py ``await_gpu_release``), on virtual
time: what counts as released, and what does not (issue 36, L10)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import pytest

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.engine.stopping import RELEASED_BELOW_BYTES, await_gpu_release
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.gpu_readings import GpuProcess, GpuSample
from tests.lib.virtual_time import run_virtual

GIB = 1024**3
SPEC = EngineSpec(name="a", model="m", port=8000, gpus=(0,), gpu_release_timeout_s=30.0)
Readings = Mapping[int, GpuSample | ProbeFailure]


def waited(readings: Iterable[Readings]) -> float:
    """Seconds ``await_gpu_release`` waited for the engine (pid 42), each poll reading the next
    of ``readings`` (the last one repeats)."""
    script = list(readings)

    def samples_for(gpus: Iterable[int]) -> Readings:
        return script.pop(0) if len(script) > 1 else script[0]

    async def scenario() -> float:
        start = aio.now()
        await await_gpu_release(SPEC, [42], samples_for)
        return aio.now() - start

    return run_virtual(scenario())


def held(used: int, processes: tuple[GpuProcess, ...] | None) -> Readings:
    return {0: nominal_sample(0, memory_used_bytes=used, processes=processes)}


def test_released_when_the_engines_processes_leave_the_list() -> None:
    assert waited([held(70 * GIB, (GpuProcess(42, 70 * GIB),)), held(0, ())]) == pytest.approx(0.5)


def test_an_unreadable_process_list_is_not_released(caplog: pytest.LogCaptureFixture) -> None:
    # NoPermission on the list (GpuSample.processes None) with 70 GiB still used: the wait runs
    # to its timeout and says why, instead of calling the GPU released at once.
    caplog.set_level(logging.INFO)
    assert waited([held(70 * GIB, None)]) == pytest.approx(SPEC.gpu_release_timeout_s, abs=0.5)
    assert "GPU memory released" not in caplog.text
    assert "GPU 0: process list unreadable, 70.0 GiB used" in caplog.text


def test_an_unreadable_list_with_the_memory_freed_is_released() -> None:
    readings = [held(70 * GIB, None), held(70 * GIB, None), held(RELEASED_BELOW_BYTES - 1, None)]
    assert waited(readings) == pytest.approx(1.0)


def test_a_failed_sample_is_not_released_either(caplog: pytest.LogCaptureFixture) -> None:
    failure: Readings = {0: ProbeFailure("timeout", "no answer from NVML within 5 s")}
    assert waited([failure, failure, held(0, ())]) == pytest.approx(1.0)
    assert waited([failure]) == pytest.approx(SPEC.gpu_release_timeout_s, abs=0.5)
    assert "GPU memory release not known after 30 s (GPU 0: GPU unreadable" in caplog.text


def test_without_nvml_there_is_nothing_to_wait_for() -> None:
    assert waited([{}]) == 0.0
