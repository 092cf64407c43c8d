"""Placing the configured engines with what this host reports: GPUs named by UUID resolved to
NVML indices (and engines on a MIG-enabled or unknown GPU not started), then CPUs
(core/placement.py) from the daemon's CPUs and, through NVML, each GPU's NUMA-node CPUs. Done at
start and at every reload, before the new config is compared with the running one, so an
unchanged file moves nothing."""

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
    config: SupervisorConfig, index_of: Mapping[str, int], mig_enabled: Iterable[int]
) -> SupervisorConfig:
    """The config with GPU UUIDs resolved to NVML indices (``index_of``: UUID -> index, as NVML
    opened them). An enabled engine is not started (``enabled`` off, the reason logged) when NVML
    does not list one of its UUIDs, when another engine already has that GPU under its index, or
    when one of its GPUs has MIG on: CUDA numbers the MIG devices, not the GPU, so the engine
    would run elsewhere than monitored (docs/gpu.md)."""
    mig = set(mig_enabled)
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
        if problem is not None:
            log.error("engine %s not started: %s (docs/gpu.md)", spec.name, problem)
            spec = replace(spec, enabled=False)
        engines.append(spec)
    return replace(config, engines=tuple(engines))


async def place_on_host(config: SupervisorConfig, monitor: GpuMonitor) -> SupervisorConfig:
    """GPUs named by UUID get their NVML indices, engines on a MIG or unknown GPU are not started
    (``resolve_gpus``); ``cpus: auto`` engines get their share of this host's CPUs."""
    index_of = {uuid: index for index, uuid in monitor.gpus_by_index().items()}
    config = resolve_gpus(config, index_of, monitor.mig_enabled(monitor.latest))
    if not any(s.cpus == AUTO for s in config.engines):
        return config
    placed = place_config(config, topology(await monitor.gpu_cpus()))
    log.info("CPU placement: %s", describe(placed))
    return placed


def describe(config: SupervisorConfig) -> str:
    placed = [f"{s.name} on {format_cpu_list(s.placement)}" for s in config.engines if s.placement]
    return ", ".join(placed) or "no engine placed"
