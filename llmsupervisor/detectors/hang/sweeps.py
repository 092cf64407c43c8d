"""The engine's process sweeps in an observation window, and the CPU used between two: what the
hang rules (detectors/hang/) read of /proc."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from llmsupervisor.core.observe import ObservationWindow
from llmsupervisor.detectors.series import newest_first
from llmsupervisor.probes.host import ProcInfo, ProcSample


def sweeps_in(window: ObservationWindow, now: float, oldest_s: float) -> Iterator[ProcSample]:
    """The distinct process sweeps in the window, newest first, back to ``oldest_s``. Several
    observations (and several engines) share one sweep; a sample without a time is skipped.
    An observation's sweep after a miss (``proc_after``) comes before the one of its round."""
    last_at: float | None = None
    for obs in newest_first(window, now):
        if obs.at_s < oldest_s:
            return
        for sample in (obs.proc_after, obs.proc):
            if not isinstance(sample, ProcSample) or sample.at_s is None or sample.at_s == last_at:
                continue
            last_at = sample.at_s
            yield sample


def _process_cpu_s(p: ProcInfo) -> float | None:
    return p.cpu_seconds


def cpu_used_s(
    older: ProcSample,
    newer: ProcSample,
    keep: Callable[[ProcInfo], bool] = lambda p: True,
    seconds: Callable[[ProcInfo], float | None] = _process_cpu_s,
) -> float | None:
    """CPU seconds the group's processes (those ``keep`` keeps) used between two sweeps, over
    the processes in both; None if no process is in both with a readable CPU time. ``seconds``
    reads a process's CPU time (the whole process's; the API server's main thread's for the
    front rule)."""
    before = {p.pid: t for p in older.processes if (t := seconds(p)) is not None}
    used = [
        t - before[p.pid]
        for p in newer.processes
        if p.pid in before and keep(p) and (t := seconds(p)) is not None
    ]
    return sum(used) if used else None


# vLLM's setproctitle names (docs/vllm-notes.md §2): the Worker runs the model; on the CPU build
# its OpenMP threads are the compute, so a Worker at rest means no forward is running.

__all__ = ["cpu_used_s", "sweeps_in"]
