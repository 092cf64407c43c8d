"""The daemon over the pynvml-level fake on virtual time, as ``Supervisor._run`` starts it less the
host's parts (guard, sockets, HTTP): the real loop, runners and NVML reader, engines on fake
processes and a scripted server (tests/lib/engine_fakes.py, tests/lib/virtual_nvml.py). Shared by
the NVML-at-boot tests and the GPU release tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec, SupervisorConfig, SupervisorSettings
from llmsupervisor.daemon.supervisor import Supervisor
from llmsupervisor.notify import Notifier
from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml, fake_uuid
from llmsupervisor.probes.nvml import NvmlReader
from tests.lib.engine_fakes import FakeProcesses, FakeSweeper, ServerScript
from tests.lib.supervisor_run import stopped as engines_stopped
from tests.lib.virtual_nvml import VirtualNvml


def engine(name: str, port: int, *, gpus: tuple[int, ...] = (), uuids: tuple[str, ...] = ()) -> EngineSpec:
    return EngineSpec(
        name=name,
        model="m",
        port=port,
        gpus=gpus,
        gpu_uuids=uuids,
        command=("vllm-fake",),
        start_timeout_s=60.0,
        gpu_release_timeout_s=0.0,
    )


def two_gpus(**kwargs: Any) -> FakeNvml:
    return VirtualNvml([FakeDevice(fake_uuid(0)), FakeDevice(fake_uuid(1))], **kwargs)


async def daemon(
    tmp_path: Path, nvml: FakeNvml, engines: tuple[EngineSpec, ...], **settings: Any
) -> tuple[Supervisor, asyncio.Task[None]]:
    """The daemon as ``_run`` starts it, less the host's parts (guard, sockets, HTTP)."""
    procs = FakeProcesses(state_dir=tmp_path)
    config = SupervisorConfig(
        path=tmp_path / "config.yaml",
        supervisor=SupervisorSettings(state_dir=tmp_path / "state", tick_interval_s=2.0, **settings),
        engines=engines,
    )
    sup = Supervisor(
        config,
        notifier=Notifier(environ={}),
        gpu_reader=NvmlReader(nvml, pids_visible=True),
        procs=procs,
        http_for=ServerScript(procs).http_for,
        sweeper=FakeSweeper(cpu_per_s=0.01),
    )
    await sup.gpu_monitor.start()
    await sup.add_engines()
    return sup, asyncio.create_task(sup._loop())


async def stopped(sup: Supervisor, loop: asyncio.Task[None]) -> None:
    await engines_stopped(sup, loop)
    await sup.gpu_release.close()
    await sup.gpu_monitor.close()


async def until(what: Callable[[], Any], *, within_s: float, step_s: float = 0.5) -> float:
    """Wait (virtual time) until ``what()`` is true; how long it took."""
    start_s = aio.now()
    while not what():
        assert aio.now() - start_s < within_s, f"not within {within_s} s"
        await aio.wait_any(timeout_s=step_s)
    return aio.now() - start_s


def state(sup: Supervisor, name: str) -> dict[str, Any]:
    engines: dict[str, Any] = sup.status()["engines"]
    return dict(engines[name])
