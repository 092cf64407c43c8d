"""GPU telemetry for the whole daemon: one NVML reader, sampled once per tick, shared by engines.

Engines see their own GPUs' latest samples and the NVML events (XIDs) for those GPUs since their
last look. Three things go wrong on a real box, and each is said, not swallowed (docs/gpu.md):

- NVML cannot be opened yet (a driver that loads after the daemon, a slow first init, a reboot
  pending after a driver upgrade). The monitor keeps trying, with a backoff on the daemon's clock
  (``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``), and picks telemetry up when it opens. Until
  then ``health()`` says why, and an engine's GPUs read as ``ProbeFailure("nvml")``: NVML_LOST.
- ``nvmlEventSetWait`` fails: the reader rebuilds the set (probes/nvml.py); the monitor counts
  the failures and backs off between them instead of retrying every second, silently.
- One GPU's calls stop answering while the others answer: after ``hang_misses`` deadline
  misses in a row it is a lost GPU (``ProbeFailure("gpu_lost")``: GPU_LOST, the node condition),
  as if NVML had said GPU_IS_LOST. When every GPU misses, it is NVML itself: NVML_LOST.

And one the operator asks for: ``release`` closes NVML on purpose (``nvmlShutdown``, which lets
go of every GPU: nvml.h has no call that lets go of one), so that ``nvidia-smi -r`` can reset a
GPU while the daemon runs (daemon/gpu_release.py). Until ``take_back`` opens it again, ``health()``
says ``released`` and why, and the engines' GPUs read as ``ProbeFailure("released")``: blind on
purpose, not failing. The GPUs' UUIDs stay known meanwhile, so a GPU's node condition stays with
it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Final

from llmsupervisor import aio
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuFabric, GpuReader, GpuSample, NvmlHealth
from llmsupervisor.probes.gpu_threads import ThreadedGpuReader

log = logging.getLogger("llmsupervisor.probes.gpus")

EVENT_BACKLOG = 256  # per GPU; an engine that never looks must not grow memory
# NVML not there yet: the next open after 2 s, then 4, 8, 15, 15, ...: telemetry within
# RETRY_MAX_S (+ one open and one sample) of the driver coming up.
RETRY_FIRST_S: Final = 2.0
RETRY_MAX_S: Final = 15.0
# A failed event wait: the next one after 1 s, doubling to this while they keep failing.
EVENT_RETRY_MAX_S: Final = 30.0
DEFAULT_HANG_MISSES: Final = 6
RELEASED: Final = "released"  # NvmlHealth.reason while NVML is closed on purpose (``release``)


class GpuMonitor:
    def __init__(
        self,
        reader: GpuReader,
        *,
        interval_s: float,
        call_timeout_s: float = 5.0,
        open_timeout_s: float = 30.0,
        hang_misses: int = DEFAULT_HANG_MISSES,
    ) -> None:
        self.reader = ThreadedGpuReader(reader, call_timeout_s=call_timeout_s, open_timeout_s=open_timeout_s)
        self.interval_s = interval_s
        self.hang_misses = hang_misses
        self.latest: dict[int, GpuSample | ProbeFailure] = {}
        # Set once NVML opened (at start or later): the daemon then places the engines that
        # waited for it (daemon/supervisor.py).
        self.opened = aio.Flag()
        self._index_of: dict[str, int] = {}
        self._events: dict[int, list[GpuEvent]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._since_s: float | None = None  # down since the first failed open, or up since it opened
        self._next_try_s: float | None = None
        self._misses: dict[str, int] = {}  # per GPU UUID: deadline misses in a row
        self._hung: set[int] = set()  # GPUs taken as lost for calls that stopped answering
        self.event_wait_errors = 0
        self._released: str | None = None  # closed on purpose (``release``): why
        self._bus_ids: dict[int, str] = {}  # the last PCI bus id each GPU's sample named
        # Opens that succeeded, each with its first sample taken: a take-back judges the GPU on
        # the sample of an open newer than the release.
        self.opens_total = 0

    @property
    def unavailable(self) -> str | None:
        reason = self.reader.unavailable
        return None if reason is None else str(reason)

    def health(self) -> NvmlHealth:
        """Whether NVML is open, and if not why, since when and when it is tried next."""
        down = self.reader.unavailable
        up = self.reader.is_open
        # Not tried yet; or, once it was open (a take-back after a release), opening again.
        reason = down.reason if down is not None else "reopening" if self.opens_total else "not_tried"
        detail = None if down is None else down.detail
        if self._released is not None:
            reason, detail = RELEASED, self._released
        return NvmlHealth(
            up=up,
            reason=None if up else reason,
            detail=None if up else detail,
            since_s=self._since_s,
            attempts=self.reader.attempts,
            next_try_s=None if up else self._next_try_s,
            gpus=len(self._index_of),
            hung=tuple(sorted(self._hung)),
            event_wait_errors=self.event_wait_errors,
            events_unwatched={
                i: s.events_unwatched
                for i, s in sorted(self.latest.items())
                if isinstance(s, GpuSample) and s.events_unwatched is not None
            },
            fabric={i: f.state_name for i, f in self.fabrics().items() if f.on_nvswitch},
        )

    def fabrics(self) -> dict[int, GpuFabric]:
        """Each GPU's NVSwitch fabric registration from its latest sample, by index; GPUs whose
        fabric could not be read (NotSupported, a failed reading or sample) are left out."""
        return {
            i: s.fabric
            for i, s in sorted(self.latest.items())
            if isinstance(s, GpuSample) and s.fabric is not None
        }

    def gpus_by_index(self) -> dict[int, str]:
        """The GPUs NVML opened, NVML index -> UUID (what fault marks are keyed by); while
        released, as NVML last opened them."""
        return {index: uuid for uuid, index in self._index_of.items()}

    def pci_bus_id(self, index: int) -> str | None:
        """The GPU's PCI bus id as its last sample named it (kept while released)."""
        return self._bus_ids.get(index)

    @property
    def released(self) -> str | None:
        """Why NVML is closed on purpose (``release``); None when it is not."""
        return self._released

    async def release(self, why: str, *, until_s: float) -> None:
        """Close NVML on purpose (``why``: for the operator) until ``take_back``, at the latest
        ``until_s`` (shown as the next open): sampling and the event wait stop, then
        ``nvmlShutdown`` (each call under the reader's deadline)."""
        self._released = why
        self._next_try_s = until_s
        self._since_s = aio.now()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.latest = {}
        self._misses.clear()
        if self.reader.is_open:
            await self.reader.close()

    def take_back(self) -> None:
        """Open NVML again after ``release``: at once, then with the usual backoff while it
        does not open (a GPU still resetting). Nothing to do while it is open or opening."""
        self._released = None
        self._next_try_s = None
        if self.reader.is_open or any(t.get_name() == "gpu-open" and not t.done() for t in self._tasks):
            return
        self._tasks.append(asyncio.create_task(self._reopen(), name="gpu-open"))

    async def _reopen(self) -> None:
        if not await self._try_open():
            await self._open_loop()

    def mig_enabled(self, gpus: Iterable[int]) -> list[int]:
        """Those of ``gpus`` with MIG on: CUDA numbers their MIG devices, not the GPU, so
        CUDA_VISIBLE_DEVICES=<NVML index> would put an engine elsewhere than monitored."""
        return sorted(
            g for g in gpus if isinstance(s := self.latest.get(g), GpuSample) and s.mig_enabled is True
        )

    async def start(self) -> None:
        """Open NVML (one try, under the reader's open deadline). If it cannot be opened, keep
        trying in the background, with a backoff, until it opens or the monitor closes."""
        if not await self._try_open():
            self._tasks.append(asyncio.create_task(self._open_loop(), name="gpu-open"))

    async def _try_open(self) -> bool:
        was_down_s = self._since_s
        # NVML's own indices, which engines' ``gpus`` name: a GPU that NVML could not read at
        # open is left out, so indices can have gaps and a position in this mapping means nothing.
        gpus = await self.reader.open()
        if not self.reader.is_open:
            if self._since_s is None:
                self._since_s = aio.now()
            return False
        self._index_of = gpus
        self._since_s = aio.now()
        if was_down_s is not None:
            log.warning(
                "NVML opened after %d tries, %.0f s without GPU telemetry",
                self.reader.attempts,
                aio.now() - was_down_s,
            )
        self._hung.clear()  # a new NVML session: a GPU that hung before is judged again
        if self._index_of:
            # One sample before engines start: MIG mode and a standing recovery action are known
            # from the first tick.
            await self._sample_once()
            log.info("NVML: %d GPU(s), indices %s", len(self._index_of), sorted(self._index_of.values()))
            self._tasks += [
                asyncio.create_task(self._sample_loop(), name="gpu-sample"),
                asyncio.create_task(self._event_loop(), name="gpu-events"),
            ]
        self.opens_total += 1
        self.opened.set()
        return True

    async def _open_loop(self) -> None:
        delay_s = RETRY_FIRST_S
        while True:
            self._next_try_s = aio.now() + delay_s
            await aio.wait_any(timeout_s=delay_s)
            if await self._try_open():
                self._next_try_s = None
                return
            delay_s = min(2 * delay_s, RETRY_MAX_S)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.reader.is_open:
            await self.reader.close()

    async def _sample_once(self) -> None:
        samples = await self.reader.sample_all()
        answered = any(isinstance(s, GpuSample) for s in samples.values())
        latest: dict[int, GpuSample | ProbeFailure] = {}
        for uuid, sample in samples.items():
            # A sample names its GPU's index; a failure has only the UUID it was asked for.
            index = sample.index if isinstance(sample, GpuSample) else self._index_of[uuid]
            latest[index] = self._judge_hang(uuid, index, sample, others_answer=answered)
            if isinstance(sample, GpuSample) and sample.pci_bus_id:
                self._bus_ids[index] = sample.pci_bus_id
        self.latest = latest

    def _judge_hang(
        self, uuid: str, index: int, sample: GpuSample | ProbeFailure, *, others_answer: bool
    ) -> GpuSample | ProbeFailure:
        """A GPU whose calls missed ``hang_misses`` deadlines in a row while another GPU answered
        is lost: what a GPU on its way off the bus looks like when no GPU_IS_LOST comes."""
        if not (isinstance(sample, ProbeFailure) and sample.kind == "timeout"):
            self._misses.pop(uuid, None)
            if index in self._hung and isinstance(sample, GpuSample):
                self._hung.discard(index)
                log.warning("NVML: GPU %d (%s) answers again", index, uuid)
            return sample
        misses = self._misses[uuid] = self._misses.get(uuid, 0) + 1
        if index not in self._hung and (misses < self.hang_misses or not others_answer):
            return sample
        if index not in self._hung:
            self._hung.add(index)
            log.error(
                "NVML: GPU %d (%s) missed %d call deadlines in a row while the other GPUs answer:"
                " taken as lost (docs/gpu.md)",
                index,
                uuid,
                misses,
            )
        return ProbeFailure(
            "gpu_lost",
            f"GPU {index} ({uuid}): NVML calls missed {misses} deadlines in a row while the other GPUs"
            f" answer ({sample.detail})",
        )

    async def _sample_loop(self) -> None:
        while True:
            await aio.wait_any(timeout_s=self.interval_s)
            await self._sample_once()

    async def _event_loop(self) -> None:
        failures = 0
        while True:
            event = await self.reader.wait_event(1000)
            if isinstance(event, ProbeFailure):
                # A wait that failed (the reader rebuilt its set) or is stuck: count it, say it,
                # and do not spin.
                failures += 1
                self.event_wait_errors += 1
                if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th, 8th ... in a row
                    log.warning("NVML event wait failed (%d in a row): %s", failures, event.detail)
                await aio.wait_any(timeout_s=min(2.0 ** (failures - 1), EVENT_RETRY_MAX_S))
                continue
            failures = 0
            if event is not None and event.index is None:
                log.warning(
                    "NVML event %s on a device NVML did not name; not attributed to a GPU", event.kind
                )
            elif event is not None and event.index is not None:
                # Stamped on receipt with the loop's clock, the one the engines' times are on.
                backlog = self._events.setdefault(event.index, [])
                backlog.append(dataclasses.replace(event, at_s=aio.now()))
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
        """The latest sample of each of ``gpus``. While NVML is not open, each reads as a
        ``ProbeFailure("nvml")`` with the reason: the engine's NVML_LOST finding says it is blind."""
        if self._released is not None:
            return dict.fromkeys(gpus, ProbeFailure("released", self._released))
        if not self.reader.is_open:
            down = ProbeFailure("nvml", str(self.reader.unavailable or "NVML not opened yet"))
            return dict.fromkeys(gpus, down)
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
