"""Placing the configured engines with what this host reports: GPUs named by UUID resolved to
NVML indices (and engines on a MIG-enabled or unknown GPU, or named by an index NVML may number
differently from CUDA, not started), then CPUs (core/placement.py) from the daemon's CPUs and,
through NVML, each GPU's NUMA-node CPUs. Done at start, at every reload, and once more when NVML
opens after the start, before the new config is compared with the running one, so an unchanged
file moves nothing.

While NVML is not open nothing can be resolved or checked: engines named by UUID are left
unresolved and start at once (CUDA takes the UUIDs themselves), unmonitored until NVML opens;
engines named by index wait for it (daemon/nvml_wait.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace

from llmsupervisor.config import SupervisorConfig
from llmsupervisor.core.placement import AUTO, Topology, Wanted, plan
from llmsupervisor.probes.cpus import format_cpu_list, host_cpus
from llmsupervisor.probes.gpus import GpuMonitor

log = logging.getLogger("llmsupervisor")


def topology(gpu_cpus: Mapping[int, frozenset[int]]) -> Topology:
    return Topology(cpus=host_cpus(), gpu_cpus=dict(gpu_cpus))


def place_config(config: SupervisorConfig, host: Topology) -> SupervisorConfig:
    """The config with each ``cpus: auto`` engine's share filled in (``placement``)."""
    if not any(s.cpus == AUTO for s in config.engines):
        return config
    wanted = [Wanted(s.name, s.cpus, s.gpus) for s in config.engines]
    placed = plan(wanted, host)
    engines = tuple(
        replace(s, placement=placed.get(s.name, ())) if s.cpus == AUTO else s for s in config.engines
    )
    return replace(config, engines=engines)


def resolve_gpus(
    config: SupervisorConfig,
    index_of: Mapping[str, int],
    mig_enabled: Iterable[int],
    *,
    nvml_open: bool = True,
) -> SupervisorConfig:
    """The config with GPU UUIDs resolved to NVML indices (``index_of``: UUID -> index, as NVML
    opened them). An enabled engine is not started (``enabled`` off, the reason logged) when NVML
    does not list one of its UUIDs, when another engine already has that GPU under its index, when
    one of its GPUs has MIG on (CUDA numbers the MIG devices, not the GPU, so the engine would run
    elsewhere than monitored), or when it names GPUs by index and NVML left out a GPU at or below
    one of them (``index_gaps``). With NVML not open (``nvml_open`` False) the config is returned
    as it is: nothing can be resolved or checked yet (docs/gpu.md)."""
    if not nvml_open:
        return config
    mig = set(mig_enabled)
    gaps = index_gaps(index_of.values())
    claimed = {g: s.name for s in config.engines if s.enabled and not s.gpu_uuids for g in s.gpus}
    engines = []
    for spec in config.engines:
        problem = None
        if spec.enabled and spec.gpu_uuids:
            resolved = spec.with_gpus(index_of)
            if isinstance(resolved, list):
                listed = ", ".join(sorted(index_of)) or "no GPU"
                problem = f"NVML does not list GPU(s) {', '.join(resolved)} (it lists {listed})"
            else:
                spec = resolved
                taken = {g: claimed[g] for g in spec.gpus if claimed.get(g, spec.name) != spec.name}
                problem = (
                    "; ".join(
                        f"GPU {spec.gpu_uuids[spec.gpus.index(g)]} is GPU {g} of engine {n}"
                        for g, n in taken.items()
                    )
                    or None
                )
                claimed.update({g: spec.name for g in spec.gpus})
        if problem is None and spec.enabled and (with_mig := sorted(g for g in spec.gpus if g in mig)):
            problem = f"GPU(s) {with_mig} have MIG enabled; disable MIG or move the engine"
        if problem is None and spec.enabled and not spec.gpu_uuids and spec.gpus:
            below = sorted(g for g in gaps if g <= max(spec.gpus))
            if below:
                problem = (
                    f"NVML cannot read GPU(s) {below}, at or below its GPU indices {list(spec.gpus)}: CUDA"
                    " may number the GPUs without that board, and the engine would run on another GPU"
                    " than the one monitored; name its GPUs by UUID"
                )
        if problem is not None:
            log.error("engine %s not started: %s (docs/gpu.md)", spec.name, problem)
            spec = replace(spec, enabled=False)
        engines.append(spec)
    return replace(config, engines=tuple(engines))


def index_gaps(indices: Iterable[int]) -> list[int]:
    """NVML indices missing below the highest one NVML opened: GPUs it could not read at open
    (probes/nvml.py leaves them out). CUDA is not expected to count such a board, so from there on
    its ordinals and NVML's can differ (docs/gpu.md, "CUDA ordinals and MIG")."""
    present = set(indices)
    return [i for i in range(max(present, default=-1)) if i not in present]


async def place_on_host(config: SupervisorConfig, monitor: GpuMonitor) -> SupervisorConfig:
    """GPUs named by UUID get their NVML indices, engines on a MIG or unknown GPU are not started
    (``resolve_gpus``); ``cpus: auto`` engines get their share of this host's CPUs."""
    index_of = {uuid: index for index, uuid in monitor.gpus_by_index().items()}
    config = resolve_gpus(
        config, index_of, monitor.mig_enabled(monitor.latest), nvml_open=monitor.reader.is_open
    )
    if not any(s.cpus == AUTO for s in config.engines):
        return config
    placed = place_config(config, topology(await monitor.gpu_cpus()))
    log.info("CPU placement: %s", describe(placed))
    return placed


def describe(config: SupervisorConfig) -> str:
    placed = [f"{s.name} on {format_cpu_list(s.placement)}" for s in config.engines if s.placement]
    return ", ".join(placed) or "no engine placed"
