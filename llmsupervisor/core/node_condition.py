"""Node conditions: GPU faults the engine cannot survive, handed to node-level remediation.

A restart fixes an engine; it does not fix a GPU that fell off the bus, nor one that the GPU
itself says must be reset. Those belong to the tools that own the node (NVIDIA's NVSentinel, the
device plugin, an operator): the daemon sets the condition, says so on ``/readyz`` (503 with the
reason), in status and as a metric, stops the engines on that GPU rather than restarting them
into READY, and does not cordon or drain the node itself (docs/gpu.md, docs/fleet.md).

Pure: which fault makes a GPU unrecoverable is a function of the fault, the GPU's verdict on it
and the GPU's recent marks; and whether a GPU taken back after an operator's reset
(daemon/gpu_release.py) is fit to serve again, and clears its condition, is a function of the
condition and of what the GPU answers after it (``after_reset``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import RECOVERY_NONE, GpuSample, recovery_action_name

GPU_UNRECOVERABLE: Final = "gpu_unrecoverable"

# The policy's reasons for a GPU-marking restart (FindingKind values, core/policy.GPU_MARKING).
GPU_LOST_REASON: Final = "gpu_lost"
GPU_FAULT_REASON: Final = "gpu_fault"

# A GPU fault's verdict (detectors/gpu.py VERDICT_*): the GPU's recovery action, or NVIDIA's XID
# catalogue where the driver has no recovery action.
VERDICT_RESTART: Final = "restart"  # restart the engine and count: the GPU is fine
VERDICT_UNKNOWN: Final = "unknown"  # no verdict: needs a look before the GPU serves again
VERDICT_RESET: Final = "reset"  # the GPU must be reset (or the node rebooted) before use
# A failed row remap: permanent, no reset clears it (nvml.h nvmlDeviceGetRemappedRows:
# failureOccurred is set "if a row remapping ever failed in the past"). NVIDIA's remedy is a field
# diagnostic, then an RMA (NVSentinel: DCGM_FR_ROW_REMAP_FAILURE -> RUN_FIELDDIAG).
VERDICT_FIELD_DIAG: Final = "field_diag"
VERDICTS: Final = (VERDICT_RESTART, VERDICT_UNKNOWN, VERDICT_RESET, VERDICT_FIELD_DIAG)  # mildest first
# The verdicts that take the GPU out of service at once: everything but a restart.
CONDITION_VERDICTS: Final = frozenset({VERDICT_UNKNOWN, VERDICT_RESET, VERDICT_FIELD_DIAG})


@dataclass(frozen=True, slots=True)
class NodeCondition:
    condition: str  # GPU_UNRECOVERABLE
    gpu: int  # the GPU's NVML index on this boot (what engines name)
    reason: str  # what the GPU did, as the finding said it
    uuid: str = ""  # the physical GPU the condition belongs to
    verdict: str = ""  # the fault's verdict (VERDICTS): what clears it; "" for a lost GPU

    def describe(self) -> str:
        return f"{self.condition} on GPU {self.gpu}{f' ({self.uuid})' if self.uuid else ''}: {self.reason}"

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "condition": self.condition,
            "gpu": self.gpu,
            "uuid": self.uuid,
            "reason": self.reason,
        }
        if self.verdict:
            out["verdict"] = self.verdict
        return out


def gpu_verdicts(raw: object) -> dict[int, str]:
    """A GPU_FAULT finding's ``verdicts`` evidence ("0=reset,1=restart") by GPU index."""
    if not isinstance(raw, str):
        return {}
    out: dict[int, str] = {}
    for part in raw.split(","):
        gpu, _, verdict = part.partition("=")
        if gpu.strip().isdigit() and verdict in VERDICTS:
            out[int(gpu)] = verdict
    return out


