"""The runner's seam to the operating system: ``Processes``, and ``HostProcesses``, the real one.

Everything the runner does to the operating system goes through one ``Processes`` object (the
seam tests replace with a fake, tests/lib/engine_fakes.py): spawning, looking at a process group,
killing trees, and the recorded-group files in the state dir.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

from llmsupervisor import process
from llmsupervisor.files import DISK_FULL_ERRNOS, JsonFileWriter
from llmsupervisor.stacks import StackDump, dump_stacks

log = logging.getLogger("llmsupervisor.engine")

STRAY_SWEEP_TIMEOUT_S: Final = 10.0  # one sweep of /proc for an engine's strays, after its stop
RECORD_GROUP_TIMEOUT_S: Final = 30.0  # the group record written at a spawn, on a disk that may stall
PORT_CHECK_TIMEOUT_S: Final = 10.0  # who listens on an engine's port, before its spawn


class EngineProcess(Protocol):
    """One spawn: the API server (the group leader), its exit, its output pipes."""

    pid: int
    pgid: int
    stdout_fd: int
    stderr_fd: int
    exit_status: process.ExitStatus | None

    @property
    def returned(self) -> bool: ...

    async def wait(self) -> process.ExitStatus: ...

    @property
    def exited(self) -> asyncio.Future[process.ExitStatus]:
        """Done at the exit, watched by ``aio.wait_any`` without a task; never cancelled."""
        ...

    def signal_main(self, sig: int) -> None: ...

    def signal_group(self, sig: int) -> None: ...


class Processes(Protocol):
    """The runner's view of the operating system's processes."""

    state_dir: Path

    def spawn(self, argv: list[str], env: Mapping[str, str], cpus: Sequence[int] = ()) -> EngineProcess: ...

    def group_members(self, pgid: int) -> list[int]: ...

    def group_gone(self, proc: EngineProcess) -> bool: ...

    def signal_each(self, pids: Sequence[int], sig: int) -> None:
        """``sig`` to each of ``pids`` (members of an engine's group); one already gone is skipped."""
        ...

    async def strays(self, engine: str, *, leader: int) -> list[int]: ...

    async def kill_trees(self, pids: Iterable[int], *, timeout_s: float) -> list[int]: ...

    async def record_group(self, engine: str, pid: int) -> None:
        """Write the group's record for a successor daemon (raises OSError, TimeoutError)."""
        ...

    def forget_group(self, engine: str) -> None: ...

    async def port_holders(self, port: int, host: str) -> list[int | None]:
        """Who listens on ``port`` where a bind of ``host`` collides (raises TimeoutError when
        the host does not say in time)."""
        ...

    def leftover_of_ours(self, pid: int) -> str | None: ...

    async def earlier_runs(self, engine: str) -> list[int]: ...

    def describe(self, pid: int) -> str: ...

    async def dump_stacks(self, pids: Sequence[int], *, timeout_s: float) -> list[StackDump] | None:
        """Each process's Python stacks (stacks.py, for engine/evidence.py); None when py-spy is missing."""
        ...


class HostProcesses:
    """The real processes of this host (llmsupervisor.process)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._groups: dict[str, JsonFileWriter] = {}  # each engine's group record, by engine

    def spawn(self, argv: list[str], env: Mapping[str, str], cpus: Sequence[int] = ()) -> EngineProcess:
        return process.spawn(argv, env, cpus=cpus)

    def group_members(self, pgid: int) -> list[int]:
        return process.group_members(pgid)

    def group_gone(self, proc: EngineProcess) -> bool:
        """The leader has exited and no other live member of its group is left (adopted
        orphans that already exited are reaped on the way)."""
        members = process.group_members(proc.pgid)
        # Look before reaping: a member that dies after the reap but before the look would be
        # counted gone and left a zombie for the daemon's life (its parent, an exiting
        # EngineCore, handed it to us). Looked at first, it counts as living, and this poll's
        # or the next one's reap collects it. A member already dead at the look is ours to reap
        # now (its parent exited and handed it to us) or its living parent's, a member that
        # keeps the group from being gone.
        living = [p for p in members if p != proc.pid and process.alive(p)]
        process.reap_adopted(members, skip=proc.pid)
        return proc.returned and not living

    def signal_each(self, pids: Sequence[int], sig: int) -> None:
        for pid in pids:
            process.signal_pid(pid, sig)

    async def strays(self, engine: str, *, leader: int) -> list[int]:
        """Processes that left the group (setsid) but carry this engine's marker. The sweep reads
        every process's environment: in a thread under STRAY_SWEEP_TIMEOUT_S, never on the loop
        (on a loaded host it took 6.7 s, and the HTTP listener went unanswered meanwhile)."""
        try:
            async with asyncio.timeout(STRAY_SWEEP_TIMEOUT_S):
                found = await asyncio.to_thread(process.marker_processes, self.state_dir, engine=engine)
        except TimeoutError:
            log.warning("the sweep for stray processes took over %g s; skipped", STRAY_SWEEP_TIMEOUT_S)
            return []
        return [p for p in found if p != leader]

    async def kill_trees(self, pids: Iterable[int], *, timeout_s: float) -> list[int]:
        return await process.kill_trees(pids, timeout_s=timeout_s)

    async def record_group(self, engine: str, pid: int) -> None:
        """In a thread: two fsyncs on a busy disk stalled the whole loop for seconds (files.py).
        A disk that does not answer fails the start after RECORD_GROUP_TIMEOUT_S (the thread may
        still finish: a record of a group that is gone is ignored by the next daemon).

        A full disk does not fail it (issue 38: a daemon on a full disk kept every engine down):
        the record is kept and written once the disk has room (files.JsonFileWriter), and the
        marker in the engine's environment finds its processes meanwhile. Any other error (a
        read-only state dir, a link planted in it) fails the start, as before."""
        async with asyncio.timeout(RECORD_GROUP_TIMEOUT_S):
            record = await asyncio.to_thread(process.group_record, pid, os.getpid())
        if record is None:
            return
        writer = self._group_file(engine)
        writer.save(record, promptly=True)
        if not await writer.settled(RECORD_GROUP_TIMEOUT_S):
            raise TimeoutError
        failed = writer.failed
        if failed is not None and failed.errno not in DISK_FULL_ERRNOS:
            raise failed

    def forget_group(self, engine: str) -> None:
        writer = self._groups.get(engine)
        if writer is not None:
            writer.remove()  # after the record, in order, even one still waiting for room
        else:
            process.forget_group(self.state_dir, engine)

    def _group_file(self, engine: str) -> JsonFileWriter:
        writer = self._groups.get(engine)
        if writer is None:
            writer = JsonFileWriter(
                process.group_path(self.state_dir, engine),
                what="the process group record",
                engine=engine,
                indent=None,
                root=self.state_dir,
            )
            self._groups[engine] = writer
        return writer

    async def port_holders(self, port: int, host: str) -> list[int | None]:
        """In a thread: psutil finds a socket's process by reading every process's descriptors
        (10 ms with 70 processes on a quiet 2-core host; it grows with the host and its load)."""
        async with asyncio.timeout(PORT_CHECK_TIMEOUT_S):
            return await asyncio.to_thread(process.port_holders, port, host)

    def leftover_of_ours(self, pid: int) -> str | None:
        """The engine name when ``pid`` is an engine process of ours, None otherwise."""
        ours, engine = process.is_ours(pid, self.state_dir)
        return (engine or "?") if ours else None

    async def earlier_runs(self, engine: str) -> list[int]:
        """Processes of ``engine`` spawned by an earlier daemon on this state dir: a sweep of
        every process's environment, in a thread as ``strays`` is (an empty list at its deadline)."""
        try:
            async with asyncio.timeout(STRAY_SWEEP_TIMEOUT_S):
                return await asyncio.to_thread(
                    process.marker_processes, self.state_dir, engine=engine, exclude_daemon_pid=os.getpid()
                )
        except TimeoutError:
            log.warning(
                "the sweep for an earlier run's processes took over %g s; skipped", STRAY_SWEEP_TIMEOUT_S
            )
            return []

    def describe(self, pid: int) -> str:
        return process.describe_pid(pid)

    async def dump_stacks(self, pids: Sequence[int], *, timeout_s: float) -> list[StackDump] | None:
        return await dump_stacks(pids, timeout_s=timeout_s)
