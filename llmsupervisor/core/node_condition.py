"""Node conditions: GPU faults the engine cannot survive, handed to node-level remediation.

A restart fixes an engine; it does not fix a GPU that fell off the bus, nor one that keeps
raising critical XIDs. Those belong to the tools that own the node (NVIDIA's NVSentinel, the
device plugin, an operator): the daemon sets the condition, says so on ``/readyz`` (503 with the
reason), in status and as a metric, keeps the engines on that GPU out of the load balancer, and
does not cordon or drain the node itself (docs/fleet.md, "GPU faults the engine cannot survive").

Pure: which fault makes a GPU unrecoverable is a function of the fault and the GPU's marks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

GPU_UNRECOVERABLE: Final = "gpu_unrecoverable"

# The policy's reasons for a GPU-marking restart (FindingKind values, core/policy.GPU_MARKING).
GPU_LOST_REASON: Final = "gpu_lost"
GPU_FAULT_REASON: Final = "gpu_fault"


@dataclass(frozen=True, slots=True)
class NodeCondition:
    condition: str  # GPU_UNRECOVERABLE
    gpu: int
    reason: str  # what the GPU did, as the finding said it

    def describe(self) -> str:
        return f"{self.condition} on GPU {self.gpu}: {self.reason}"

    def as_json(self) -> dict[str, Any]:
        return {"condition": self.condition, "gpu": self.gpu, "reason": self.reason}


def gpu_unrecoverable(fault_reason: str, marks_before: int) -> bool:
    """Whether a GPU-marking restart means the GPU itself is gone for this node.

    - ``gpu_lost`` (XID 79, a GPU-unavailable event, NVML saying the GPU is lost): at once. No
      engine restart brings a GPU back onto the bus; only a reset or a reboot does.
    - ``gpu_fault`` (a critical XID, a double-bit ECC error, poison, a failed row remap; the
      policy marks only critical ones): when the GPU was marked before. A single fault may be
      one bad kernel and a restart clears it; a second on the same GPU says the hardware is bad.

    ``marks_before`` counts every earlier mark of the GPU, kept across daemon restarts.
    """
    if fault_reason == GPU_LOST_REASON:
        return True
    return fault_reason == GPU_FAULT_REASON and marks_before >= 1


def engine_blocked(gpus: tuple[int, ...], conditions: tuple[NodeCondition, ...]) -> NodeCondition | None:
    """The condition that keeps an engine on ``gpus`` out of rotation, if any."""
    return next((c for c in conditions if c.gpu in gpus), None)


__all__ = [
    "GPU_FAULT_REASON",
    "GPU_LOST_REASON",
    "GPU_UNRECOVERABLE",
    "NodeCondition",
    "engine_blocked",
    "gpu_unrecoverable",
]
