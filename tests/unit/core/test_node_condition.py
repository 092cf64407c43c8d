"""GPU faults the engine cannot survive: the node condition (core/node_condition.py), how it is
kept (daemon/actions.GpuMarks), and how it is said: /readyz, /engines/NAME/ready, the HAProxy
agent, the metric and status. Through the real daemon with the fake GPU file:
tests/system/test_node_condition_system.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor.cli.render import format_status
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.node_condition import (
    GPU_UNRECOVERABLE,
    NodeCondition,
    after_reset,
    engine_blocked,
    gpu_unrecoverable,
)
from llmsupervisor.core.policy import finding_gpus
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.actions import GpuMarks, blocked_reason
from llmsupervisor.daemon.agent import agent_reply
from llmsupervisor.engine.status import EngineStatus
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.gpu_readings import GpuSample
from tests.lib.endpoints import serve_endpoints

LOST = NodeCondition(GPU_UNRECOVERABLE, 1, "gpu_lost (fault 1): GPU 1 lost")
UUIDS = {0: "GPU-aaaa", 1: "GPU-bbbb", 2: "GPU-cccc", 3: "GPU-dddd"}


def on(mapping: dict[int, str]) -> Any:
    return lambda: dict(mapping)


def status(name: str, gpus: tuple[int, ...]) -> EngineStatus:
    spec = EngineSpec(name=name, model="m", gpus=gpus, port=8000)
    base = EngineStatus(name=name, spec=spec, state=EngineState.READY, state_reason="", state_since_s=0.0)
    return base


@pytest.mark.parametrize(
    ("reason", "verdict", "unrecoverable"),
    [
        ("gpu_lost", "unknown", True),  # no restart brings a GPU back onto the bus
        ("gpu_lost", "restart", True),
        ("gpu_fault", "reset", True),  # the GPU says reset (or XID 48/95/64/62/46... without it)
        ("gpu_fault", "field_diag", True),  # a failed row remap: no reset clears it
        ("gpu_fault", "restart", False),  # recovery action NONE: restart and count, never more
        # No verdict (no field 230, an XID the catalogue gives no fix for): a look, at once; a
        # restart on a GPU nobody judged would loop (issue 36, M4).
        ("gpu_fault", "unknown", True),
        ("hang", "reset", False),  # not a GPU-marking cause
    ],
)
def test_which_faults_make_a_gpu_unrecoverable(reason: str, verdict: str, unrecoverable: bool) -> None:
    assert gpu_unrecoverable(reason, verdict) is unrecoverable


def test_engine_blocked_by_a_condition_on_any_of_its_gpus() -> None:
    assert engine_blocked((0,), (LOST,)) is None
    assert engine_blocked((0, 1), (LOST,)) == LOST


def test_a_fault_with_no_verdict_sets_the_condition_at_once_and_keeps_it_for_this_boot(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gpu-faults.json"
    marks = GpuMarks(path, gpus=on(UUIDS), boot="boot-1")
    new = marks.mark((0,), "GPU fault: xid 61 on GPU 0", reason="gpu_fault", verdicts={0: "unknown"})
    assert new == [
        NodeCondition(
            GPU_UNRECOVERABLE,
            0,
            "gpu_fault (needs a look: no recovery action, and no fix in NVIDIA's XID catalogue):"
            " GPU fault: xid 61 on GPU 0",
            "GPU-aaaa",
            "unknown",
        )
    ]
    assert marks.conditions == tuple(new)
    # Set once: a second fault neither repeats it nor changes its reason.
    assert marks.mark((0,), "again", reason="gpu_fault") == []
    assert marks.conditions == tuple(new)
    # A daemon restart in the same boot keeps it; a reboot (the usual remediation) clears it,
    # and keeps the count within the window.
    assert GpuMarks(path, gpus=on(UUIDS), boot="boot-1").conditions == tuple(new)
    rebooted = GpuMarks(path, gpus=on(UUIDS), boot="boot-2")
    assert rebooted.conditions == () and rebooted.counts == {0: 2}
    # What clears it, per verdict: a look then `gpu clear`; never `gpu clear` for a failed remap.
    assert "XID catalogue" in blocked_reason(new[0]) and "gpu clear GPU-aaaa" in blocked_reason(new[0])


def test_a_failed_row_remap_is_permanent_and_says_field_diagnostic_not_gpu_clear(tmp_path: Path) -> None:
    """Issue 36, L6: nvml.h sets failureOccurred "if a row remapping ever failed": no reset
    clears it, so the condition names a field diagnostic and an RMA, not a reset and `gpu clear`."""
    marks = GpuMarks(tmp_path / "gpu-faults.json", gpus=on(UUIDS), boot="b")
    (condition,) = marks.mark(
        (1,), "row remap failed on GPU 1", reason="gpu_fault", verdicts={1: "field_diag"}
    )
    assert condition.verdict == "field_diag" and "RMA" in condition.reason
    why = blocked_reason(condition)
    assert "field diagnostic" in why and "RMA" in why
    assert "gpu clear" not in why and "after the reset" not in why
    assert condition.as_json()["verdict"] == "field_diag"
    reset = marks.mark((0,), "xid 48 on GPU 0", reason="gpu_fault", verdicts={0: "reset"})
    assert "gpu release 0, the reset, llm-supervisor gpu take-back 0" in blocked_reason(reset[0])
    assert "llm-supervisor gpu clear GPU-aaaa" in blocked_reason(reset[0])


def test_an_operator_clears_a_condition_after_a_reset_and_the_marks_stay(tmp_path: Path) -> None:
    path = tmp_path / "gpu-faults.json"
    marks = GpuMarks(path, gpus=on(UUIDS), boot="boot-1")
    marks.mark((0,), "xid 48 on GPU 0", reason="gpu_fault", verdicts={0: "reset"})
    # `gpu clear` reads the file without NVML: the conditions of this boot, by UUID.
    offline = GpuMarks(path, boot="boot-1")
    assert list(offline.held_uuids()) == ["GPU-aaaa"]
    assert GpuMarks(path, boot="boot-2").held_uuids() == {}  # another boot's is history
    assert offline.clear("GPU-aaaa") and not offline.clear("GPU-aaaa") and not offline.clear("GPU-zz")
    after = GpuMarks(path, gpus=on(UUIDS), boot="boot-1")
    assert after.conditions == () and after.counts == {0: 1}


def test_a_reset_verdict_sets_the_condition_at_the_first_fault(tmp_path: Path) -> None:
    marks = GpuMarks(tmp_path / "gpu-faults.json", gpus=on(UUIDS), boot="b")
    new = marks.mark((0,), "xid 48 on GPU 0", reason="gpu_fault", verdicts={0: "reset"})
    assert [(c.gpu, c.uuid) for c in new] == [(0, "GPU-aaaa")]
    assert "needs a GPU reset" in new[0].reason


def test_restart_verdicts_count_but_never_set_the_condition(tmp_path: Path) -> None:
    marks = GpuMarks(tmp_path / "gpu-faults.json", gpus=on(UUIDS), boot="b")
    for _ in range(5):
        assert marks.mark((0,), "xid 94", reason="gpu_fault", verdicts={0: "restart"}) == []
    assert marks.counts == {0: 5} and marks.conditions == ()


def test_a_mark_follows_the_uuid_not_the_index_after_a_reorder(tmp_path: Path) -> None:
    # GPU-aaaa at index 0 faults; after a reboot GPU-aaaa is missing and GPU-bbbb moved to 0.
    path = tmp_path / "gpu-faults.json"
    marks = GpuMarks(path, gpus=on({0: "GPU-aaaa", 1: "GPU-bbbb"}), boot="boot-1")
    marks.mark((0,), "xid 48 on GPU 0", reason="gpu_fault", verdicts={0: "reset"})
    assert marks.counts == {0: 1} and [c.gpu for c in marks.conditions] == [0]
    # Same boot, index order changed (a GPU that was missing came back at 0): the condition
    # moves with its board.
    same_boot = GpuMarks(path, gpus=on({0: "GPU-zzzz", 1: "GPU-aaaa", 2: "GPU-bbbb"}), boot="boot-1")
    assert [(c.gpu, c.uuid) for c in same_boot.conditions] == [(1, "GPU-aaaa")]
    assert same_boot.counts == {1: 1}
    # The board is gone (RMA): nothing lands on the GPU that now has its index.
    replaced = GpuMarks(path, gpus=on({0: "GPU-bbbb"}), boot="boot-1")
    assert replaced.conditions == () and replaced.counts == {}
    # The file followed the pod to another node (a PVC): other UUIDs, nothing applies.
    elsewhere = GpuMarks(path, gpus=on({0: "GPU-1111"}), boot="boot-9")
    assert elsewhere.conditions == () and elsewhere.counts == {}
    stored = json.loads(path.read_text())
    assert stored["version"] == 2
    (mark,) = stored["gpus"]["GPU-aaaa"]["marks"]
    assert mark["boot_id"] == "boot-1" and mark["verdict"] == "reset" and "node" in mark


def test_marks_expire_after_the_window(tmp_path: Path) -> None:
    now = [1_000_000.0]
    marks = GpuMarks(tmp_path / "m.json", gpus=on(UUIDS), boot="b", window_s=3600, clock=lambda: now[0])
    marks.mark((0,), "xid 94", reason="gpu_fault", verdicts={0: "restart"})
    now[0] += 3601
    assert marks.counts == {}
    marks.mark((0,), "xid 94", reason="gpu_fault", verdicts={0: "restart"})
    assert marks.counts == {0: 1}  # the first is history


def test_the_old_by_index_file_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "gpu-faults.json"
    path.write_text(json.dumps({"0": {"count": 3, "unrecoverable": {"reason": "x", "boot_id": "b"}}}))
    marks = GpuMarks(path, gpus=on(UUIDS), boot="b")
    assert marks.counts == {} and marks.conditions == ()


def test_a_gpu_nvml_does_not_name_is_not_marked(tmp_path: Path) -> None:
    marks = GpuMarks(tmp_path / "gpu-faults.json", gpus=on({}), boot="b")
    assert marks.mark((0,), "xid 48", reason="gpu_fault", verdicts={0: "reset"}) == []
    assert marks.counts == {}


def test_a_lost_gpu_is_a_condition_at_once(tmp_path: Path) -> None:
    marks = GpuMarks(tmp_path / "gpu-faults.json", gpus=on(UUIDS), boot="b")
    assert [c.gpu for c in marks.mark((1,), "GPU 1 lost", reason="gpu_lost")] == [1]


def test_readyz_engine_ready_and_agent_say_the_condition() -> None:
    engines = (status("a", (0,)), status("b", (1,)))
    got = serve_endpoints(engines, readyz_requires=lambda: "any", node_conditions=lambda: (LOST,))
    code, body = got["/readyz"]
    assert code == 503 and body["ready"] is False
    assert body["reason"] == "gpu_unrecoverable on GPU 1: gpu_lost (fault 1): GPU 1 lost"
    assert body["node_conditions"] == [
        {"condition": "gpu_unrecoverable", "gpu": 1, "uuid": "", "reason": LOST.reason}
    ]
    assert got["/engines/a/ready"][0] == 200  # on another GPU: still serves its own traffic
    assert agent_reply(engines[0], (LOST,)).startswith("ready up")
    assert agent_reply(engines[1], (LOST,)) == "maint"
    assert serve_endpoints(engines)["/readyz"][0] == 200  # without the condition


def test_status_says_the_condition() -> None:
    text = format_status({"engines": {}, "node_conditions": [LOST.as_json()]})
    assert "Node condition gpu_unrecoverable on GPU 1: gpu_lost (fault 1): GPU 1 lost" in text


def test_status_says_which_way_each_gpus_faults_are_judged() -> None:
    # Issue 36 (M4): the recovery action read (field 230), or NVIDIA's XID catalogue without it.
    status = {
        "engines": {},
        "gpu_verdicts": {"0": "recovery_action", "1": "xid_catalogue", "2": "xid_catalogue"},
    }
    lines = format_status(status).splitlines()
    assert "GPU faults judged by the GPU's recovery action (field 230): GPU 0" in lines
    assert (
        "GPU faults judged by NVIDIA's XID catalogue (the driver has no recovery action, R565+ needed):"
        " GPU 1,2" in lines
    )


def test_a_tensor_parallel_engine_marks_only_the_gpu_the_fault_was_on(tmp_path: Path) -> None:
    marks = GpuMarks(tmp_path / "gpu-faults.json", gpus=on(UUIDS), boot="b")
    for _ in range(2):
        marks.mark((0, 1), "xid 48 on GPU 1", reason="gpu_fault", faulted=(1,), verdicts={1: "reset"})
    assert marks.counts == {1: 2} and [c.gpu for c in marks.conditions] == [1]
    # A finding that names no GPU of the engine (or none at all) counts against all of them.
    marks.mark((2, 3), "ECC", reason="gpu_fault", faulted=None)
    marks.mark((2, 3), "xid on GPU ?", reason="gpu_fault", faulted=(7,))
    assert marks.counts == {1: 2, 2: 2, 3: 2}
    assert [c.gpu for c in marks.conditions] == [1, 2, 3]


def test_the_policy_passes_the_findings_gpus_to_the_action() -> None:
    def finding(gpus: str | None) -> Finding:
        evidence: dict[str, float | str] = {} if gpus is None else {"gpus": gpus}
        return Finding(
            engine="a",
            kind=FindingKind.GPU_LOST,
            severity=Severity.CRITICAL,
            evidence=evidence,
            since_s=0.0,
            summary="",
        )

    assert finding_gpus(finding("1,3")) == (1, 3)
    assert finding_gpus(finding("?")) is None
    assert finding_gpus(finding(None)) is None


def _sample(**fields: object) -> GpuSample:
    return nominal_sample(
        1, "GPU-b", **{"recovery_action": 0, "remap_pending": False, "remap_failed": False, **fields}
    )


RESET = NodeCondition("gpu_unrecoverable", 1, "gpu_fault (needs a GPU reset): xid 48", "GPU-b", "reset")


@pytest.mark.parametrize(
    ("condition", "sample", "fit", "clears", "said"),
    [
        (RESET, _sample(), True, True, "recovery action none"),
        (None, _sample(), True, False, "recovery action none"),
        (RESET, _sample(recovery_action=None), True, True, "taken on the operator's word"),
        (RESET, _sample(recovery_action=1), False, False, "still asks for gpu_reset"),
        (RESET, _sample(remap_pending=True), False, False, "row remap is still pending"),
        (RESET, _sample(remap_failed=True), False, False, "field diagnostic"),
        (
            NodeCondition("gpu_unrecoverable", 1, "row remap failed", "GPU-b", "field_diag"),
            _sample(),
            False,
            False,
            "permanent",
        ),
        (RESET, ProbeFailure("gpu_lost", "GPU-b is lost"), False, False, "does not answer NVML"),
        (RESET, None, False, False, "NVML does not list the GPU"),
    ],
)
def test_after_a_reset_a_gpu_is_fit_and_cleared_only_when_nothing_asks_for_the_reset_again(
    condition: NodeCondition | None,
    sample: GpuSample | ProbeFailure | None,
    fit: bool,
    clears: bool,
    said: str,
) -> None:
    """`gpu take-back` (daemon/gpu_release.py) judges the GPU on its first sample: field 230 back
    to NONE, no remap pending (nvml.h: applied at the next reset); never a failed remap (nvml.h:
    set "if a row remapping ever failed")."""
    check = after_reset(condition, sample)
    assert (check.fit, check.clears) == (fit, clears) and said in check.why
