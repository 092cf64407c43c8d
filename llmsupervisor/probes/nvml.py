"""NVML through nvidia-ml-py, behind the narrow ``GpuReader`` that the rest of the daemon sees.

::

    GpuReader (Protocol; blocking calls)          ThreadedGpuReader (async, for the loop)
     ├── NvmlReader(lib=None)   the real binding ◄── each call in a daemon thread under a timeout;
     └── FakeGpu                scripted              one call per GPU at a time; failures become
                                                      ProbeFailure, NVML missing is reported once

Only ``NvmlReader`` knows the binding's quirks (docs/host-notes.md §1): the new function name first and
the old one on ``FunctionNotFound`` (``TemperatureV``/``Temperature``,
``ClocksEventReasons``/``ClocksThrottleReasons``, ``ComputeRunningProcesses`` and ``_v2``);
``NotSupported`` is ``None``, not an error; no driver, driver not loaded, a pending reboot or no
permission become ``NvmlUnavailable``; a GPU that fell off the bus becomes ``GpuLost``. Units are
converted here (mW -> W) so that the rest of the daemon sees plain numbers.

NVML errors are unhashable (``__eq__`` without ``__hash__``): never put them in sets or use them
as dict keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol, TypeVar

from llmsupervisor.errors import NvmlUnavailable, SupervisorError
from llmsupervisor.probes import ProbeFailure

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# ABI constants (nvml.h), the same in every binding version; tests check them against pynvml.
NVML_TEMPERATURE_GPU: Final = 0
NVML_CLOCK_SM: Final = 1
NVML_CLOCK_MEM: Final = 2
NVML_MEMORY_ERROR_TYPE_UNCORRECTED: Final = 1
NVML_VOLATILE_ECC: Final = 0

# Clock-event (throttle) reason bits; old and new constant names share these values.
CLOCK_EVENT_REASONS: Final[Mapping[int, str]] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",  # routine at full load: record, not a fault
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
    0x200: "board_limit",  # old header names only
    0x400: "reliability",
}

# Event type bits (nvmlEventType*) and the kind each becomes in a GpuEvent.
EVENT_SINGLE_BIT_ECC: Final = 0x1
EVENT_DOUBLE_BIT_ECC: Final = 0x2
EVENT_XID: Final = 0x8
EVENT_GPU_UNAVAILABLE: Final = 0x4000
EVENT_KINDS: Final[Mapping[int, str]] = {
    EVENT_SINGLE_BIT_ECC: "single_bit_ecc",
    EVENT_DOUBLE_BIT_ECC: "double_bit_ecc",
    0x4: "pstate",
    EVENT_XID: "xid",
    0x10: "clock",
    0x80: "power_source_change",
    0x100: "mig_config_change",
    0x200: "single_bit_ecc_storm",
    0x400: "dram_retirement",
    0x800: "dram_retirement_failure",
    0x1000: "non_fatal_poison",
    0x2000: "fatal_poison",
    EVENT_GPU_UNAVAILABLE: "gpu_unavailable",
    0x8000: "gpu_recovery_action",
}
# XIDs carry the fault detail; double-bit ECC and "GPU unavailable" matter without one.
# Single-bit ECC is corrected by the hardware and only noise here.
DEFAULT_EVENT_TYPES: Final = EVENT_XID | EVENT_DOUBLE_BIT_ECC | EVENT_GPU_UNAVAILABLE
XID_UNKNOWN: Final = 999  # what NVML reports when it cannot name the XID

# Binding error class name -> (NvmlUnavailable.reason, what it means for the operator).
_UNAVAILABLE: Final[Mapping[str, tuple[str, str]]] = {
    "NVMLError_LibraryNotFound": ("library_not_found", "no NVIDIA driver here (libnvidia-ml.so.1 not found)"),
    "NVMLError_DriverNotLoaded": ("driver_not_loaded", "the NVIDIA kernel module is not loaded"),
    "NVMLError_LibRmVersionMismatch": (
        "reboot_pending",
        "the driver library and kernel module differ: reboot pending after a driver upgrade",
    ),
    "NVMLError_NoPermission": ("no_permission", "no permission on the NVIDIA device nodes"),
}


class GpuLost(SupervisorError):
    """NVML says the GPU is gone from the bus (``NVML_ERROR_GPU_IS_LOST``, usually after XID 79)."""

    def __init__(self, uuid: str, detail: str) -> None:
        super().__init__(f"GPU {uuid} is lost: {detail}")
        self.uuid = uuid
        self.detail = detail


def decode_clock_event_reasons(mask: int) -> frozenset[str]:
    """Names of the clock-event reason bits set in ``mask``; unknown bits are left out."""
    return frozenset(name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit)


class GpuProcess(NamedTuple):
    pid: int  # a host PID: bare metal, no PID namespace in between
    used_bytes: int | None  # None where the driver cannot say (WDDM, some MIG setups)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSample:
    """One GPU at one moment. ``None`` means the board does not support that reading."""

    index: int  # NVML index, PCI bus order
    uuid: str
    name: str
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None  # enforced limit
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None
    clock_event_reasons: int | None  # raw mask; see clock_event_reason_names
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_gpu_pct: int | None
    ecc_uncorrected_volatile: int | None  # since the last driver reload; None = no ECC on this board
    processes: tuple[GpuProcess, ...] | None  # compute processes; None = cannot be listed

    @property
    def clock_event_reason_names(self) -> frozenset[str]:
        return (
            frozenset()
            if self.clock_event_reasons is None
            else decode_clock_event_reasons(self.clock_event_reasons)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuEvent:
    """One NVML event. ``index``/``uuid`` are None when the event's device could not be matched."""

    index: int | None
    uuid: str | None
    kind: str  # EVENT_KINDS value, or "event_0x..." for a type this table lacks
    xid: int | None  # for kind "xid" only; XID_UNKNOWN (999) when NVML cannot name it


