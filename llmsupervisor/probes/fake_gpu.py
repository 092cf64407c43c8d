"""Test and demo doubles for ``GpuReader``: never used against a real GPU.

``FakeGpu`` is scripted in-process (unit and loop tests); ``FileGpu`` reads a JSON file that a
test or a demo rewrites while the daemon runs (``llm-supervisor run --fake-gpu FILE``);
``nominal_sample`` is the healthy idle GPU both start from. ``FakeNvml`` and ``FileNvml``
(probes/fake_nvml.py) sit one level lower, in place of the ``pynvml`` module itself, so that the
real reader (``nvml.NvmlReader``) runs over them; ``--fake-gpu FILE`` uses ``FileNvml``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from llmsupervisor.errors import NvmlUnavailable
from llmsupervisor.probes.cpus import parse_cpu_list
from llmsupervisor.probes.gpu_readings import CLOCK_EVENT_REASONS, GpuEvent, GpuLost, GpuProcess, GpuSample


def nominal_sample(index: int = 0, uuid: str | None = None, **changes: Any) -> GpuSample:
    """A healthy, idle 80 GB GPU; ``changes`` override fields (``temperature_c=91``, ...)."""
    values: dict[str, Any] = {
        "index": index,
        "uuid": uuid if uuid is not None else f"GPU-fake-{index:04d}",
        "name": "Fake GPU 80GB",
        "temperature_c": 40,
        "power_w": 90.0,
        "power_limit_w": 350.0,
        "sm_clock_mhz": 1410,
        "mem_clock_mhz": 1593,
        "clock_event_reasons": 0x1,  # gpu_idle
        "memory_used_bytes": 0,
        "memory_total_bytes": 80 * 1024**3,
        "utilization_gpu_pct": 0,
        "ecc_uncorrected_volatile": 0,
        "processes": (),
        "slowdown_temperature_c": 90,  # the board's own thresholds (an H100 SXM's, roughly)
        "max_operating_temperature_c": 87,
    }
    values.update(changes)
    return GpuSample(**values)


class FakeGpu:
    """A scripted ``GpuReader`` for loop tests and the daemon's ``--fake-gpu``.

    Each GPU replays its scripted items in order, one per ``sample`` call; the last one then
    repeats (a steady state, or a GPU that stays lost). An item that is an exception is raised
    (``GpuLost(...)``, say). ``push_event`` queues an event for ``wait_event``; ``hang(uuid)``
    makes that GPU's calls block until ``release(uuid)``, for timeout tests.
    """

    def __init__(
        self,
        script: Mapping[str, Iterable[GpuSample | Exception]] | None = None,
        *,
        events: Iterable[GpuEvent] = (),
        unavailable: NvmlUnavailable | None = None,
        max_hang_s: float = 30.0,
        cpus: Mapping[str, frozenset[int]] | None = None,
    ) -> None:
        self._cpus = dict(cpus or {})  # UUID -> the GPU's CPU affinity (its NUMA node's CPUs)
        self._scripts: dict[str, deque[GpuSample | Exception]] = {
            uuid: deque(items) for uuid, items in (script or {}).items()
        }
        self._events: deque[GpuEvent] = deque(events)
        self._unavailable = unavailable
        self._max_hang_s = max_hang_s
        self._cond = threading.Condition()
        self._gates: dict[str, threading.Event] = {}
        self.calls: Counter[str] = Counter()
        self.opened = False
        self.closed = False

    @classmethod
    def nominal(cls, count: int = 1) -> FakeGpu:
        """``count`` healthy idle GPUs, ``GPU-fake-0000`` onwards."""
        return cls({f"GPU-fake-{i:04d}": [nominal_sample(i)] for i in range(count)})

    def script(self, uuid: str, *items: GpuSample | Exception) -> None:
        """Append items to a GPU's script (a new GPU if the UUID is new)."""
        with self._cond:
            self._scripts.setdefault(uuid, deque()).extend(items)

    def push_event(self, event: GpuEvent) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def hang(self, uuid: str) -> None:
        with self._cond:
            self._gates[uuid] = threading.Event()

    def release(self, uuid: str) -> None:
        with self._cond:
            gate = self._gates.pop(uuid, None)
        if gate is not None:
            gate.set()

    def open(self) -> dict[str, int]:
        self.calls["open"] += 1
        if self._unavailable is not None:
            raise self._unavailable
        self.opened = True
        with self._cond:
            return {uuid: self._index_of(position, uuid) for position, uuid in enumerate(self._scripts)}

    def _index_of(self, position: int, uuid: str) -> int:
        # The NVML index is the one the GPU's samples carry, so a script can leave a GPU out
        # (indices 1 and 2, no 0); a GPU scripted with exceptions only takes its position.
        samples = (item for item in self._scripts[uuid] if isinstance(item, GpuSample))
        first = next(samples, None)
        return position if first is None else first.index

    def sample(self, uuid: str) -> GpuSample:
        self.calls[uuid] += 1
        with self._cond:
            gate = self._gates.get(uuid)
        if gate is not None:
            gate.wait(self._max_hang_s)
        with self._cond:
            items = self._scripts[uuid]
            if not items:
                raise LookupError(f"FakeGpu: nothing scripted for {uuid}")
            item = items.popleft() if len(items) > 1 else items[0]
        if isinstance(item, Exception):
            raise item
        return item

    def cpu_affinity(self, uuid: str) -> frozenset[int] | None:
        self.calls["cpu_affinity"] += 1
        return self._cpus.get(uuid)

    def wait_event(self, timeout_ms: int) -> GpuEvent | None:
        self.calls["wait_event"] += 1
        with self._cond:
            self._cond.wait_for(lambda: bool(self._events) or self.closed, timeout_ms / 1000)
            return self._events.popleft() if self._events else None

    def close(self) -> None:
        self.calls["close"] += 1
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        for uuid in list(self._gates):
            self.release(uuid)


