"""Launching one incarnation: the port preflight, the engine's environment, the spawn.

Everything the runner does to the operating system goes through one ``Processes`` object (the
seam tests replace with a fake): spawning, looking at a process group, killing trees, and the
recorded-group files in the state dir. ``launch`` turns every way a start can fail before the
engine runs into a ``Launched`` failure with a reason: a foreign port holder, an executable that
will not exec, and a full or read-only state dir (that last one used to crash the runner task
and restart it every 5 s forever: defect D7).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llmsupervisor import process
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.placement import format_cpu_list, omp_threads_bind
from llmsupervisor.engine.access_log import probe_access_flags
from llmsupervisor.engine.evidence import StackDump, dump_stacks
from llmsupervisor.errors import PortHeld
from llmsupervisor.probes.cpus import host_cpus

log = logging.getLogger("llmsupervisor.engine")


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

    def signal_main(self, sig: int) -> None: ...

    def signal_group(self, sig: int) -> None: ...


class Processes(Protocol):
    """The runner's view of the operating system's processes."""

    state_dir: Path

    def spawn(self, argv: list[str], env: Mapping[str, str], cpus: Sequence[int] = ()) -> EngineProcess: ...

    def group_members(self, pgid: int) -> list[int]: ...

    def group_gone(self, proc: EngineProcess) -> bool: ...

    def strays(self, engine: str, *, leader: int) -> list[int]: ...

    async def kill_trees(self, pids: Iterable[int], *, timeout_s: float) -> list[int]: ...

    def record_group(self, engine: str, pid: int) -> None: ...

    def forget_group(self, engine: str) -> None: ...

    def port_holders(self, port: int) -> list[int | None]: ...

    def leftover_of_ours(self, pid: int) -> str | None: ...

    def earlier_runs(self, engine: str) -> list[int]: ...

    def describe(self, pid: int) -> str: ...

    async def dump_stacks(self, pids: Sequence[int], *, timeout_s: float) -> list[StackDump] | None:
        """Each process's Python stacks (engine/evidence.py); None when py-spy is missing."""
        ...


class HostProcesses:
    """The real processes of this host (llmsupervisor.process)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

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

    def strays(self, engine: str, *, leader: int) -> list[int]:
        """Processes that left the group (setsid) but carry this engine's marker."""
        return [p for p in process.marker_processes(self.state_dir, engine=engine) if p != leader]

    async def kill_trees(self, pids: Iterable[int], *, timeout_s: float) -> list[int]:
        return await process.kill_trees(pids, timeout_s=timeout_s)

    def record_group(self, engine: str, pid: int) -> None:
        process.record_group(self.state_dir, engine, pid, os.getpid())

    def forget_group(self, engine: str) -> None:
        process.forget_group(self.state_dir, engine)

    def port_holders(self, port: int) -> list[int | None]:
        return process.port_holders(port)

    def leftover_of_ours(self, pid: int) -> str | None:
        """The engine name when ``pid`` is an engine process of ours, None otherwise."""
        ours, engine = process.is_ours(pid, self.state_dir)
        return (engine or "?") if ours else None

    def earlier_runs(self, engine: str) -> list[int]:
        """Processes of ``engine`` spawned by an earlier daemon on this state dir."""
        return process.marker_processes(self.state_dir, engine=engine, exclude_daemon_pid=os.getpid())

    def describe(self, pid: int) -> str:
        return process.describe_pid(pid)

    async def dump_stacks(self, pids: Sequence[int], *, timeout_s: float) -> list[StackDump] | None:
        return await dump_stacks(pids, timeout_s=timeout_s)


@dataclass(frozen=True, slots=True)
class Launched:
    proc: EngineProcess | None  # None: the start failed before anything ran
    failure: str = ""


async def preflight_port(spec: EngineSpec, procs: Processes) -> None:
    """Before binding: a leftover engine of ours on the port is killed; anyone else fails us."""
    for pid in procs.port_holders(spec.port):
        engine = procs.leftover_of_ours(pid) if pid is not None else None
        if pid is None or engine is None:
            raise PortHeld(spec.port, pid, procs.describe(pid) if pid is not None else "")
        log.warning(
            "port %d is held by pid %d, a leftover engine %r of an earlier run: killing its tree",
            spec.port,
            pid,
            engine,
            extra={"engine": spec.name},
        )
        leftovers = [pid, *(p for p in procs.earlier_runs(engine) if p != pid)]
        alive = await procs.kill_trees(leftovers, timeout_s=spec.kill_timeout_s)
        if alive:
            raise PortHeld(spec.port, alive[0], "leftover engine that survived SIGKILL")


async def launch(spec: EngineSpec, step: int, procs: Processes) -> Launched:
    """Preflight, environment, spawn, record the group. Never raises for an OS problem."""
    try:
        await preflight_port(spec, procs)
    except PortHeld as exc:
        return Launched(None, str(exc))
    cache_dir = procs.state_dir / "engines" / spec.name / "vllm-cache"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return Launched(None, f"cannot create {cache_dir}: {exc.strerror or exc}")
    extra_env = dict(spec.env)
    # The key goes to vLLM in its environment, which `ps` does not show (a --api-key would be
    # on every process listing); a VLLM_API_KEY the daemon inherited would make vLLM demand a
    # key the probes do not know.
    extra_env.pop("VLLM_API_KEY", None)
    if spec.bearer_key and "api-key" not in spec.args:
        extra_env["VLLM_API_KEY"] = spec.bearer_key
    env = process.engine_environment(
        base=os.environ,
        engine=spec.name,
        gpus=spec.gpus,
        state_dir=procs.state_dir,
        cache_dir=cache_dir,
        extra=extra_env,
        daemon_pid=os.getpid(),
    )
    if "VLLM_API_KEY" not in extra_env:
        env.pop("VLLM_API_KEY", None)
    cpus = spec.placement
    if cpus:
        # vLLM's CPU build binds its OpenMP threads itself, by default to the same cores for
        # every engine of the host: tell it the engine's CPUs (one list per worker rank).
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(cpus, spec.ranks)
        unavailable = sorted(set(cpus) - host_cpus())
        if unavailable:
            return Launched(
                None,
                f"cannot bind to CPU(s) {format_cpu_list(unavailable)}: the daemon may use only "
                f"{format_cpu_list(host_cpus())}",
            )
    argv = spec.argv(step)
    # In the loop, not a thread: a few stats and one small file read per vLLM installation,
    # cached for the daemon's life (engine/access_log.py).
    argv += probe_access_flags(spec.command, spec.args, log_probe_requests=spec.log_probe_requests)
    try:
        proc = procs.spawn(argv, env, cpus)
    except OSError as exc:
        return Launched(None, f"cannot execute {argv[0]!r}: {exc.strerror or exc}")
    on = f" on CPU(s) {format_cpu_list(cpus)}" if cpus else ""
    log.info("spawned pid %d%s: %s", proc.pid, on, " ".join(argv), extra={"engine": spec.name})
    try:
        procs.record_group(spec.name, proc.pid)
    except OSError as exc:
        # Without the record a SIGKILLed daemon's successor cannot find this group: fail the
        # start (the runner stops what was spawned) rather than run an engine we may lose.
        return Launched(proc, f"cannot record the process group in the state dir: {exc.strerror or exc}")
    return Launched(proc)
