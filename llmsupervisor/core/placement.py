"""Which CPUs each engine runs on: the plan for ``cpus: auto``. Pure (CPU lists: probes/cpus.py).

An engine with ``cpus`` set is bound to those CPUs from its first instruction (the daemon sets
the spawning thread's affinity, which the child inherits across exec, and every process and
thread of the engine inherits it in turn), and vLLM's own OpenMP binding on the CPU build is
told the same list (``VLLM_CPU_OMP_THREADS_BIND``), since vLLM would otherwise bind every
engine's threads by its own rule, the same cores for every engine of a host.

``auto`` gives engines disjoint sets:

* an engine with GPUs whose CPU affinity NVML reports (the CPUs of the GPUs' NUMA node) gets
  an even share of those CPUs, shared with the other auto engines on the same node;
* every other auto engine (the CPU build, or no NVML) gets an even share of the CPUs left.

CPUs an explicit list claims are never handed out to an auto engine. The plan is a function of
the config and the host only, so a reload of an unchanged file places every engine where it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmsupervisor.probes.cpus import format_cpu_list

AUTO = "auto"


def split_evenly(cpus: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """``cpus`` cut into ``parts`` contiguous runs whose sizes differ by at most one (the
    earlier runs get the extra CPUs). Fewer CPUs than parts: the last parts are empty."""
    ordered = sorted(cpus)
    size, extra = divmod(len(ordered), parts)
    out: list[tuple[int, ...]] = []
    start = 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(ordered[start:end]))
        start = end
    return out


def omp_threads_bind(cpus: Sequence[int], ranks: int) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for an engine on ``cpus`` with ``ranks`` CPU workers
    (tensor x pipeline parallel): one list per rank, ranks separated by ``|`` (vllm 0.32
    ``utils/ompmultiprocessing.py``: the number of lists must equal the local world size)."""
    if ranks <= 1 or len(cpus) < ranks:
        return format_cpu_list(cpus)
    return "|".join(format_cpu_list(part) for part in split_evenly(cpus, ranks))


@dataclass(frozen=True, slots=True)
class Wanted:
    """One engine's placement request."""

    name: str
    cpus: tuple[int, ...] | str  # an explicit list, AUTO, or () for none
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Topology:
    """What the host offers: the CPUs engines may use, and each GPU's CPUs (its NUMA node's)."""

    cpus: frozenset[int]
    gpu_cpus: Mapping[int, frozenset[int]]


def plan(engines: Sequence[Wanted], topology: Topology) -> dict[str, tuple[int, ...]]:
    """Each engine's CPUs (an empty tuple: not placed, it runs wherever the daemon may)."""
    placed: dict[str, tuple[int, ...]] = {}
    claimed: set[int] = set()
    for e in engines:
        if isinstance(e.cpus, tuple):
            placed[e.name] = e.cpus
            claimed.update(e.cpus)
    free = topology.cpus - claimed
    by_node: dict[frozenset[int], list[str]] = {}
    rest: list[str] = []
    for e in engines:
        if e.cpus != AUTO:
            continue
        node: set[int] = set()
        for gpu in e.gpus:
            node |= topology.gpu_cpus.get(gpu, frozenset())
        node &= free
        if node:
            by_node.setdefault(frozenset(node), []).append(e.name)
        else:
            rest.append(e.name)
    used: set[int] = set()
    for node_cpus, names in by_node.items():
        for name, share in zip(names, split_evenly(sorted(node_cpus), len(names)), strict=True):
            placed[name] = share or tuple(sorted(node_cpus))  # more engines than CPUs: share them
        used |= node_cpus
    left = sorted(free - used) or sorted(free)
    for name, share in zip(rest, split_evenly(left, len(rest)) if rest else [], strict=True):
        placed[name] = share or tuple(left)
    return placed


def overlaps(placed: Mapping[str, tuple[int, ...]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(engine, earlier engine, shared CPUs) for every pair of engines that share CPUs."""
    found = []
    names = list(placed)
    for i, name in enumerate(names):
        for other in names[:i]:
            shared = tuple(sorted(set(placed[name]) & set(placed[other])))
            if shared:
                found.append((name, other, shared))
    return found
