"""GPU faults the engine cannot survive: the node condition (core/node_condition.py), how it is
kept (daemon/actions.GpuMarks), and how it is said: /readyz, /engines/NAME/ready, the HAProxy
agent, the metric and status. Through the real daemon with the fake GPU file:
tests/system/test_node_condition_system.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsupervisor.agent import agent_reply
from llmsupervisor.cli_render import format_status
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.node_condition import (
    GPU_UNRECOVERABLE,
    NodeCondition,
    engine_blocked,
    gpu_unrecoverable,
)
from llmsupervisor.core.policy import finding_gpus
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.actions import GpuMarks
from llmsupervisor.engine.status import EngineStatus
from tests.lib.endpoints import serve_endpoints

LOST = NodeCondition(GPU_UNRECOVERABLE, 1, "gpu_lost (fault 1): GPU 1 lost")


def status(name: str, gpus: tuple[int, ...]) -> EngineStatus:
    spec = EngineSpec(name=name, model="m", gpus=gpus, port=8000)
    base = EngineStatus(name=name, spec=spec, state=EngineState.READY, state_reason="", state_since_s=0.0)
    return base


@pytest.mark.parametrize(
    ("reason", "marks_before", "unrecoverable"),
    [
        ("gpu_lost", 0, True),  # no restart brings a GPU back onto the bus
        ("gpu_lost", 3, True),
        ("gpu_fault", 0, False),  # one critical XID: the restart may clear it
        ("gpu_fault", 1, True),  # the second on the same GPU: the hardware
        ("hang", 5, False),  # not a GPU-marking cause
    ],
)
def test_which_faults_make_a_gpu_unrecoverable(reason: str, marks_before: int, unrecoverable: bool) -> None:
    assert gpu_unrecoverable(reason, marks_before) is unrecoverable


def test_engine_blocked_by_a_condition_on_any_of_its_gpus() -> None:
    assert engine_blocked((0,), (LOST,)) is None
    assert engine_blocked((0, 1), (LOST,)) == LOST


def test_marks_set_the_condition_on_the_second_fault_and_keep_it_for_this_boot(tmp_path: Path) -> None:
    path = tmp_path / "gpu-faults.json"
    marks = GpuMarks(path, boot="boot-1")
    assert marks.mark((0,), "GPU fault: xid 48 on GPU 0", reason="gpu_fault") == []
    assert marks.conditions == ()
    new = marks.mark((0,), "GPU fault: xid 48 on GPU 0", reason="gpu_fault")
    assert new == [NodeCondition(GPU_UNRECOVERABLE, 0, "gpu_fault (fault 2): GPU fault: xid 48 on GPU 0")]
    assert marks.conditions == tuple(new)
    # Set once: a third fault neither repeats it nor changes its reason.
    assert marks.mark((0,), "again", reason="gpu_fault") == []
    assert marks.conditions == tuple(new)
    # A daemon restart in the same boot keeps it; a reboot (the usual remediation) clears it,
    # and keeps the count.
    assert GpuMarks(path, boot="boot-1").conditions == tuple(new)
    rebooted = GpuMarks(path, boot="boot-2")
    assert rebooted.conditions == () and rebooted.counts == {0: 3}


def test_a_lost_gpu_is_a_condition_at_once(tmp_path: Path) -> None:
    marks = GpuMarks(tmp_path / "gpu-faults.json", boot="b")
    assert [c.gpu for c in marks.mark((1,), "GPU 1 lost", reason="gpu_lost")] == [1]


def test_readyz_engine_ready_and_agent_say_the_condition() -> None:
    engines = (status("a", (0,)), status("b", (1,)))
    got = serve_endpoints(engines, readyz_requires=lambda: "any", node_conditions=lambda: (LOST,))
    code, body = got["/readyz"]
    assert code == 503 and body["ready"] is False
    assert body["reason"] == "gpu_unrecoverable on GPU 1: gpu_lost (fault 1): GPU 1 lost"
    assert body["node_conditions"] == [{"condition": "gpu_unrecoverable", "gpu": 1, "reason": LOST.reason}]
    assert got["/engines/a/ready"][0] == 200  # on another GPU: still serves its own traffic
    assert agent_reply(engines[0], (LOST,)).startswith("ready up")
    assert agent_reply(engines[1], (LOST,)) == "maint"
    assert serve_endpoints(engines)["/readyz"][0] == 200  # without the condition


def test_status_says_the_condition() -> None:
    text = format_status({"engines": {}, "node_conditions": [LOST.as_json()]})
    assert "Node condition gpu_unrecoverable on GPU 1: gpu_lost (fault 1): GPU 1 lost" in text


def test_a_tensor_parallel_engine_marks_only_the_gpu_the_fault_was_on(tmp_path: Path) -> None:
    marks = GpuMarks(tmp_path / "gpu-faults.json", boot="b")
    for _ in range(2):
        marks.mark((0, 1), "xid 48 on GPU 1", reason="gpu_fault", faulted=(1,))
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