class GpuReader(Protocol):
    """What the daemon uses of NVML. Every call blocks; run them through ``ThreadedGpuReader``."""

    def open(self) -> list[str]:
        """Initialise and return the GPU UUIDs in PCI order; raises ``NvmlUnavailable``."""
        ...

    def sample(self, uuid: str) -> GpuSample:
        """Read one GPU; raises ``GpuLost`` when it fell off the bus."""
        ...

    def wait_event(self, timeout_ms: int) -> GpuEvent | None:
        """Block up to ``timeout_ms`` for an event; None when nothing happened."""
        ...

    def close(self) -> None: ...


class _Never(Exception):
    """Stands in for a binding error class that the given module lacks; never raised."""


@dataclass(slots=True)
class _Device:
    index: int
    uuid: str
    name: str
    handle: Any
    events: int = 0


def _handle_key(handle: object) -> object:
    # A real handle is a ctypes pointer, and the copy inside event data is a different Python
    # object for the same device: compare the addresses. Fakes pass plain objects.
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """The real ``GpuReader`` over the nvidia-ml-py binding (the ``pynvml`` module).

    ``lib`` is the binding module, or anything shaped like it (tests pass a ``SimpleNamespace``
    with the real module's error classes and stubbed functions); None imports ``pynvml``.
    ``open`` remembers an ``NvmlUnavailable`` and raises the same one again without retrying;
    build a new reader to try again (after a reboot, say).
    """

    def __init__(self, lib: Any = None, *, event_types: int = DEFAULT_EVENT_TYPES) -> None:
        self._lib: Any = lib
        self._event_types = event_types
        self._devices: dict[str, _Device] = {}
        self._by_handle: dict[object, _Device] = {}
        self._missing: set[str] = set()  # function names this driver lacks; go straight to the old one
        self._initialised = False
        self._unavailable: NvmlUnavailable | None = None
        self._event_set: Any = None
        # Held for the whole of nvmlEventSetWait, so close() never frees the set under a waiter.
        self._event_lock = threading.Lock()

    def _cls(self, name: str) -> type[BaseException]:
        cls = getattr(self._lib, name, None)
        return cls if isinstance(cls, type) and issubclass(cls, BaseException) else _Never

    def _is(self, exc: BaseException, name: str) -> bool:
        return isinstance(exc, self._cls(name))

    def _unavailable_from(self, exc: BaseException) -> NvmlUnavailable | None:
        for cls_name, (reason, meaning) in _UNAVAILABLE.items():
            if self._is(exc, cls_name):
                return NvmlUnavailable(reason, f"{meaning} [{exc}]")
        return None

    def _translate(self, exc: Exception, uuid: str) -> Exception:
        if self._is(exc, "NVMLError_GpuIsLost"):
            return GpuLost(uuid, str(exc))
        return self._unavailable_from(exc) or exc

    def _read(self, names: Sequence[str], uuid: str, *args: Any) -> Any:
        """Call the first function of ``names`` that this driver has; None if unsupported."""
        for name in names:
            if name in self._missing:
                continue
            fn = getattr(self._lib, name, None)
            if fn is None:  # an older binding than the names we know
                self._missing.add(name)
                continue
            try:
                return fn(*args)
            except Exception as exc:
                if self._is(exc, "NVMLError_NotSupported"):
                    return None
                # The unversioned process call turns FunctionNotFound into NVMLLibraryMismatchError,
                # which is not an NVMLError.
                if self._is(exc, "NVMLError_FunctionNotFound") or self._is(exc, "NVMLLibraryMismatchError"):
                    self._missing.add(name)
                    continue
                translated = self._translate(exc, uuid)
                if translated is exc:
                    raise
                raise translated from exc
        return None

    def open(self) -> list[str]:
        if self._unavailable is not None:
            raise self._unavailable
        if self._initialised:
            return list(self._devices)
        if self._lib is None:
            try:
                import pynvml
            except ImportError as exc:
                self._unavailable = NvmlUnavailable("import_failed", f"cannot import pynvml: {exc}")
                raise self._unavailable from exc
            self._lib = pynvml
        lib = self._lib
        try:
            lib.nvmlInit()
        except Exception as exc:
            self._unavailable = self._unavailable_from(exc) or NvmlUnavailable(
                "init_failed", f"nvmlInit: {type(exc).__name__}: {exc}"
            )
            raise self._unavailable from exc
        self._initialised = True
        try:
            count = int(lib.nvmlDeviceGetCount())
        except Exception as exc:
            self.close()
            self._unavailable = self._unavailable_from(exc) or NvmlUnavailable(
                "init_failed", f"nvmlDeviceGetCount: {type(exc).__name__}: {exc}"
            )
            raise self._unavailable from exc
        for index in range(count):
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(lib.nvmlDeviceGetUUID(handle))
                name = _text(lib.nvmlDeviceGetName(handle))
            except Exception as exc:
                # Typically GpuIsLost: a GPU we cannot even name cannot serve an engine either.
                log.warning(
                    "NVML: GPU index %d cannot be read, left out: %s: %s", index, type(exc).__name__, exc
                )
                continue
            dev = _Device(index=index, uuid=uuid, name=name, handle=handle)
            self._devices[uuid] = dev
            self._by_handle[_handle_key(handle)] = dev
        self._register_events()
        return list(self._devices)

    def _register_events(self) -> None:
        lib = self._lib
        try:
            event_set = lib.nvmlEventSetCreate()
        except Exception as exc:
            log.warning("NVML: no event set (%s: %s); XID events will not be seen", type(exc).__name__, exc)
            return
        registered = 0
        for dev in self._devices.values():
            try:
                supported = int(lib.nvmlDeviceGetSupportedEventTypes(dev.handle))
            except Exception:
                supported = 0
            # One type at a time: a NotSupported registration drops every type in its mask.
            for bit in EVENT_KINDS:
                if not (self._event_types & supported & bit):
                    continue
                try:
                    lib.nvmlDeviceRegisterEvents(dev.handle, bit, event_set)
                except Exception as exc:
                    log.debug("NVML: GPU %s: event %s not registered: %s", dev.uuid, EVENT_KINDS[bit], exc)
                    continue
                dev.events |= bit
                registered += 1
        if registered:
            self._event_set = event_set
            return
        with_devices = f" on {len(self._devices)} GPU(s)" if self._devices else ""
        log.warning("NVML: no event type could be registered%s; XID events will not be seen", with_devices)
        with contextlib.suppress(Exception):
            lib.nvmlEventSetFree(event_set)

    def sample(self, uuid: str) -> GpuSample:
        dev = self._devices[uuid]
        h = dev.handle
        temperature = self._read(
            ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), uuid, h, NVML_TEMPERATURE_GPU
        )
        power_mw = self._read(("nvmlDeviceGetPowerUsage",), uuid, h)
        limit_mw = self._read(("nvmlDeviceGetEnforcedPowerLimit",), uuid, h)
        sm_clock = self._read(("nvmlDeviceGetClockInfo",), uuid, h, NVML_CLOCK_SM)
        mem_clock = self._read(("nvmlDeviceGetClockInfo",), uuid, h, NVML_CLOCK_MEM)
        reasons = self._read(
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), uuid, h
        )
        memory = self._read(("nvmlDeviceGetMemoryInfo",), uuid, h)
        utilization = self._read(("nvmlDeviceGetUtilizationRates",), uuid, h)
        ecc = self._read(
            ("nvmlDeviceGetTotalEccErrors",), uuid, h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC
        )
        procs = self._read(
            ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"), uuid, h
        )
        return GpuSample(
            index=dev.index,
            uuid=uuid,
            name=dev.name,
            temperature_c=None if temperature is None else int(temperature),
            power_w=None if power_mw is None else power_mw / 1000.0,
            power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
            sm_clock_mhz=None if sm_clock is None else int(sm_clock),
            mem_clock_mhz=None if mem_clock is None else int(mem_clock),
            clock_event_reasons=None if reasons is None else int(reasons),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization_gpu_pct=None if utilization is None else int(utilization.gpu),
            ecc_uncorrected_volatile=None if ecc is None else int(ecc),
            processes=None
            if procs is None
            else tuple(
                GpuProcess(
                    int(p.pid),
                    None if getattr(p, "usedGpuMemory", None) is None else int(p.usedGpuMemory),
                )
                for p in procs
            ),
        )

    def wait_event(self, timeout_ms: int) -> GpuEvent | None:
        with self._event_lock:
            if self._event_set is None:
                # Nothing registered: behave like a wait that saw nothing, so a caller's loop
                # paces itself instead of spinning.
                time.sleep(timeout_ms / 1000)
                return None
            try:
                data = self._lib.nvmlEventSetWait(self._event_set, timeout_ms)
            except Exception as exc:
                if self._is(exc, "NVMLError_Timeout"):
                    return None
                translated = self._translate(exc, "(event set)")
                if translated is exc:
                    raise
                raise translated from exc
        event_type = int(data.eventType)
        dev = self._by_handle.get(_handle_key(data.device))
        return GpuEvent(
            index=None if dev is None else dev.index,
            uuid=None if dev is None else dev.uuid,
            kind=EVENT_KINDS.get(event_type, f"event_0x{event_type:x}"),
            xid=int(data.eventData) if event_type & EVENT_XID else None,
        )

    def close(self) -> None:
        # A waiter holds the lock for at most its timeout (1 s in practice); if it is stuck in the
        # driver, leak the set rather than free it under the waiter.
        if self._event_lock.acquire(timeout=5.0):
            try:
                if self._event_set is not None:
                    try:
                        self._lib.nvmlEventSetFree(self._event_set)
                    except Exception as exc:
                        log.debug("NVML: nvmlEventSetFree: %s", exc)
                    self._event_set = None
            finally:
                self._event_lock.release()
        if self._initialised:
            self._initialised = False
            try:
                self._lib.nvmlShutdown()  # pairs with the one nvmlInit (NVML counts references)
            except Exception as exc:
                log.debug("NVML: nvmlShutdown: %s", exc)
        self._devices.clear()
        self._by_handle.clear()


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

    ``open`` returns the UUIDs, or ``[]`` when NVML is unavailable; the reason is logged once, at
    WARNING, and kept in ``unavailable`` for STATUS=.
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
        self._uuids: list[str] | None = None
        self._unavailable: NvmlUnavailable | None = None

    @property
    def unavailable(self) -> NvmlUnavailable | None:
        return self._unavailable

    @property
    def uuids(self) -> list[str]:
        return list(self._uuids or [])

    def outstanding(self) -> frozenset[str]:
        """Keys (GPU UUIDs, "events", "open", "close") whose call has not returned yet."""
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
        if self._unavailable is None:
            self._unavailable = exc
            log.warning("%s; engines run without GPU telemetry", exc)

    async def open(self) -> list[str]:
        if self._unavailable is not None:
            return []
        if self._uuids is not None:
            return list(self._uuids)
        try:
            uuids = await self._run("open", self._reader.open, self._open_timeout_s)
        except NvmlUnavailable as exc:
            self._mark_unavailable(exc)
            return []
        except (TimeoutError, _Busy):
            self._mark_unavailable(
                NvmlUnavailable("init_timeout", f"NVML did not initialise within {self._open_timeout_s} s")
            )
            return []
        except Exception as exc:
            self._mark_unavailable(NvmlUnavailable("init_failed", f"{type(exc).__name__}: {exc}"))
            return []
        self._uuids = list(uuids)
        return list(uuids)

    async def sample(self, uuid: str) -> GpuSample | ProbeFailure:
        if self._unavailable is not None:
            return ProbeFailure("nvml", str(self._unavailable))
        try:
            return await self._run(uuid, partial(self._reader.sample, uuid), self._call_timeout_s)
        except Exception as exc:
            return self._failure(f"GPU {uuid}", exc, self._call_timeout_s)

    async def sample_all(self) -> dict[str, GpuSample | ProbeFailure]:
        """Every opened GPU at once; one stuck GPU costs the others nothing."""
        uuids = self.uuids
        results = await asyncio.gather(*(self.sample(uuid) for uuid in uuids))
        return dict(zip(uuids, results, strict=True))

    async def wait_event(self, timeout_ms: int = 1000) -> GpuEvent | ProbeFailure | None:
        if self._unavailable is not None or not self._uuids:
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
        self._uuids = None


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
    ) -> None:
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

    def open(self) -> list[str]:
        self.calls["open"] += 1
        if self._unavailable is not None:
            raise self._unavailable
        self.opened = True
        with self._cond:
            return list(self._scripts)

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
    """A ``GpuReader`` driven by a JSON file that a test (or a demo) rewrites while the daemon
    runs: ``llm-supervisor run --fake-gpu FILE``. Never for production; it stands in for NVML
    on machines without a GPU, so that the daemon's GPU paths can be exercised end to end.

    The file, re-read on every call::

        {"gpus": [{"index": 0, "temperature_c": 91, "clock_event_reasons": ["hw_thermal"],
                   "lost": false, ...any GpuSample field...}],
         "events": [{"id": 1, "gpu": 0, "kind": "xid", "xid": 48}]}

    Missing fields take ``nominal_sample`` values; ``clock_event_reasons`` may be a list of
    names; ``"lost": true`` makes the GPU raise ``GpuLost``; each event is delivered once (by id).
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

    def open(self) -> list[str]:
        return [f"GPU-fake-{int(g.get('index', i)):04d}" for i, g in enumerate(self._gpus())]

    def sample(self, uuid: str) -> GpuSample:
        for i, raw in enumerate(self._gpus()):
            index = int(raw.get("index", i))
            if f"GPU-fake-{index:04d}" != uuid:
                continue
            fields = {k: v for k, v in raw.items() if k not in ("index", "lost")}
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
                    )
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._closed.wait(min(0.2, left))
        return None

    def close(self) -> None:
        self._closed.set()


__all__ = [
    "CLOCK_EVENT_REASONS",
    "DEFAULT_EVENT_TYPES",
    "EVENT_KINDS",
    "XID_UNKNOWN",
    "FakeGpu",
    "FileGpu",
    "GpuEvent",
    "GpuLost",
    "GpuProcess",
    "GpuReader",
    "GpuSample",
    "NvmlReader",
    "ThreadedGpuReader",
    "decode_clock_event_reasons",
    "nominal_sample",
]
