"""The reconcile step: statuses in, commands out; the policy's memory; the action executor."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from llmsupervisor.core.policy import Action, ActionKind, FleetRules
from llmsupervisor.core.policy_memory import PolicyMemory
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.actions import ActionExecutor, GpuMarks, commands_for
from llmsupervisor.daemon.reconcile import Reconciler
from llmsupervisor.detectors import Finding, FindingKind, Severity
from llmsupervisor.engine.commands import Command, ResetPrefixCache, Restart, Shed, StepTo
from llmsupervisor.engine.status import EngineStatus, Incarnation
from tests.lib.statuses import spec, status

S = EngineState
K = FindingKind
NOON = 12 * 60


def finding(kind: FindingKind, severity: Severity = Severity.WARNING) -> Finding:
    return Finding(
        engine="e", kind=kind, severity=severity, evidence={}, since_s=0.0, summary=f"{kind.value}!"
    )


class Sent:
    def __init__(self) -> None:
        self.commands: list[tuple[str, Command]] = []

    def __call__(self, name: str, cmd: Command) -> None:
        self.commands.append((name, cmd))


def reconciler(tmp_path: Path) -> tuple[Reconciler, Sent]:
    sent = Sent()
    marks = GpuMarks(tmp_path / "gpu-faults.json")
    return Reconciler(PolicyMemory(), ActionExecutor(sent, lambda name: (int(name[-1]),), marks)), sent


def run(rec: Reconciler, *statuses: EngineStatus, now: float = 10_000.0, **kw: Any) -> None:
    rec(statuses, now=now, minute_of_day=NOON, fleet=FleetRules(), **kw)


def test_a_hung_engine_gets_a_restart_that_counts_as_a_failure(tmp_path: Path) -> None:
    rec, sent = reconciler(tmp_path)
    run(rec, status("e0", findings=(finding(K.HANG, Severity.CRITICAL),)))
    assert sent.commands == [("e0", Restart(cause="hang", reason="hang: hang!", drain=False, failure=True))]


def test_nothing_is_sent_twice_while_commands_are_pending(tmp_path: Path) -> None:
    rec, sent = reconciler(tmp_path)
    hung = status("e0", findings=(finding(K.HANG, Severity.CRITICAL),))
    run(rec, hung)
    run(rec, hung, pending=lambda name: True)  # the runner has not taken the restart yet
    run(rec, dataclasses.replace(hung, busy=True))  # it has: a restart is in flight
    assert len(sent.commands) == 1


def test_d2_a_fresh_incarnation_is_not_restarted_on_the_last_ones_due_time(tmp_path: Path) -> None:
    """The defect: the policy saw READY with the previous incarnation's past due time and sent a
    second scheduled restart, bypassing max_unavailable (b is still starting)."""
    rec, sent = reconciler(tmp_path)
    now = 10_000.0
    fresh = Incarnation(
        number=2, pid=1, pgid=1, step=0, started_s=now - 130, ready_since_s=now, scheduled_due_s=now + 3600
    )
    run(rec, status("e0", since_s=now, incarnation=fresh), status("e1", S.STARTING), now=now)
    assert sent.commands == []


def test_a_due_scheduled_restart_waits_for_capacity(tmp_path: Path) -> None:
    rec, sent = reconciler(tmp_path)
    now = 10_000.0
    due = Incarnation(number=1, pid=1, pgid=1, step=0, started_s=0, ready_since_s=0, scheduled_due_s=now - 1)
    run(rec, status("e0", incarnation=due), status("e1", S.STARTING), now=now)
    assert sent.commands == []
    run(rec, status("e0", incarnation=due), status("e1"), now=now)
    assert sent.commands == [
        ("e0", Restart(cause="scheduled", reason="scheduled: periodic restart (restart_every_h)"))
    ]


def test_memory_keeps_rate_limits_and_resets_the_prefix_attempt_per_incarnation(tmp_path: Path) -> None:
    rec, sent = reconciler(tmp_path)
    degraded = status("e0", findings=(finding(K.DEGRADATION_TTFT),))
    run(rec, degraded, status("e1"), now=10_000)
    assert [c for _, c in sent.commands] == [ResetPrefixCache("degradation_ttft!")]
    run(rec, degraded, status("e1"), now=10_010)  # tried, within repair_verify_s: wait
    assert len(sent.commands) == 1
    memory = rec.memory.of("e0")
    assert memory.prefix_reset_at_s == 10_000 and memory.actions_total == {
        ("reset_prefix_cache", "degradation_ttft"): 1
    }
    inc2 = Incarnation(number=2, pid=2, pgid=2, step=0, started_s=10_020, ready_since_s=10_020)
    run(rec, dataclasses.replace(degraded, incarnation=inc2), status("e1"), now=20_000)
    assert rec.memory.of("e0").prefix_reset_at_s == 20_000  # a new incarnation: the cheap repair again


def test_oom_at_start_steps_the_next_spawn_down_without_a_restart(tmp_path: Path) -> None:
    rec, sent = reconciler(tmp_path)
    failed = dataclasses.replace(
        status("e0", S.BACKOFF, incarnation=None),
        start_failed_oom=True,
        ladder_steps=2,
        spec=spec("e0", ladder=({"max-num-seqs": 8},) * 2),
    )
    run(rec, failed)
    assert [c for _, c in sent.commands] == [
        StepTo(1, "oom_at_start: the last start ran out of memory: the next one starts a step down")
    ]


def test_gpu_faults_mark_the_engines_gpus(tmp_path: Path) -> None:
    rec, _sent = reconciler(tmp_path)
    run(rec, status("e3", findings=(finding(K.GPU_FAULT, Severity.CRITICAL),)))
    assert rec.executor.marks.counts == {3: 1}
    assert GpuMarks(tmp_path / "gpu-faults.json").counts == {3: 1}  # persisted


def test_commands_for_each_action_kind() -> None:
    def action(kind: ActionKind, **kw: Any) -> Action:
        return Action(engine="e", kind=kind, reason="r", detail="d", **kw)

    assert commands_for(action(ActionKind.SHED)) == [Shed("d")]
    assert commands_for(action(ActionKind.UNSHED)) == [Shed(None)]
    assert commands_for(action(ActionKind.STEP_DOWN, step=2, planned=True)) == [
        StepTo(2, "r: d"),
        Restart(cause="step_down", reason="step_down: d"),
    ]
    assert commands_for(action(ActionKind.STEP_DOWN, step=2)) == [StepTo(2, "r: d")]
    assert commands_for(action(ActionKind.SCHEDULED_RESTART)) == [
        Restart(cause="scheduled", reason="scheduled: d")
    ]


def test_an_engine_with_a_restart_not_yet_begun_counts_as_out_of_rotation(tmp_path: Path) -> None:
    """Two reconciles before the first engine has taken its scheduled restart must not let the
    second one restart too (max_unavailable=1)."""
    rec, sent = reconciler(tmp_path)
    now = 10_000.0
    due = Incarnation(number=1, pid=1, pgid=1, step=0, started_s=0, ready_since_s=0, scheduled_due_s=now - 1)
    both = (status("e0", incarnation=due), status("e1", incarnation=due))
    run(rec, *both, now=now)
    run(rec, *both, now=now + 0.1, pending=lambda name: name == "e0")
    assert [name for name, _ in sent.commands] == ["e0"]
