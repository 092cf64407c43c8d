"""What a GPU reading is, for everyone who reads one: ``GpuSample``, ``GpuEvent``, ``GpuLost``, the
``GpuReader`` that gives them, and NVML's tables that name what they carry (event kinds, clock-event
reasons, recovery actions) with their decoders; NVIDIA's XID catalogue (``XID_CATALOGUE``); a GPU's
place in the NVSwitch fabric (``GpuFabric``); and what ``doctor`` reads besides (``GpuFacts``,
``DriverFacts``, through a ``GpuInspector``).

::

    GpuReader (Protocol; blocking calls)           gpu_threads.ThreadedGpuReader (async, for the loop)
     ├── nvml.NvmlReader(lib=None) the real binding ◄── each call in a daemon thread under a timeout;
     └── fake_gpu.FakeGpu/FileGpu  test doubles         one call per GPU at a time; failures become
                                                        ProbeFailure, NVML missing is reported once

The values are plain numbers in the daemon's units (W, MHz, bytes), converted by the reader. The
tables hold nvml.h's numbers (the same in every binding version; tests check them against
``pynvml``) and the names the daemon gives them in its findings, events and metrics. Only
``probes/nvml.py`` talks to the binding; the detectors, the observer, the status and the exporter
import this module alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol, runtime_checkable

from llmsupervisor.errors import SupervisorError

# NVML_GPU_RECOVERY_ACTION_* (nvml.h): what the GPU says must happen before it is used again.
# NONE: "start a new process"; anything else needs at least a GPU reset ("Error Recovery and
# Response Flags", https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/).
RECOVERY_NONE: Final = 0
RECOVERY_ACTIONS: Final[Mapping[int, str]] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}


def recovery_action_name(action: int) -> str:
    return RECOVERY_ACTIONS.get(action, f"action_{action}")


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
EVENT_DRAM_RETIREMENT: Final = 0x400
EVENT_DRAM_RETIREMENT_FAILURE: Final = 0x800
EVENT_NON_FATAL_POISON: Final = 0x1000
EVENT_FATAL_POISON: Final = 0x2000
EVENT_GPU_RECOVERY_ACTION: Final = 0x8000
XID_UNKNOWN: Final = 999  # what NVML reports when it cannot name the XID
XID_RECOVERY_ACTION_CHANGED: Final = 154  # "GPU recovery action changed": read field 230

# NVIDIA's XID catalogue: the resolution NVIDIA gives each XID ("Analyzing Xid Catalog",
# https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, its "Resolution" column).
# NVIDIA ships the same buckets machine-readable in NVIDIA/NVSentinel,
# distros/kubernetes/nvsentinel/charts/gpu-health-monitor/xiderrorsmapping.csv (checked against
# it for XIDs 1-162). The daemon reads it only where the driver has no recovery action (field
# 230, R565+): the GPU's own verdict comes first (detectors/gpu.py, docs/gpu.md).
XID_RESET_GPU: Final = "RESET_GPU"
XID_RESTART_BM: Final = "RESTART_BM"  # restart the bare-metal node
XID_RESTART_VM: Final = "RESTART_VM"
XID_RESTART_APP: Final = "RESTART_APP"
XID_IGNORE: Final = "IGNORE"
XID_REPORT_ISSUE: Final = "UNEXPECTED_ERR_REPORT_ISSUE"  # NVIDIA does not expect it: report it


def _xids(*spans: int | tuple[int, int]) -> frozenset[int]:
    """XIDs from single numbers and inclusive (first, last) ranges."""
    out: set[int] = set()
    for span in spans:
        first, last = span if isinstance(span, tuple) else (span, span)
        out.update(range(first, last + 1))
    return frozenset(out)


_XID_BUCKETS: Final[tuple[tuple[str, frozenset[int]], ...]] = (
    (XID_RESET_GPU, _xids(46, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158, 162)),
    (XID_RESTART_BM, _xids(79, 160)),
    (XID_RESTART_VM, _xids(151)),
    ("WORKFLOW_XID_48", _xids(48)),  # double-bit ECC: "reboot the system (or reset GPUs)"
    ("WORKFLOW_XID_45", _xids(45)),  # preemptive cleanup: follows an earlier error
    ("WORKFLOW_NVLINK_ERR", _xids(74)),
    ("WORKFLOW_NVLINK5_ERR", _xids((144, 150))),
    ("CHECK_MECHANICALS", _xids(54)),
    ("UPDATE_SWFW", _xids(78)),
    ("CHECK_UVM", _xids(159)),
    ("FOLLOW_OTHER_XID", _xids(XID_RECOVERY_ACTION_CHANGED)),  # "as it applies to another Xid"
    (
        XID_RESTART_APP,
        _xids(8, 11, 13, 25, 31, 32, (39, 41), 60, (68, 72), (75, 77), 80, (82, 86), 88, 89, 94),
    ),
    (XID_RESTART_APP, _xids((96, 105), (126, 135), 139)),
    (XID_IGNORE, _xids(14, 37, 38, 43, 44, 63, 66, 67, 92, 93, 106, 107, 121, 137, 141, 152, 153)),
    (XID_IGNORE, _xids(157, 161)),
    (
        XID_REPORT_ISSUE,
        _xids((1, 7), 9, 10, 12, (15, 24), (26, 30), (33, 36), 42, 47, (49, 53), (55, 59), 61, 65, 73),
    ),
    (XID_REPORT_ISSUE, _xids(81, 87, 90, 91, 108, (111, 118), (122, 125), 138, 142)),
)
XID_CATALOGUE: Final[Mapping[int, str]] = {xid: bucket for bucket, xids in _XID_BUCKETS for xid in xids}


def xid_resolution(xid: int) -> str | None:
    """NVIDIA's resolution bucket for ``xid`` (XID_CATALOGUE); None for an XID it does not list."""
    return XID_CATALOGUE.get(xid)


