"""``ThreadedGpuReader``: the async face of a blocking ``GpuReader``, for the supervisor loop.

NVML calls are synchronous C calls that can stall on a faulted GPU (docs/host-notes.md §1.8), so each one
runs in a thread of its own under a deadline; see the class docstring for why a daemon thread per
call and not an executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from llmsupervisor.errors import NvmlUnavailable
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuLost, GpuReader, GpuSample

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class _Busy(Exception):
    def __init__(self, key: str, age_s: float) -> None:
        super().__init__(key, age_s)
        self.key = key
        self.age_s = age_s


class ThreadedGpuReader:
    """Async face of a ``GpuReader`` for the supervisor loop; never raises for NVML trouble.

    NVML calls are synchronous C calls that can stall on a faulted GPU (docs/host-notes.md §1.8). Each
    call runs in a daemon thread (a stuck one must not hold up the daemon's exit, as a
    ``ThreadPoolExecutor`` would) under ``call_timeout_s``. A call that times out keeps its
    thread; until it returns, the same GPU gets no second call, only
    ``ProbeFailure(kind="timeout")``, so stuck threads cannot pile up. The event waiter is a key
    of its own, so it never blocks sampling.

    ``open`` returns the GPUs (UUID -> NVML index), or ``{}`` while NVML is unavailable, with the
    reason in ``unavailable`` (logged at WARNING when it first appears or changes). Each call
    tries again (``GpuMonitor`` paces the calls); an open that outlived ``open_timeout_s`` is not
    abandoned: the next call waits for that same open again rather than starting a second one,
    and takes its GPUs if it succeeded meanwhile.
    """

    def __init__(
        self,
        reader: GpuReader,
        *,
        call_timeout_s: float = 5.0,
        open_timeout_s: float = 30.0,
    ) -> None:
        self._reader = reader
        self._call_timeout_s = call_timeout_s
        self._open_timeout_s = open_timeout_s
        self._busy: dict[str, tuple[asyncio.Future[Any], float]] = {}
        self._gpus: dict[str, int] | None = None  # UUID -> NVML index, from open
        self._unavailable: NvmlUnavailable | None = None  # why the last open failed; None once open
        self._opening: asyncio.Future[dict[str, int]] | None = None  # an open still running
        self.attempts = 0  # opens tried

    @property
    def unavailable(self) -> NvmlUnavailable | None:
        """Why NVML could not be opened at the last try; None before the first try and once open."""
        return self._unavailable

    @property
    def is_open(self) -> bool:
        return self._gpus is not None

    @property
    def uuids(self) -> list[str]:
        return list(self._gpus or {})

    def outstanding_for_tests(self) -> frozenset[str]:
        """Test hook: keys (GPU UUIDs, "events", "open", "close") whose call has not returned yet.

        The daemon never needs it (a stuck call shows as a ``timeout`` failure); tests use it to
        wait until an abandoned call has returned and freed its slot.
        """
        return frozenset(self._busy)

    def _start(self, key: str, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_T] = loop.create_future()

        def settle(result: _T | None, exc: Exception | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)  # type: ignore[arg-type]

        def run() -> None:
            result: _T | None = None
            error: Exception | None = None
            try:
                result = fn()
            except Exception as exc:
                error = exc
            # RuntimeError: the loop is closed, and nobody waits for this answer any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, error)

        def finished(done: asyncio.Future[_T]) -> None:
            entry = self._busy.get(key)
            if entry is not None and entry[0] is done:
                del self._busy[key]
            if not done.cancelled():
                done.exception()  # retrieved, so an abandoned failure is not reported at GC

        fut.add_done_callback(finished)
        self._busy[key] = (fut, time.monotonic())
        try:
            threading.Thread(target=run, name=f"nvml:{key}", daemon=True).start()
        except RuntimeError as exc:  # "can't start new thread": fail this call, keep the slot free
            fut.set_exception(exc)
        return fut

    async def _run(self, key: str, fn: Callable[[], _T], timeout_s: float) -> _T:
        pending = self._busy.get(key)
        if pending is not None:
            raise _Busy(key, time.monotonic() - pending[1])
        fut = self._start(key, fn)
        async with asyncio.timeout(timeout_s):
            # shield: a timeout abandons the wait, not the call, which keeps its slot in _busy.
            return await asyncio.shield(fut)

    def _failure(self, what: str, exc: Exception, timeout_s: float) -> ProbeFailure:
        if isinstance(exc, _Busy):
            return ProbeFailure(
                "timeout",
                f"{what}: the previous NVML call is still running after {exc.age_s:.1f} s; not starting"
                " another",
            )
        if isinstance(exc, TimeoutError):
            return ProbeFailure("timeout", f"{what}: no answer from NVML within {timeout_s} s")
        if isinstance(exc, GpuLost):
            return ProbeFailure("gpu_lost", str(exc))
        if isinstance(exc, NvmlUnavailable):
            return ProbeFailure("nvml", str(exc))
        return ProbeFailure("nvml", f"{what}: {type(exc).__name__}: {exc}")

    def _mark_unavailable(self, exc: NvmlUnavailable) -> None:
        before, self._unavailable = self._unavailable, exc
        if before is None or before.reason != exc.reason:
            log.warning("%s; no GPU telemetry until it opens (retrying)", exc)
        else:
            log.debug("%s (try %d)", exc, self.attempts)

    def _not_open(self) -> ProbeFailure:
        why = self._unavailable or "NVML not opened yet"
        return ProbeFailure("nvml", str(why))

    async def open(self) -> dict[str, int]:
        if self._gpus is not None:
            return dict(self._gpus)
        self.attempts += 1
        fut = self._opening
        if fut is None:
            fut = self._opening = self._start("open", self._reader.open)
        try:
            async with asyncio.timeout(self._open_timeout_s):
                # shield: a timeout abandons this wait, not the open, which the next call awaits.
                gpus = await asyncio.shield(fut)
        except TimeoutError:
            self._mark_unavailable(
                NvmlUnavailable(
                    "init_timeout",
                    f"NVML did not initialise within {self._open_timeout_s:g} s (nvmlInit and one"
                    " nvmlDeviceGetHandleByIndex per GPU; still waiting for it)",
                )
            )
            return {}
        except NvmlUnavailable as exc:
            self._opening = None
            self._mark_unavailable(exc)
            return {}
        except Exception as exc:
            self._opening = None
            self._mark_unavailable(NvmlUnavailable("init_failed", f"{type(exc).__name__}: {exc}"))
            return {}
        self._opening = None
        self._gpus = dict(gpus)
        self._unavailable = None
        return dict(gpus)

    async def sample(self, uuid: str) -> GpuSample | ProbeFailure:
        if self._gpus is None:
            return self._not_open()
        try:
            return await self._run(uuid, partial(self._reader.sample, uuid), self._call_timeout_s)
        except Exception as exc:
            return self._failure(f"GPU {uuid}", exc, self._call_timeout_s)

    async def cpu_affinity(self, uuid: str) -> frozenset[int] | ProbeFailure | None:
        if self._gpus is None:
            return self._not_open()
        try:
            return await self._run(
                f"{uuid}/affinity", partial(self._reader.cpu_affinity, uuid), self._call_timeout_s
            )
        except Exception as exc:
            return self._failure(f"GPU {uuid} CPU affinity", exc, self._call_timeout_s)

    async def sample_all(self) -> dict[str, GpuSample | ProbeFailure]:
        """Every opened GPU at once; one stuck GPU costs the others nothing."""
        uuids = self.uuids
        results = await asyncio.gather(*(self.sample(uuid) for uuid in uuids))
        return dict(zip(uuids, results, strict=True))

    async def wait_event(self, timeout_ms: int = 1000) -> GpuEvent | ProbeFailure | None:
        if not self._gpus:
            await asyncio.sleep(timeout_ms / 1000)  # keep a caller's event loop from spinning
            return None
        timeout_s = timeout_ms / 1000 + self._call_timeout_s
        try:
            return await self._run("events", partial(self._reader.wait_event, timeout_ms), timeout_s)
        except Exception as exc:
            return self._failure("NVML events", exc, timeout_s)

    async def close(self) -> None:
        try:
            await self._run("close", self._reader.close, self._call_timeout_s)
        except Exception as exc:
            log.warning("NVML close: %s", self._failure("close", exc, self._call_timeout_s))
        self._gpus = None


__all__ = ["ThreadedGpuReader"]
