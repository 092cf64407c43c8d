"""Placing the configured engines on CPUs (core/placement.py) with what this host reports: the
daemon's CPUs and, through NVML, each GPU's NUMA-node CPUs. Done at start and at every reload,
before the new config is compared with the running one, so an unchanged file moves nothing.
At start, engines on a GPU with MIG enabled are not placed at all (``refuse_mig``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from llmsupervisor.config import SupervisorConfig
from llmsupervisor.core.placement import AUTO, Topology, Wanted, plan
from llmsupervisor.probes.cpus import format_cpu_list, host_cpus

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


def describe(config: SupervisorConfig) -> str:
    placed = [f"{s.name} on {format_cpu_list(s.placement)}" for s in config.engines if s.placement]
    return ", ".join(placed) or "no engine placed"


def refuse_mig(
    config: SupervisorConfig, mig_enabled: Callable[[Iterable[int]], list[int]]
) -> SupervisorConfig:
    """The config with engines on a GPU with MIG enabled disabled: CUDA numbers the MIG devices,
    not the GPU, so CUDA_VISIBLE_DEVICES=<NVML index> would run them elsewhere than monitored."""
    engines = []
    for spec in config.engines:
        with_mig = mig_enabled(spec.gpus) if spec.enabled else []
        if with_mig:
            log.error(
                "engine %s not started: GPU(s) %s have MIG enabled; disable MIG or move the engine"
                " (docs/gpu.md)",
                spec.name,
                with_mig,
            )
            spec = replace(spec, enabled=False)
        engines.append(spec)
    return replace(config, engines=tuple(engines))
