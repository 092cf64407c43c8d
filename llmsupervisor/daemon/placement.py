"""Placing the configured engines on CPUs (core/placement.py) with what this host reports: the
daemon's CPUs and, through NVML, each GPU's NUMA-node CPUs. Done at start and at every reload,
before the new config is compared with the running one, so an unchanged file moves nothing."""

from __future__ import annotations

import logging
from collections.abc import Mapping
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
