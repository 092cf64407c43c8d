"""NVML through nvidia-ml-py, behind the narrow ``GpuReader`` that the rest of the daemon sees.

``NvmlReader`` is the real ``GpuReader``; what it returns and raises (``GpuSample``, ``GpuEvent``,
``GpuLost``) and the tables that name them are the GPU vocabulary, ``probes/gpu_readings.py``,
which the daemon's readers of GPU data import instead of this module.

Only ``NvmlReader`` knows the binding's quirks (docs/host-notes.md §1): the new function name first and
the old one on ``FunctionNotFound`` (``TemperatureV``/``Temperature``,
``ClocksEventReasons``/``ClocksThrottleReasons``, ``ComputeRunningProcesses`` and ``_v2``);
``NotSupported`` is ``None``, not an error; no driver, driver not loaded, a pending reboot or no
permission become ``NvmlUnavailable``; a GPU that fell off the bus becomes ``GpuLost``. Units are
converted here (mW -> W) so that the rest of the daemon sees plain numbers.

Each reading is read on its own (docs/gpu.md, "What the daemon reads"): a failing call loses that
reading only (NoPermission on the process list under MIG or in a container still leaves temperature,
clocks and ECC), and is named in ``GpuSample.unread``. Two answers end the sample instead, because they
are the GPU's own fault rather than a missing reading: ``NVML_ERROR_GPU_IS_LOST`` and
``NVML_ERROR_RESET_REQUIRED`` ("GPU requires a reset", nvml.h) both become ``GpuLost``, which the
daemon treats as a GPU that needs a reset.

NVML errors are unhashable (``__eq__`` without ``__hash__``): never put them in sets or use them
as dict keys.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from llmsupervisor.errors import NvmlUnavailable
from llmsupervisor.probes.gpu_readings import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_DRAM_RETIREMENT,
    EVENT_DRAM_RETIREMENT_FAILURE,
    EVENT_FATAL_POISON,
    EVENT_GPU_RECOVERY_ACTION,
    EVENT_GPU_UNAVAILABLE,
    EVENT_KINDS,
    EVENT_NON_FATAL_POISON,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID,
    DriverFacts,
    GpuEvent,
    GpuFabric,
    GpuFacts,
    GpuLost,
    GpuProcess,
    GpuSample,
)

log = logging.getLogger(__name__)

# ABI constants (nvml.h), the same in every binding version; tests check them against pynvml.
NVML_TEMPERATURE_GPU: Final = 0
NVML_CLOCK_SM: Final = 1
NVML_CLOCK_MEM: Final = 2
NVML_MEMORY_ERROR_TYPE_UNCORRECTED: Final = 1
NVML_VOLATILE_ECC: Final = 0
NVML_SUCCESS: Final = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: Final = 1
NVML_TEMPERATURE_THRESHOLD_GPU_MAX: Final = 3
NVML_DEVICE_MIG_ENABLE: Final = 1
NVML_FEATURE_ENABLED: Final = 1
# nvmlDeviceGetFieldValues field ids (nvml.h; nvidia-ml-py 13.615 names them NVML_FI_DEV_*).
FI_GPU_RECOVERY_ACTION: Final = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: the GPU's own verdict
# Time spent throttled since the driver loaded, in ns (NVML_FI_DEV_CLOCKS_EVENT_REASON_*): a
# duration, where the clock-event mask is one instant. These ids are R580's: the NVML change log
# for R575 to R580 "adjusted NVML_FI_DEV_CLOCKS_EVENT_REASON_* ... numbering to resolve overlap
# with NVML_FI_PWR_SMOOTHING_*" (the 12.9 header has them at 251-253, and 269-271 are power
# smoothing fields there). So they are read on R580 and later only, and the detectors check that
# each behaves as a duration counter (detectors/gpu.py ``_counter_share``).
FI_SW_THERMAL_NS: Final = 269
FI_HW_THERMAL_NS: Final = 270
FI_HW_POWER_BRAKE_NS: Final = 271
DURATION_FIELDS_SINCE: Final = 580  # the driver branch that numbers the duration counters so
SAMPLE_FIELDS: Final = (FI_GPU_RECOVERY_ACTION, FI_SW_THERMAL_NS, FI_HW_THERMAL_NS, FI_HW_POWER_BRAKE_NS)
FI_NVLINK_LINK_COUNT: Final = 91  # NVML_FI_DEV_NVLINK_LINK_COUNT

# Every type the detectors act on (detectors/gpu.py); registered where the GPU supports it
# (nvmlDeviceGetSupportedEventTypes), one bit at a time. Clock and P-state changes are left out:
# they fire on every boost step, and the clock-event reasons are sampled every tick anyway.
DEFAULT_EVENT_TYPES: Final = (
    EVENT_SINGLE_BIT_ECC
    | EVENT_DOUBLE_BIT_ECC
    | EVENT_XID
    | 0x200  # single-bit ECC storm
    | EVENT_DRAM_RETIREMENT
    | EVENT_DRAM_RETIREMENT_FAILURE
    | EVENT_NON_FATAL_POISON
    | EVENT_FATAL_POISON
    | EVENT_GPU_UNAVAILABLE
    | EVENT_GPU_RECOVERY_ACTION
)
# After these the GPU's recovery action is read at once and carried on the event. The
# recovery-action event is one of them: its eventData is 0 (nvml.h, nvmlEventData_t: "Stores Xid
# error ... in the event of nvmlEventTypeXidCriticalError, eventData is 0 for any other event"),
# so the new action is field 230's.
_VERDICT_EVENTS: Final = (
    EVENT_XID
    | EVENT_DOUBLE_BIT_ECC
    | EVENT_DRAM_RETIREMENT_FAILURE
    | EVENT_NON_FATAL_POISON
    | EVENT_FATAL_POISON
    | EVENT_GPU_RECOVERY_ACTION
)

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


class EventSetRebuilt(Exception):
    """``nvmlEventSetWait`` failed (other than a timeout) and the event set was rebuilt; the
    message says with which GPUs. The caller sees one failed wait, and waits again."""


class _Never(Exception):
    """Stands in for a binding error class that the given module lacks; never raised."""


@dataclass(slots=True)
class _Device:
    index: int
    uuid: str
    name: str
    handle: Any
    events: int = 0
    # Why this GPU is left out of the event set (a registration failed, or it fell off the bus);
    # None: in the set (or it supports no event type the daemon asks for).
    unwatched: str | None = None
    mig_enabled: bool | None = None
    # The board's temperature thresholds never change: read once (None: not supported).
    thresholds: tuple[int | None, int | None] | None = None
    # False once the fabric call answered NotSupported (no NVSwitch fabric, not Hopper): a board
    # does not grow one, so it is not asked again.
    fabric_supported: bool = True
    pci_bus_id: str | None = None  # nvmlDeviceGetPciInfo's busId, read once at open


# The init PID namespace's inode is fixed (PROC_PID_INIT_INO, include/linux/proc_ns.h): anywhere
# else, the daemon sees PIDs of its own namespace while NVML reports the host's.
PROC_PID_INIT_INO: Final = 0xEFFFFFFC


def in_host_pid_namespace(path: str = "/proc/self/ns/pid") -> bool:
    """Whether this process sees the host's PIDs (the ones NVML reports). True when unknowable."""
    try:
        return os.stat(path).st_ino == PROC_PID_INIT_INO
    except OSError:
        return True


