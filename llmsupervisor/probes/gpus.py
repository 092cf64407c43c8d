"""GPU telemetry for the whole daemon: one NVML reader, sampled once per tick, shared by engines.

Engines see their own GPUs' latest samples and the NVML events (XIDs) for those GPUs since their
last look. Without a driver the reader reports NVML unavailable once and everything else runs
without GPU telemetry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Mapping

from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_threads import ThreadedGpuReader
from llmsupervisor.probes.nvml import CLOCK_EVENT_REASONS, GpuEvent, GpuReader, GpuSample

log = logging.getLogger("llmsupervisor.probes.gpus")

EVENT_BACKLOG = 256  # per GPU; an engine that never looks must not grow memory


class GpuMonitor:
    def __init__(self, reader: GpuReader, *, interval_s: float, call_timeout_s: float = 5.0) -> None:
        self.reader = ThreadedGpuReader(reader, call_timeout_s=call_timeout_s)
        self.interval_s = interval_s
        self.latest: dict[int, GpuSample | ProbeFailure] = {}
        self._index_of: dict[str, int] = {}
        self._events: dict[int, list[GpuEvent]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def unavailable(self) -> str | None:
        reason = self.reader.unavailable
        return None if reason is None else str(reason)

    async def start(self) -> None:
        # NVML's own indices, which engines' ``gpus`` name: a GPU that NVML could not read at
        # open is left out, so indices can have gaps and a position in this mapping means nothing.
        self._index_of = await self.reader.open()
        if self._index_of:
            log.info("NVML: %d GPU(s), indices %s", len(self._index_of), sorted(self._index_of.values()))
            self._tasks = [
                asyncio.create_task(self._sample_loop(), name="gpu-sample"),
                asyncio.create_task(self._event_loop(), name="gpu-events"),
            ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._index_of:
            await self.reader.close()

    async def _sample_loop(self) -> None:
        while True:
            samples = await self.reader.sample_all()
            # A sample names its GPU's index; a failure has only the UUID it was asked for.
            self.latest = {
                s.index if isinstance(s, GpuSample) else self._index_of[uuid]: s
                for uuid, s in samples.items()
            }
            await asyncio.sleep(self.interval_s)

    async def _event_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            event = await self.reader.wait_event(1000)
            if isinstance(event, ProbeFailure):
                await asyncio.sleep(1.0)  # the failure shows in samples; do not spin
            elif event is not None and event.index is not None:
                # Stamped on receipt with the loop's clock, the one the engines' times are on.
                backlog = self._events.setdefault(event.index, [])
                backlog.append(dataclasses.replace(event, at_s=loop.time()))
                del backlog[:-EVENT_BACKLOG]

    async def gpu_cpus(self) -> dict[int, frozenset[int]]:
        """Each GPU's CPU affinity (its NUMA node's CPUs), by NVML index; GPUs NVML says nothing
        about (or no NVML) are left out."""
        uuids = list(self._index_of)
        found = await asyncio.gather(*(self.reader.cpu_affinity(uuid) for uuid in uuids))
        return {
            self._index_of[uuid]: cpus
            for uuid, cpus in zip(uuids, found, strict=True)
            if isinstance(cpus, frozenset)
        }

    def samples_for(self, gpus: Iterable[int]) -> Mapping[int, GpuSample | ProbeFailure]:
        return {g: self.latest[g] for g in gpus if g in self.latest}

    def take_events(self, gpus: Iterable[int], since_s: float | None = None) -> tuple[GpuEvent, ...]:
        """The events on ``gpus`` received since the last take (each is taken once), per GPU in
        order of receipt.

        Events received before ``since_s`` (``loop.time()``) are dropped: an engine passes its
        incarnation's start, so the XIDs of the incident that restarted it, which arrive while it
        drains, stops and starts again, are not replayed into the new incarnation.
        """
        taken: list[GpuEvent] = []
        for g in gpus:
            taken += self._events.pop(g, [])
        if since_s is not None:
            taken = [e for e in taken if e.at_s >= since_s]
        return tuple(taken)

    def exporter_samples(self) -> Mapping[int, Mapping[str, float]]:
        """The latest samples under the exporter's GPU_METRICS names."""
        out: dict[int, dict[str, float]] = {}
        for index, sample in self.latest.items():
            if isinstance(sample, ProbeFailure):
                continue
            values: dict[str, float] = {}
            pairs: tuple[tuple[str, float | int | None, float], ...] = (
                ("temperature_celsius", sample.temperature_c, 1.0),
                ("power_watts", sample.power_w, 1.0),
                ("power_limit_watts", sample.power_limit_w, 1.0),
                ("sm_clock_hertz", sample.sm_clock_mhz, 1e6),
                ("memory_clock_hertz", sample.mem_clock_mhz, 1e6),
                ("utilization_ratio", sample.utilization_gpu_pct, 0.01),
                ("memory_used_bytes", sample.memory_used_bytes, 1.0),
                ("memory_total_bytes", sample.memory_total_bytes, 1.0),
                ("ecc_uncorrected_errors_total", sample.ecc_uncorrected_volatile, 1.0),
            )
            for name, value, scale in pairs:
                if value is not None:
                    values[name] = float(value) * scale
            if sample.clock_event_reasons is not None:
                active = sample.clock_event_reason_names
                for reason in CLOCK_EVENT_REASONS.values():
                    values[f"throttle_reason/{reason}"] = 1.0 if reason in active else 0.0
            out[index] = values
        return out
