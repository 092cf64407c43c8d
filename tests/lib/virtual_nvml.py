"""The real NVML reader over the pynvml-level fake (llmsupervisor/probes/fake_nvml.py), on virtual
time (tests/lib/virtual_time.py).

On virtual time a call in a thread answers in real time while the clock runs ahead to the call's
deadline, so every call would time out. ``inline_nvml`` runs ``ThreadedGpuReader``'s calls on the
loop instead, except those ``threaded`` names (a hung GPU's, which must block a thread of its own
while the daemon's deadlines pass). ``VirtualNvml``'s event wait never blocks: a wait that finds
nothing answers after its timeout, 1 s of virtual time, as ``nvmlEventSetWait`` would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from llmsupervisor.probes.fake_nvml import FakeNvml
from llmsupervisor.probes.gpu_threads import ThreadedGpuReader

EVENT_WAIT_S = 1.0  # GpuMonitor waits 1000 ms at a time


class VirtualNvml(FakeNvml):
    """``FakeNvml`` whose ``nvmlEventSetWait`` answers at once (``inline_nvml`` spends the wait's
    timeout in virtual time)."""

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        return super().nvmlEventSetWait(event_set, 0)


def inline_nvml(
    monkeypatch: pytest.MonkeyPatch, *, threaded: Callable[[str], bool] = lambda key: False
) -> None:
    """``ThreadedGpuReader``'s calls run inline (see the module's docstring); ``threaded(key)``:
    that call keeps its thread (keys are a GPU's UUID, ``UUID/affinity``, "events", "open")."""
    original = ThreadedGpuReader._start

    def start(self: ThreadedGpuReader, key: str, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        if threaded(key):
            return original(self, key, fn)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        try:
            result = fn()
        except Exception as exc:
            fut.set_exception(exc)
            return fut
        if key == "events" and result is None:

            def nothing() -> None:
                if not fut.done():
                    fut.set_result(None)

            loop.call_later(EVENT_WAIT_S, nothing)
        else:
            fut.set_result(result)
        return fut

    monkeypatch.setattr(ThreadedGpuReader, "_start", start)
