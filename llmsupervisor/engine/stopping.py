"""Taking an engine down: the drain, the stop ladder, and waiting for its GPU memory.

The drain first (the runner has already taken the engine out of rotation): ``drain_grace_s`` for
the load balancer to notice, then in-flight requests are given until ``drain_timeout_s`` to
finish. vLLM answers new requests with HTTP 500 once it is SIGTERMed while /health stays 200,
so rotation must change before the ladder starts.

The ladder is data (``core.restarts.StopLadder``): SIGTERM to the API server only (vLLM drains
on it, while a group SIGTERM fails in-flight requests), SIGTERM to the group, SIGKILL to the
group, each rung with its own deadline. A quick stop (second SIGINT) cuts the first two short.
A hung or stalled engine, after its stacks (engine/evidence.py: its processes SIGSTOPped, or the
API server blocked), gets the last rung only (``StopLadder.kill_only``): a stopped process cannot
act on a SIGTERM, and waiting for it to would only delay the restart.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.restarts import StopLadder
from llmsupervisor.engine.http import EngineHttp
from llmsupervisor.engine.processes import EngineProcess, Processes
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import GpuSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics

log = logging.getLogger("llmsupervisor.engine")

GROUP_POLL_S = 0.1
INFLIGHT_POLL_S = 1.0
GPU_RELEASE_POLL_S = 0.5

# Waits until the timeout, an exit of the process or a command, whichever is first.
Pause = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Rung:
    what: str
    sig: int
    to_group: bool
    timeout_s: float
    cut_short_by_quick: bool


def rungs(ladder: StopLadder) -> tuple[Rung, ...]:
    kill = Rung("SIGKILL to the process group", signal.SIGKILL, True, ladder.kill_timeout_s, False)
    if ladder.kill_only:
        return (kill,)
    return (
        Rung("SIGTERM to the API server", signal.SIGTERM, False, ladder.main_term_timeout_s, True),
        Rung("SIGTERM to the process group", signal.SIGTERM, True, ladder.group_term_timeout_s, True),
        kill,
    )


def inflight(metrics: EngineMetrics | ProbeFailure) -> int | None:
    """Running plus waiting requests; None when unknown (no answer, or the gauges are absent, as
    in multi-API-server mode before the first request)."""
    if (
        isinstance(metrics, ProbeFailure)
        or metrics.requests_running is None
        or metrics.requests_waiting is None
    ):
        return None
    return metrics.requests_running + metrics.requests_waiting


async def drain(
    spec: EngineSpec, http: EngineHttp, proc: EngineProcess, *, pause: Pause, quick: Callable[[], bool]
) -> None:
    """Wait for the load balancer, then for in-flight requests; bounded, cut short by a quick
    stop or by the process exiting."""
    grace_end = aio.now() + spec.rotation_grace_s
    while not quick() and not proc.returned and (left := grace_end - aio.now()) > 0:
        await pause(left)
    deadline = aio.now() + spec.drain_timeout_s
    while not quick() and not proc.returned:
        count = inflight(await http.metrics(timeout_s=spec.health_timeout_s))
        if not count or aio.now() >= deadline:
            if count:
                log.warning(
                    "drain deadline: %d request(s) still in flight; vLLM's own drain "
                    "(--shutdown-timeout) gets them next",
                    count,
                    extra={"engine": spec.name},
                )
            return
        await pause(min(INFLIGHT_POLL_S, max(0.0, deadline - aio.now())))


async def terminate(
    engine: str,
    proc: EngineProcess,
    ladder: StopLadder,
    procs: Processes,
    *,
    pause: Pause,
    quick: Callable[[], bool],
) -> None:
    """Run the stop ladder; return once no process of the incarnation is left (or SIGKILL has
    failed, which is logged: nothing else can be done). ``pause`` is the runner's wait, so an
    escalation (second SIGINT) sent meanwhile cuts the current rung short."""
    for i, rung in enumerate(rungs(ladder.quick() if quick() else ladder)):
        if i == 0 and proc.returned and not rung.to_group:
            continue  # the leader is gone: its orphans get the group signals
        log.info(
            "%s (pid %d), waiting up to %g s", rung.what, proc.pid, rung.timeout_s, extra={"engine": engine}
        )
        if rung.to_group:
            proc.signal_group(rung.sig)
        else:
            proc.signal_main(rung.sig)
        if await _group_gone(proc, procs, rung.timeout_s, pause, quick if rung.cut_short_by_quick else None):
            break
    else:
        log.error(
            "processes %s of the engine survived SIGKILL",
            procs.group_members(proc.pgid),
            extra={"engine": engine},
        )
    strays = await procs.strays(engine, leader=proc.pid)
    if strays:
        log.warning(
            "killing %d stray process(es) of the engine outside its group: %s",
            len(strays),
            strays,
            extra={"engine": engine},
        )
        await procs.kill_trees(strays, timeout_s=ladder.kill_timeout_s)
    if not procs.group_members(proc.pgid):
        procs.forget_group(engine)
    if proc.exit_status is not None:
        log.info(
            "engine processes gone (API server %s)", proc.exit_status.describe(), extra={"engine": engine}
        )


async def _group_gone(
    proc: EngineProcess, procs: Processes, timeout_s: float, pause: Pause, quick: Callable[[], bool] | None
) -> bool:
    deadline = aio.now() + timeout_s
    while True:
        if procs.group_gone(proc):
            return True
        if aio.now() >= deadline or (quick is not None and quick()):
            return False
        # The leader's exit wakes the pause; other members of the group are polled.
        await pause(min(GROUP_POLL_S, max(0.0, deadline - aio.now())))


# Where a GPU's process list cannot be read, its used memory (nvmlMemory_v2: without the
# driver's reserved part) below this counts as released: a GPU serves one engine, so what is
# left after its stop is another process's (or nothing).
RELEASED_BELOW_BYTES = 256 * 1024**2


def _gpu_holders(sample: GpuSample | ProbeFailure, pids: frozenset[int]) -> tuple[list[int], str | None]:
    """The stopped engine's PIDs still on the GPU, and why the GPU cannot be judged (None: it
    can). A process list that could not be read (NoPermission, a failed sample) is not an empty
    one: the GPU's used memory decides then, or nothing does."""
    if isinstance(sample, ProbeFailure):
        return [], f"GPU unreadable ({sample})"
    if sample.processes is None:
        used = sample.memory_used_bytes
        if used is not None and used < RELEASED_BELOW_BYTES:
            return [], None
        return [], "process list unreadable" + ("" if used is None else f", {used / 1024**3:.1f} GiB used")
    return [p.pid for p in sample.processes if p.pid in pids or not sample.pids_visible], None