def _handle_key(handle: object) -> object:
    # A real handle is a ctypes pointer, and the copy inside event data is a different Python
    # object for the same device: compare the addresses. Fakes pass plain objects.
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# c_nvmlValue_t's member for each NVML_VALUE_TYPE_* (nvml.h: nvmlValueType_t).
VALUE_MEMBERS: Final[Mapping[int, str]] = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}


class _Readings:
    """One sample's bookkeeping: which readings answered and which failed."""

    def __init__(self) -> None:
        self.answered = 0
        self.failed: list[tuple[str, Exception]] = []


class NvmlReader:
    """The real ``GpuReader`` over the nvidia-ml-py binding (the ``pynvml`` module).

    ``lib`` is the binding module, or anything shaped like it (tests pass
    ``fake_gpu.FakeNvml``, built from the real module's constants, structs and error classes);
    None imports ``pynvml``. ``open`` raises ``NvmlUnavailable`` while NVML cannot be opened
    and tries again at every call (a driver that loads after the daemon: ``GpuMonitor`` paces the
    retries); once open, it returns the GPUs it opened.

    The event set is rebuilt after any error of ``nvmlEventSetWait`` other than a timeout, without
    the GPUs that answer ``GPU_IS_LOST`` (nvml.h: the wait fails so "if a GPU has fallen off the
    bus", and a set with that GPU in it cannot be trusted to deliver the others' events again). A
    GPU whose registration fails (other than ``NOT_SUPPORTED``, which registers nothing and leaves
    the set usable) is left out of the set and the set built again without it (nvml.h, for
    ``UNKNOWN``: "event set is in undefined state and should be freed"); its samples say so
    (``GpuSample.events_unwatched``).
    """

    def __init__(
        self,
        lib: Any = None,
        *,
        event_types: int = DEFAULT_EVENT_TYPES,
        pids_visible: bool | None = None,
    ) -> None:
        self._lib: Any = lib
        self._event_types = event_types
        self._pids_visible = in_host_pid_namespace() if pids_visible is None else pids_visible
        self._devices: dict[str, _Device] = {}
        self._by_handle: dict[object, _Device] = {}
        self._missing: set[str] = set()  # function names this driver lacks; go straight to the old one
        self._initialised = False
        self._event_set: Any = None
        self.event_wait_errors = 0  # nvmlEventSetWait errors other than a timeout
        self._driver: DriverFacts | None = None
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

    def _lost(self, exc: BaseException, uuid: str) -> GpuLost | None:
        if self._is(exc, "NVMLError_GpuIsLost"):
            return GpuLost(uuid, str(exc))
        if self._is(exc, "NVMLError_ResetRequired"):
            return GpuLost(uuid, f"the GPU requires a reset (NVML_ERROR_RESET_REQUIRED) [{exc}]")
        return None

    def _translate(self, exc: Exception, uuid: str) -> Exception:
        return self._lost(exc, uuid) or self._unavailable_from(exc) or exc

    def _read(
        self,
        names: Sequence[str | tuple[str, str]],
        uuid: str,
        *args: Any,
        readings: _Readings | None = None,
        what: str = "",
    ) -> Any:
        """Call the first function of ``names`` that this driver has; None if unsupported.

        A name may be ``(key, function)``: ``key`` is what is remembered as missing, so that a
        failed version-selected call (``nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2)``) does not
        hide the same function's v1 form. With ``readings``, an error other than a lost GPU is
        recorded there and the reading is None: one failing call does not blind the sample.
        """
        for entry in names:
            key, name = entry if isinstance(entry, tuple) else (entry, entry)
            if key in self._missing:
                continue
            fn = getattr(self._lib, name, None)
            if fn is None:  # an older binding than the names we know
                self._missing.add(key)
                continue
            try:
                result = fn(*args)
            except Exception as exc:
                if self._is(exc, "NVMLError_NotSupported"):
                    if readings is not None:
                        readings.answered += 1
                    return None
                # The unversioned process call turns FunctionNotFound into NVMLLibraryMismatchError,
                # which is not an NVMLError.
                if self._is(exc, "NVMLError_FunctionNotFound") or self._is(exc, "NVMLLibraryMismatchError"):
                    self._missing.add(key)
                    continue
                lost = self._lost(exc, uuid)
                if lost is not None:
                    raise lost from exc
                if readings is not None:
                    readings.failed.append((what or name, exc))
                    return None
                translated = self._translate(exc, uuid)
                if translated is exc:
                    raise
                raise translated from exc
            if readings is not None:
                readings.answered += 1
            return result
        return None

    def open(self) -> dict[str, int]:
        if self._initialised:
            return self._indices()
        if self._lib is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable("import_failed", f"cannot import pynvml: {exc}") from exc
            self._lib = pynvml
        lib = self._lib
        try:
            lib.nvmlInit()
        except Exception as exc:
            # Not remembered: the next open tries again (nvml.h: nvmlInit_v2 answers
            # DRIVER_NOT_LOADED until the kernel module is loaded).
            raise self._unavailable_from(exc) or NvmlUnavailable(
                "init_failed", f"nvmlInit: {type(exc).__name__}: {exc}"
            ) from exc
        self._initialised = True
        try:
            count = int(lib.nvmlDeviceGetCount())
        except Exception as exc:
            self.close()  # the nvmlShutdown that pairs with this nvmlInit: the next open starts over
            raise self._unavailable_from(exc) or NvmlUnavailable(
                "init_failed", f"nvmlDeviceGetCount: {type(exc).__name__}: {exc}"
            ) from exc
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
            dev.mig_enabled = self._mig_enabled(dev)
            dev.pci_bus_id = self._pci_bus_id(dev)
            self._devices[uuid] = dev
            self._by_handle[_handle_key(handle)] = dev
        if not self._pids_visible:
            log.info(
                "NVML: this daemon runs in its own PID namespace (a container without hostPID): NVML's"
                " host PIDs cannot be matched, so every process on an engine's GPU counts as the engine's"
            )
        self._build_event_set()
        return self._indices()

    def _at_open(self, dev: _Device, name: str, what: str) -> Any:
        """A reading taken once, at open; None where it fails (said at DEBUG) or is unsupported."""
        try:
            return self._read((name,), dev.uuid, dev.handle)
        except Exception as exc:
            log.debug("NVML: GPU %s: %s: %s", dev.uuid, what, exc)
            return None

    def _mig_enabled(self, dev: _Device) -> bool | None:
        modes = self._at_open(dev, "nvmlDeviceGetMigMode", "MIG mode")
        return None if modes is None else int(modes[0]) == NVML_DEVICE_MIG_ENABLE

    def _pci_bus_id(self, dev: _Device) -> str | None:
        info = self._at_open(dev, "nvmlDeviceGetPciInfo", "PCI info")
        return None if info is None else _text(info.busId) or None

    def _indices(self) -> dict[str, int]:
        return {uuid: dev.index for uuid, dev in self._devices.items()}

    def registered_events(self) -> dict[str, int]:
        """The event types registered per GPU (UUID -> mask of nvmlEventType bits) in the event set
        now: the types asked for that the GPU supports and that registered one by one."""
        return {uuid: dev.events for uuid, dev in self._devices.items()}

    def unwatched_events(self) -> dict[str, str]:
        """The GPUs left out of the event set, UUID -> why."""
        return {uuid: dev.unwatched for uuid, dev in self._devices.items() if dev.unwatched is not None}

    def _build_event_set(self) -> None:
        """A new event set over every GPU not left out, in ``_event_set`` (None when nothing could
        be registered). Called with no set in place (at open, or after ``_free_event_set``).

        One type at a time: a NOT_SUPPORTED registration drops every type in its mask (nvml.h:
        "None of the requested eventTypes are registered", and the set "can still be used"). Any
        other failure (UNKNOWN: "event set is in undefined state and should be freed";
        GPU_IS_LOST) leaves that GPU out: the set is freed and built again without it, at most
        once per GPU.
        """
        lib = self._lib
        for _ in range(len(self._devices) + 1):
            try:
                event_set = lib.nvmlEventSetCreate()
            except Exception as exc:
                log.warning(
                    "NVML: no event set (%s: %s); XID events will not be seen", type(exc).__name__, exc
                )
                return
            broken = self._register_all(event_set)
            if broken is None:
                break
            log.warning(
                "NVML: GPU %d (%s) left out of the event set: %s; its XID events will not be seen, the"
                " other GPUs' will (the set is built again without it)",
                broken.index,
                broken.uuid,
                broken.unwatched,
            )
            with contextlib.suppress(Exception):
                lib.nvmlEventSetFree(event_set)
        else:  # pragma: no cover - every GPU left out ends the loop with an empty, clean set
            return
        for dev in self._devices.values():
            if dev.events:
                log.info(
                    "NVML: GPU %s: events registered: %s",
                    dev.uuid,
                    ",".join(kind for bit, kind in EVENT_KINDS.items() if dev.events & bit),
                )
        if any(dev.events for dev in self._devices.values()):
            self._event_set = event_set
            return
        with_devices = f" on {len(self._devices)} GPU(s)" if self._devices else ""
        log.warning("NVML: no event type could be registered%s; XID events will not be seen", with_devices)
        with contextlib.suppress(Exception):
            lib.nvmlEventSetFree(event_set)

    def _register_all(self, event_set: Any) -> _Device | None:
        """Register every watched GPU's types in ``event_set``; the GPU whose registration failed
        (then left out, with why), or None."""
        lib = self._lib
        for dev in self._devices.values():
            dev.events = 0
        for dev in self._devices.values():
            if dev.unwatched is not None:
                continue
            try:
                supported = int(lib.nvmlDeviceGetSupportedEventTypes(dev.handle))
            except Exception as exc:
                if self._lost(exc, dev.uuid) is not None:
                    dev.unwatched = f"the GPU is lost ({type(exc).__name__})"
                    continue
                supported = 0
            for bit in EVENT_KINDS:
                if not (self._event_types & supported & bit):
                    continue
                try:
                    lib.nvmlDeviceRegisterEvents(dev.handle, bit, event_set)
                except Exception as exc:
                    if self._is(exc, "NVMLError_NotSupported"):
                        log.debug("NVML: GPU %s: event %s not supported: %s", dev.uuid, EVENT_KINDS[bit], exc)
                        continue
                    dev.unwatched = f"registering {EVENT_KINDS[bit]} failed: {type(exc).__name__}: {exc}"
                    return dev
                dev.events |= bit
        return None

    def _free_event_set(self) -> None:
        if self._event_set is not None:
            try:
                self._lib.nvmlEventSetFree(self._event_set)
            except Exception as exc:
                log.debug("NVML: nvmlEventSetFree: %s", exc)
            self._event_set = None

    def _rebuild_event_set(self, error: Exception) -> str:
        """After ``nvmlEventSetWait`` failed with ``error`` (not a timeout): find the GPUs that
        fell off the bus, free the set, and build a new one without them. What was done, in words.
        """
        self.event_wait_errors += 1
        lost = []
        for dev in self._devices.values():
            if not dev.events:
                continue
            try:
                # A GPU that fell off the bus answers GPU_IS_LOST to its device calls (nvml.h lists
                # it for this one too); a cheap call that reads no sensor.
                self._lib.nvmlDeviceGetSupportedEventTypes(dev.handle)
            except Exception as exc:
                if self._lost(exc, dev.uuid) is not None:
                    dev.unwatched = f"the GPU is lost ({type(exc).__name__}, from the event wait)"
                    lost.append(dev)
        self._free_event_set()
        self._build_event_set()
        left_out = ", ".join(f"GPU {dev.index}" for dev in lost) or "no GPU"
        watched = sorted(dev.index for dev in self._devices.values() if dev.events)
        return (
            f"nvmlEventSetWait: {type(error).__name__}: {error}; the event set was rebuilt without"
            f" {left_out}, watching GPU(s) {watched or 'none'}"
        )

    def driver(self) -> DriverFacts:
        """The driver's version and branch, read once (``open`` first). A reading this driver
        lacks (nvmlSystemGetDriverBranch before R560) is None."""
        if self._driver is None:
            version = branch = nvml_version = None
            with contextlib.suppress(Exception):
                version = _text(self._lib.nvmlSystemGetDriverVersion())
            with contextlib.suppress(Exception):
                branch = _text(self._lib.nvmlSystemGetDriverBranch().branch) or None
            with contextlib.suppress(Exception):
                nvml_version = _text(self._lib.nvmlSystemGetNVMLVersion())
            self._driver = DriverFacts(version=version, branch=branch, nvml_version=nvml_version)
        return self._driver

    def _sample_fields(self) -> tuple[int, ...]:
        """Field 230, and the duration counters where the driver gives them these ids (R580+;
        a driver that does not say its version gets field 230 only)."""
        major = self.driver().major
        if major is not None and major >= DURATION_FIELDS_SINCE:
            return SAMPLE_FIELDS
        return (FI_GPU_RECOVERY_ACTION,)

    def _field_values(
        self, dev: _Device, ids: Sequence[int], readings: _Readings | None
    ) -> dict[int, tuple[int, int]]:
        """(per-field return code, value) by field id; {} when the call itself failed."""
        values = self._read(
            ("nvmlDeviceGetFieldValues",),
            dev.uuid,
            dev.handle,
            list(ids),
            readings=readings,
            what="field values",
        )
        found: dict[int, tuple[int, int]] = {}
        for value in values or ():
            ret = int(value.nvmlReturn)
            member = VALUE_MEMBERS.get(int(value.valueType), "ullVal")
            found[int(value.fieldId)] = (ret, int(getattr(value.value, member)) if ret == NVML_SUCCESS else 0)
        return found

    def _fields(self, dev: _Device, readings: _Readings | None) -> dict[int, int]:
        """The sample fields that answered, by id. Each field has its own return code
        (``c_nvmlFieldValue_t.nvmlReturn``): a driver without field 230 still gives the others."""
        values = self._field_values(dev, self._sample_fields(), readings)
        return {field_id: value for field_id, (ret, value) in values.items() if ret == NVML_SUCCESS}

    def _thresholds(self, dev: _Device, readings: _Readings) -> tuple[int | None, int | None]:
        if dev.thresholds is None:
            got: list[int | None] = []
            for threshold in (NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, NVML_TEMPERATURE_THRESHOLD_GPU_MAX):
                value = self._read(
                    ("nvmlDeviceGetTemperatureThreshold",),
                    dev.uuid,
                    dev.handle,
                    threshold,
                    readings=readings,
                    what="temperature thresholds",
                )
                got.append(None if value is None else int(value))
            if readings.failed and readings.failed[-1][0] == "temperature thresholds":
                return got[0], got[1]  # try again next time
            dev.thresholds = (got[0], got[1])
            if got[0] is None:
                # Read once per GPU, so said once (issue 36, L3): nvml.h calls the threshold API
                # "no longer the preferred interface" from Ada on, and support may go.
                log.warning(
                    "NVML: GPU %s reports no slowdown temperature (nvmlDeviceGetTemperatureThreshold"
                    " not supported): THERMAL is judged by the clock-event reasons alone there, and"
                    " the LlmSupervisorGpuHot alert has no threshold series for it",
                    dev.uuid,
                )
        return dev.thresholds

    def _fabric(self, dev: _Device, readings: _Readings) -> GpuFabric | None:
        """The GPU's NVSwitch fabric registration (docs/gpu.md, "The NVSwitch fabric"), every
        sample: it moves from NOT_STARTED to COMPLETED once Fabric Manager runs, and the daemon
        starts the engines that waited for it then. ``nvmlDeviceGetGpuFabricInfoV`` with the
        versioned struct (``c_nvmlGpuFabricInfoV_t``, its ``version`` nvmlGpuFabricInfo_v2) first;
        the unversioned ``nvmlDeviceGetGpuFabricInfo`` (deprecated, nvml.h) where the driver or
        the binding lacks it. Both fill the caller's struct (the binding passes it through:
        ``ctypes.byref``). None: NotSupported (no fabric), or the reading failed (``unread``)."""
        if not dev.fabric_supported:
            return None
        lib = self._lib
        versioned = getattr(lib, "c_nvmlGpuFabricInfoV_t", None) or getattr(
            lib, "c_nvmlGpuFabricInfo_v2_t", None
        )
        v2 = getattr(lib, "nvmlGpuFabricInfo_v2", None)
        calls = (
            ("fabric_v", "nvmlDeviceGetGpuFabricInfoV", versioned, v2),
            ("fabric", "nvmlDeviceGetGpuFabricInfo", getattr(lib, "c_nvmlGpuFabricInfo_t", None), None),
        )
        for key, name, struct, version in calls:
            if struct is None or key in self._missing:
                continue
            info = struct()
            if version is not None:
                info.version = version
            failed = len(readings.failed)
            got = self._read(
                ((key, name),), dev.uuid, dev.handle, ctypes.byref(info), readings=readings, what="fabric"
            )
            if key in self._missing:
                continue  # FunctionNotFound: the older call
            if got is None:
                if len(readings.failed) == failed:
                    dev.fabric_supported = False  # NotSupported: no fabric on this GPU
                return None
            status = int(info.status)
            return GpuFabric(state=int(info.state), status=status, status_name=self._error_name(status))
        return None

    def _error_name(self, code: int) -> str | None:
        """The binding's name for an NVML return code (``Timeout`` for NVML_ERROR_TIMEOUT); None
        for success, or a code the binding does not name."""
        if code == NVML_SUCCESS:
            return None
        try:
            name = type(self._lib.NVMLError(code)).__name__
        except Exception:
            return None
        return name.removeprefix("NVMLError_") if name != "NVMLError" else None

    def _memory(self, dev: _Device, readings: _Readings) -> tuple[int | None, int | None, int | None]:
        """(used, total, reserved). v2 first (nvmlMemory_v2: ``used`` leaves driver-reserved memory
        out, as nvidia-smi does since R510); v1 where the driver lacks the _v2 symbol."""
        version = getattr(self._lib, "nvmlMemory_v2", None)
        if version is not None:
            v2 = self._read(
                (("memory_v2", "nvmlDeviceGetMemoryInfo"),),
                dev.uuid,
                dev.handle,
                version,
                readings=readings,
                what="memory",
            )
            if v2 is not None:
                return int(v2.used), int(v2.total), int(v2.reserved)
            if "memory_v2" not in self._missing:
                return None, None, None  # v2 exists but failed or is not supported here
        v1 = self._read(("nvmlDeviceGetMemoryInfo",), dev.uuid, dev.handle, readings=readings, what="memory")
        return (None, None, None) if v1 is None else (int(v1.used), int(v1.total), None)

    def sample(self, uuid: str) -> GpuSample:
        dev = self._devices[uuid]
        h = dev.handle
        r = _Readings()
        temperature = self._read(
            ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
            uuid,
            h,
            NVML_TEMPERATURE_GPU,
            readings=r,
            what="temperature",
        )
        power_mw = self._read(("nvmlDeviceGetPowerUsage",), uuid, h, readings=r, what="power")
        limit_mw = self._read(("nvmlDeviceGetEnforcedPowerLimit",), uuid, h, readings=r, what="power limit")
        sm_clock = self._read(
            ("nvmlDeviceGetClockInfo",), uuid, h, NVML_CLOCK_SM, readings=r, what="sm clock"
        )
        mem_clock = self._read(
            ("nvmlDeviceGetClockInfo",), uuid, h, NVML_CLOCK_MEM, readings=r, what="memory clock"
        )
        reasons = self._read(
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
            uuid,
            h,
            readings=r,
            what="clock event reasons",
        )
        used, total, reserved = self._memory(dev, r)
        utilization = self._read(("nvmlDeviceGetUtilizationRates",), uuid, h, readings=r, what="utilization")
        ecc = self._read(
            ("nvmlDeviceGetTotalEccErrors",),
            uuid,
            h,
            NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            NVML_VOLATILE_ECC,
            readings=r,
            what="ecc",
        )
        procs = self._read(
            ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"),
            uuid,
            h,
            readings=r,
            what="processes",
        )
        fields = self._fields(dev, r)
        remapped = self._read(("nvmlDeviceGetRemappedRows",), uuid, h, readings=r, what="remapped rows")
        slowdown_c, max_c = self._thresholds(dev, r)
        fabric = self._fabric(dev, r)
        if not r.answered and r.failed:
            # Nothing answered at all: NVML itself is in trouble, not one reading.
            first = r.failed[0][1]
            translated = self._translate(first, uuid)
            raise translated from first
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
            memory_used_bytes=used,
            memory_total_bytes=total,
            memory_reserved_bytes=reserved,
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
            recovery_action=fields.get(FI_GPU_RECOVERY_ACTION),
            remap_pending=None if remapped is None else bool(remapped[2]),
            remap_failed=None if remapped is None else bool(remapped[3]),
            slowdown_temperature_c=slowdown_c,
            max_operating_temperature_c=max_c,
            sw_thermal_ns=fields.get(FI_SW_THERMAL_NS),
            hw_thermal_ns=fields.get(FI_HW_THERMAL_NS),
            power_brake_ns=fields.get(FI_HW_POWER_BRAKE_NS),
            mig_enabled=dev.mig_enabled,
            pids_visible=self._pids_visible,
            unread=tuple(f"{what}: {type(exc).__name__}" for what, exc in r.failed),
            events_unwatched=dev.unwatched,
            fabric=fabric,
            pci_bus_id=dev.pci_bus_id,
        )

    def facts(self, uuid: str) -> GpuFacts:
        """What ``doctor`` reports of one GPU (``GpuFacts``): settings and link health, each read
        on its own; NotSupported or a function this driver lacks is None."""
        dev = self._devices[uuid]
        r = _Readings()

        def read(name: str, *args: Any) -> Any:
            return self._read(
                (name,), uuid, dev.handle, *args, readings=r, what=name.removeprefix("nvmlDevice")
            )

        persistence = read("nvmlDeviceGetPersistenceMode")
        ecc = read("nvmlDeviceGetEccMode")
        compute = read("nvmlDeviceGetComputeMode")
        replays = read("nvmlDeviceGetPcieReplayCounter")
        fields = self._field_values(dev, (FI_GPU_RECOVERY_ACTION, FI_NVLINK_LINK_COUNT), r)
        action_ret = fields.get(FI_GPU_RECOVERY_ACTION, (None, 0))[0]
        active, links = self._nvlinks(dev, fields.get(FI_NVLINK_LINK_COUNT))
        return GpuFacts(
            uuid=uuid,
            persistence_mode=None if persistence is None else int(persistence) == NVML_FEATURE_ENABLED,
            ecc_enabled=None if ecc is None else int(ecc[0]) == NVML_FEATURE_ENABLED,
            ecc_pending=None if ecc is None else int(ecc[1]) == NVML_FEATURE_ENABLED,
            compute_mode=None if compute is None else int(compute),
            pcie_replay_count=None if replays is None else int(replays),
            nvlinks_active=active,
            nvlinks=links,
            recovery_action_supported=None if action_ret is None else action_ret == NVML_SUCCESS,
            unread=tuple(f"{what}: {type(exc).__name__}" for what, exc in r.failed),
        )

    def _nvlinks(self, dev: _Device, count: tuple[int, int] | None) -> tuple[int | None, int | None]:
        """(active, links) from nvmlDeviceGetNvLinkState: over the link count field where it
        answers, else link by link until NVML refuses the link (INVALID_ARGUMENT past the last,
        NOT_SUPPORTED on a board without NVLink). (None, None): no NVLink."""
        known = count is not None and count[0] == NVML_SUCCESS
        limit = (
            count[1] if known and count is not None else int(getattr(self._lib, "NVML_NVLINK_MAX_LINKS", 18))
        )
        states: list[int] = []
        for link in range(limit):
            try:
                states.append(int(self._lib.nvmlDeviceGetNvLinkState(dev.handle, link)))
            except Exception:
                if known:
                    continue  # a link the count names that does not answer: not active
                break
        if not states and not (known and limit):
            return None, None
        return sum(1 for state in states if state), (limit if known else len(states))

    def cpu_affinity(self, uuid: str) -> frozenset[int] | None:
        # A bitmask in unsigned longs (64 bits here), CPU n at bit n % 64 of word n // 64.
        words = (max(os.cpu_count() or 1, 1) + 63) // 64
        mask = self._read(("nvmlDeviceGetCpuAffinity",), uuid, self._devices[uuid].handle, words)
        if mask is None:
            return None
        cpus = frozenset(
            w * 64 + bit for w, word in enumerate(mask) for bit in range(64) if int(word) >> bit & 1
        )
        return cpus or None

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
                # Waiting on the same set again would fail the same way, and every other GPU's
                # XIDs would be lost with it (docs/gpu.md, "The event set after a lost GPU").
                raise EventSetRebuilt(self._rebuild_event_set(exc)) from exc
        event_type = int(data.eventType)
        dev = self._by_handle.get(_handle_key(data.device))
        if dev is None:
            log.warning(
                "NVML: event %s for a device this reader does not know; kept without a GPU",
                EVENT_KINDS.get(event_type, hex(event_type)),
            )
        action: int | None = None
        if event_type & _VERDICT_EVENTS and dev is not None:
            # The GPU's verdict on this fault, read now (docs/gpu.md): NONE restarts the engine;
            # anything else needs a reset first.
            with contextlib.suppress(Exception):
                action = self._fields(dev, None).get(FI_GPU_RECOVERY_ACTION)
        return GpuEvent(
            index=None if dev is None else dev.index,
            uuid=None if dev is None else dev.uuid,
            kind=EVENT_KINDS.get(event_type, f"event_0x{event_type:x}"),
            xid=int(data.eventData) if event_type & EVENT_XID else None,
            at_s=time.monotonic(),
            recovery_action=action,
        )

    def close(self) -> None:
        # A waiter holds the lock for at most its timeout (1 s in practice); if it is stuck in the
        # driver, leak the set rather than free it under the waiter.
        if self._event_lock.acquire(timeout=5.0):
            try:
                self._free_event_set()
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


__all__ = [
    "DEFAULT_EVENT_TYPES",
    "VALUE_MEMBERS",
    "EventSetRebuilt",
    "NvmlReader",
    "in_host_pid_namespace",
]
