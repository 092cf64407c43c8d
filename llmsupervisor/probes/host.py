"""One engine's process group as psutil sees it: each process's RSS, CPU time, state; zombies.

vLLM keeps every process of an engine in the launcher's process group (vllm-facts §2), and the
supervisor starts each engine in a session of its own, so the group id names the engine's whole
tree, including children orphaned when their parent died (a walk from the leader would miss
those). ``process_*`` in vLLM's ``/metrics`` describes the API server only; EngineCore and Worker
RSS have to be read here.

The sweep blocks (it reads ``/proc``), so the loop runs ``sweep_group`` in a thread. It is split
in two so tests can feed fixtures: ``list_group_psutil`` (the only part that touches the OS)
produces ``RawProcess`` records, and the pure ``summarize`` turns them into a ``ProcSample``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

import psutil

ZOMBIE: Final = psutil.STATUS_ZOMBIE  # "zombie"


@dataclass(frozen=True, slots=True, kw_only=True)
class RawProcess:
    """What one process looked like; ``None`` where the OS would not say (access denied)."""

    pid: int
    pgid: int
    name: str
    cmdline: tuple[str, ...] | None  # empty or None for zombies and kernel threads
    rss_bytes: int | None
    cpu_user_s: float | None
    cpu_system_s: float | None
    status: str  # psutil.STATUS_* ("running", "sleeping", "zombie", "stopped", ...)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcInfo:
    pid: int
    title: str  # command line joined, as setproctitle shows it ("VLLM::EngineCore")
    rss_bytes: int | None
    cpu_seconds: float | None  # user + system, this process only
    status: str
    zombie: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcSample:
    """An engine's process group at one moment. ``process_count`` includes zombies."""

    pgid: int
    processes: tuple[ProcInfo, ...]  # by pid
    rss_bytes_total: int  # over the processes whose RSS could be read
    cpu_seconds_total: float
    process_count: int
    zombie_count: int

    @property
    def pids(self) -> frozenset[int]:
        return frozenset(p.pid for p in self.processes)

    @property
    def stopped_count(self) -> int:
        """Processes stopped by a signal (SIGSTOP): alive to ``/health``, dead to the engine."""
        return sum(
            1 for p in self.processes if p.status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        )


def _title(raw: RawProcess) -> str:
    if raw.cmdline:
        return " ".join(raw.cmdline)
    # No command line: a zombie (its memory is gone) or a kernel thread; ps shows "[name]".
    return f"[{raw.name}]"


def _cpu_seconds(raw: RawProcess) -> float | None:
    if raw.cpu_user_s is None or raw.cpu_system_s is None:
        return None
    return raw.cpu_user_s + raw.cpu_system_s


def summarize(pgid: int, raws: Iterable[RawProcess]) -> ProcSample:
    """Pure: the members of ``pgid`` among ``raws`` (others are ignored), with totals."""
    members = sorted((r for r in raws if r.pgid == pgid), key=lambda r: r.pid)
    infos = tuple(
        ProcInfo(
            pid=r.pid,
            title=_title(r),
            rss_bytes=r.rss_bytes,
            cpu_seconds=_cpu_seconds(r),
            status=r.status,
            zombie=r.status == ZOMBIE,
        )
        for r in members
    )
    return ProcSample(
        pgid=pgid,
        processes=infos,
        rss_bytes_total=sum(p.rss_bytes for p in infos if p.rss_bytes is not None),
        cpu_seconds_total=sum((p.cpu_seconds for p in infos if p.cpu_seconds is not None), 0.0),
        process_count=len(infos),
        zombie_count=sum(1 for p in infos if p.zombie),
    )


_ATTRS: Final = ["name", "cmdline", "memory_info", "cpu_times", "status"]


def list_group_psutil(pgid: int) -> list[RawProcess]:
    """The processes whose process group is ``pgid`` right now (blocking; reads ``/proc``).

    ``os.getpgid`` per PID is one cheap syscall; the full read happens only for members.
    Processes that exit mid-sweep are left out; unreadable fields are ``None``.
    """
    found: list[RawProcess] = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
            info = psutil.Process(pid).as_dict(attrs=_ATTRS, ad_value=None)
        except (OSError, psutil.Error):  # gone mid-sweep, or not ours to read
            continue
        mem = info["memory_info"]
        cpu = info["cpu_times"]
        cmdline = info["cmdline"]
        found.append(
            RawProcess(
                pid=pid,
                pgid=pgid,
                name=info["name"] or "?",
                cmdline=None if cmdline is None else tuple(cmdline),
                rss_bytes=None if mem is None else int(mem.rss),
                cpu_user_s=None if cpu is None else float(cpu.user),
                cpu_system_s=None if cpu is None else float(cpu.system),
                status=info["status"] or "unknown",
            )
        )
    return found


def sweep_group(
    pgid: int, *, list_group: Callable[[int], Iterable[RawProcess]] = list_group_psutil
) -> ProcSample:
    """Sweep one engine's process group; blocking, so run it with ``asyncio.to_thread``."""
    return summarize(pgid, list_group(pgid))


__all__ = [
    "ProcInfo",
    "ProcSample",
    "RawProcess",
    "list_group_psutil",
    "summarize",
    "sweep_group",
]