# nvmlGpuFabricState_t (nvml.h, NVML_GPU_FABRIC_STATE_*): how far a GPU's registration with the
# NVLink fabric has come. On an NVSwitch box (HGX/DGX H100, H200) NVIDIA Fabric Manager trains the
# NVLinks and registers each GPU, Not Started -> In Progress -> Completed (NVSentinel #883); until
# it completes, CUDA cannot start there (cudaErrorSystemNotReady, 802: "the system is not yet
# ready to start any CUDA work ... verify ... all required driver daemons are actively running",
# the CUDA runtime API). A GPU outside such a fabric reads NOT_SUPPORTED, or its call does.
FABRIC_NOT_SUPPORTED: Final = 0
FABRIC_NOT_STARTED: Final = 1
FABRIC_IN_PROGRESS: Final = 2
FABRIC_COMPLETED: Final = 3
FABRIC_STATES: Final[Mapping[int, str]] = {
    FABRIC_NOT_SUPPORTED: "not_supported",
    FABRIC_NOT_STARTED: "not_started",
    FABRIC_IN_PROGRESS: "in_progress",
    FABRIC_COMPLETED: "completed",
}
FABRIC_MANAGER_HINT: Final = "systemctl status nvidia-fabricmanager"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuFabric:
    """A GPU's place in the NVLink fabric of an NVSwitch box (``nvmlDeviceGetGpuFabricInfoV``,
    "Hopper or newer", nvml.h). ``status`` is the registration's outcome, an ``nvmlReturn_t``
    that nvml.h says "must be checked only if state returns complete"."""

    state: int  # FABRIC_STATES
    status: int = 0  # NVML_SUCCESS, or the error the registration ended with
    status_name: str | None = None  # the binding's name for a failed status ("Timeout")

    @property
    def state_name(self) -> str:
        return FABRIC_STATES.get(self.state, f"state_{self.state}")

    @property
    def on_nvswitch(self) -> bool:
        """Whether the GPU belongs to an NVSwitch fabric at all."""
        return self.state != FABRIC_NOT_SUPPORTED

    @property
    def pending(self) -> bool:
        """Registration not done yet: Fabric Manager has not started it, or is at it."""
        return self.state in (FABRIC_NOT_STARTED, FABRIC_IN_PROGRESS)

    @property
    def failed(self) -> bool:
        """Registration ended with an error (``status``)."""
        return self.state == FABRIC_COMPLETED and self.status != 0

    @property
    def problem(self) -> str | None:
        """What in the fabric stops CUDA on this GPU, in the operator's words; None: nothing
        (registered, or no NVSwitch fabric). An unknown state is none: only what nvml.h names
        holds an engine back."""
        if self.state == FABRIC_NOT_STARTED:
            return f"fabric manager not running? (registration not started; {FABRIC_MANAGER_HINT})"
        if self.state == FABRIC_IN_PROGRESS:
            return "registration in progress (Fabric Manager is setting up the NVLink fabric)"
        if self.failed:
            return (
                f"registration failed ({self.status_name or f'NVML error {self.status}'}); see Fabric"
                f" Manager's log ({FABRIC_MANAGER_HINT})"
            )
        return None


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
    # NVML's PID: always the host's ("you will always get the host pids", NVIDIA/nvidia-docker#1483).
    # Equal to the daemon's view only where ``GpuSample.pids_visible``.
    pid: int
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
    # nvmlMemory_v2's driver-reserved memory, left out of ``memory_used_bytes`` as nvidia-smi leaves
    # it out; None where only the v1 call exists (then ``memory_used_bytes`` includes it).
    memory_reserved_bytes: int | None = None
    recovery_action: int | None = None  # field 230 (RECOVERY_ACTIONS); None = not readable
    remap_pending: bool | None = None  # nvmlDeviceGetRemappedRows: a remap waits for the next reset
    remap_failed: bool | None = None  # a row could not be remapped: the GPU needs a reset
    slowdown_temperature_c: int | None = None  # the board's own thresholds
    max_operating_temperature_c: int | None = None
    # Time with the clocks held back since the driver loaded, in ns (fields 269, 270, 271; read on
    # R580+ drivers only, where nvml.h gives them these ids): a duration, where the clock-event
    # mask is one instant. SW thermal is Boost holding the GPU at its max operating temperature;
    # HW thermal halves the clocks or more.
    sw_thermal_ns: int | None = None
    hw_thermal_ns: int | None = None
    power_brake_ns: int | None = None
    mig_enabled: bool | None = None  # nvmlDeviceGetMigMode, current mode; None = no MIG on this board
    # Whether ``processes``' PIDs are this daemon's: False in a container with its own PID
    # namespace, where NVML's host PIDs match nothing in our /proc.
    pids_visible: bool = True
    unread: tuple[str, ...] = ()  # readings that failed this time ("processes: NVMLError_NoPermission")
    # Why NVML's events (XIDs, ECC, poison) on this GPU are not watched: it was left out of the
    # event set after a registration failed (nvml.h: UNKNOWN leaves the set "in undefined state").
    # None: its events are watched, or it supports none.
    events_unwatched: str | None = None
    # nvmlDeviceGetGpuFabricInfoV (else nvmlDeviceGetGpuFabricInfo): the GPU's NVSwitch fabric
    # registration; None where the call is NotSupported (no fabric: not Hopper, or no NVSwitch) or
    # could not be read (then named in ``unread``).
    fabric: GpuFabric | None = None
    # nvmlDeviceGetPciInfo's busId ("00000000:19:00.0"), read once at open: what `nvidia-smi -r -i`
    # takes to name the board unambiguously (daemon/gpu_release.py). None: not read.
    pci_bus_id: str | None = None

    @property
    def thermal_throttle_ns(self) -> int | None:
        """SW plus HW thermal slowdown time (the ``gpu_thermal_throttle_seconds_total`` metric)."""
        known = [ns for ns in (self.sw_thermal_ns, self.hw_thermal_ns) if ns is not None]
        return sum(known) if known else None

    @property
    def clock_event_reason_names(self) -> frozenset[str]:
        return (
            frozenset()
            if self.clock_event_reasons is None
            else decode_clock_event_reasons(self.clock_event_reasons)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuEvent:
    """One NVML event. ``index``/``uuid`` are None when the event's device could not be matched.

    ``at_s`` is when it was received, on the monotonic clock. A reader stamps it as the event
    leaves NVML; ``GpuMonitor`` stamps it again as it reaches the loop, with ``loop.time()``, the
    daemon's one clock, so that an engine can drop the events from before its incarnation.
    """

    index: int | None
    uuid: str | None
    kind: str  # EVENT_KINDS value, or "event_0x..." for a type this table lacks
    xid: int | None  # for kind "xid" only; XID_UNKNOWN (999) when NVML cannot name it
    at_s: float  # monotonic, when received
    # The GPU's recovery action read just after the event (for kind "gpu_recovery_action", the
    # event's own data); None when not read or not readable.
    recovery_action: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmlHealth:
    """Whether the daemon can read its GPUs at all (``GpuMonitor.health``): STATUS=, ``status``,
    ``/metrics`` and ``doctor`` show it. Times are on the daemon's loop clock."""

    up: bool  # NVML opened (it may list no GPU)
    reason: str | None = None  # while down: NvmlUnavailable.reason ("driver_not_loaded", ...)
    detail: str | None = None  # while down: what NVML said
    since_s: float | None = None  # down since the first failed open; up since it opened
    attempts: int = 0  # opens tried since the daemon started
    next_try_s: float | None = None  # while down: when the next open is tried
    gpus: int = 0  # GPUs opened
    # GPUs taken as lost because their NVML calls stopped answering (docs/gpu.md, "Calls that hang")
    hung: tuple[int, ...] = ()
    # Event waits that failed since the start: an NVML error other than its timeout (the reader
    # then rebuilds the event set without the GPUs that fell off the bus, docs/gpu.md), or a
    # wait that outlived its deadline
    event_wait_errors: int = 0
    events_unwatched: Mapping[int, str] = field(default_factory=dict)  # GPU index -> why
    # The daemon's: engines named by GPU index that wait for NVML to open, and until when
    # (daemon/nvml_wait.py); and whether any enabled engine is on GPUs (a CPU-only host without
    # NVML is not blind: nothing there needs it).
    waiting: Mapping[str, float] = field(default_factory=dict)
    needed: bool = True
    # Each NVSwitch GPU's fabric state by index (FABRIC_STATES' names; GPUs outside a fabric left
    # out); and the daemon's: the engines that wait for their GPUs' fabric, with why
    # (docs/gpu.md, "The NVSwitch fabric").
    fabric: Mapping[int, str] = field(default_factory=dict)
    fabric_waiting: Mapping[str, str] = field(default_factory=dict)


# nvmlComputeMode_t (nvml.h): who may create a CUDA context on the GPU.
COMPUTE_MODES: Final[Mapping[int, str]] = {
    0: "default",
    1: "exclusive_thread",
    2: "prohibited",
    3: "exclusive_process",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuFacts:
    """What ``doctor`` reports of one GPU beyond a sample: its settings and link health. Each is
    None where the board or driver does not support the reading (NVMLError_NotSupported, or a
    function this driver lacks); a reading that failed otherwise is named in ``unread``."""

    uuid: str
    persistence_mode: bool | None = None  # nvmlDeviceGetPersistenceMode
    ecc_enabled: bool | None = None  # nvmlDeviceGetEccMode: current
    ecc_pending: bool | None = None  # and after the next reset
    compute_mode: int | None = None  # nvmlDeviceGetComputeMode: COMPUTE_MODES
    pcie_replay_count: int | None = None  # nvmlDeviceGetPcieReplayCounter: since the driver loaded
    nvlinks_active: int | None = None  # nvmlDeviceGetNvLinkState over the GPU's links
    nvlinks: int | None = None  # the links NVML answers for; None: no NVLink (a PCIe board)
    # Field 230's own return code: True where the driver answers it (R565+), so the GPU's verdict
    # on a fault is read; False where it does not, and XIDs are judged by XID_CATALOGUE.
    recovery_action_supported: bool | None = None
    unread: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverFacts:
    """The driver under NVML (nvmlSystemGetDriverVersion, nvmlSystemGetDriverBranch on R560+,
    nvmlSystemGetNVMLVersion); None where this driver does not say."""

    version: str | None = None  # "580.159.04"
    branch: str | None = None
    nvml_version: str | None = None

    @property
    def major(self) -> int | None:
        """The driver's major version (580 for "580.159.04"): its branch, R580."""
        head = (self.version or "").split(".", 1)[0]
        return int(head) if head.isdigit() else None


@runtime_checkable
class GpuInspector(Protocol):
    """What ``doctor`` asks of a reader besides ``GpuReader``'s calls (``nvml.NvmlReader`` has it;
    the sample-level doubles do not). Blocking, like every NVML call."""

    def driver(self) -> DriverFacts: ...

    def facts(self, uuid: str) -> GpuFacts: ...


class GpuReader(Protocol):
    """What the daemon uses of NVML. Every call blocks; run them through ``ThreadedGpuReader``."""

    def open(self) -> dict[str, int]:
        """Initialise and return the GPUs, UUID -> NVML index, in index (PCI) order.

        The indices are NVML's own, with gaps where a GPU could not be read and was left out:
        never a position in this mapping. Raises ``NvmlUnavailable``.
        """
        ...

    def sample(self, uuid: str) -> GpuSample:
        """Read one GPU; raises ``GpuLost`` when it fell off the bus."""
        ...

    def wait_event(self, timeout_ms: int) -> GpuEvent | None:
        """Block up to ``timeout_ms`` for an event; None when nothing happened."""
        ...

    def cpu_affinity(self, uuid: str) -> frozenset[int] | None:
        """The CPUs close to the GPU (its NUMA node's; nvmlDeviceGetCpuAffinity); None when the
        driver does not say."""
        ...

    def close(self) -> None: ...


__all__ = [
    "CLOCK_EVENT_REASONS",
    "COMPUTE_MODES",
    "EVENT_DOUBLE_BIT_ECC",
    "EVENT_DRAM_RETIREMENT",
    "EVENT_DRAM_RETIREMENT_FAILURE",
    "EVENT_FATAL_POISON",
    "EVENT_GPU_RECOVERY_ACTION",
    "EVENT_GPU_UNAVAILABLE",
    "EVENT_KINDS",
    "EVENT_NON_FATAL_POISON",
    "EVENT_SINGLE_BIT_ECC",
    "EVENT_XID",
    "FABRIC_COMPLETED",
    "FABRIC_IN_PROGRESS",
    "FABRIC_MANAGER_HINT",
    "FABRIC_NOT_STARTED",
    "FABRIC_NOT_SUPPORTED",
    "FABRIC_STATES",
    "RECOVERY_ACTIONS",
    "RECOVERY_NONE",
    "XID_CATALOGUE",
    "XID_IGNORE",
    "XID_RECOVERY_ACTION_CHANGED",
    "XID_REPORT_ISSUE",
    "XID_RESET_GPU",
    "XID_RESTART_APP",
    "XID_RESTART_BM",
    "XID_RESTART_VM",
    "XID_UNKNOWN",
    "DriverFacts",
    "GpuEvent",
    "GpuFabric",
    "GpuFacts",
    "GpuInspector",
    "GpuLost",
    "GpuProcess",
    "GpuReader",
    "GpuSample",
    "NvmlHealth",
    "decode_clock_event_reasons",
    "recovery_action_name",
    "xid_resolution",
]
