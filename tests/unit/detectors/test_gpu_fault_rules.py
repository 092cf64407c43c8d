"""GPU_FAULT's event rules (detectors/gpu.py, EVENT_RULES): which rule claims each NVML event,
in the order the table gives, and what one event alone makes of the finding."""

from __future__ import annotations

import pytest

from llmsupervisor.core.observe import Observation
from llmsupervisor.detectors import DetectorConfig, Severity, detect_gpu_fault, new_window
from llmsupervisor.detectors.gpu import EVENT_RULES
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.gpu_readings import GpuEvent

CFG = DetectorConfig()


def test_the_event_rules_run_in_this_order() -> None:
    # A lost GPU is claimed before its XID 79 is read as a fault; a recovery-action event with
    # its action before the fault kinds (which name it too, for when the action is unreadable).
    assert [rule.__name__ for rule in EVENT_RULES] == [
        "_lost_event",
        "_xid_event",
        "_recovery_event",
        "_fault_event",
        "_repair_event",
    ]


def one_event(
    kind: str, *, xid: int | None = None, action: int | None = None, index: int | None = 0
) -> GpuEvent:
    return GpuEvent(index=index, uuid=None, kind=kind, xid=xid, at_s=10.0, recovery_action=action)


# One event on a healthy GPU 0: (the event, the finding's severity, its faults, its verdicts).
ONE_EVENT: list[tuple[str, GpuEvent, Severity | None, str | None, str | None]] = [
    ("XID 79: GPU_LOST's", one_event("xid", xid=79), None, None, None),
    ("unavailable: GPU_LOST's", one_event("gpu_unavailable"), None, None, None),
    ("XID 13: the engine's", one_event("xid", xid=13), Severity.INFO, "xid 13 on GPU 0", None),
    ("XID 48", one_event("xid", xid=48), Severity.CRITICAL, "xid 48 on GPU 0", "0=reset"),
    ("an XID event without its number", one_event("xid"), None, None, None),
    ("recovery action NONE", one_event("gpu_recovery_action", action=0), None, None, None),
    (
        "recovery action gpu_reset",
        one_event("gpu_recovery_action", action=1),
        Severity.CRITICAL,
        "recovery action gpu_reset on GPU 0",
        "0=reset",
    ),
    (
        "a recovery-action event, its action unread: a fault kind",
        one_event("gpu_recovery_action"),
        Severity.CRITICAL,
        "gpu_recovery_action on GPU 0",
        "0=unknown",
    ),
    (
        "non-fatal poison",
        one_event("non_fatal_poison"),
        Severity.CRITICAL,
        "non_fatal_poison on GPU 0",
        "0=restart",
    ),
    (
        "a repair: DRAM retirement",
        one_event("dram_retirement"),
        Severity.INFO,
        "dram_retirement on GPU 0",
        None,
    ),
    ("no rule's kind", one_event("pstate"), None, None, None),
]


@pytest.mark.parametrize(
    ("name", "event", "severity", "faults", "verdicts"), ONE_EVENT, ids=[case[0] for case in ONE_EVENT]
)
def test_one_event(
    name: str, event: GpuEvent, severity: Severity | None, faults: str | None, verdicts: str | None
) -> None:
    window = new_window(CFG)
    window.append(Observation(engine="e", at_s=10.0, gpus={0: nominal_sample(0)}, gpu_events=(event,)))
    finding = detect_gpu_fault(window, 10.0, CFG)
    assert (finding and finding.severity) == severity
    assert (finding and finding.evidence["faults"]) == faults
    assert (finding and finding.evidence.get("verdicts")) == verdicts