class FileGpu:
    """A ``GpuReader`` driven by a JSON file that a test rewrites, at the sample level (it skips
    the reader). ``--fake-gpu FILE`` uses ``FileNvml`` instead, with the same file format, so that
    the real reader runs; this one stays for the monitor's own tests.

    The file, re-read on every call::

        {"gpus": [{"index": 0, "temperature_c": 91, "clock_event_reasons": ["hw_thermal"],
                   "lost": false, ...any GpuSample field...}],
         "events": [{"id": 1, "gpu": 0, "kind": "xid", "xid": 48}]}

    Missing fields take ``nominal_sample`` values; ``clock_event_reasons`` may be a list of
    names; ``"lost": true`` makes the GPU raise ``GpuLost``; each event is delivered once (by id);
    ``"cpus": "0-3"`` is the GPU's CPU affinity (its NUMA node's CPUs).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._delivered: set[object] = set()
        self._closed = threading.Event()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise NvmlUnavailable("fake_gpu_file", f"cannot read {self.path}: {exc}") from None
        return data if isinstance(data, dict) else {}

    def _gpus(self) -> list[dict[str, Any]]:
        return [g for g in self._read().get("gpus", []) if isinstance(g, dict)]

    def open(self) -> dict[str, int]:
        indices = [int(g.get("index", i)) for i, g in enumerate(self._gpus())]
        return {f"GPU-fake-{index:04d}": index for index in indices}

    def sample(self, uuid: str) -> GpuSample:
        for i, raw in enumerate(self._gpus()):
            index = int(raw.get("index", i))
            if f"GPU-fake-{index:04d}" != uuid:
                continue
            fields = {k: v for k, v in raw.items() if k not in ("index", "lost", "cpus")}
            if raw.get("lost"):
                raise GpuLost(uuid, "fake GPU marked lost")
            reasons = fields.get("clock_event_reasons")
            if isinstance(reasons, list):
                by_name = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}
                fields["clock_event_reasons"] = sum(by_name[name] for name in reasons)
            if isinstance(fields.get("processes"), list):
                fields["processes"] = tuple(GpuProcess(int(p[0]), p[1]) for p in fields["processes"])
            return nominal_sample(index, uuid, **fields)
        raise GpuLost(uuid, "fake GPU no longer in the file")

    def cpu_affinity(self, uuid: str) -> frozenset[int] | None:
        """The entry's ``"cpus": "0-3"`` (a cpulist), None without one."""
        for i, raw in enumerate(self._gpus()):
            if f"GPU-fake-{int(raw.get('index', i)):04d}" == uuid and isinstance(raw.get("cpus"), str):
                return frozenset(parse_cpu_list(raw["cpus"]))
        return None

    def wait_event(self, timeout_ms: int) -> GpuEvent | None:
        deadline = time.monotonic() + timeout_ms / 1000
        while not self._closed.is_set():
            with contextlib.suppress(NvmlUnavailable):
                for raw in self._read().get("events", []):
                    key = raw.get("id", json.dumps(raw, sort_keys=True))
                    if key in self._delivered:
                        continue
                    self._delivered.add(key)
                    gpu = raw.get("gpu")
                    return GpuEvent(
                        index=gpu,
                        uuid=None if gpu is None else f"GPU-fake-{int(gpu):04d}",
                        kind=str(raw.get("kind", "xid")),
                        xid=raw.get("xid"),
                        at_s=time.monotonic(),
                    )
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._closed.wait(min(0.2, left))
        return None

    def close(self) -> None:
        self._closed.set()


__all__ = ["FakeGpu", "FileGpu", "nominal_sample"]
