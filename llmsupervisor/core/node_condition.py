"""Node conditions: GPU faults the engine cannot survive, handed to node-level remediation.

A restart fixes an engine; it does not fix a GPU that fell off the bus, nor one that the GPU
itself says must be reset. Those belong to the tools that own the node (NVIDIA's NVSentinel, the
device plugin, an operator): the daemon sets the condition, says so on ``/readyz`` (503 with the
reason), in status and as a metric, stops the engines on that GPU rather than restarting them
into READY, and does not cordon or drain the node itself (docs/gpu.md, docs/fleet.md).

Pure: which fault makes a GPU unrecoverable is a function of the fault, the GPU's verdict on it
and the GPU's recent marks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

GPU_UNRECOVERABLE: Final = "gpu_unrecoverable"

# The policy's reasons for a GPU-marking restart (FindingKind values, core/policy.GPU_MARKING).
GPU_LOST_REASON: Final = "gpu_lost"
GPU_FAULT_REASON: Final = "gpu_fault"

# A GPU fault's verdict (detectors/gpu.py VERDICT_*): the GPU's recovery action, or the XID table.
VERDICT_RESET: Final = "reset"
VERDICT_RESTART: Final = "restart"
VERDICT_UNKNOWN: Final = "unknown"


@dataclass(frozen=True, slots=True)
class NodeCondition:
    condition: str  # GPU_UNRECOVERABLE
    gpu: int  # the GPU's NVML index on this boot (what engines name)
    reason: str  # what the GPU did, as the finding said it
    uuid: str = ""  # the physical GPU the condition belongs to

    def describe(self) -> str:
        return f"{self.condition} on GPU {self.gpu}{f' ({self.uuid})' if self.uuid else ''}: {self.reason}"

    def as_json(self) -> dict[str, Any]:
        return {"condition": self.condition, "gpu": self.gpu, "uuid": self.uuid, "reason": self.reason}


def gpu_verdicts(raw: object) -> dict[int, str]:
    """A GPU_FAULT finding's ``verdicts`` evidence ("0=reset,1=restart") by GPU index."""
    if not isinstance(raw, str):
        return {}
    out: dict[int, str] = {}
    for part in raw.split(","):
        gpu, _, verdict = part.partition("=")
        if gpu.strip().isdigit() and verdict in (VERDICT_RESET, VERDICT_RESTART, VERDICT_UNKNOWN):
            out[int(gpu)] = verdict
    return out


def gpu_unrecoverable(fault_reason: str, marks_before: int, verdict: str = VERDICT_UNKNOWN) -> bool:
    """Whether a GPU-marking fault means the GPU itself is gone for this node.

    - ``gpu_lost`` (XID 79, a GPU-unavailable event, NVML saying the GPU is lost or needs a
      reset): at once. No engine restart brings a GPU back; only a reset or a reboot does.
    - ``gpu_fault`` with verdict ``reset`` (a recovery action other than NONE, a failed row remap,
      or on drivers without field 230 a reset-class XID: 48, 64, 95, 119, 120, 140): at once.
      NVIDIA: "terminate all GPU processes, reset the GPU" before it is used again.
    - verdict ``restart`` (recovery action NONE, or XID 8/94 without field 230): never; the
      engine is restarted and the mark counted.
    - verdict ``unknown`` (no field 230 and an XID outside the table): when the GPU was marked
      before within the marks' window, on this node.

    ``marks_before`` counts the physical GPU's earlier marks in the window (daemon/actions.py).
    """
    if fault_reason == GPU_LOST_REASON:
        return True
    if fault_reason != GPU_FAULT_REASON:
        return False
    if verdict == VERDICT_RESET:
        return True
    return verdict == VERDICT_UNKNOWN and marks_before >= 1


def engine_blocked(gpus: tuple[int, ...], conditions: tuple[NodeCondition, ...]) -> NodeCondition | None:
    """The condition that keeps an engine on ``gpus`` out of rotation, if any."""
    return next((c for c in conditions if c.gpu in gpus), None)


def verdict_for(verdicts: Mapping[int, str], gpu: int) -> str:
    return verdicts.get(gpu, VERDICT_UNKNOWN)


__all__ = [
    "GPU_FAULT_REASON",
    "GPU_LOST_REASON",
    "GPU_UNRECOVERABLE",
    "VERDICT_RESET",
    "VERDICT_RESTART",
    "VERDICT_UNKNOWN",
    "NodeCondition",
    "engine_blocked",
    "gpu_unrecoverable",
    "gpu_verdicts",
    "verdict_for",
]
