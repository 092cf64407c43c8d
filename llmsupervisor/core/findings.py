"""The findings vocabulary: what a detector can find, how bad it is, and the finding itself.

The detectors (``llmsupervisor.detectors``) produce findings and the policy (``core.policy``)
decides on them; both read these types from here, so the policy needs nothing of the detectors.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


class FindingKind(enum.Enum):
    HANG = "hang"
    STALL = "stall"
    KV_PRESSURE = "kv_pressure"
    PREEMPTION_STORM = "preemption_storm"
    DEGRADATION_THROUGHPUT = "degradation_throughput"
    DEGRADATION_TTFT = "degradation_ttft"
    DEGRADATION_PREFIX_CACHE = "degradation_prefix_cache"
    THERMAL = "thermal"
    POWER_THROTTLE = "power_throttle"
    GPU_FAULT = "gpu_fault"
    GPU_LOST = "gpu_lost"
    MEMORY_GROWTH = "memory_growth"
    FOREIGN_GPU_MEMORY = "foreign_gpu_memory"
    NVML_LOST = "nvml_lost"

    def __str__(self) -> str:
        return self.name


class Severity(enum.Enum):
    INFO = "info"  # worth a log line; no action
    WARNING = "warning"  # degraded; the policy may drain or reconfigure
    CRITICAL = "critical"  # broken; the policy restarts or quarantines

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One detected condition of one engine, with the values that show it."""

    engine: str
    kind: FindingKind
    severity: Severity
    evidence: Mapping[str, float | str]
    since_s: float  # monotonic: when the condition began, as far as the window shows
    summary: str

    def __post_init__(self) -> None:
        if not isinstance(self.evidence, MappingProxyType):
            object.__setattr__(self, "evidence", MappingProxyType(dict(self.evidence)))

    @property
    def key(self) -> tuple[str, FindingKind, Severity]:
        return (self.engine, self.kind, self.severity)


__all__ = ["Finding", "FindingKind", "Severity"]
