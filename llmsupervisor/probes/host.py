"""One engine's process group as psutil sees it: each process's RSS, CPU time, state; zombies.

vLLM keeps every process of an engine in the launcher's process group (docs/vllm-notes.md §2), and the
supervisor starts each engine in a session of its own, so the group id names the engine's whole
tree, including children orphaned when their parent died (a walk from the leader would miss
those). ``process_*`` in vLLM's ``/metrics`` describes the API server only; EngineCore and Worker
RSS have to be read here.

The sweep blocks (it reads ``/proc``), so the loop runs it in a thread. It is split in two so
tests can feed fixtures: ``list_groups_psutil`` (the only part that touches the OS) produces
``RawProcess`` records, and the pure ``summarize`` turns them into a ``ProcSample``.

Finding a group's members (``process.members_of``) means asking every process on the host for
its group, so one sweep per engine costs engines x processes. ``GroupSweeper`` makes one sweep,
over every group asked for recently, serve every engine that asks within ``max_age_s`` (a tick):
engines x processes becomes processes, and one thread per tick instead of one per engine.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import psutil

from llmsupervisor import process
from llmsupervisor.probes import ProbeFailure

ZOMBIE: Final = psutil.STATUS_ZOMBIE  # "zombie"
# A process the kernel holds still: SIGSTOP ("T") or a tracer's stop ("t"). It runs nothing,
# whatever its sockets still answer (docs/vllm-notes.md §7: a stopped worker, /health 200).
STOPPED: Final = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})


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
    # The main thread's own user + system CPU (/proc/PID/task/PID/stat), read for the group's
    # leader only: the API server, whose loop runs there (detectors/hang/front.py).
    main_thread_cpu_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcInfo:
    pid: int
    title: str  # command line joined, as setproctitle shows it ("VLLM::EngineCore")
    rss_bytes: int | None
    cpu_seconds: float | None  # user + system, this process only
    status: str
    zombie: bool
    # Its main thread's share of cpu_seconds; the group's leader only (RawProcess).
    main_thread_cpu_seconds: float | None = None

    @property
    def stopped(self) -> bool:
        return self.status in STOPPED


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcSample:
    """An engine's process group at one moment. ``process_count`` includes zombies.

    ``at_s`` is when the sweep that read it started (the sweeper's clock), None when unknown:
    several engines' observations share one sweep, and the liveness detectors difference CPU
    times between sweeps, not between observations.
    """

    pgid: int
    processes: tuple[ProcInfo, ...]  # by pid
    rss_bytes_total: int  # over the processes whose RSS could be read
    cpu_seconds_total: float
    process_count: int
    zombie_count: int
    at_s: float | None = None

    @property
    def pids(self) -> frozenset[int]:
        return frozenset(p.pid for p in self.processes)


def _title(raw: RawProcess) -> str:
    if raw.cmdline:
        return " ".join(raw.cmdline)
    # No command line: a zombie (its memory is gone) or a kernel thread; ps shows "[name]".
    return f"[{raw.name}]"


def _cpu_seconds(raw: RawProcess) -> float | None:
    if raw.cpu_user_s is None or raw.cpu_system_s is None:
        return None
    return raw.cpu_user_s + raw.cpu_system_s


def summarize(pgid: int, raws: Iterable[RawProcess], *, at_s: float | None = None) -> ProcSample:
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
            main_thread_cpu_seconds=r.main_thread_cpu_s,
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
        at_s=at_s,
    )


_ATTRS: Final = ["name", "cmdline", "memory_info", "cpu_times", "status"]
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


def task_cpu_s(stat_path: str) -> float | None:
    """User + system CPU seconds from a ``/proc/PID/stat`` or ``/proc/PID/task/TID/stat`` file,
    None if it cannot be read (blocking: one small read)."""
    try:
        with open(stat_path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last
    # ")"; utime and stime are the 14th and 15th fields (proc(5)), the 12th and 13th after it.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (IndexError, ValueError):
        return None


def main_thread_cpu_s(pid: int) -> float | None:
    """``pid``'s main thread's user + system CPU seconds, None if it cannot be read. psutil reads
    every thread's file for ``threads()``; one is wanted here."""
    return task_cpu_s(f"/proc/{pid}/task/{pid}/stat")


def list_groups_psutil(pgids: Collection[int]) -> dict[int, list[RawProcess]]:
    """The processes of each group in ``pgids`` right now, in one pass (blocking; reads ``/proc``).

    One ``process.members_of`` walk finds the members; the full read happens only for them.
    Processes that exit mid-sweep are left out; unreadable fields are ``None``. Every group asked
    for has an entry, empty when it has no processes.
    """
    found: dict[int, list[RawProcess]] = {}
    for pgid, pids in process.members_of(pgids).items():
        members = found[pgid] = []
        for pid in pids:
            try:
                info = psutil.Process(pid).as_dict(attrs=_ATTRS, ad_value=None)
            except (OSError, psutil.Error):  # gone mid-sweep
                continue
            mem = info["memory_info"]
            cpu = info["cpu_times"]
            cmdline = info["cmdline"]
            members.append(
                RawProcess(
                    pid=pid,
                    pgid=pgid,
                    name=info["name"] or "?",
                    cmdline=None if cmdline is None else tuple(cmdline),
                    rss_bytes=None if mem is None else int(mem.rss),
                    cpu_user_s=None if cpu is None else float(cpu.user),
                    cpu_system_s=None if cpu is None else float(cpu.system),
                    status=info["status"] or "unknown",
                    main_thread_cpu_s=main_thread_cpu_s(pid) if pid == pgid else None,
                )
            )
    return found


ListGroups = Callable[[Collection[int]], Mapping[int, Iterable[RawProcess]]]


def sweep_groups(
    pgids: Collection[int], *, list_groups: ListGroups = list_groups_psutil, at_s: float | None = None
) -> dict[int, ProcSample]:
    """Sweep several groups in one pass; blocking, so run it with ``asyncio.to_thread``."""
    listed = list_groups(pgids)
    return {pgid: summarize(pgid, listed.get(pgid, ()), at_s=at_s) for pgid in pgids}


@dataclass(frozen=True, slots=True)
class _Sweep:
    started_s: float
    pgids: frozenset[int]
    task: asyncio.Task[dict[int, ProcSample]]


class GroupSweeper:
    """One sweep of the host's processes, shared by every engine that asks within ``max_age_s``.

    A sweep covers every group asked for in the last ``forget_after_s``, so the engines of one
    tick share it; a group it does not cover (a new incarnation) starts a new one. A sweep in
    flight is awaited, never doubled: one that blocks (a process stuck in the kernel can block a
    read of its ``/proc`` files) costs each asker its deadline, but not a thread per asker per tick.
    ``max_age_s=0`` sweeps on every call (tests, and a daemon with one engine gains nothing).
    """

    def __init__(
        self,
        *,
        max_age_s: float,
        monotonic: Callable[[], float],
        forget_after_s: float = 60.0,
        list_groups: ListGroups = list_groups_psutil,
    ) -> None:
        self.max_age_s = max_age_s
        self.forget_after_s = forget_after_s
        self._monotonic = monotonic
        self._list_groups = list_groups
        self._asked_s: dict[int, float] = {}  # pgid -> when an engine last asked for it
        self._sweep: _Sweep | None = None

    def _current(self, pgid: int, now: float, fresh_after_s: float | None) -> _Sweep | None:
        sweep = self._sweep
        if sweep is None or pgid not in sweep.pgids:
            return None
        if fresh_after_s is not None and sweep.started_s < fresh_after_s:
            return None
        if not sweep.task.done():
            return sweep  # in flight: its answer is the freshest there will be soon
        if now - sweep.started_s >= self.max_age_s or sweep.task.cancelled():
            return None
        return sweep

    async def sample(
        self, pgid: int, *, timeout_s: float, fresh_after_s: float | None = None
    ) -> ProcSample | ProbeFailure:
        """Group ``pgid`` as the latest shared sweep saw it, or a timeout after ``timeout_s``;
        with ``fresh_after_s``, from a sweep started no earlier than that (the hang rules want one
        taken after a probe missed its deadline, not the one taken as the round began).

        A sweep that raises (``/proc`` unreadable: EMFILE when the daemon is out of descriptors)
        raises here, to every asker: the observation round's one catch-all counts it as
        ``proc_sweep`` wherever it raised (engine/observer.py), so it has one name."""
        now = self._monotonic()
        self._asked_s[pgid] = now
        sweep = self._current(pgid, now, fresh_after_s)
        if sweep is None:
            horizon = now - self.forget_after_s
            for old in [g for g, t in self._asked_s.items() if t < horizon]:
                del self._asked_s[old]
            pgids = frozenset(self._asked_s)
            task = asyncio.ensure_future(
                asyncio.to_thread(sweep_groups, pgids, list_groups=self._list_groups, at_s=now)
            )
            # Each asker gets the error; if all have given up, nothing else should log it.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            sweep = self._sweep = _Sweep(now, pgids, task)
        try:
            async with asyncio.timeout(timeout_s):
                # Shielded: an asker that gives up (deadline, cancelled round) leaves the sweep
                # running for the others.
                samples = await asyncio.shield(sweep.task)
        except TimeoutError:
            return ProbeFailure("timeout", f"process sweep took over {timeout_s} s")
        return samples[pgid]


__all__ = [
    "STOPPED",
    "GroupSweeper",
    "ListGroups",
    "ProcInfo",
    "ProcSample",
    "RawProcess",
    "list_groups_psutil",
    "main_thread_cpu_s",
    "summarize",
    "sweep_groups",
    "task_cpu_s",
]
