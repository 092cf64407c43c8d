"""GPU_FAULT's event rules (detectors/gpu.py, EVENT_RULES): which rule claims each NVML event,
in the order the table gives, and what one event alone makes of the finding."""

from __future__ import annotations

import pytest

from llmsupervisor.core.observe import Observation
from llmsupervisor.detectors import DetectorConfig, Severity, detect_gpu_fault, new_window
from llmsupervisor.detectors.gpu import EVENT_RULES, catalogue_verdict
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.gpu_readings import XID_CATALOGUE, GpuEvent

CFG = DetectorConfig()


def test_the_event_rules_run_in_this_order() -> None:
    # A lost GPU is claimed before its XID 79 is read as a fault; a recovery-action event with
    # its action before the fault kinds (which name it too, for when the action is unreadable).
    assert [rule.__name__ for rule in EVENT_RULES] == [
        "_lost_event",
        "_recovery_changed_xid",
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
    (
        "XID 48, no field 230",
        one_event("xid", xid=48),
        Severity.CRITICAL,
        "xid 48 on GPU 0 (no recovery action; NVIDIA's XID catalogue: WORKFLOW_XID_48)",
        "0=reset",
    ),
    (
        "XID 48, action GPU_RESET",
        one_event("xid", xid=48, action=1),
        Severity.CRITICAL,
        "xid 48 on GPU 0",
        "0=reset",
    ),
    # Issue 36 (L7): XID 154 has no action of its own; the recovery action read says.
    (
        "XID 154, action NONE",
        one_event("xid", xid=154, action=0),
        Severity.INFO,
        "xid 154 (recovery action changed) on GPU 0: none",
        None,
    ),
    (
        "XID 154, action GPU_RESET",
        one_event("xid", xid=154, action=1),
        Severity.CRITICAL,
        "xid 154 (recovery action changed) on GPU 0: gpu_reset",
        "0=reset",
    ),
    (
        "XID 154, action unread",
        one_event("xid", xid=154),
        Severity.CRITICAL,
        "xid 154 (recovery action changed) on GPU 0, action unread",
        "0=unknown",
    ),
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


# Issue 36 (M4): without field 230 (drivers before R565), NVIDIA's XID catalogue decides. The
# review's list of reset-class XIDs the old table called unknown, and the other buckets.
CATALOGUE: list[tuple[int, Severity, str | None]] = [
    *((n, Severity.CRITICAL, "0=reset") for n in (46, 62, 110, 136, 143, 155, 156, 158)),
    *((n, Severity.CRITICAL, "0=reset") for n in (48, 64, 95, 119, 120, 140)),  # the old table's
    (160, Severity.CRITICAL, "0=reset"),  # RESTART_BM: a node restart resets the GPU
    (8, Severity.CRITICAL, "0=restart"),  # RESTART_APP
    (94, Severity.CRITICAL, "0=restart"),
    (32, Severity.CRITICAL, "0=restart"),
    (93, Severity.INFO, None),  # IGNORE: a note
    (61, Severity.CRITICAL, "0=unknown"),  # UNEXPECTED_ERR_REPORT_ISSUE: a look
    (54, Severity.CRITICAL, "0=unknown"),  # CHECK_MECHANICALS
    (163, Severity.CRITICAL, "0=unknown"),  # not in the catalogue
    (999, Severity.CRITICAL, "0=unknown"),  # NVML could not name it
    (13, Severity.INFO, None),  # the engine's own (xid_engine_level)
    (63, Severity.INFO, None),  # info only
]


@pytest.mark.parametrize(("xid", "severity", "verdicts"), CATALOGUE, ids=[str(c[0]) for c in CATALOGUE])
def test_without_field_230_the_xid_catalogue_gives_the_verdict(
    xid: int, severity: Severity, verdicts: str | None
) -> None:
    window = new_window(CFG)
    window.append(
        Observation(
            engine="e", at_s=10.0, gpus={0: nominal_sample(0)}, gpu_events=(one_event("xid", xid=xid),)
        )
    )
    finding = detect_gpu_fault(window, 10.0, CFG)
    assert finding is not None
    assert (finding.severity, finding.evidence.get("verdicts")) == (severity, verdicts)


def test_the_catalogue_is_nvidias_buckets() -> None:
    # A spot check of XID_CATALOGUE against the catalogue's "Resolution" column (NVIDIA's
    # machine-readable copy is NVSentinel's xiderrorsmapping.csv; docs/gpu.md).
    assert XID_CATALOGUE[62] == "RESET_GPU" and XID_CATALOGUE[79] == "RESTART_BM"
    assert XID_CATALOGUE[31] == "RESTART_APP" and XID_CATALOGUE[92] == "IGNORE"
    assert XID_CATALOGUE[154] == "FOLLOW_OTHER_XID" and XID_CATALOGUE[151] == "RESTART_VM"
    assert set(XID_CATALOGUE) == set(range(1, 163))
    assert {catalogue_verdict(x) for x in XID_CATALOGUE} == {"reset", "restart", "unknown", None}
