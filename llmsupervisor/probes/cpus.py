"""The host's CPUs for placement: the ones this process may run on (its affinity, which is the
cgroup cpuset's CPUs unless someone narrowed it) and what the kernel reports for a process, and
the kernel's cpulist format (``0-3,8``) both ways."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` -> (0, 1, 2, 3, 8): ascending, no duplicates. Raises ValueError."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            raise ValueError("empty item")
        first, sep, last = part.partition("-")
        lo = int(first)
        hi = int(last) if sep else lo
        if lo < 0 or hi < lo:
            raise ValueError(f"bad range {part!r}")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> ``"0-3,8"`` (the kernel's cpulist format, as in Cpus_allowed_list)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


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
