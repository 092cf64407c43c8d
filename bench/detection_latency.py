"""Detection latency per fault kind with the default settings, in simulated time.

Replays what the engine loop does (engine.py ``_serve``/``_observe``): wait ``tick_interval_s``,
then observe (a canary only when step counters stand still and ``canary_interval_s`` has passed;
a missed canary costs its whole ``live_canary_timeout_s``), then run every detector and the
finding tracker. Faults are injected at t0 after a healthy warm-up; the latency is the time from
t0 to the finding opening. Pure and deterministic: no processes, no sleeping.

    .venv/bin/python bench/detection_latency.py          # prints the simulated table
    .venv/bin/python bench/detection_latency.py --real   # the real vLLM CPU build (detection_real.py)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmsupervisor.config import EngineSpec, SupervisorSettings
from llmsupervisor.core.observe import Observation
from llmsupervisor.detectors import DetectorConfig, FindingKind, FindingTracker, detect_all, new_window
from llmsupervisor.engine.observer import canary_deadline_s, second_sweep_at
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuProcess
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcInfo, ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics, parse_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.lib.hang_rounds import API, CORE, WORKER, sweep

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "metrics"
SPEC = EngineSpec(name="gpu0", model="m", gpus=(0,), port=8001)
TICK_S = SupervisorSettings().tick_interval_s
CFG = DetectorConfig()
OK = HttpCheck(ok=True, detail="completed", latency_s=0.05, status_code=200)
HEALTH_OK = HttpCheck(ok=True, detail="HTTP 200", latency_s=0.002, status_code=200)
# The live canary's deadline as the observer learns it from answers like OK's (the floor, 1 s).
DEADLINE_S = canary_deadline_s([OK.latency_s], SPEC)
TIMEOUT = HttpCheck(ok=False, detail="timed out (ReadTimeout)", latency_s=DEADLINE_S, failure="timeout")
MIB = 1024 * 1024


def _metrics(name: str) -> EngineMetrics:
    parsed = parse_metrics((FIXTURES / name).read_text())
    assert isinstance(parsed, EngineMetrics)
    return parsed


BUSY, IDLE = _metrics("vllm-0.32.0-cpu.txt"), _metrics("vllm-0.32.0-cpu-idle.txt")


class World:
    """The engine as the probes would see it at time t; ``fault`` flips at t0."""

    def __init__(self, t0: float, fault: str) -> None:
        self.t0, self.fault, self.steps = t0, fault, 0

    def faulty(self, t: float) -> bool:
        return t >= self.t0

    def metrics(self, t: float) -> EngineMetrics:
        hung = self.faulty(t) and self.fault in ("hang", "stall")
        if self.fault == "hang":  # idle engine, then frozen (SIGSTOP): gauges stay at 0
            return replace(IDLE, iterations_total=self.steps, generation_tokens_total=self.steps)
        if not hung:
            self.steps += 40
        kv = 0.95 if self.faulty(t) and self.fault == "kv" else 0.3
        return replace(
            BUSY,
            iterations_total=self.steps,
            generation_tokens_total=self.steps * 4,
            prompt_tokens_total=self.steps * 8,
            requests_running=8,
            kv_usage_ratio=kv,
        )

    def canary(self, t: float) -> HttpCheck:
        return TIMEOUT if self.faulty(t) and self.fault in ("hang", "stall") else OK

    def gpu(self, t: float) -> Any:
        if not self.faulty(t):
            return nominal_sample(0)
        if self.fault == "thermal":
            return nominal_sample(0, temperature_c=91, clock_event_reasons=0x40)
        if self.fault == "foreign":
            return nominal_sample(0, processes=(GpuProcess(4100, 30000 * MIB), GpuProcess(9999, 2048 * MIB)))
        return nominal_sample(0)

    def events(self, t: float, last: float) -> tuple[GpuEvent, ...]:
        if self.fault.startswith("xid") and last < self.t0 <= t:
            xid = int(self.fault[3:] or 79)
            return (GpuEvent(index=0, uuid=nominal_sample(0).uuid, kind="xid", xid=xid, at_s=t),)
        return ()

    def proc(self, t: float) -> ProcSample:
        """The group as the sweep sees it: the engine computing (0.9 s of CPU a second) until a
        hang or stall fault freezes it (SIGSTOP for "hang": stopped; a deadlock for "stall")."""
        growth = max(0.0, t - self.t0) / 3600 * 2048 * MIB if self.fault == "memory" else 0.0
        rss = int(3000 * MIB + growth)
        frozen = self.fault in ("hang", "stall") and self.faulty(t)
        cpu_s = 0.9 * (min(t, self.t0) if frozen else t)
        status = "stopped" if frozen and self.fault == "hang" else "sleeping"
        info = ProcInfo(
            pid=4100, title="python", rss_bytes=rss, cpu_seconds=cpu_s, status=status, zombie=False
        )
        return ProcSample(
            pgid=4100,
            processes=(info,),
            rss_bytes_total=rss,
            cpu_seconds_total=cpu_s,
            process_count=1,
            zombie_count=0,
            at_s=t,
        )


def latency(
    fault: str, kind: FindingKind, *, warmup_s: float = 900.0, horizon_s: float = 7200.0
) -> float | None:
    world = World(warmup_s, fault)
    window, tracker = new_window(CFG), FindingTracker(CFG)
    t, last_canary, last_t = 0.0, 0.0, 0.0
    previous: EngineMetrics | None = None
    while t < warmup_s + horizon_s:
        t += TICK_S
        metrics = world.metrics(t)
        moved = previous is not None and (metrics.iterations_total or 0) > (previous.iterations_total or 0)
        canary = None
        if not moved and t - last_canary >= SPEC.canary_interval_s:
            canary = world.canary(t)
            t += canary.latency_s  # a missed canary costs its whole deadline
            last_canary = t
        previous = metrics
        obs = Observation(
            engine="gpu0",
            at_s=t,
            metrics=metrics,
            health=HEALTH_OK,
            canary=canary,
            gpus={0: world.gpu(t)},
            gpu_events=world.events(t, last_t),
            proc=world.proc(t),
            engine_pids=frozenset({4100}),
        )
        last_t = t
        window.append(obs)
        update = tracker.update(detect_all(window, t, CFG), t)
        for finding in update.opened:
            if finding.kind is kind and t >= world.t0:
                return t - world.t0
    return None


# CPU a second per process: serving 8 streams, idle, and each hang (issue 25).
RATES = {
    "load": {API: 0.3, CORE: 0.4, WORKER: 1.5},
    "idle": {API: 0.01, CORE: 0.0, WORKER: 0.0},
    "deadlock": {API: 0.01, CORE: 0.0, WORKER: 0.0},
    "spin": {API: 0.01, CORE: 1.0, WORKER: 0.0},
    "stopped": {API: 0.0, CORE: 0.0, WORKER: 0.0},
}


def _group(t: float, cpu: dict[int, float], stopped: frozenset[int]) -> ProcSample:
    return sweep(t, cpu, dict.fromkeys(stopped, "stopped"))


def hang_latency(hang: str, load: str, t0: float, round_s: float = 0.0) -> tuple[float, str] | None:
    """Simulated time from a hang at ``t0`` to the finding, with the observer's round as it is
    (engine/observer.py): the sweep as the round starts; the canary (only while the heartbeat
    shows no step) and /health (waited for at most hang_probe_late_s) with it; then the step
    heartbeat; a second sweep after a miss, or hang_cpu_min_span_s after the first while a step
    is overdue; the next round a tick after this one ended.

    ``hang``: "deadlock" or "spin" in EngineCore, or "api-stopped" (SIGSTOP of the API server);
    ``load``: "idle" or "load" (8 streams: a step every few ms, 8 requests held)."""
    cpu = {API: 10.0, CORE: 20.0, WORKER: 30.0}
    window = new_window(CFG)
    t, done, done_s, scheduled_s, moved = 0.0, 0, 0.0, 0.0, True
    late_s = min(SPEC.health_timeout_s, CFG.hang_probe_late_s)

    def run(until_s: float) -> None:
        # CPU from the last sweep to ``until_s``, in pieces around t0.
        nonlocal last_cpu_s
        pieces = (
            (last_cpu_s, min(until_s, t0)),
            (max(last_cpu_s, t0), min(until_s, t0 + SHM_BUSY_LOOP_S)),
            (max(last_cpu_s, t0 + SHM_BUSY_LOOP_S), until_s),
        )
        for a, b in pieces:
            if b <= a:
                continue
            state = load if a < t0 else ("stopped" if hang == "api-stopped" else hang)
            if state == "stopped" or (hang == "api-stopped" and a >= t0):
                rates = {**RATES[load], API: 0.0}
            else:
                rates = dict(RATES[state])
                if load == "load" and a < t0 + SHM_BUSY_LOOP_S:
                    rates[WORKER] = 1.0  # the Worker polls for its next step before it idles
            for pid, r in rates.items():
                cpu[pid] += r * (b - a)
        last_cpu_s = until_s

    last_cpu_s = 0.0
    while t < t0 + 120:
        t += TICK_S
        hung = t >= t0
        engine_hung = hung and hang != "api-stopped"
        stopped = frozenset({API}) if hung and hang == "api-stopped" else frozenset()
        run(t)
        proc = _group(t, cpu, stopped)
        canary = None
        if not moved and load == "idle":
            if engine_hung or stopped:
                canary = replace(TIMEOUT, latency_s=DEADLINE_S)
            else:
                canary = OK
                done, done_s, scheduled_s = done + 2, t + 0.02, t
        health = replace(TIMEOUT, latency_s=late_s) if stopped else HEALTH_OK
        # Under load the round's /health and /metrics take a while on a busy host.
        took_s = max(
            canary.latency_s if canary else 0.0, health.latency_s, round_s if load == "load" else 0.0
        )
        end = t + took_s
        if load == "load" and not engine_hung and not stopped:
            done, done_s, scheduled_s = done + 400, end, end
        elif load == "load" and not engine_hung:
            done, done_s, scheduled_s = done + 400, end, end  # the API server stopped: the core steps on
        run(end)
        after = _group(end + 0.01, cpu, stopped) if (canary and not canary.ok) or not health.ok else None
        work = 8 if load == "load" else 0
        if engine_hung and load == "load":
            # Under load a step comes back every few ms: the last one just before the hang.
            done_s = scheduled_s = min(max(done_s, t0), end)
        last_done_s = min(done_s, t0) if engine_hung else done_s
        probe = StepBeat(
            pid=CORE,
            scheduled=done,
            done=done,
            scheduled_s=last_done_s,
            done_s=last_done_s,
            work=work,
            longest_step_s=0.05,
        )
        second_s = None if after is not None else second_sweep_at(probe, end, t, CFG)
        if second_s is not None:  # a step overdue: the observer sweeps again (engine/observer.py)
            end = max(end, second_s)
            run(end)
            after = _group(end, cpu, stopped)
        beat = StepBeat(
            pid=CORE,
            scheduled=done,
            done=done,
            scheduled_s=min(scheduled_s, t0) if engine_hung else scheduled_s,
            done_s=min(done_s, t0) if engine_hung else done_s,
            work=work,
            longest_step_s=0.05,
        )
        obs = Observation(
            engine="gpu0",
            at_s=end,
            health=health,
            canary=canary,
            proc=proc,
            proc_after=after,
            heartbeat=beat,
        )
        previous = window.latest()
        moved = (
            previous is not None
            and isinstance(previous.heartbeat, StepBeat)
            and done > previous.heartbeat.done
            and work > 0  # the observer: an idle engine's own canary steps are not progress
        )
        window.append(obs)
        t = end
        finding = detect_all(window, t, CFG)
        hangs = [f for f in finding if f.kind is FindingKind.HANG]
        if hangs and t >= t0:
            return t - t0, str(hangs[0].evidence.get("rule"))
    return None


HANG_CASES: tuple[tuple[str, str, str], ...] = (
    ("EngineCore deadlocked (0 % CPU)", "deadlock", "idle"),
    ("EngineCore deadlocked (0 % CPU)", "deadlock", "load"),
    ("EngineCore spinning (100 % CPU, no step)", "spin", "idle"),
    ("EngineCore spinning (100 % CPU, no step)", "spin", "load"),
    ("API server stopped (SIGSTOP)", "api-stopped", "idle"),
)
# vLLM 0.32's shm MessageQueue reader busy-loops this long after its last read before it waits
# on a socket (distributed/device_communicators/shm_broadcast.py, SpinCondition busy_loop_s).
SHM_BUSY_LOOP_S = 1.0
# How long a loaded engine's round takes (its probes on a busy host): none, and most of a second.
ROUND_S = (0.0, 0.4, 0.8)
# Where in the tick the hang begins: the worst case is just after a round's sweep.
PHASES = (0.01, 0.5, 1.0, 1.5, 1.99)


SCENARIOS: tuple[tuple[str, str, FindingKind], ...] = (
    ("hang (worker frozen, gauges stale at 0: the SIGSTOP case)", "hang", FindingKind.HANG),
    ("hang with work queued (8 requests running, counters frozen)", "stall", FindingKind.HANG),
    ("stall (8 requests running, counters frozen)", "stall", FindingKind.STALL),
    ("KV pressure (usage 0.95)", "kv", FindingKind.KV_PRESSURE),
    ("thermal (91 C, hw_thermal slowdown)", "thermal", FindingKind.THERMAL),
    ("XID 79 (fallen off the bus)", "xid", FindingKind.GPU_LOST),
    ("XID 48 (double-bit ECC)", "xid48", FindingKind.GPU_FAULT),
    ("foreign process holding 2 GiB on the GPU", "foreign", FindingKind.FOREIGN_GPU_MEMORY),
    ("RSS growing 2 GiB/h", "memory", FindingKind.MEMORY_GROWTH),
)


def main(out: Callable[[str], None] = print) -> None:
    out(
        f"Defaults: tick_interval_s={TICK_S:g}, canary_interval_s={SPEC.canary_interval_s:g}, "
        f"live canary deadline {DEADLINE_S:g} s (learned; live_canary_timeout_s="
        f"{SPEC.live_canary_timeout_s:g} until a canary answers)"
    )
    out("")
    out("| fault | finding | time to detect |")
    out("|---|---|---|")
    for label, fault, kind in SCENARIOS:
        found = latency(fault, kind)
        out(f"| {label} | {kind.value} | {'not found' if found is None else f'{found:.0f} s'} |")
    out("")
    out("With the step heartbeat (issue 25), the hang beginning at each of")
    out(f"{', '.join(f'{p:g}' for p in PHASES)} s into a {TICK_S:g} s tick, a loaded round taking")
    out(f"{', '.join(f'{r:g}' for r in ROUND_S)} s:")
    out("")
    out("| hang | engine | rule | fastest | slowest |")
    out("|---|---|---|---|---|")
    for label, hang, load in HANG_CASES:
        results = [hang_latency(hang, load, 900.0 + p, r) for p in PHASES for r in ROUND_S]
        found = [r for r in results if r is not None]
        rules = ", ".join(sorted({r[1] for r in found})) or "-"
        if len(found) < len(results):
            out(f"| {label} | {load} | {rules} | not always found | |")
            continue
        lat = [r[0] for r in found]
        out(f"| {label} | {load} | {rules} | {min(lat):.1f} s | {max(lat):.1f} s |")


if __name__ == "__main__":
    if "--real" in sys.argv[1:]:  # against the real vLLM CPU build: bench/detection_real.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from detection_real import main as real_main

        raise SystemExit(real_main([a for a in sys.argv[1:] if a != "--real"]))
    main()
