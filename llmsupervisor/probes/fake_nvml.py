"""A fake ``pynvml`` module for tests and demos: never used against a real GPU.

It sits in place of the ``pynvml`` module itself, with the real binding's constants, structs
(``c_nvmlMemory_v2_t``, ``c_nvmlFieldValue_t``) and ``NVMLError`` subclasses, so that the real
reader (``probes/nvml.NvmlReader``) runs over it. ``FakeNvml`` is scripted per GPU in-process;
``FileNvml`` reads the JSON file that ``llm-supervisor run --fake-gpu FILE`` watches. The
``GpuReader``-level doubles (``FakeGpu``, ``FileGpu``) are in probes/fake_gpu.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from llmsupervisor.probes.cpus import parse_cpu_list
from llmsupervisor.probes.gpu_readings import CLOCK_EVENT_REASONS, EVENT_KINDS, FABRIC_STATES

GIB = 1024**3
_T = TypeVar("_T")
MIB = 1024**2


@dataclass(slots=True)
class FakeDevice:
    """One scripted GPU as NVML would report it. Change the attributes while a reader runs.

    Defaults are an idle H100 SXM as ``nvidia-smi -q`` shows one (thresholds: slowdown 90 C,
    max operating 87 C; about 0.5 GiB reserved by the driver and firmware); the exact figures
    are stand-ins, not a recording.
    """

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    temperature_c: int = 40
    power_mw: int = 90_000
    power_limit_mw: int = 700_000
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 2619
    clock_event_reasons: int = 0x1  # gpu_idle
    memory_total: int = 80 * GIB
    memory_reserved: int = 512 * MIB
    memory_used: int = 0  # v2's used: without the reserved part
    utilization_gpu_pct: int = 0
    ecc_uncorrected_volatile: int | None = 0  # None: a board without ECC (NotSupported)
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # host PIDs, bytes
    # nvmlDeviceGetFieldValues answers, by field id: (per-field return code, value). A field that
    # is absent answers NVML_ERROR_NOT_SUPPORTED in its own entry, as an older driver does.
    fields: dict[int, tuple[int, int]] = field(
        default_factory=lambda: {230: (0, 0), 269: (0, 0), 270: (0, 0), 271: (0, 0)}
    )
    thresholds: dict[int, int] = field(default_factory=lambda: {0: 92, 1: 90, 2: 95, 3: 87})
    mig_mode: tuple[int, int] | None = (0, 0)  # (current, pending); None: NotSupported
    pci_bus_id: str = ""  # nvmlDeviceGetPciInfo's busId; "" = 00000000:<0x18 + index>:00.0
    margin_temperature_c: int | None = 45  # nvmlDeviceGetMarginTemperature; None: NotSupported
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corr, unc, pending, failure
    cpus: tuple[int, ...] = ()  # nvmlDeviceGetCpuAffinity; () = NotSupported
    # What doctor reads (NvmlReader.facts); None answers NotSupported.
    persistence_mode: int | None = 1  # NVML_FEATURE_ENABLED
    ecc_mode: tuple[int, int] | None = (1, 1)  # (current, pending)
    compute_mode: int | None = 0  # NVML_COMPUTEMODE_DEFAULT
    pcie_replay_count: int | None = 0
    # nvmlDeviceGetNvLinkState per link (1 active); None: no NVLink (a PCIe board). An SXM H100
    # has 18 links.
    nvlink_states: tuple[int, ...] | None = None
    # nvmlDeviceGetGpuFabricInfoV: (state, status) of the GPU's registration with the NVSwitch
    # fabric (NVML_GPU_FABRIC_STATE_*, and the nvmlReturn_t it ended with); None: the call answers
    # NOT_SUPPORTED, as on a board outside an NVSwitch fabric. An HGX H100 whose Fabric Manager
    # runs reads (3, 0): COMPLETED, NVML_SUCCESS.
    fabric: tuple[int, int] | None = None
    supported_events: int = 0x1 | 0x2 | 0x8 | 0x200 | 0x400 | 0x800 | 0x1000 | 0x2000 | 0x4000 | 0x8000
    # Function name -> NVML return code it fails with (pynvml.NVML_ERROR_*), e.g.
    # {"nvmlDeviceGetComputeRunningProcesses": NVML_ERROR_NO_PERMISSION}.
    errors: dict[str, int] = field(default_factory=dict)
    lost: bool = False  # every call: NVML_ERROR_GPU_IS_LOST
    unreadable: bool = False  # at open: handle lookup fails (the index is left out)


class _EventSet:
    """One ``nvmlEventSet_t``: the (GPU index, event bit) pairs registered in it."""

    def __init__(self) -> None:
        self.registered: set[tuple[int, int]] = set()
        self.freed = False


class FakeNvml:
    """A stand-in for the ``pynvml`` module, for ``NvmlReader(lib=FakeNvml(...))``.

    Everything but the functions is the real module's: constants, structs (``c_nvmlMemory_v2_t``,
    ``c_nvmlFieldValue_t``, ``c_nvmlEventData_t``, ``c_nvmlProcessInfo_v3_t``) and the
    ``NVMLError`` subclasses, raised the way the binding raises them (``NVMLError(code)`` picks the
    subclass). The functions follow nvidia-ml-py 13.615's ``pynvml.py`` and NVML's API reference
    (https://docs.nvidia.com/deploy/nvml-api/), per behaviour:

    - ``nvmlDeviceGetMemoryInfo(h, version=None)``: no version is the v1 struct, whose ``used`` is
      total - free and so includes driver-reserved memory; ``nvmlMemory_v2`` selects the
      ``_v2`` symbol, with ``reserved`` on its own (nvidia-smi R510+ shows v2's used; rust-nvml#57).
      ``missing`` holding ``"nvmlDeviceGetMemoryInfo_v2"`` makes that symbol absent
      (``NVML_ERROR_FUNCTION_NOT_FOUND``, as ``_nvmlGetFunctionPointer`` raises on an old driver).
    - ``nvmlDeviceGetFieldValues``: the call succeeds and each entry carries its own
      ``nvmlReturn`` (nvml.h, nvmlFieldValue_t: "Return code for retrieving this value").
    - ``nvmlEventSetWait(set, ms)``: raises ``NVMLError_Timeout`` when nothing arrives in time;
      only the types registered in that set are delivered; the event's ``device`` is a new pointer
      object to the same handle, as in the C struct copy. It raises ``NVMLError_GpuIsLost`` while a
      GPU registered in the set is lost (nvml.h, nvmlEventSetWait_v2: GPU_IS_LOST "if a GPU has
      fallen off the bus or is otherwise inaccessible"; whether a set recovers afterwards is not
      documented, and this fake keeps failing, the case the reader must survive).
    - ``nvmlDeviceRegisterEvents``: NOT_SUPPORTED when a requested type is not supported, and none
      of the mask registered; a device's ``errors`` entry for it (UNKNOWN, say) fails it as given.
    - ``nvmlInit`` raises ``init_error`` (a code) while it is set: DRIVER_NOT_LOADED until a test
      clears it plays a driver that loads after the daemon.
    - ``hang(index)``: every call on that GPU blocks until ``release(index)`` (a GPU on its way off
      the bus, docs/host-notes.md §1.8; NVML documents no such state, the daemon must survive it).
    - process lists carry host PIDs (NVIDIA/nvidia-docker#1483), whatever the caller's namespace.
    - ``nvmlDeviceGetGpuFabricInfoV(h, byref(info))`` fills the caller's struct, as the C call does
      through the binding (which passes the argument on untouched): a struct passed by value is a
      ``TypeError`` here (in C the call would write elsewhere). Its ``version`` must be
      ``nvmlGpuFabricInfo_v2`` or later (``ARGUMENT_VERSION_MISMATCH`` otherwise); the unversioned,
      deprecated ``nvmlDeviceGetGpuFabricInfo`` fills ``c_nvmlGpuFabricInfo_t``. A device whose
      ``fabric`` is None answers NOT_SUPPORTED ("If device doesn't support gpu fabric", nvml.h);
      ``status`` is set as given whatever the state (nvml.h: it "must be checked only if state
      returns complete").
    - a function name in ``missing`` raises ``NVML_ERROR_FUNCTION_NOT_FOUND`` (an older driver).
    """

    def __init__(
        self,
        devices: Iterable[FakeDevice] = (),
        *,
        missing: Iterable[str] = (),
        init_error: int | None = None,
    ) -> None:
        import pynvml

        self._pynvml = pynvml
        self.devices: list[FakeDevice] = list(devices)
        self.missing = set(missing)
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        self.registered: list[tuple[int, int]] = []  # (index, event bit), in the sets not freed
        self.sets: list[_EventSet] = []
        self.dropped: list[tuple[int, int, int]] = []  # events of unregistered types
        self._events: deque[tuple[int, int, int]] = deque()  # (index, type, data)
        self._cond = threading.Condition()
        self.initialised = 0
        self._hangs: dict[int, threading.Event] = {}
        self.max_hang_s = 600.0
        # nvmlSystemGet*: the driver seen on the lent H100 (docs/launch.md) and its NVML.
        self.driver_version = "580.159.04"
        self.nvml_version = "13.580.159.04"
        self.cuda_driver_version = 13000

    def __getattr__(self, name: str) -> Any:
        # Constants, structs and error classes: the real module's.
        if name.startswith(
            ("NVML", "nvmlMemory", "nvmlEventType", "nvmlGpuFabricInfo", "c_nvml", "SystemDriverBranchInfo")
        ):
            return getattr(self._pynvml, name)
        raise AttributeError(name)

    # -- plumbing --------------------------------------------------------------------------

    def _error(self, code: int) -> Exception:
        exc: Exception = self._pynvml.NVMLError(code)
        return exc

    def _handle(self, index: int) -> Any:
        return ctypes.cast(ctypes.c_void_p(0x1000 + index), self._pynvml.c_nvmlDevice_t)

    def _index(self, handle: Any) -> int:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0) - 0x1000

    def _dev(self, name: str, handle: Any) -> FakeDevice:
        self.calls[name] += 1
        if name in self.missing:
            raise self._error(self._pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        index = self._index(handle)
        gate = self._hangs.get(index)
        if gate is not None:
            gate.wait(self.max_hang_s)
        dev = self.devices[index]
        if dev.lost:
            raise self._error(self._pynvml.NVML_ERROR_GPU_IS_LOST)
        if name in dev.errors:
            raise self._error(dev.errors[name])
        return dev

    def hang(self, index: int) -> None:
        """Every call on GPU ``index`` blocks from now on, until ``release(index)``."""
        self._hangs.setdefault(index, threading.Event())

    def release(self, index: int) -> None:
        gate = self._hangs.pop(index, None)
        if gate is not None:
            gate.set()

    def push_event(self, index: int, event_type: int, data: int = 0) -> None:
        """Queue an event; delivered only if its type was registered on that GPU. Only an XID
        event carries data: nvml.h, nvmlEventData_t.eventData, "eventData is 0 for any other
        event"."""
        if event_type != self._pynvml.nvmlEventTypeXidCriticalError:
            data = 0
        with self._cond:
            if (index, event_type) in self.registered:
                self._events.append((index, event_type, data))
                self._cond.notify_all()
            else:
                self.dropped.append((index, event_type, data))

    def xid(self, index: int, xid: int) -> None:
        self.push_event(index, self._pynvml.nvmlEventTypeXidCriticalError, xid)

    def recovery_action_changed(self, index: int, action: int) -> None:
        """What an R565+ driver does when a GPU's recovery action changes: field 230 says the new
        action, and an ``nvmlEventTypeGpuRecoveryAction`` event (data 0) says that it changed."""
        self.devices[index].fields[self._pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] = (
            self._pynvml.NVML_SUCCESS,
            action,
        )
        self.push_event(index, self._pynvml.nvmlEventTypeGpuRecoveryAction)

    # -- the functions ---------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise self._error(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        # nvml.h: "Shut down NVML by releasing all GPU resources previously allocated with
        # nvmlInit_v2()" once the last reference goes (NVML counts its initialisations);
        # UNINITIALIZED without one.
        self.calls["nvmlShutdown"] += 1
        if self.initialised <= 0:
            raise self._error(self._pynvml.NVML_ERROR_UNINITIALIZED)
        self.initialised -= 1

    def reset(self, index: int) -> None:
        """``nvidia-smi -r -i INDEX`` as this process sees it: refused while NVML is initialised
        here (nvidia-smi(1), -r: the GPU must not be in use by any application, "a monitoring
        application like another instance of nvidia-smi" included); else the GPU comes back
        clean: recovery action NONE, no remap pending, volatile ECC counts cleared, on the bus."""
        if self.initialised > 0:
            raise RuntimeError(f"GPU {index}: in use by another client (NVML initialised)")
        dev = self.devices[index]
        dev.fields[self._pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] = (self._pynvml.NVML_SUCCESS, 0)
        if dev.remapped_rows is not None:
            dev.remapped_rows = (*dev.remapped_rows[:2], 0, dev.remapped_rows[3])
        dev.ecc_uncorrected_volatile = None if dev.ecc_uncorrected_volatile is None else 0
        dev.lost = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        return self.nvml_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_driver_version

    def nvmlSystemGetDriverBranch(self) -> Any:
        # New in R560 (NVML change log, "v555 and v560"): older drivers lack the symbol. The
        # branch string is a stand-in (the GPU proof records a real one).
        major = int(self.driver_version.split(".")[0])
        if major < 560 or "nvmlSystemGetDriverBranch" in self.missing:
            raise self._error(self._pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info = self._pynvml.c_nvmlSystemDriverBranchInfo_v1_t(0)
        info.version = self._pynvml.SystemDriverBranchInfo_v1
        info.branch = f"r{major}_00".encode()
        return info

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if self.devices[index].unreadable:
            raise self._error(self._pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._handle(index)

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return self._dev("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: Any) -> str:
        return self._dev("nvmlDeviceGetName", h).name

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        dev = self._dev("nvmlDeviceGetMigMode", h)
        if dev.mig_mode is None:
            raise self._error(self._pynvml.NVML_ERROR_NOT_SUPPORTED)
        return list(dev.mig_mode)

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        dev = self._dev("nvmlDeviceGetPciInfo", h)
        info = self._pynvml.nvmlPciInfo_t()
        info.busId = (dev.pci_bus_id or f"00000000:{0x18 + self._index(h):02X}:00.0").encode()
        return info

    def nvmlDeviceGetMarginTemperature(self, h: Any) -> int:
        # The distance to the nearest slowdown threshold, in C (pynvml returns marginTemperature).
        dev = self._dev("nvmlDeviceGetMarginTemperature", h)
        if dev.margin_temperature_c is None:
            raise self._error(self._pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev.margin_temperature_c

    def nvmlDeviceGetTemperatureV(self, h: Any, sensor: int, version: int | None = None) -> int:
        return self._dev("nvmlDeviceGetTemperatureV", h).temperature_c

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return self._dev("nvmlDeviceGetTemperature", h).temperature_c

    def nvmlDeviceGetTemperatureThreshold(self, h: Any, threshold: int) -> int:
        dev = self._dev("nvmlDeviceGetTemperatureThreshold", h)
        if threshold not in dev.thresholds:
            raise self._error(self._pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev.thresholds[threshold]

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return self._dev("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:
        return self._dev("nvmlDeviceGetEnforcedPowerLimit", h).power_limit_mw

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:
        dev = self._dev("nvmlDeviceGetClockInfo", h)
        return dev.sm_clock_mhz if clock == self._pynvml.NVML_CLOCK_SM else dev.mem_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return self._dev("nvmlDeviceGetCurrentClocksEventReasons", h).clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: Any) -> int:
        return self._dev("nvmlDeviceGetCurrentClocksThrottleReasons", h).clock_event_reasons

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
        # pynvml.py: no version -> c_nvmlMemory_t and the v1 symbol; a version -> the _v2 symbol.
        if version:
            dev = self._dev("nvmlDeviceGetMemoryInfo_v2", h)
            if version != self._pynvml.nvmlMemory_v2:
                raise self._error(self._pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            v2 = self._pynvml.c_nvmlMemory_v2_t()
            v2.version = version
            v2.total = dev.memory_total
            v2.reserved = dev.memory_reserved
            v2.used = dev.memory_used
            v2.free = dev.memory_total - dev.memory_reserved - dev.memory_used
            return v2
        dev = self._dev("nvmlDeviceGetMemoryInfo", h)
        v1 = self._pynvml.c_nvmlMemory_t()
        v1.total = dev.memory_total
        v1.free = dev.memory_total - dev.memory_reserved - dev.memory_used
        v1.used = dev.memory_total - v1.free  # reserved included: what v1 has always reported
        return v1

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        dev = self._dev("nvmlDeviceGetUtilizationRates", h)
        rates = self._pynvml.c_nvmlUtilization_t()
        rates.gpu = dev.utilization_gpu_pct
        rates.memory = 0
        return rates

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter_type: int) -> int:
        dev = self._dev("nvmlDeviceGetTotalEccErrors", h)
        if dev.ecc_uncorrected_volatile is None:
            raise self._error(self._pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev.ecc_uncorrected_volatile

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        dev = self._dev("nvmlDeviceGetComputeRunningProcesses", h)
        out = []
        for pid, used in dev.processes:
            info = self._pynvml.c_nvmlProcessInfo_v3_t()
            info.pid = pid
            info.usedGpuMemory = (
                self._pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
            )
            obj = self._pynvml.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == self._pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None  # as the binding does
            out.append(obj)
        return out

    def nvmlDeviceGetFieldValues(self, h: Any, field_ids: list[int]) -> Any:
        dev = self._dev("nvmlDeviceGetFieldValues", h)
        values = (self._pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, field_id in enumerate(field_ids):
            ret, value = dev.fields.get(field_id, (self._pynvml.NVML_ERROR_NOT_SUPPORTED, 0))
            if field_id == self._pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT and dev.nvlink_states is not None:
                ret, value = self._pynvml.NVML_SUCCESS, len(dev.nvlink_states)
            values[i].fieldId = field_id
            values[i].nvmlReturn = ret
            values[i].valueType = self._pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            values[i].value.ullVal = value
        return values

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        dev = self._dev("nvmlDeviceGetRemappedRows", h)
        if dev.remapped_rows is None:
            raise self._error(self._pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev.remapped_rows

    def nvmlDeviceGetPersistenceMode(self, h: Any) -> int:
        return self._optional(self._dev("nvmlDeviceGetPersistenceMode", h).persistence_mode)

    def nvmlDeviceGetEccMode(self, h: Any) -> list[int]:
        return list(self._optional(self._dev("nvmlDeviceGetEccMode", h).ecc_mode))

    def nvmlDeviceGetComputeMode(self, h: Any) -> int:
        return self._optional(self._dev("nvmlDeviceGetComputeMode", h).compute_mode)

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        return self._optional(self._dev("nvmlDeviceGetPcieReplayCounter", h).pcie_replay_count)

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        # nvml.h: NOT_SUPPORTED on a device without NVLink, INVALID_ARGUMENT for a link it lacks.
        states = self._optional(self._dev("nvmlDeviceGetNvLinkState", h).nvlink_states)
        if not 0 <= link < len(states):
            raise self._error(self._pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return states[link]

    def nvmlDeviceGetGpuFabricInfoV(self, h: Any, info: Any) -> int:
        dev = self._dev("nvmlDeviceGetGpuFabricInfoV", h)
        target = self._filled(info)
        versions = {self._pynvml.nvmlGpuFabricInfo_v2, getattr(self._pynvml, "nvmlGpuFabricInfo_v3", None)}
        if int(getattr(target, "version", 0)) not in versions:
            raise self._error(self._pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return self._fabric_into(dev, target)

    def nvmlDeviceGetGpuFabricInfo(self, h: Any, info: Any) -> int:
        return self._fabric_into(self._dev("nvmlDeviceGetGpuFabricInfo", h), self._filled(info))

    def _filled(self, ref: Any) -> Any:
        """The struct behind ``ctypes.byref(struct)`` (or a pointer to it), which the C call fills."""
        if isinstance(ref, ctypes.Structure):
            raise TypeError("pass the fabric struct by reference (ctypes.byref): the C call fills it")
        target = getattr(ref, "_obj", None)
        return target if target is not None else ref.contents

    def _fabric_into(self, dev: FakeDevice, info: Any) -> int:
        state, status = self._optional(dev.fabric)
        info.state = state
        info.status = status
        return int(self._pynvml.NVML_SUCCESS)

    def _optional(self, value: _T | None) -> _T:
        if value is None:
            raise self._error(self._pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetCpuAffinity(self, h: Any, words: int) -> list[int]:
        dev = self._dev("nvmlDeviceGetCpuAffinity", h)
        if not dev.cpus:
            raise self._error(self._pynvml.NVML_ERROR_NOT_SUPPORTED)
        mask = [0] * words
        for cpu in dev.cpus:
            if cpu // 64 < words:
                mask[cpu // 64] |= 1 << (cpu % 64)
        return mask

    def nvmlEventSetCreate(self) -> object:
        self.calls["nvmlEventSetCreate"] += 1
        event_set = _EventSet()
        self.sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        return self._dev("nvmlDeviceGetSupportedEventTypes", h).supported_events

    def nvmlDeviceRegisterEvents(self, h: Any, mask: int, event_set: object) -> None:
        dev = self._dev("nvmlDeviceRegisterEvents", h)
        if mask & ~dev.supported_events:
            raise self._error(self._pynvml.NVML_ERROR_NOT_SUPPORTED)
        index = self._index(h)
        pairs = [(index, bit) for bit in (1 << b for b in range(64)) if mask & bit]
        if isinstance(event_set, _EventSet):
            event_set.registered.update(pairs)
        self.registered += pairs

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        self.calls["nvmlEventSetWait"] += 1
        mine = event_set.registered if isinstance(event_set, _EventSet) else set(self.registered)
        if any(self.devices[index].lost for index, _ in mine):
            raise self._error(self._pynvml.NVML_ERROR_GPU_IS_LOST)
        with self._cond:
            self._cond.wait_for(lambda: bool(self._events), timeout_ms / 1000)
            # Events of GPUs not in this set stay queued for no one: drop them, as NVML does.
            while self._events and (self._events[0][0], self._events[0][1]) not in mine:
                self.dropped.append(self._events.popleft())
            if not self._events:
                raise self._error(self._pynvml.NVML_ERROR_TIMEOUT)
            index, event_type, data = self._events.popleft()
        event = self._pynvml.c_nvmlEventData_t()
        event.device = self._handle(index)  # a new pointer object to the same device
        event.eventType = event_type
        event.eventData = data
        event.gpuInstanceId = 0xFFFFFFFF
        event.computeInstanceId = 0xFFFFFFFF
        return event

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.calls["nvmlEventSetFree"] += 1
        if isinstance(event_set, _EventSet) and not event_set.freed:
            event_set.freed = True
            for pair in event_set.registered:
                self.registered.remove(pair)


def fake_uuid(index: int) -> str:
    return f"GPU-fake-{index:04d}"


class FileNvml(FakeNvml):
    """``FakeNvml`` driven by a JSON file that a test (or a demo) rewrites while the daemon runs:
    ``llm-supervisor run --fake-gpu FILE`` builds ``NvmlReader(FileNvml(FILE))``, so the real
    reader runs. Never for production. The file, re-read on every sample and event wait::

        {"gpus": [{"index": 0, "uuid": "GPU-...", "temperature_c": 91,
                   "clock_event_reasons": ["hw_thermal"], "memory_used_bytes": 0,
                   "processes": [[4242, 75161927680]], "recovery_action": 1,
                   "fields": {"270": 5000000000}, "errors": {"nvmlDeviceGetComputeRunningProcesses":
                   "NoPermission"}, "mig": true, "remap_failure": true, "lost": false,
                   "cpus": "0-3", "fabric": "not_started"}],
         "events": [{"id": 1, "gpu": 0, "xid": 48}, {"id": 2, "gpu": 0, "kind": "double_bit_ecc"}]}

    A GPU's place in NVML's order is its ``index`` (indices the file leaves out are unreadable
    GPUs); ``uuid`` defaults to ``GPU-fake-0000`` style; a top-level ``"pids_visible": false`` plays
    a daemon in a container without hostPID (read once, at start); a top-level ``"init_error":
    "DriverNotLoaded"`` makes every ``nvmlInit`` fail so until the file drops it (a driver that
    loads after the daemon). While NVML is initialised, ``FILE.held`` holds the daemon's pid
    (``held_path``): a test's ``nvidia-smi -r`` refuses while it is there, as the real one refuses
    a GPU that any process holds. Each event is delivered once (by id), and only if its type was
    registered, as NVML does. Only an XID event carries data (nvml.h): a
    ``{"kind": "gpu_recovery_action"}`` event says the action changed, and the GPU's
    ``recovery_action`` (field 230) says to what. A GPU's ``fabric`` is its NVSwitch fabric state by
    name (``not_started``, ``in_progress``, ``completed``, ``not_supported``), or ``{"state":
    "completed", "status": "Unknown"}`` for a registration that failed; left out, the call answers
    NOT_SUPPORTED (no NVSwitch fabric).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self._delivered: set[object] = set()
        # Wakes a wait when its set is freed (a close, a rebuild); cleared for the next set, so
        # that a set made after a close (NVML opened again after `gpu release`) is waited on.
        self._set_freed = threading.Event()
        # The file's PIDs are the test's own; "pids_visible": false plays a container without
        # hostPID, where NVML's host PIDs match nothing in the daemon's /proc.
        self.pids_visible = bool(self._load().get("pids_visible", True))

    def _read_file(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _load(self) -> dict[str, Any]:
        data = self._read_file()
        raw_gpus = [g for g in data.get("gpus", []) if isinstance(g, dict)]
        by_index = {int(g.get("index", i)): g for i, g in enumerate(raw_gpus)}
        count = max(by_index) + 1 if by_index else 0
        devices = []
        for index in range(count):
            raw = by_index.get(index)
            devices.append(_device_from(index, raw) if raw is not None else FakeDevice(fake_uuid(index)))
            if raw is None:
                devices[-1].unreadable = True
        if not self.initialised or len(devices) == len(self.devices):
            self.devices = devices  # the count is fixed after open, as NVML's is
        return data

    @property
    def held_path(self) -> Path:
        """``FILE.held`` exists while NVML is initialised in the daemon (its pid inside): what a
        test's stand-in for ``nvidia-smi -r`` looks at, which refuses while any process holds
        the GPU (nvidia-smi(1), -r)."""
        return self.path.with_name(self.path.name + ".held")

    def nvmlInit(self) -> None:
        # "init_error": "DriverNotLoaded" plays a driver that is not there yet; each try reads it.
        error = self._load().get("init_error")
        name = f"NVML_ERROR_{_snake(str(error))}"
        self.init_error = None if error is None else int(getattr(self._pynvml, name, error))
        super().nvmlInit()
        with contextlib.suppress(OSError):
            self.held_path.write_text(f"{os.getpid()}\n")

    def nvmlShutdown(self) -> None:
        super().nvmlShutdown()
        if self.initialised == 0:
            with contextlib.suppress(OSError):
                self.held_path.unlink()

    def nvmlDeviceGetTemperatureV(self, h: Any, sensor: int, version: int | None = None) -> int:
        self._load()  # once per sample: temperature is the first reading
        return super().nvmlDeviceGetTemperatureV(h, sensor, version)

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        deadline = time.monotonic() + timeout_ms / 1000
        by_kind = {kind: bit for bit, kind in EVENT_KINDS.items()}
        while not (isinstance(event_set, _EventSet) and event_set.freed):
            for raw in self._load().get("events", []):
                key = raw.get("id", json.dumps(raw, sort_keys=True))
                if key in self._delivered:
                    continue
                self._delivered.add(key)
                kind = str(raw.get("kind", "xid"))
                data = int(raw.get("xid", raw.get("data", 0)))
                self.push_event(int(raw.get("gpu", 0)), by_kind.get(kind, 0x8), data)
            with self._cond:
                if self._events:
                    return super().nvmlEventSetWait(event_set, 0)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._set_freed.wait(min(0.2, left))
        raise self._error(self._pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetCreate(self) -> object:
        self._set_freed.clear()
        return super().nvmlEventSetCreate()

    def nvmlEventSetFree(self, event_set: object) -> None:
        super().nvmlEventSetFree(event_set)
        self._set_freed.set()


def _device_from(index: int, raw: Mapping[str, Any]) -> FakeDevice:
    """A ``FakeDevice`` from one entry of the ``--fake-gpu`` file (see ``FileNvml``)."""
    import pynvml

    dev = FakeDevice(str(raw.get("uuid", fake_uuid(index))))
    simple = {
        "name": "name",
        "temperature_c": "temperature_c",
        "utilization_gpu_pct": "utilization_gpu_pct",
        "memory_used_bytes": "memory_used",
        "memory_total_bytes": "memory_total",
        "memory_reserved_bytes": "memory_reserved",
        "ecc_uncorrected_volatile": "ecc_uncorrected_volatile",
        "sm_clock_mhz": "sm_clock_mhz",
        "mem_clock_mhz": "mem_clock_mhz",
    }
    for key, attr in simple.items():
        if key in raw:
            setattr(dev, attr, raw[key])
    if "power_w" in raw:
        dev.power_mw = int(float(raw["power_w"]) * 1000)
    if "power_limit_w" in raw:
        dev.power_limit_mw = int(float(raw["power_limit_w"]) * 1000)
    reasons = raw.get("clock_event_reasons")
    if isinstance(reasons, list):
        by_name = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}
        dev.clock_event_reasons = sum(by_name[name] for name in reasons)
    elif isinstance(reasons, int):
        dev.clock_event_reasons = reasons
    if isinstance(raw.get("processes"), list):
        dev.processes = [(int(p[0]), None if p[1] is None else int(p[1])) for p in raw["processes"]]
    if "recovery_action" in raw:
        action = raw["recovery_action"]
        dev.fields[230] = (
            (pynvml.NVML_ERROR_NOT_SUPPORTED, 0) if action is None else (pynvml.NVML_SUCCESS, int(action))
        )
    for field_id, value in dict(raw.get("fields", {})).items():
        dev.fields[int(field_id)] = (pynvml.NVML_SUCCESS, int(value))
    for fn, error in dict(raw.get("errors", {})).items():
        code: Any = getattr(pynvml, f"NVML_ERROR_{_snake(str(error))}", error)
        dev.errors[str(fn)] = int(code)
    if raw.get("mig"):
        dev.mig_mode = (1, 1)
    if raw.get("remap_failure"):
        dev.remapped_rows = (0, 1, 0, 1)
    if isinstance(raw.get("cpus"), str):
        dev.cpus = tuple(sorted(parse_cpu_list(raw["cpus"])))
    if raw.get("fabric") is not None:
        dev.fabric = _fabric_from(raw["fabric"])
    dev.lost = bool(raw.get("lost"))
    return dev


def _fabric_from(raw: Any) -> tuple[int, int]:
    """(state, status) from a ``--fake-gpu`` file's ``fabric``: a state's name, or ``{"state": NAME,
    "status": ERROR}`` (an NVML error's name, ``Unknown``, or its code)."""
    import pynvml

    by_name = {name: state for state, name in FABRIC_STATES.items()}
    spec = raw if isinstance(raw, dict) else {"state": raw}
    state = spec.get("state", "completed")
    status = spec.get("status", 0)
    if isinstance(status, str):
        status = getattr(pynvml, f"NVML_ERROR_{_snake(status)}", pynvml.NVML_ERROR_UNKNOWN)
    return (by_name[state] if isinstance(state, str) else int(state)), int(status)


def _snake(name: str) -> str:
    """``NoPermission`` -> ``NO_PERMISSION`` (the NVML_ERROR_* spelling)."""
    if name.isupper() or not name.isalpha():
        return name
    return "".join(("_" + c if c.isupper() and i else c) for i, c in enumerate(name)).upper()


__all__ = ["GIB", "MIB", "FakeDevice", "FakeNvml", "FileNvml", "fake_uuid"]
