"""What the hang rules share, gathered once per ``detect_hang`` call: ``HangFacts``.

The walk back from the newest observation to the engine's last sign of life, the deadline misses
since then, a stopped process, the newest process sweep and the stuck step (the step heartbeat):
each is read once here, and every rule in ``HANG_RULES`` (detectors/hang/rules.py) reads it
from the facts instead of walking the window again.

Signs of life: a canary that answered, or a step/token counter that moved between two readings
(busy, not dead, even if the canary was slow). A deadline miss: the canary, ``/health`` or
``/metrics`` timing out. ``/health`` 200 proves nothing (docs/vllm-notes.md §7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from llmsupervisor.core.observe import Observation, ObservationWindow, check_timed_out
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.hang.steps import Stuck, beat_progressed, find_stuck
from llmsupervisor.detectors.hang.sweeps import sweeps_in
from llmsupervisor.detectors.series import counters_progressed, in_flight, newest_first
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcInfo, ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics


@dataclass(frozen=True, slots=True)
class HangFacts:
    """One engine's window as the hang rules read it, at one ``now``."""

    newest: Observation  # the newest observation at or before now: the finding's
    # The last sign of life; without one in the window, the oldest observation walked: the
    # window shows nothing earlier.
    since_s: float
    missed: tuple[Observation, ...]  # the deadline misses after the last sign of life, newest first
    last_reading: EngineMetrics | None  # the newest /metrics reading walked
    stopped: tuple[ProcInfo, float] | None  # a stopped process and since when (``stopped_process``)
    newest_sweep: ProcSample | None  # the newest process sweep of the last ``stale_after_s``
    stuck: Stuck | None  # the step heartbeat's stuck engine (detectors/hang/steps.py ``find_stuck``)

    @property
    def misses(self) -> int:
        return len(self.missed)

    @property
    def last_miss(self) -> Observation | None:
        return self.missed[0] if self.missed else None

    @property
    def work(self) -> int | None:
        """Requests in flight by the newest reading; None without one or without its gauges."""
        return None if self.last_reading is None else in_flight(self.last_reading)

    @property
    def idle(self) -> bool:
        """Idle by its gauges: the newest reading says nothing is in flight."""
        return self.work == 0


class _Walk(NamedTuple):
    newest: Observation
    oldest: Observation
    last_life_s: float | None
    missed: list[Observation]
    last_reading: EngineMetrics | None


def hang_facts(window: ObservationWindow, now: float, cfg: DetectorConfig) -> HangFacts | None:
    """The facts of ``window`` at ``now``; None when it holds no observation at or before ``now``."""
    walk = _walk_back(window, now)
    if walk is None:
        return None
    # The observation whose reading showed progress was alive, whatever else timed out in it.
    missed = tuple(o for o in walk.missed if walk.last_life_s is None or o.at_s > walk.last_life_s)
    return HangFacts(
        newest=walk.newest,
        since_s=walk.last_life_s if walk.last_life_s is not None else walk.oldest.at_s,
        missed=missed,
        last_reading=walk.last_reading,
        stopped=stopped_process(window, now, cfg) or _stopped_at_miss(missed),
        newest_sweep=next(sweeps_in(window, now, now - cfg.stale_after_s), None),
        stuck=find_stuck(window, now, cfg),
    )


def _walk_back(window: ObservationWindow, now: float) -> _Walk | None:
    """Newest first, back to the last sign of life: the observations walked, the deadline misses
    among them and the newest /metrics reading."""
    newest: Observation | None = None
    oldest: Observation | None = None
    last_life_s: float | None = None
    missed: list[Observation] = []
    newer: tuple[Observation, EngineMetrics] | None = None  # the next newer reading
    newer_beat: Observation | None = None  # the next newer observation with a heartbeat
    last_reading: EngineMetrics | None = None
    for obs in newest_first(window, now):
        newest = newest or obs
        oldest = obs
        if isinstance(obs.heartbeat, StepBeat):
            if newer_beat is not None and beat_progressed(obs, newer_beat):
                last_life_s = newer_beat.at_s  # a step completed by the newer reading
                break
            newer_beat = obs
        if isinstance(obs.metrics, EngineMetrics):
            last_reading = last_reading or obs.metrics
            if newer is not None and counters_progressed(obs.metrics, newer[1]):
                last_life_s = newer[0].at_s  # the counters moved by the newer reading
                break
            newer = (obs, obs.metrics)
        if obs.canary is not None and obs.canary.ok:
            last_life_s = obs.at_s
            break
        if _unresponsive(obs):
            missed.append(obs)
    if newest is None or oldest is None:
        return None
    return _Walk(newest, oldest, last_life_s, missed, last_reading)


def stopped_process(
    window: ObservationWindow, now: float, cfg: DetectorConfig
) -> tuple[ProcInfo, float] | None:
    """A process stopped, CPU time unchanged, in sweeps ``hang_stopped_after_s`` apart: the
    process and the time of the oldest of those sweeps."""
    sweeps = sweeps_in(window, now, now - cfg.stale_after_s)
    newest = next(sweeps, None)
    if newest is None or newest.at_s is None:
        return None
    held = {p.pid: p for p in newest.processes if p.stopped and not p.zombie}
    for older in sweeps:
        if not held:
            return None
        before = {p.pid: p for p in older.processes}
        held = {
            pid: p
            for pid, p in held.items()
            if (b := before.get(pid)) is not None and b.stopped and b.cpu_seconds == p.cpu_seconds
        }
        assert older.at_s is not None  # sweeps_in yields only timed samples
        if held and newest.at_s - older.at_s >= cfg.hang_stopped_after_s:
            return min(held.values(), key=lambda p: p.pid), older.at_s
    return None


def _stopped_at_miss(missed: Sequence[Observation]) -> tuple[ProcInfo, float] | None:
    """A process stopped in the sweep of a round whose canary or /health then missed its
    deadline: the sweep is taken as the round starts, the probes sent with it, so the stop came
    first and the engine did not answer after it. One round instead of two sweeps a second apart."""
    for obs in missed:
        sample = obs.proc
        late = check_timed_out(obs.canary) or check_timed_out(obs.health)
        if not late or not isinstance(sample, ProcSample):
            continue
        held = [p for p in sample.processes if p.stopped and not p.zombie]
        if held:
            return held[0], sample.at_s if sample.at_s is not None else obs.at_s
    return None


def _metrics_timed_out(obs: Observation) -> bool:
    return isinstance(obs.metrics, ProbeFailure) and obs.metrics.kind == "timeout"


def _unresponsive(obs: Observation) -> bool:
    # Only deadline misses: a refused connection or a 503 is the crash path, not a hang.
    return check_timed_out(obs.canary) or check_timed_out(obs.health) or _metrics_timed_out(obs)


def miss_detail(obs: Observation) -> str:
    """What missed its deadline in ``obs``: ``canary``, ``/health`` and ``/metrics``, joined by +."""
    parts = []
    if check_timed_out(obs.canary):
        parts.append("canary")
    if check_timed_out(obs.health):
        parts.append("/health")
    if _metrics_timed_out(obs):
        parts.append("/metrics")
    return "+".join(parts)


__all__ = ["HangFacts", "hang_facts", "miss_detail", "stopped_process"]
