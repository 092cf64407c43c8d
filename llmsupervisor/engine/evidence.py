"""Evidence before the kill: the Python stacks of every process of a hung or stalled engine.

A restart fixes a hang and destroys the only evidence of why it happened. So before the kill of
a restart whose cause is a hang or a stall, the runner has ``py-spy dump`` take the stacks of the
engine's processes (API server, EngineCore, workers), all at once and under one short deadline
(``EVIDENCE_TIMEOUT_S``). The result goes to ``STATE_DIR/engines/NAME/incidents/`` as one text
file per incident, bounded in count and size (the oldest are removed), and the log line names it.

The stacks must not keep the balancer's requests waiting (issue 27): a request the hung engine
holds is resent elsewhere only once its connection closes, so the order is data
(``evidence_moves``), chosen by what the finding blames (``core.findings.Blame``)::

    the API server not blamed (a hung EngineCore, Worker, or no process named):
        FREEZE     SIGSTOP to every process of the group but the API server: their stacks stay
                   as the hang left them, and they cannot react to their parent's death
        CUT_FRONT  SIGKILL to the API server at once: every connection it held closes, and the
                   balancer resends each request that had no byte of an answer
        DUMP       the stacks of the frozen processes
    the API server blamed (the ``stopped`` rule's pid is the leader, or the ``front`` rule):
        DUMP       every process's stacks first (the API server's is the evidence)

then the kill ladder goes straight to SIGKILL of the group (``StopLadder.kill_only``): a stopped
process cannot act on a SIGTERM, nor can a blocked API server.

So requests on a hung engine wait for the hang's detection and a few milliseconds, not for the
stacks. The API server's own stack is given up in the first case (the incident file says so).

The stacks themselves are ``stacks.dump_stacks``, reached through the ``Processes`` seam.
py-spy reads the target's memory (process_vm_readv, ptrace), so it works on a process frozen
by SIGSTOP as well (measured: py-spy 0.4.3 dumps a stopped CPython 3.11; stopped processes are
dumped with ``--nonblocking``, which does not pause and resume them). It needs the right to
ptrace the engine: root, the engines' own user where Yama's ptrace_scope is 0, or
CAP_SYS_PTRACE (docs/launch.md). Whatever fails is recorded per process in the incident; no py-spy
at all is a log line and no evidence, never a failure of the restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from llmsupervisor import aio
from llmsupervisor.core.findings import Blame
from llmsupervisor.engine.processes import EngineProcess, Processes
from llmsupervisor.files import open_directory, write_atomic
from llmsupervisor.stacks import StackDump, proc_facts

log = logging.getLogger("llmsupervisor.engine")

EVIDENCE_CAUSES: Final = frozenset({"hang", "stall"})
EVIDENCE_TIMEOUT_S: Final = 5.0  # all processes together, dumped concurrently
MAX_INCIDENTS: Final = 20  # per engine; the oldest files go first
MAX_INCIDENT_BYTES: Final = 512 * 1024  # per file; each process's stacks get an equal share
INCIDENT_WRITE_TIMEOUT_S: Final = 10.0  # the stacks file, on a disk that may stall; the restart goes on
INCIDENTS_DIR: Final = "incidents"


class Move(enum.Enum):
    FREEZE = "SIGSTOP to every process of the engine but the API server"
    CUT_FRONT = "SIGKILL to the API server"
    DUMP = "the stacks"


# The API server not blamed: cut it before the stacks (module docstring).
CUT_FRONT_FIRST: Final = (Move.FREEZE, Move.CUT_FRONT, Move.DUMP)
# The API server blamed: its stack is the evidence, taken with every other before the kill.
STACKS_FIRST: Final = (Move.DUMP,)


def evidence_moves(blame: Blame | None, leader_pid: int) -> tuple[Move, ...]:
    """The order of the evidence for an engine whose API server is ``leader_pid``."""
    return STACKS_FIRST if blame is not None and blame.names_leader(leader_pid) else CUT_FRONT_FIRST


@dataclass(frozen=True, slots=True)
class Evidence:
    """What ``take_evidence`` did: the incident file (None: nothing kept), and whether the API
    server was cut first (the rest of the engine is then SIGSTOPped)."""

    path: Path | None
    front_cut: bool

    @property
    def incident(self) -> str | None:
        """The incident file, as the ledger keeps it."""
        return None if self.path is None else str(self.path)


NO_EVIDENCE: Final = Evidence(None, front_cut=False)


def incident_dir(state_dir: Path, engine: str) -> Path:
    return state_dir / "engines" / engine / INCIDENTS_DIR


def write_incident(
    directory: Path,
    *,
    engine: str,
    cause: str,
    reason: str,
    dumps: Sequence[StackDump],
    wall_time_s: float | None = None,
    max_files: int = MAX_INCIDENTS,
    max_bytes: int = MAX_INCIDENT_BYTES,
    root: Path | None = None,
) -> Path:
    """One text file for the incident; older files beyond ``max_files`` are removed. Written as
    every state file is (files.write_atomic: nothing below ``root``, the state dir, is reached
    through a link, and the temporary file is created ``O_EXCL|O_NOFOLLOW``). Raises OSError (a
    full or read-only state dir, a planted link): the caller logs it and restarts anyway."""
    now = time.time() if wall_time_s is None else wall_time_s
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    path = directory / f"{stamp}-{cause}.txt"
    share = max(1024, (max_bytes - 2048) // max(1, len(dumps)))
    dumped = sum(1 for d in dumps if d.ok)
    lines = [
        f"engine: {engine}",
        f"cause: {cause}",
        f"reason: {reason}",
        f"time: {time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(now))}Z",
        f"processes: {len(dumps)}, stacks taken: {dumped}",
        "",
    ]
    for d in dumps:
        lines.append(f"==== pid {d.pid} [{d.state}] {d.title}")
        body = d.text if d.ok else f"NO STACKS: {d.text}"
        encoded = body.encode()
        if len(encoded) > share:
            body = encoded[:share].decode(errors="ignore") + f"\n[... cut at {share} bytes]"
        lines += [body.rstrip("\n"), ""]
    write_atomic(path, "\n".join(lines).encode(), root=root)
    prune(directory, max_files, root=root)
    return path


def prune(directory: Path, max_files: int, *, root: Path | None = None) -> None:
    dir_fd = open_directory(directory, root=root)
    try:
        names = sorted(n for n in os.listdir(dir_fd) if n.endswith(".txt") and not n.startswith("."))
        for old in names[: max(0, len(names) - max_files)]:
            with contextlib.suppress(OSError):
                os.unlink(old, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


async def take_evidence(
    name: str, proc: EngineProcess, procs: Processes, *, cause: str, reason: str, blame: Blame | None = None
) -> Evidence:
    """The stacks of the hung engine's processes before the kill destroys them, kept as an
    incident file, in the order ``evidence_moves`` gives for ``blame``; the stacks bounded by
    EVIDENCE_TIMEOUT_S, and never in the way of the restart."""
    if procs.group_gone(proc):
        return NO_EVIDENCE
    started_s = aio.now()
    pids = procs.group_members(proc.pgid)  # the API server, EngineCore, workers
    front_cut_s: float | None = None  # since the evidence began (the engine just left rotation)
    leader_title = "?"
    dumps: list[StackDump] | None = []
    for move in evidence_moves(blame, proc.pid):
        if move is Move.FREEZE:
            pids = [p for p in pids if p != proc.pid]
            procs.signal_each(pids, signal.SIGSTOP)
        elif move is Move.CUT_FRONT:
            leader_title, _ = proc_facts(proc.pid)  # read while it lives: a zombie has no cmdline
            proc.signal_main(signal.SIGKILL)
            front_cut_s = aio.now() - started_s
        else:
            dumps = await procs.dump_stacks(pids, timeout_s=EVIDENCE_TIMEOUT_S)
    front_cut = front_cut_s is not None
    dumped_s = aio.now() - started_s
    if dumps is None:
        log.warning(
            "%s: py-spy not found (next to the daemon's python or on PATH): no stacks of the engine%s",
            reason,
            f" (front cut at {front_cut_s:.2f} s)" if front_cut_s is not None else "",
            extra={"engine": name},
        )
        return Evidence(None, front_cut=front_cut)
    if front_cut:
        cut = "SIGKILLed before the stacks (front cut): its connections closed for the balancer to resend"
        dumps = [StackDump(proc.pid, leader_title, "killed", False, cut), *dumps]
    directory = incident_dir(procs.state_dir, name)
    try:
        # In a thread, as every state file (files.JsonFileWriter): the kernel holds a writer on a
        # busy disk, and the loop must keep answering the balancers' checks of the other engines.
        async with asyncio.timeout(INCIDENT_WRITE_TIMEOUT_S):
            path = await asyncio.to_thread(
                write_incident,
                directory,
                engine=name,
                cause=cause,
                reason=reason,
                dumps=dumps,
                root=procs.state_dir,
            )
    except (OSError, TimeoutError) as exc:
        log.warning(
            "%s: cannot keep the engine's stacks in %s: %s",
            reason,
            directory,
            getattr(exc, "strerror", None) or exc or f"no answer in {INCIDENT_WRITE_TIMEOUT_S:g} s",
            extra={"engine": name},
        )
        return Evidence(None, front_cut=front_cut)
    taken = sum(1 for d in dumps if d.ok)
    if front_cut_s is not None:
        log.warning(
            "%s: front cut at %.2f s (API server pid %d SIGKILLed), stacks of %d/%d stopped process(es)"
            " in %.2f s: %s",
            reason,
            front_cut_s,
            proc.pid,
            taken,
            len(pids),
            dumped_s,
            path,
            extra={"engine": name},
        )
    else:
        log.warning(
            "%s: stacks of %d/%d engine process(es) before the kill, in %.2f s: %s",
            reason,
            taken,
            len(dumps),
            dumped_s,
            path,
            extra={"engine": name},
        )
    return Evidence(path, front_cut=front_cut)
