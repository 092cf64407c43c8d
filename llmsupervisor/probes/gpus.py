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
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuReader, GpuSample
from llmsupervisor.probes.gpu_threads import ThreadedGpuReader

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

    def gpus_by_index(self) -> dict[int, str]:
        """The GPUs NVML opened, NVML index -> UUID (what fault marks are keyed by)."""
        return {index: uuid for uuid, index in self._index_of.items()}

    def mig_enabled(self, gpus: Iterable[int]) -> list[int]:
        """Those of ``gpus`` with MIG on: CUDA numbers their MIG devices, not the GPU, so
        CUDA_VISIBLE_DEVICES=<NVML index> would put an engine elsewhere than monitored."""
        return sorted(
            g for g in gpus if isinstance(s := self.latest.get(g), GpuSample) and s.mig_enabled is True
        )

    async def start(self) -> None:
        # NVML's own indices, which engines' ``gpus`` name: a GPU that NVML could not read at
        # open is left out, so indices can have gaps and a position in this mapping means nothing.
        self._index_of = await self.reader.open()
        if self._index_of:
            # One sample before engines start: MIG mode and a standing recovery action are known
            # from the first tick.
            await self._sample_once()
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

    async def _sample_once(self) -> None:
        samples = await self.reader.sample_all()
        # A sample names its GPU's index; a failure has only the UUID it was asked for.
        self.latest = {
            s.index if isinstance(s, GpuSample) else self._index_of[uuid]: s for uuid, s in samples.items()
        }

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._sample_once()

    async def _event_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            event = await self.reader.wait_event(1000)
            if isinstance(event, ProbeFailure):
                await asyncio.sleep(1.0)  # the failure shows in samples; do not spin
            elif event is not None and event.index is None:
                log.warning(
                    "NVML event %s on a device NVML did not name; not attributed to a GPU", event.kind
                )
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
