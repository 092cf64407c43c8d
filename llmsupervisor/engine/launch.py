"""Launching one incarnation: the port preflight, the engine's environment, the spawn.

The operating system is reached through the ``Processes`` seam (engine/processes.py).
``launch`` turns every way a start can fail before the engine runs into a ``Launched`` failure
with a reason: a foreign port holder, an executable that will not exec, and a full or read-only
state dir (that last one used to crash the runner task and restart it every 5 s forever: defect
D7). A foreign port holder is no failure of the engine's: ``launch_when_free`` waits for the port.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from llmsupervisor import process
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.placement import omp_threads_bind
from llmsupervisor.engine.access_log import probe_access_flags
from llmsupervisor.engine.heartbeat import heartbeat_launch, heartbeat_path
from llmsupervisor.engine.processes import EngineProcess, Processes
from llmsupervisor.errors import PortHeld
from llmsupervisor.files import open_directory, remove_file
from llmsupervisor.probes.cpus import format_cpu_list, host_cpus

log = logging.getLogger("llmsupervisor.engine")

# A port someone else listens on is looked at again after 1 s, then twice as long each time, at
# most every PORT_WAIT_MAX_S: never a failure of the engine's (issue 38: five preflight failures
# made it FATAL in about 12 s, and it stayed FATAL once the port was free).
PORT_WAIT_FIRST_S: Final = 1.0
PORT_WAIT_MAX_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Launched:
    proc: EngineProcess | None  # None: the start failed before anything ran
    failure: str = ""
    # Someone else listens where the engine would bind: no failure of the engine's, the runner
    # waits for the port (issue 38; engine/runner.py).
    held: PortHeld | None = None


async def preflight_port(spec: EngineSpec, procs: Processes) -> None:
    """Before binding: a leftover engine of ours on the port is killed; anyone else raises
    ``PortHeld``. Only a listener the engine's bind of ``spec.host`` collides with counts (a
    listener on ``[::1]`` only does not hold an engine on 127.0.0.1: process.port_holders)."""
    try:
        holders = await procs.port_holders(spec.port, spec.host)
    except TimeoutError:
        # The spawn goes on: a port held after all fails vLLM's bind, which the runner sees.
        log.warning(
            "no answer in time to who holds port %d; not checked", spec.port, extra={"engine": spec.name}
        )
        return
    for pid in holders:
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
        leftovers = [pid, *(p for p in await procs.earlier_runs(engine) if p != pid)]
        alive = await procs.kill_trees(leftovers, timeout_s=spec.kill_timeout_s)
        if alive:
            raise PortHeld(spec.port, alive[0], "leftover engine that survived SIGKILL")


async def launch_when_free(
    spec: EngineSpec, step: int, procs: Processes, *, wait: Callable[[str, float], Awaitable[bool]]
) -> Launched | None:
    """``launch``; while someone else holds the port, ``wait(reason, seconds)`` (the runner:
    STARTING with the reason, which names the holder, until then or a command) and try again.
    None when ``wait`` answers False (a stop or restart ended the wait)."""
    wait_s, said = PORT_WAIT_FIRST_S, ""
    while (launched := await launch(spec, step, procs)).held is not None:
        reason = f"{launched.failure}; waiting for it to be free"
        if reason != said:  # once per holder, not at every look
            log.warning(
                "%s (looking again every %g s at most)", reason, PORT_WAIT_MAX_S, extra={"engine": spec.name}
            )
            said = reason
        if not await wait(f"{reason} (next look in {wait_s:g} s)", wait_s):
            return None
        wait_s = min(wait_s * 2, PORT_WAIT_MAX_S)
    return launched


async def launch(spec: EngineSpec, step: int, procs: Processes) -> Launched:
    """Preflight, environment, spawn, record the group. Never raises for an OS problem."""
    try:
        await preflight_port(spec, procs)
    except PortHeld as exc:
        return Launched(None, str(exc), held=exc)
    cache_dir = procs.state_dir / "engines" / spec.name / "vllm-cache"
    try:
        # Component by component under the state dir, no link followed: a link planted at
        # engines/NAME must not have the daemon (root, often) make directories where it points.
        os.close(open_directory(cache_dir, root=procs.state_dir, create=True))
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
        gpus=spec.cuda_devices,
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
    # The step heartbeat (engine/heartbeat.py): the previous incarnation's file must not be read
    # as this one's, so it goes before the spawn, whether or not this one writes one. Under the
    # engine directory's descriptor: a link planted at engines/NAME (the engine would create its
    # heartbeat, and vLLM its compile cache, wherever it points) refuses the start.
    beat = heartbeat_path(procs.state_dir, spec.name)
    try:
        remove_file(beat, root=procs.state_dir, durable=False)  # a few syscalls, no fsync
    except OSError as exc:
        return Launched(None, f"cannot remove {beat}: {exc.strerror or exc}")
    beat_argv, beat_env = heartbeat_launch(
        spec.command, spec.args, env, path=beat, enabled=spec.step_heartbeat
    )
    argv += beat_argv
    env.update(beat_env)
    try:
        proc = procs.spawn(argv, env, cpus)
    except OSError as exc:
        return Launched(None, f"cannot execute {argv[0]!r}: {exc.strerror or exc}")
    on = f" on CPU(s) {format_cpu_list(cpus)}" if cpus else ""
    log.info("spawned pid %d%s: %s", proc.pid, on, " ".join(argv), extra={"engine": spec.name})
    try:
        await procs.record_group(spec.name, proc.pid)
    except TimeoutError:
        return Launched(proc, "cannot record the process group in the state dir: the disk did not answer")
    except OSError as exc:
        # Without the record a SIGKILLed daemon's successor cannot find this group: fail the
        # start (the runner stops what was spawned) rather than run an engine we may lose.
        return Launched(proc, f"cannot record the process group in the state dir: {exc.strerror or exc}")
    return Launched(proc)
