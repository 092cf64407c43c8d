"""The reconcile step: statuses in, commands out; the policy's memory; the action executor."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.findings import Blame
from llmsupervisor.core.policy import Action, ActionKind, FleetRules
from llmsupervisor.core.policy_memory import PolicyMemory
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.actions import ActionExecutor, GpuMarks, commands_for
from llmsupervisor.daemon.reconcile import Reconciler, roll_due
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
    marks = GpuMarks(tmp_path / "gpu-faults.json", gpus=lambda: {i: f"GPU-{i}" for i in range(8)})
    return Reconciler(PolicyMemory(), ActionExecutor(sent, lambda name: (int(name[-1]),), marks)), sent


def run(rec: Reconciler, *statuses: EngineStatus, now: float = 10_000.0, **kw: Any) -> None:
    rec(statuses, now=now, minute_of_day=NOON, fleet=FleetRules(), **kw)


def test_a_hung_engine_gets_a_restart_that_counts_as_a_failure(tmp_path: Path) -> None:
    rec, sent = reconciler(tmp_path)
    run(rec, status("e0", findings=(finding(K.HANG, Severity.CRITICAL),)))
    restart = Restart(cause="hang", reason="hang: hang!", drain=False, failure=True, blame=Blame())
    assert sent.commands == [("e0", restart)]


@pytest.mark.parametrize(
    ("kind", "evidence", "blame"),
    [
        (K.HANG, {"rule": "stopped", "stopped_pid": 4242, "hung_pid": 4242}, Blame(pid=4242)),
        (K.HANG, {"rule": "stopped", "stopped_pid": 4242}, Blame(pid=4242)),
        (K.HANG, {"rule": "front", "hung_pid": 7, "hung_role": "api_server"}, Blame(pid=7, api_server=True)),
        (K.HANG, {"rule": "front"}, Blame(api_server=True)),
        (K.HANG, {"rule": "frozen", "hung_pid": 8, "hung_role": "engine_core"}, Blame(pid=8)),
        (K.HANG, {"rule": "deadlines"}, Blame()),
        (K.STALL, {}, Blame()),
        (K.GPU_FAULT, {"gpus": "0", "verdicts": "0=restart"}, None),  # no stacks: nothing to blame
    ],
    ids=["stopped", "stopped-old", "front", "front-rule-only", "frozen", "deadlines", "stall", "gpu-fault"],
)
def test_a_broken_engine_restart_carries_what_its_finding_blames(
    tmp_path: Path, kind: FindingKind, evidence: dict[str, float | str], blame: Blame | None
) -> None:
    """The process a hang's finding blames reaches the runner as data (engine/evidence.py
    decides from it whether the API server is cut before the stacks)."""
    rec, sent = reconciler(tmp_path)
    broken = Finding(
        engine="e0", kind=kind, severity=Severity.CRITICAL, evidence=evidence, since_s=0.0, summary="!"
    )
    run(rec, status("e0", findings=(broken,)))
    restarts = [cmd for _, cmd in sent.commands if isinstance(cmd, Restart)]
    assert [r.blame for r in restarts] == [blame]


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


def test_a_report_only_thermal_finding_is_no_step_down_cause_for_the_calm(tmp_path: Path) -> None:
    """Issue 36 (M1): the policy's memory counts the calm before a step up from the last
    step-down cause it saw; THERMAL INFO (SW thermal, Boost at the max operating temperature) is
    none, THERMAL WARNING is one."""
    rec, _sent = reconciler(tmp_path)
    run(rec, status("e0", findings=(finding(K.THERMAL, Severity.INFO),)), now=10_000)
    assert rec.memory.of("e0").step_cause_seen_s is None
    run(rec, status("e0", findings=(finding(K.THERMAL, Severity.WARNING),)), now=10_010)
    assert rec.memory.of("e0").step_cause_seen_s == 10_010


def test_gpu_faults_mark_the_engines_gpus(tmp_path: Path) -> None:
    rec, _sent = reconciler(tmp_path)
    run(rec, status("e3", findings=(finding(K.GPU_FAULT, Severity.CRITICAL),)))
    assert rec.executor.marks.counts == {3: 1}
    persisted = GpuMarks(tmp_path / "gpu-faults.json", gpus=lambda: {3: "GPU-3"})
    assert persisted.counts == {3: 1}


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


# ---- an engine `enabled: false` in the config, started by hand (issue 35) ----


def disabled(name: str, state: EngineState = S.READY, **changes: Any) -> EngineStatus:
    """A disabled engine as its runner publishes it: not asked to run until `start`."""
    return status(name, state, spec=spec(name, enabled=False), **{"wants_run": False, **changes})


def test_a_hung_disabled_engine_started_by_hand_is_restarted(tmp_path: Path) -> None:
    """The policy skipped every engine `enabled: false` names: one started by hand (`start`,
    for this run of the daemon) that hung was taken out of rotation and never restarted."""
    rec, sent = reconciler(tmp_path)
    hung = (finding(K.HANG, Severity.CRITICAL),)
    run(rec, disabled("e0", findings=hung, wants_run=True))
    restart = Restart(cause="hang", reason="hang: hang!", drain=False, failure=True, blame=Blame())
    assert sent.commands == [("e0", restart)]


def test_a_disabled_engine_is_the_policys_only_once_started_by_hand(tmp_path: Path) -> None:
    """Not started, or stopped again: no action, and not counted against max_unavailable.
    Started and drained by an operator: held out, and counted (it is out of rotation)."""
    rec, sent = reconciler(tmp_path)
    now = 10_000.0
    due = Incarnation(number=1, pid=1, pgid=1, step=0, started_s=0, ready_since_s=0, scheduled_due_s=now - 1)
    run(rec, status("e0", incarnation=due), disabled("e1", S.STOPPED, incarnation=None), now=now)
    assert [name for name, _ in sent.commands] == ["e0"]
    rec, sent = reconciler(tmp_path)
    drained = disabled("e1", S.DRAINING, wants_run=True, held=True, findings=(finding(K.MEMORY_GROWTH),))
    run(rec, status("e0", incarnation=due), drained, now=now)
    assert sent.commands == []  # e1 is out of rotation: e0's scheduled restart waits
    run(rec, disabled("e1", findings=(finding(K.HANG, Severity.CRITICAL),)), now=now)  # never started
    assert sent.commands == []


def test_a_changed_disabled_engine_started_by_hand_is_rolled(tmp_path: Path) -> None:
    """A reload that changes a disabled engine running by hand (still disabled): the policy
    restarts it onto its new spec, and the status says the roll is pending for it."""
    rec, sent = reconciler(tmp_path)
    new = spec("e0", enabled=False, args={"max-num-seqs": 8})
    by_hand = disabled("e0", wants_run=True)
    assert roll_due(by_hand, new) and not roll_due(disabled("e0", S.STOPPED), new)
    assert not roll_due(status("e0"), spec("e0", enabled=False))  # the reload disables it: stopped
    run(rec, by_hand, specs={"e0": new})
    assert sent.commands == [("e0", Restart(cause="config_change", reason="config changed", spec=new))]


# ---- a reload's roll (defect E1) ----


def test_a_reload_rolls_through_the_policy_with_the_configs_spec(tmp_path: Path) -> None:
    """The config names new specs for e0 and e1, and e2's scheduled restart is due: one restart,
    carrying the new spec; nothing more while it is pending, under way or just back."""
    rec, sent = reconciler(tmp_path)
    now = 10_000.0
    new = {n: spec(n, drain_grace_s=5.0, args={"max-num-seqs": 8}) for n in ("e0", "e1")}
    due = Incarnation(number=1, pid=1, pgid=1, step=0, started_s=0.0, ready_since_s=0.0, scheduled_due_s=1.0)
    fleet = [status("e0"), status("e1"), status("e2", incarnation=due)]
    specs = {**new, "e2": fleet[2].spec}
    run(rec, *fleet, now=now, specs=specs)
    assert sent.commands == [
        ("e0", Restart(cause="config_change", reason="config changed", spec=new["e0"])),
    ]
    run(rec, *fleet, now=now + 1, specs=specs, pending=lambda name: name == "e0")
    fleet[0] = status("e0", S.STARTING, spec=new["e0"], since_s=now + 30)
    run(rec, *fleet, now=now + 40, specs=specs)
    fleet[0] = status("e0", spec=new["e0"], since_s=now + 60)
    run(rec, *fleet, now=now + 62, specs=specs)  # READY, not yet seen by the load balancer
    assert len(sent.commands) == 1
    run(rec, *fleet, now=now + 70, specs=specs)
    assert sent.commands[1:] == [
        ("e1", Restart(cause="config_change", reason="config changed", spec=new["e1"]))
    ]
    # An operator's request: no rate-limit budget spent.
    assert rec.memory.of("e0").action_times_s == []


def test_a_new_spec_that_fails_halts_the_roll_until_it_is_ready_or_changed(tmp_path: Path) -> None:
    rec, sent = reconciler(tmp_path)
    new = {n: spec(n, args={"max-num-seqs": 8}) for n in ("e0", "e1")}
    specs = {**new, "e2": spec("e2")}
    two = FleetRules(max_unavailable=2)

    def run2(*statuses: EngineStatus, now: float, specs: dict[str, EngineSpec]) -> None:
        rec(statuses, now=now, minute_of_day=NOON, fleet=two, specs=specs)

    run2(status("e0"), status("e1"), status("e2", S.STARTING), now=10_000.0, specs=specs)
    assert [name for name, _ in sent.commands] == ["e0"]  # e2 starting counts: e1 waits
    sent.commands.clear()
    # e0's new spec fails to start; e2 is READY, so e1 would fit, but the roll halts.
    failed = status("e0", S.BACKOFF, spec=new["e0"])
    rest = (status("e1"), status("e2"))
    run2(failed, *rest, now=10_100.0, specs=specs)
    assert sent.commands == [] and rec.roll_halted_by == ("e0",)
    # The same file reloaded (equal specs, new objects): still halted.
    same = {n: dataclasses.replace(s) for n, s in specs.items()}
    run2(failed, *rest, now=10_200.0, specs=same)
    assert sent.commands == [] and rec.roll_halted_by == ("e0",)
    # A fix for e0 (another spec): the halt is lifted; e0 (in backoff) gets it at once, e1 rolls.
    fixed = {**same, "e0": spec("e0", args={"max-num-seqs": 4})}
    run2(failed, *rest, now=10_300.0, specs=fixed)
    assert not rec.roll_halted_by
    assert [(name, cmd.spec) for name, cmd in sent.commands if isinstance(cmd, Restart)] == [
        ("e0", fixed["e0"]),
        ("e1", fixed["e1"]),
    ]


def test_a_rolled_engine_ready_on_its_new_spec_lifts_the_halt(tmp_path: Path) -> None:
    rec, sent = reconciler(tmp_path)
    new = {n: spec(n, args={"max-num-seqs": 8}) for n in ("e0", "e1")}
    many = FleetRules(max_unavailable=2)
    rec((status("e0"), status("e1")), now=10_000.0, minute_of_day=NOON, fleet=many, specs=new)
    sent.commands.clear()
    rec((status("e0", S.FATAL, spec=new["e0"]),), now=10_100.0, minute_of_day=NOON, fleet=many, specs=new)
    assert rec.roll_halted_by == ("e0",)
    # The operator started it and it is READY on its new spec: the roll goes on.
    rec((status("e0", spec=new["e0"]), status("e1")), now=10_200.0, minute_of_day=NOON, fleet=many, specs=new)
    assert not rec.roll_halted_by


def test_e1_a_reload_right_after_a_policy_restart_not_yet_taken_waits(tmp_path: Path) -> None:
    """The defect's window: the policy sent e1 its scheduled restart and e1's runner has not taken
    it (its status is still READY, not busy); a reload in that gap changed e0. The roll counted
    capacity without ``pending`` and restarted e0 too: two out with max_unavailable=1."""
    rec, sent = reconciler(tmp_path)
    now = 10_000.0
    due = Incarnation(number=1, pid=1, pgid=1, step=0, started_s=0, ready_since_s=0, scheduled_due_s=now - 1)
    fleet = (status("e0"), status("e1", incarnation=due))
    run(rec, *fleet, now=now, specs={s.name: s.spec for s in fleet})
    assert [(name, type(cmd)) for name, cmd in sent.commands] == [("e1", Restart)]
    reloaded = {"e0": spec("e0", args={"max-num-seqs": 8}), "e1": fleet[1].spec}
    run(rec, *fleet, now=now + 0.5, specs=reloaded, pending=lambda name: name == "e1")
    assert len(sent.commands) == 1
