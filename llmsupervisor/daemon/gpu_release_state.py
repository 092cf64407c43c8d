"""What a GPU release is (daemon/gpu_release.py, which carries it out): its phases, the value the
releaser keeps and publishes, and how `status` shows it. Values and pure functions only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from llmsupervisor.config import EngineSpec
from llmsupervisor.daemon.holds import OperatorHold

DEFAULT_WINDOW_S: Final = 600.0  # NVML stays closed at most this long unless asked otherwise
MAX_WINDOW_S: Final = 3600.0
TAKE_BACK_S: Final = 60.0  # NVML must open again within this (the reopen backs off 2, 4, 8, 15 s)
STOP_MARGIN_S: Final = 30.0  # beyond the engines' own stop deadlines


class Phase(enum.Enum):
    STOPPING = "stopping"
    RELEASED = "released"
    TAKING_BACK = "taking_back"
    DONE = "done"
    FAILED = "failed"


ACTIVE: Final = frozenset({Phase.STOPPING, Phase.RELEASED, Phase.TAKING_BACK})


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuRelease:
    """One GPU's release, as it stands. Times are on the daemon's loop clock."""

    id: int  # one per release in this daemon's life: the CLI follows its own
    gpu: int  # NVML index
    uuid: str
    pci_bus_id: str | None
    by: str  # who asked (the release; the take-back is logged with its own)
    phase: Phase
    since_s: float  # when this phase began
    deadline_s: float | None  # when it ends by itself
    window_s: float  # NVML closed at most this long
    engines: tuple[str, ...]  # stopped and held for the reset; started again at the take-back
    drained: tuple[tuple[str, OperatorHold], ...] = ()  # of those, held drained before: drained again
    kept: tuple[str, ...] = ()  # on the GPU and already stopped by an operator: left so
    nvml_closed: bool = False
    opens_seen: int = 0  # GpuMonitor.opens_total when the take-back began
    outcome: str = ""  # where it stands and why, for the operator

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE


def reset_command(release: GpuRelease) -> str:
    """The reset for the operator, naming the board by its UUID: NVML's indices and
    nvidia-smi's may differ (CUDA_DEVICE_ORDER aside), a UUID never does."""
    return f"nvidia-smi -r -i {release.uuid}"


def release_json(release: GpuRelease | None, now: float) -> dict[str, Any] | None:
    """`status --json`'s ``gpu_release``: the release under way, or the last one."""
    if release is None:
        return None
    return {
        "id": release.id,
        "gpu": release.gpu,
        "uuid": release.uuid,
        "pci_bus_id": release.pci_bus_id,
        "phase": release.phase.value,
        "active": release.active,
        "by": release.by,
        "for_s": round(now - release.since_s, 1),
        "ends_in_s": None if release.deadline_s is None else round(max(0.0, release.deadline_s - now), 1),
        "window_s": release.window_s,
        "engines": list(release.engines),
        "kept_stopped": list(release.kept),
        "nvml_closed": release.nvml_closed,
        "outcome": release.outcome,
        "reset_command": reset_command(release),
        "take_back_command": f"llm-supervisor gpu take-back {release.gpu}",
    }


def stop_deadline_s(specs: Iterable[EngineSpec]) -> float:
    """How long the engines' stops may take, each by its own deadlines: the drain, the stop
    ladder, the wait for its GPU memory; plus a margin."""
    longest = max(
        (
            s.drain_timeout_s
            + s.stop_timeout_s
            + s.group_term_timeout_s
            + s.kill_timeout_s
            + s.gpu_release_timeout_s
            for s in specs
        ),
        default=0.0,
    )
    return longest + STOP_MARGIN_S


def names(engines: Iterable[str]) -> str:
    return ", ".join(engines) or "no engine"


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    return f"{minutes}m" if not secs else f"{minutes}m{secs:02d}s"


__all__ = [
    "ACTIVE",
    "DEFAULT_WINDOW_S",
    "MAX_WINDOW_S",
    "TAKE_BACK_S",
    "GpuRelease",
    "Phase",
    "duration",
    "names",
    "release_json",
    "reset_command",
    "stop_deadline_s",
]