def gpu_unrecoverable(fault_reason: str, verdict: str = VERDICT_UNKNOWN) -> bool:
    """Whether a GPU-marking fault takes the GPU out of service for this node, at once.

    - ``gpu_lost`` (XID 79, a GPU-unavailable event, NVML saying the GPU is lost or needs a
      reset): no engine restart brings a GPU back; only a reset or a reboot does.
    - ``gpu_fault`` with verdict ``reset`` (a recovery action other than NONE, or on drivers
      without it an XID NVIDIA's catalogue resolves with a reset: 46, 48, 62, 64, 95, 110, ...):
      NVIDIA: "terminate all GPU processes, reset the GPU" before it is used again.
    - verdict ``field_diag`` (a failed row remap): no reset clears it.
    - verdict ``unknown`` (no recovery action, and an XID the catalogue does not resolve, or
      says to report): the GPU needs a look. Restarting the engine on it would loop on a GPU
      nobody judged, so it is out of rotation until an operator clears it or the node reboots.
    - verdict ``restart`` (recovery action NONE, or a RESTART_APP XID without it): never; the
      engine is restarted and the mark counted.
    """
    if fault_reason == GPU_LOST_REASON:
        return True
    return fault_reason == GPU_FAULT_REASON and verdict in CONDITION_VERDICTS


def engine_blocked(gpus: tuple[int, ...], conditions: tuple[NodeCondition, ...]) -> NodeCondition | None:
    """The condition that keeps an engine on ``gpus`` out of rotation, if any."""
    return next((c for c in conditions if c.gpu in gpus), None)


def verdict_for(verdicts: Mapping[int, str], gpu: int) -> str:
    return verdicts.get(gpu, VERDICT_UNKNOWN)


@dataclass(frozen=True, slots=True)
class ResetCheck:
    """A GPU taken back after a reset: whether its engines may start on it (``fit``), whether its
    condition is cleared (``clears``), and why, for the operator."""

    fit: bool
    clears: bool
    why: str


def after_reset(condition: NodeCondition | None, sample: GpuSample | ProbeFailure | None) -> ResetCheck:
    """Judge a GPU on its first sample after an operator's reset (NVML opened again).

    Fit, and its condition cleared, when it answers and nothing it says still asks for the reset
    the condition was set for: no recovery action but NONE (field 230; where the driver has none,
    the operator's take-back is the word that it was reset, as `gpu clear`'s is), no row remap
    pending (nvml.h: a pending remap waits for the next reset). Never for a failed row remap
    (nvml.h: ``failureOccurred`` is set "if a row remapping ever failed", a reset does not clear
    it): its remedy is a field diagnostic and an RMA. Not fit, the condition kept, when NVML does
    not list it (``sample`` None) or it does not answer."""
    if sample is None:
        return ResetCheck(False, False, "NVML does not list the GPU after the reset (off the bus?)")
    if isinstance(sample, ProbeFailure):
        return ResetCheck(False, False, f"the GPU does not answer NVML after the reset ({sample})")
    if sample.remap_failed or (condition is not None and condition.verdict == VERDICT_FIELD_DIAG):
        return ResetCheck(
            False,
            False,
            "a row remap failed on it: permanent, no reset clears it; run NVIDIA's field diagnostic"
            " and RMA it if that fails",
        )
    action = sample.recovery_action
    if action is not None and action != RECOVERY_NONE:
        return ResetCheck(
            False,
            False,
            f"it still asks for {recovery_action_name(action)} (recovery action, field 230): the"
            " reset did not happen or did not help",
        )
    if sample.remap_pending:
        return ResetCheck(
            False, False, "a row remap is still pending, which the next reset applies: was it reset?"
        )
    said = (
        "recovery action none"
        if action is not None
        else "no recovery action on this driver (before R565): taken on the operator's word"
    )
    return ResetCheck(True, condition is not None, f"it answers NVML ({said})")


__all__ = [
    "CONDITION_VERDICTS",
    "GPU_FAULT_REASON",
    "GPU_LOST_REASON",
    "GPU_UNRECOVERABLE",
    "VERDICTS",
    "VERDICT_FIELD_DIAG",
    "VERDICT_RESET",
    "VERDICT_RESTART",
    "VERDICT_UNKNOWN",
    "NodeCondition",
    "ResetCheck",
    "after_reset",
    "engine_blocked",
    "gpu_unrecoverable",
    "gpu_verdicts",
    "verdict_for",
]
