"""The ``front`` hang rule: the API server's event loop is blocked (issue 25).

vLLM's API server answers ``/health`` from its event loop without asking EngineCore (0.32:
``api_server.py`` ``health`` awaits ``engine_client.check_health()``, which reads a flag), so a
live one answers in milliseconds however busy its engine is. When ``/health`` misses
``hang_probe_late_s`` twice in a row (the observer asks again at once after a late answer, so
both misses can fall in one round) and the first was sent ``hang_front_after_s`` ago, the loop
has been held that long. What the API server's process did meanwhile says how:

``deadlocked``  its main thread, where the loop runs, under ``hang_cpu_idle_ratio`` of a core
                and asleep: it waits on a lock (a blocking call in a coroutine, the GIL held by
                a C call). The main thread's own CPU, not the process's: under load the
                process's ZMQ I/O threads, which take no GIL, went on receiving the engine's
                tokens for seconds after its Python was held (issue 25: 8 s). The whole
                process must still be under ``hang_spin_busy_ratio``: a loop that waits on a
                thread burning a core is the spinning case's. A loop that serves, however
                loaded, burns CPU on its main thread; one starved of CPU on a saturated host is
                runnable, not asleep. Without the main thread's reading, the process's CPU.
``spinning``    at least ``hang_spin_busy_ratio`` of a core, and no request handed to the
                scheduler since the first miss (the step heartbeat's ``added`` count, read as
                the misses began and again after them): it burns a core and admits nothing. A
                loop held up by load is loaded by requests it admits.

A process stopped (SIGSTOP) is the ``stopped`` rule's, one waiting on a disk (state D) is left
to the deadline rule, and so is anything between the two CPU shares. Without the heartbeat only
the deadlocked case is told.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmsupervisor.core.observe import ObservationWindow, check_timed_out
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.hang.steps import DISK_SLEEP, span_in
from llmsupervisor.detectors.hang.sweeps import cpu_used_s
from llmsupervisor.detectors.series import newest_first
from llmsupervisor.probes.heartbeat import StepBeat

SLEEPING = "sleeping"  # psutil.STATUS_SLEEPING: blocked on something, not waiting for a CPU


@dataclass(frozen=True, slots=True)
class FrontHang:
    how: Literal["deadlocked", "spinning"]
    pid: int  # the API server
    since_s: float  # when the first of the missed /health checks was sent
    misses: int
    cpu_ratio: float  # the API server's share of a core across the span
    span_s: float


def _health_misses(window: ObservationWindow, now: float, cfg: DetectorConfig) -> tuple[float, int] | None:
    """(when the oldest was sent, how many) of the /health checks that missed their deadline
    since the last one that got any answer, or None if the newest did not miss."""
    first_sent_s: float | None = None
    misses = 0
    for obs in newest_first(window, now):
        if now - obs.at_s > cfg.stale_after_s:
            break
        # The check asked again after a late answer was sent as the round's probes ended (at_s).
        for check, sent_s in ((obs.health_after, obs.at_s), (obs.health, None)):
            if check is None:
                continue
            if not check_timed_out(check):
                return (first_sent_s, misses) if first_sent_s is not None else None
            misses += 1
            first_sent_s = sent_s if sent_s is not None else obs.at_s - check.latency_s
    return (first_sent_s, misses) if first_sent_s is not None else None


def _beats(window: ObservationWindow, now: float, since_s: float) -> tuple[StepBeat, StepBeat] | None:
    """The oldest heartbeat read since ``since_s`` (the first missed /health was sent) and the
    newest, from one writer: what the scheduler was handed while the API server did not answer.
    A round that asked /health again read the heartbeat twice: as its probes ended (at_s) and at
    its end."""
    reads: list[StepBeat] = []  # newest first
    for obs in newest_first(window, now):
        if obs.at_s < since_s:
            break
        for beat in (obs.heartbeat, obs.heartbeat_at_miss):
            if isinstance(beat, StepBeat):
                reads.append(beat)
    if len(reads) < 2 or reads[0].pid != reads[-1].pid:
        return None
    return reads[-1], reads[0]


def front_hung(window: ObservationWindow, now: float, cfg: DetectorConfig) -> FrontHang | None:
    """The API server's loop held for ``hang_front_after_s`` (module docstring), or None."""
    missed = _health_misses(window, now, cfg)
    if missed is None:
        return None
    since_s, misses = missed
    if misses < 2 or now - since_s < cfg.hang_front_after_s:
        return None
    span = span_in(window, now, cfg, since_s)  # the sweeps across the misses
    if span is None:
        return None
    older, newer = span
    assert older.at_s is not None and newer.at_s is not None
    front = next((p for p in newer.processes if p.pid == newer.pgid), None)
    if front is None or front.stopped or front.zombie or front.status == DISK_SLEEP:
        return None
    used_s = cpu_used_s(older, newer, lambda p: p.pid == newer.pgid)
    if used_s is None:
        return None
    span_s = newer.at_s - older.at_s
    ratio = used_s / span_s
    loop_s = cpu_used_s(older, newer, lambda p: p.pid == newer.pgid, lambda p: p.main_thread_cpu_seconds)
    # Asleep, not waiting for a CPU: a process starved on a saturated host is runnable ("running")
    # whenever it is looked at. Asleep in either sweep: a main thread waiting on the GIL wakes
    # every switch interval (5 ms) to ask for it, and one sweep in a real-vLLM run caught it
    # runnable at no CPU (issue 25).
    before = next((p for p in older.processes if p.pid == newer.pgid), None)
    asleep = front.status == SLEEPING or (before is not None and before.status == SLEEPING)
    if (
        (used_s if loop_s is None else loop_s) <= cfg.hang_cpu_idle_ratio * span_s
        and used_s < cfg.hang_spin_busy_ratio * span_s
        and asleep
    ):
        return FrontHang("deadlocked", front.pid, since_s, misses, ratio, span_s)
    if used_s < cfg.hang_spin_busy_ratio * span_s:
        return None
    beats = _beats(window, now, since_s)
    if beats is None or beats[1].added != beats[0].added:
        return None  # no heartbeat, or requests still admitted: a loaded loop, not a stuck one
    return FrontHang("spinning", front.pid, since_s, misses, ratio, span_s)


__all__ = ["FrontHang", "front_hung"]
