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


def counted(n: int | float, noun: str, nouns: str | None = None) -> str:
    """``1 deadline miss``, ``3 deadline misses``: a count with its noun in the right number."""
    return f"{n:g} {noun if n == 1 else nouns or noun + 's'}"


def evidence_text(evidence: Mapping[str, float | str]) -> str:
    """A finding's evidence for a person (the log line and `events`): units read off the key
    (``_s`` seconds, ``_ratio`` a share), floats rounded to three digits, underscores as spaces:
    ``rule deadlines, frozen 12.3 s, misses 3, cpu 0.4%``. The raw values stay in the event's
    JSON (`events --json`)."""
    parts = []
    for key, value in evidence.items():
        name, unit = key, ""
        if key.endswith("_s"):
            name, unit = key[:-2], " s"
        elif key.endswith("_ratio") and isinstance(value, float):
            name = key[: -len("_ratio")]
            parts.append(f"{name.replace('_', ' ')} {value:.1%}")
            continue
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        parts.append(f"{name.replace('_', ' ')} {shown}{unit}")
    return ", ".join(parts)


# The hang rules whose finding says the API server itself is the hung process (the ``front``
# rule: its event loop held, detectors/hang/front.py). Its stack is then the evidence.
API_SERVER_RULES: frozenset[str] = frozenset({"front"})
API_SERVER_ROLE = "api_server"  # the ``hung_role`` evidence of a finding that blames the API server


@dataclass(frozen=True, slots=True, kw_only=True)
class Blame:
    """The process a hang finding blames, as its evidence says (detectors/hang/rules.py: the
    ``hung_pid`` and ``hung_role`` of every rule that names one, the ``stopped`` rule's
    ``stopped_pid``). It travels with the restart to the runner, which cuts the API server
    before taking the stacks unless it is the one blamed (engine/evidence.py)."""

    pid: int | None = None  # the process the finding names; None: it names none
    api_server: bool = False  # the finding says the API server is hung

    def names_leader(self, leader_pid: int) -> bool:
        """Whether the API server (the group's leader, ``leader_pid``) is the process blamed."""
        return self.api_server or self.pid == leader_pid


def _pid(raw: float | str | None) -> int | None:
    if isinstance(raw, (int, float)) or (isinstance(raw, str) and raw.isdigit()):
        return int(raw)
    return None


def blame_of(finding: Finding) -> Blame:
    """What ``finding``'s evidence blames; an empty ``Blame`` when it names no process."""
    ev = finding.evidence
    pid = _pid(ev.get("hung_pid"))
    return Blame(
        pid=pid if pid is not None else _pid(ev.get("stopped_pid")),
        api_server=ev.get("hung_role") == API_SERVER_ROLE or ev.get("rule") in API_SERVER_RULES,
    )


__all__ = [
    "API_SERVER_ROLE",
    "API_SERVER_RULES",
    "Blame",
    "Finding",
    "FindingKind",
    "Severity",
    "blame_of",
    "counted",
    "evidence_text",
]
