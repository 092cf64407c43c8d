"""Probes: read-only looks at an engine, each with its own deadline; failures are data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

# timeout   the probe's deadline passed (or an earlier call for the same target is still stuck)
# connect   nothing answered: connection refused, reset, or the process is gone
# http      an answer that is not the expected one (non-200, protocol error)
# parse     an answer that could not be read (a garbage /metrics body)
# nvml      an NVML call failed, or NVML is unavailable on this host
# gpu_lost  NVML says the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST, usually after XID 79)
ProbeFailureKind = Literal["timeout", "connect", "http", "parse", "nvml", "gpu_lost"]
PROBE_FAILURE_KINDS: Final[frozenset[str]] = frozenset(get_args(ProbeFailureKind))


@dataclass(frozen=True, slots=True)
class ProbeFailure:
    """A probe that produced no sample; kept in the observation instead of raised."""

    kind: ProbeFailureKind
    detail: str

    def __post_init__(self) -> None:
        if self.kind not in PROBE_FAILURE_KINDS:
            raise ValueError(f"unknown probe failure kind {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


__all__ = ["PROBE_FAILURE_KINDS", "ProbeFailure", "ProbeFailureKind"]
