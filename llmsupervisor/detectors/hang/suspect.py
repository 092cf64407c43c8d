"""A hang suspected: what a hang looks like in its first round, before any rule can prove it.

The HANG rules (detectors/hang/rules.py) wait for proof: a process stopped in two sweeps, a canary
missed while the group used no CPU, or deadline misses for ``hang_after_s`` (10-14 s for an
engine that spins). Then the daemon takes the stacks and kills the engine. Every request a load
balancer sends to the engine meanwhile waits for nothing. A balancer can stop sending at the
first sign, and send new requests to the engine's peers, at no cost but the engine's share of
traffic for a round or two if the sign was false.

A suspicion, from the newest observation back to the engine's last sign of life (a canary that
answered, or step/token counters that moved between two readings):

- a live canary missed its deadline. The canary runs only while the counters stand still
  (engine/observer.py), so a busy engine's slowness does not make it miss;
- a process of the engine's group is stopped (SIGSTOP, a tracer): a fact, seen in one sweep.

A ``/health`` or ``/metrics`` timeout alone is not one: both are slow on a loaded host while the
engine serves. The suspicion clears with the next sign of life; it opens no finding and makes the
policy do nothing: only the load balancer hears of it (``EngineStatus.in_rotation``, the HAProxy
agent, ``/engines/NAME/ready``).
"""

from __future__ import annotations

from llmsupervisor.core.observe import Observation, ObservationWindow, check_timed_out
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import counters_progressed, newest_first
from llmsupervisor.probes.host import ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics


def hang_suspected(window: ObservationWindow, now: float, cfg: DetectorConfig) -> str | None:
    """Why a hang is suspected (the newest sign since the last sign of life), or None."""
    since_life: list[Observation] = []  # newest first
    life_s: float | None = None
    newer: tuple[Observation, EngineMetrics] | None = None  # the next newer reading
    for obs in newest_first(window, now):
        if now - obs.at_s > cfg.stale_after_s:
            break  # too old to say anything about the engine now
        if obs.canary is not None and obs.canary.ok:
            life_s = obs.at_s
            break
        if isinstance(obs.metrics, EngineMetrics):
            if newer is not None and counters_progressed(obs.metrics, newer[1]):
                life_s = newer[0].at_s  # alive by the newer reading, whatever timed out in it
                break
            newer = (obs, obs.metrics)
        since_life.append(obs)
    for obs in since_life:
        if life_s is not None and obs.at_s <= life_s:
            continue
        if check_timed_out(obs.canary):
            assert obs.canary is not None
            return f"a canary got no answer in {obs.canary.latency_s:.1f} s"
        if isinstance(obs.proc, ProcSample):
            held = [p for p in obs.proc.processes if p.stopped and not p.zombie]
            if held:
                return f"process {held[0].pid} ({held[0].title.strip()[:40]}) stopped"
    return None
