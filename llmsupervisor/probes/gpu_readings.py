"""What a GPU reading is, for everyone who reads one: ``GpuSample``, ``GpuEvent``, ``GpuLost``, the
``GpuReader`` that gives them, and NVML's tables that name what they carry (event kinds, clock-event
reasons, recovery actions) with their decoders.

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
from typing import Final, NamedTuple, Protocol

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
    thermal_throttle_ns: int | None = None  # fields 269 + 270: time throttled for heat, cumulative
    power_brake_ns: int | None = None  # field 271
    mig_enabled: bool | None = None  # nvmlDeviceGetMigMode, current mode; None = no MIG on this board
    # Whether ``processes``' PIDs are this daemon's: False in a container with its own PID
    # namespace, where NVML's host PIDs match nothing in our /proc.
    pids_visible: bool = True
    unread: tuple[str, ...] = ()  # readings that failed this time ("processes: NVMLError_NoPermission")
    # Why NVML's events (XIDs, ECC, poison) on this GPU are not watched: it was left out of the
    # event set after a registration failed (nvml.h: UNKNOWN leaves the set "in undefined state").
    # None: its events are watched, or it supports none.
    events_unwatched: str | None = None

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
    "RECOVERY_ACTIONS",
    "RECOVERY_NONE",
    "XID_UNKNOWN",
    "GpuEvent",
    "GpuLost",
    "GpuProcess",
    "GpuReader",
    "GpuSample",
    "NvmlHealth",
    "decode_clock_event_reasons",
    "recovery_action_name",
]
