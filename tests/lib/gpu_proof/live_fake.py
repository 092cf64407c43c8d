"""The pynvml-level fake (``llmsupervisor/probes/fake_nvml.py``) with the one habit of a driver
that the checks measure: a process holding memory is listed while it lives."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml
from llmsupervisor.process import alive


class LiveFakeNvml(FakeNvml):
    """The fake with a driver's one habit the checks measure: a process that holds memory is
    listed, and its memory counted in ``used``, while it lives, and not after it exits.

    ``hold`` says which (real, local) process holds how much on which GPU; the fake mode's holder
    grandchild is registered so, and checks 2 and 3 run their whole path over it."""

    def __init__(self, devices: Sequence[FakeDevice]) -> None:
        super().__init__(devices)
        self.holders: dict[int, tuple[int, int]] = {}  # pid -> (GPU index, bytes)
        self._base_used = [d.memory_used for d in self.devices]
        self._sync_lock = threading.Lock()

    def hold(self, pid: int, gpu: int, nbytes: int) -> None:
        with self._sync_lock:
            self.holders[pid] = (gpu, nbytes)

    def _sync(self) -> None:
        with self._sync_lock:
            for pid in [p for p in self.holders if not alive(p)]:
                del self.holders[pid]
            for index, dev in enumerate(self.devices):
                mine = [(pid, n) for pid, (g, n) in self.holders.items() if g == index]
                dev.processes = [(pid, n) for pid, n in mine]
                dev.memory_used = self._base_used[index] + sum(n for _, n in mine)

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        self._sync()
        return super().nvmlDeviceGetComputeRunningProcesses(h)

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
        self._sync()
        return super().nvmlDeviceGetMemoryInfo(h, version)