async def await_gpu_release(
    spec: EngineSpec,
    pids: Iterable[int],
    samples_for: Callable[[Iterable[int]], Mapping[int, GpuSample | ProbeFailure]],
) -> None:
    """Where NVML lists compute processes: wait until none of the stopped engine's processes
    holds memory on its GPUs, so that the next start does not fail for want of it.

    In a container with its own PID namespace NVML's host PIDs match none of ``pids``
    (``GpuSample.pids_visible`` False): there every process on the engine's GPUs counts, and the
    wait is for the list to empty (a GPU given to this pod runs only this pod's engines). A GPU
    whose list cannot be read is released only when its used memory says so
    (``RELEASED_BELOW_BYTES``); else the wait runs to ``gpu_release_timeout_s``. A GPU without
    NVML at all (no sample) is not waited for."""
    if not spec.gpus or spec.gpu_release_timeout_s <= 0:
        return
    pids = frozenset(pids)
    started_s = aio.now()
    deadline = started_s + spec.gpu_release_timeout_s
    while True:
        holders: set[int] = set()
        unknown: dict[int, str] = {}
        for gpu, sample in samples_for(spec.gpus).items():
            on_gpu, why = _gpu_holders(sample, pids)
            holders.update(on_gpu)
            if why is not None:
                unknown[gpu] = why
        if not holders and not unknown:
            if aio.now() > started_s:
                log.info(
                    "GPU memory released %.1f s after the stop",
                    aio.now() - started_s,
                    extra={"engine": spec.name},
                )
            return
        if aio.now() >= deadline:
            if holders:
                log.warning(
                    "GPU memory still held by stopped engine pid(s) %s after %g s; starting anyway",
                    sorted(holders),
                    spec.gpu_release_timeout_s,
                    extra={"engine": spec.name},
                )
            if unknown:
                log.warning(
                    "GPU memory release not known after %g s (%s); starting anyway",
                    spec.gpu_release_timeout_s,
                    "; ".join(f"GPU {g}: {why}" for g, why in sorted(unknown.items())),
                    extra={"engine": spec.name},
                )
            return
        await aio.wait_any(timeout_s=GPU_RELEASE_POLL_S)
