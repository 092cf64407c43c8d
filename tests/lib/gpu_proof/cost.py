"""Check 8, cost: the CPU the daemon's threaded reader spends per GPU sample and per event wait,
and a sample's NVML calls alone (no thread)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.lib.gpu_proof.proof import Proof
from tests.lib.gpu_proof.result import Result


def check_cost(proof: Proof, r: Result) -> None:
    from llmsupervisor.probes.gpu_threads import ThreadedGpuReader

    opts = proof.opts
    reader = proof.reader()

    async def measure() -> dict[str, Any]:
        threaded = ThreadedGpuReader(reader)
        gpus = await threaded.open()
        try:
            await threaded.sample_all()  # warm: thresholds read once
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(opts.cost_samples):
                await threaded.sample_all()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            per = opts.cost_samples * max(len(gpus), 1)
            waits = []
            cpu1 = time.process_time()
            for _ in range(opts.event_waits):
                t0 = time.perf_counter()
                await threaded.wait_event(opts.event_wait_ms)
                waits.append(time.perf_counter() - t0)
            wait_cpu = time.process_time() - cpu1
        finally:
            await threaded.close()
        # One sample in this thread, without the daemon's per-call thread: the NVML calls alone.
        return {
            "gpus": len(gpus),
            "samples": opts.cost_samples,
            "cpu_ms_per_gpu_sample": round(1000 * cpu / per, 3),
            "wall_ms_per_gpu_sample": round(1000 * wall / per, 3),
            "event_waits": opts.event_waits,
            "event_wait_ms": opts.event_wait_ms,
            "cpu_ms_per_event_wait": round(1000 * wait_cpu / max(opts.event_waits, 1), 3),
            "wall_s_per_event_wait": round(sum(waits) / max(len(waits), 1), 3),
        }

    r.data.update(asyncio.run(measure()))
    direct = proof.reader()
    direct.open()
    try:
        uuid = next(iter(direct.registered_events()), None)
        if uuid is not None:
            t0 = time.thread_time()
            for _ in range(opts.cost_samples):
                direct.sample(uuid)
            r.data["cpu_ms_per_sample_unthreaded"] = round(
                1000 * (time.thread_time() - t0) / opts.cost_samples, 3
            )
    finally:
        direct.close()
    # At the default 1 s tick: the share of one core the GPU sampling takes, per GPU.
    r.data["percent_of_a_core_per_gpu_at_1s_tick"] = round(r.data["cpu_ms_per_gpu_sample"] / 10, 3)
    r.expect(r.data["gpus"] > 0, "the threaded reader opened no GPU")
