"""The host's CPUs for placement: the ones this process may run on (its affinity, which is the
cgroup cpuset's CPUs unless someone narrowed it) and what the kernel reports for a process."""

from __future__ import annotations

import os
from pathlib import Path

from llmsupervisor.core.placement import parse_cpu_list


def host_cpus() -> frozenset[int]:
    """CPUs the daemon, and so the engines it spawns, may be bound to."""
    return frozenset(os.sched_getaffinity(0))


def allowed_cpus_of(pid: int, proc: Path = Path("/proc")) -> tuple[int, ...] | None:
    """A process's ``Cpus_allowed_list`` (its main thread's affinity); None when it is gone."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpu_list(line.split(":", 1)[1].strip())
    except (OSError, ValueError):
        return None
    return None
