"""The policy: findings and engine states in, actions out (pure; no clock but ``now_s``)."""

from __future__ import annotations

import dataclasses

import pytest

from llmsupervisor.core.policy import (
    ENGINE_RULES,
    PLANNED_RULES,
    WAIT,
    Action,
    ActionKind,
    Decision,
    EngineRules,
    EngineView,
    FleetRules,
    decide,
    in_window,
    rate_limit,
)
from llmsupervisor.core.state import EngineState
from llmsupervisor.detectors import Finding, FindingKind, Severity

K = FindingKind
S = EngineState
A = ActionKind
NOON = 12 * 60


def finding(kind: FindingKind, severity: Severity = Severity.WARNING, engine: str = "e1") -> Finding:
    return Finding(
        engine=engine, kind=kind, severity=severity, evidence={}, since_s=0.0, summary=f"{kind.value}!"
    )


def view(name: str = "e1", *findings: Finding, **changes: object) -> EngineView:
    base = EngineView(name=name, state=S.READY, findings=tuple(findings))
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def kinds(actions: tuple[Action, ...]) -> list[tuple[str, ActionKind, str]]:
    return [(a.engine, a.kind, a.reason) for a in actions]


def run(
    *views: EngineView, now_s: float = 10_000.0, minute: int = NOON, fleet: FleetRules | None = None
) -> Decision:
    return decide(views, now_s, minute_of_day=minute, fleet=fleet or FleetRules())


@pytest.mark.parametrize(
    ("found", "expected", "drain", "mark"),
    [
        (finding(K.HANG, Severity.CRITICAL), A.RESTART, False, False),
        (finding(K.STALL), A.RESTART, False, False),
        (finding(K.GPU_FAULT, Severity.CRITICAL), A.RESTART, True, True),
        (finding(K.GPU_LOST, Severity.CRITICAL), A.RESTART, True, True),
    ],
    ids=lambda x: getattr(x, "value", None) or str(x),
)
def test_broken_engines_restart_at_once_as_failures(
    found: Finding, expected: ActionKind, drain: bool, mark: bool
) -> None:
    # Even past the rate limit and with another engine out: a broken engine is already lost.
    busy_hour = tuple(10_000.0 - i for i in range(10))
    decision = run(view("e1", found, action_times_s=busy_hour), view("e2", state=S.BACKOFF))
    (action,) = decision.actions
    assert (action.kind, action.reason, action.drain, action.failure, action.mark_gpus) == (
        expected,
        found.kind.value,
        drain,
        True,
        mark,
    )


def test_engine_level_xid_is_reported_only() -> None:
    assert run(view("e1", finding(K.GPU_FAULT, Severity.INFO))).actions == ()


@pytest.mark.parametrize(
    "found",
    [finding(K.FOREIGN_GPU_MEMORY), finding(K.POWER_THROTTLE, Severity.INFO), finding(K.NVML_LOST)],
    ids=lambda f: f.kind.value,
)
def test_report_only_findings(found: Finding) -> None:
    assert run(view("e1", found, ladder_steps=2)).actions == ()


def test_kv_pressure_sheds_then_unsheds() -> None:
    pressure = finding(K.KV_PRESSURE)
    assert kinds(run(view("e1", pressure), view("e2")).actions) == [("e1", A.SHED, "kv_pressure")]
    shedding = view("e1", state=S.SHEDDING)
    assert kinds(run(shedding, view("e2")).actions) == [("e1", A.UNSHED, "kv_pressure")]
    # Still under pressure while shedding: nothing new.
    assert run(view("e1", pressure, state=S.SHEDDING), view("e2")).actions == ()


def test_shedding_keeps_min_in_rotation() -> None:
    pressure = finding(K.KV_PRESSURE)
    decision = run(view("e1", pressure), view("e2", finding(K.KV_PRESSURE, engine="e2")))
    assert kinds(decision.actions) == [("e1", A.SHED, "kv_pressure")]
    assert [(d.engine, d.kind) for d in decision.deferred] == [("e2", A.SHED)]
    assert "min_in_rotation=1" in decision.deferred[0].why
    # A single engine is never shed unless the operator allows zero (a backup server exists).
    assert run(view("e1", pressure)).actions == ()
    zero = FleetRules(min_in_rotation=0)
    assert kinds(run(view("e1", pressure), fleet=zero).actions) == [("e1", A.SHED, "kv_pressure")]


def test_shedding_ignores_the_rate_limit() -> None:
    limited = tuple(10_000.0 - i for i in range(10))
    decision = run(view("e1", finding(K.KV_PRESSURE), action_times_s=limited), view("e2"))
    assert kinds(decision.actions) == [("e1", A.SHED, "kv_pressure")]


@pytest.mark.parametrize("cause", [K.PREEMPTION_STORM, K.THERMAL], ids=str)
def test_ladder_steps_down_on_load_causes(cause: FindingKind) -> None:
    (action,) = run(view("e1", finding(cause), ladder_steps=2, ladder_step=0)).actions
    assert (action.kind, action.step, action.planned, action.drain) == (A.STEP_DOWN, 1, True, True)


def test_a_warm_gpu_is_reported_not_stepped_down_and_does_not_hold_the_ladder_down() -> None:
    """Issue 36 (M1): THERMAL INFO (SW thermal alone: Boost at the max operating temperature)
    steps nothing down, and an engine on a lower step still steps up after the calm period."""
    warm = finding(K.THERMAL, Severity.INFO)
    assert run(view("e1", warm, ladder_steps=2, ladder_step=0)).actions == ()
    lower = view(
        "e1",
        warm,
        ladder_steps=2,
        ladder_step=1,
        ladder_changed_s=0.0,
        step_cause_seen_s=0.0,
        rules=EngineRules(ladder_calm_s=1800),
    )
    (action,) = run(lower, now_s=1_800.0).actions
    assert (action.kind, action.step) == (A.STEP_UP, 0)


def test_the_power_brake_is_alerted_on_not_restarted_for() -> None:
    # Issue 23: the PSU/BMC asserts the brake; a smaller batch does not clear it.
    assert run(view("e1", finding(K.POWER_THROTTLE), ladder_steps=2, ladder_step=0)).actions == ()


# Issue 36 (M4, L6): every verdict that sets the node condition, "unknown" (a look) and
# "field_diag" (a failed remap) as "reset": marked, not left to the start-failure budget (which
# would restart the engine on a GPU nobody judged).
@pytest.mark.parametrize("verdict", ["reset", "unknown", "field_diag"])
def test_a_gpu_that_needs_a_reset_is_marked_even_while_the_engine_starts(verdict: str) -> None:
    reset = Finding(
        engine="e1",
        kind=K.GPU_FAULT,
        severity=Severity.CRITICAL,
        evidence={"gpus": "0", "verdicts": f"0={verdict}"},
        since_s=0.0,
        summary="GPU fault that needs a GPU reset: xid 48 on GPU 0",
    )
    (action,) = run(view("e1", reset, state=S.STARTING)).actions
    assert action.mark_gpus and action.gpu_verdicts == ((0, verdict),) and action.fault_gpus == (0,)
    # An app-level or restart-class fault during a start is the start's business: no mark.
    restart = dataclasses.replace(reset, evidence={"gpus": "0", "verdicts": "0=restart"})
    assert run(view("e1", restart, state=S.STARTING)).actions == ()


def test_ladder_bottom_reports_only() -> None:
    assert run(view("e1", finding(K.THERMAL), ladder_steps=2, ladder_step=2)).actions == ()
    assert run(view("e1", finding(K.THERMAL), ladder_steps=0)).actions == ()


def test_ladder_steps_up_after_calm_one_step_at_a_time() -> None:
    calm = EngineRules(ladder_calm_s=1800)
    lower = view(
        "e1", ladder_steps=3, ladder_step=2, ladder_changed_s=0.0, step_cause_seen_s=5_000.0, rules=calm
    )
    assert run(lower, now_s=6_799.0).actions == ()  # 1799 s since the cause was last seen
    (action,) = run(lower, now_s=6_800.0).actions
    assert (action.kind, action.step, action.reason) == (A.STEP_UP, 1, "calm")
    # The step change itself restarts the calm period.
    assert run(dataclasses.replace(lower, ladder_changed_s=6_000.0), now_s=6_800.0).actions == ()
    # Never while the cause is active.
    assert (
        run(dataclasses.replace(lower, findings=(finding(K.THERMAL),)), now_s=99_999.0).actions[0].kind
        is A.STEP_DOWN
    )


def test_oom_at_start_steps_down_before_the_next_start() -> None:
    failed = view("e1", state=S.BACKOFF, start_failed_oom=True, ladder_steps=2, ladder_step=0)
    (action,) = run(failed).actions
    assert (action.kind, action.step, action.reason, action.planned) == (
        A.STEP_DOWN,
        1,
        "oom_at_start",
        False,
    )
    assert run(dataclasses.replace(failed, ladder_step=2)).actions == ()


def test_planned_actions_respect_max_unavailable() -> None:
    storm = finding(K.PREEMPTION_STORM)
    e1 = view("e1", storm, ladder_steps=1)
    e2 = view("e2", finding(K.PREEMPTION_STORM, engine="e2"), ladder_steps=1)
    decision = run(e1, e2)
    assert kinds(decision.actions) == [("e1", A.STEP_DOWN, "preemption_storm")]
    assert [(d.engine, d.kind) for d in decision.deferred] == [("e2", A.STEP_DOWN)]
    assert kinds(run(e1, e2, fleet=FleetRules(max_unavailable=2)).actions) == [
        ("e1", A.STEP_DOWN, "preemption_storm"),
        ("e2", A.STEP_DOWN, "preemption_storm"),
    ]


@pytest.mark.parametrize("other", [S.BACKOFF, S.STARTING, S.FATAL, S.DRAINING, S.SHEDDING], ids=str)
def test_unplanned_unavailability_counts_against_max_unavailable(other: EngineState) -> None:
    still_out = (finding(K.KV_PRESSURE, engine="e2"),) if other is S.SHEDDING else ()
    decision = run(view("e1", finding(K.MEMORY_GROWTH)), view("e2", *still_out, state=other))
    assert decision.actions == ()
    assert "max_unavailable=1" in decision.deferred[0].why


def test_a_planned_action_on_an_engine_already_out_does_not_count_twice() -> None:
    shed = view("e1", finding(K.KV_PRESSURE), finding(K.MEMORY_GROWTH), state=S.SHEDDING)
    assert kinds(run(shed, view("e2")).actions) == [("e1", A.RESTART, "memory_growth")]


def test_one_action_in_flight_per_engine() -> None:
    assert run(view("e1", finding(K.HANG, Severity.CRITICAL), busy=True)).actions == ()
    assert run(view("e1", finding(K.MEMORY_GROWTH), held_out=True)).actions == ()


@pytest.mark.parametrize(
    "state", [S.STARTING, S.STOPPING, S.STOPPED, S.BACKOFF, S.FATAL, S.DRAINING], ids=str
)
def test_only_serving_engines_are_acted_on(state: EngineState) -> None:
    assert run(view("e1", finding(K.HANG, Severity.CRITICAL), state=state)).actions == ()


def test_automatic_off_reports_only() -> None:
    quiet = EngineRules(automatic=False)
    assert run(view("e1", finding(K.HANG, Severity.CRITICAL), rules=quiet)).actions == ()


def test_rate_limit() -> None:
    rules = EngineRules(max_actions_per_hour=2, action_cooldown_s=60)
    assert rate_limit(view(rules=rules), 10_000.0) is None
    assert "action_cooldown_s=60" in (
        rate_limit(view(rules=rules, action_times_s=(9_950.0,)), 10_000.0) or ""
    )
    full = view(rules=rules, action_times_s=(7_000.0, 8_000.0))
    assert "2 actions in the last hour" in (rate_limit(full, 10_000.0) or "")
    assert rate_limit(full, 10_601.0) is None  # the first fell out of the hour
    decision = run(view("e1", finding(K.MEMORY_GROWTH), rules=rules, action_times_s=(9_990.0,)))
    assert decision.actions == () and "rate limit" in decision.deferred[0].why


def test_degradation_tries_the_cheap_repair_first_then_restarts() -> None:
    slow = finding(K.DEGRADATION_PREFIX_CACHE)
    rules = EngineRules(repair_verify_s=300)
    (first,) = run(view("e1", slow, rules=rules)).actions
    assert (first.kind, first.planned) == (A.RESET_PREFIX_CACHE, False)
    assert run(view("e1", slow, rules=rules, prefix_reset_at_s=9_800.0)).actions == ()  # verifying
    (then,) = run(view("e1", slow, rules=rules, prefix_reset_at_s=9_700.0)).actions
    assert (then.kind, then.planned, then.reason) == (A.RESTART, True, "degradation_prefix_cache")
    assert "did not help" in then.detail
    (unsupported,) = run(view("e1", slow, prefix_reset_supported=False)).actions
    assert unsupported.kind is A.RESTART


def test_scheduled_restart_when_due_and_inside_the_window() -> None:
    rules = EngineRules(restart_window=(2 * 60, 5 * 60))
    due = view("e1", scheduled_due_s=9_000.0, rules=rules)
    assert run(due, minute=NOON).actions == ()  # outside 02:00-05:00
    (action,) = run(due, minute=3 * 60).actions
    assert (action.kind, action.reason, action.planned) == (A.SCHEDULED_RESTART, "schedule", True)
    assert run(dataclasses.replace(due, scheduled_due_s=20_000.0), minute=3 * 60).actions == ()


def test_scheduled_restarts_never_two_at_once() -> None:
    e1 = view("e1", scheduled_due_s=1.0)
    e2 = view("e2", scheduled_due_s=1.0)
    decision = run(e1, e2)
    assert kinds(decision.actions) == [("e1", A.SCHEDULED_RESTART, "schedule")]
    # Next tick: e1 is restarting (not READY), so e2 waits its turn.
    assert run(dataclasses.replace(e1, state=S.STARTING, scheduled_due_s=None), e2).actions == ()


@pytest.mark.parametrize(
    ("minute", "window", "inside"),
    [
        (0, None, True),
        (120, (120, 300), True),
        (300, (120, 300), False),
        (23 * 60 + 30, (23 * 60, 60), True),
        (30, (23 * 60, 60), True),
        (90, (23 * 60, 60), False),
    ],
)
def test_in_window(minute: int, window: tuple[int, int] | None, inside: bool) -> None:
    assert in_window(minute, window) is inside


def test_an_engine_just_back_counts_as_out_until_the_load_balancer_sees_it() -> None:
    # e2 came back 2 s ago; HAProxy needs drain_grace_s (5 s here) to send it traffic again.
    grace = EngineRules(rotation_grace_s=5.0)
    e1 = view("e1", finding(K.MEMORY_GROWTH), rules=grace, ready_since_s=0.0)
    e2 = view("e2", rules=grace, ready_since_s=9_998.0)
    decision = run(e1, e2)
    assert decision.actions == () and "max_unavailable=1" in decision.deferred[0].why
    later = run(e1, e2, now_s=10_003.0)
    assert kinds(later.actions) == [("e1", A.RESTART, "memory_growth")]


# ---- a reload's roll: CONFIG_RESTART (defect E1: the roll decided capacity on its own) ----


def test_config_roll_and_a_due_schedule_take_one_engine_out_at_a_time() -> None:
    """Two engines with a new spec pending and a third's scheduled restart due in the same round,
    max_unavailable=1: one restart; the next waits until the first is READY again (and seen)."""
    grace = EngineRules(rotation_grace_s=5.0)
    e1 = view("e1", config_pending=True, rules=grace, ready_since_s=0.0)
    e2 = view("e2", config_pending=True, rules=grace, ready_since_s=0.0)
    e3 = view("e3", scheduled_due_s=1.0, rules=grace, ready_since_s=0.0)
    first = run(e1, e2, e3)
    assert kinds(first.actions) == [("e1", A.CONFIG_RESTART, "config_change")]
    assert first.actions[0].planned and first.actions[0].drain
    assert [(d.engine, d.kind) for d in first.deferred] == [
        ("e2", A.CONFIG_RESTART),
        ("e3", A.SCHEDULED_RESTART),
    ]
    # The restart sent but not yet taken (busy), then under way, then READY but not yet seen
    # by the load balancer: nothing else goes.
    for e1_now in (
        dataclasses.replace(e1, busy=True),
        dataclasses.replace(e1, state=S.DRAINING, busy=True),
        dataclasses.replace(e1, state=S.STARTING, config_pending=False, config_rolled=True),
        dataclasses.replace(e1, config_pending=False, config_rolled=True, ready_since_s=9_998.0),
    ):
        assert run(e1_now, e2, e3).actions == (), e1_now
    back = dataclasses.replace(e1, config_pending=False, ready_since_s=9_990.0)
    assert kinds(run(back, e2, e3).actions) == [("e2", A.CONFIG_RESTART, "config_change")]


def test_two_engines_just_ready_together_are_not_both_rolled() -> None:
    """Seen in CI (tests/vllm/test_haproxy_vllm.py): two engines READY in the same second, a
    reload 5 s later with rotation_grace_s 5: both were "not yet back in rotation", so restarting
    each counted as free, and both were drained at once with max_unavailable=1. An engine that
    serves waits for its grace to end, then takes its turn under the capacity check."""
    grace = EngineRules(rotation_grace_s=5.0)
    e1 = view("e1", config_pending=True, rules=grace, ready_since_s=9_997.0)
    e2 = view("e2", config_pending=True, rules=grace, ready_since_s=9_997.0)
    early = run(e1, e2)
    assert early.actions == ()
    assert [(d.engine, d.why) for d in early.deferred] == [
        ("e1", "back in rotation only just now"),
        ("e2", "back in rotation only just now"),
    ]
    later = run(e1, e2, now_s=10_003.0)
    assert kinds(later.actions) == [("e1", A.CONFIG_RESTART, "config_change")]


def test_a_config_restart_waits_for_a_command_not_yet_taken() -> None:
    """The policy sent e3 a scheduled restart that its runner has not taken (pending: busy):
    e3 counts as out, so the roll waits (the reload's own check did not see it)."""
    decision = run(view("e1", config_pending=True), view("e3", busy=True))
    assert decision.actions == ()
    assert "max_unavailable=1" in decision.deferred[0].why
    both = run(view("e1", config_pending=True), view("e3", busy=True), fleet=FleetRules(max_unavailable=2))
    assert kinds(both.actions) == [("e1", A.CONFIG_RESTART, "config_change")]


@pytest.mark.parametrize("failed", [S.BACKOFF, S.FATAL], ids=str)
def test_a_new_spec_that_fails_to_start_halts_the_roll(failed: EngineState) -> None:
    e1 = view("e1", state=failed, config_rolled=True)
    e2 = view("e2", config_pending=True)
    for fleet in (FleetRules(), FleetRules(max_unavailable=3)):
        decision = run(e1, e2, fleet=fleet)
        assert decision.actions == ()
        assert decision.roll_halted_by == ("e1",)
        assert "roll halted: e1 failed to start on the new config" in decision.deferred[0].why
    # e1 READY on its new spec again (its own retries, or the operator's start): the roll goes on.
    recovered = run(view("e1", ready_since_s=0.0), e2, fleet=FleetRules(max_unavailable=2))
    assert kinds(recovered.actions) == [("e2", A.CONFIG_RESTART, "config_change")]
    assert recovered.roll_halted_by == ()
    # An engine that failed on its OLD spec (its config restart not begun) halts nothing.
    old = run(
        view("e1", state=failed, config_rolled=True, config_pending=True),
        e2,
        fleet=FleetRules(max_unavailable=2),
    )
    assert old.roll_halted_by == ()


def test_a_config_change_rolls_in_report_only_mode_and_past_the_rate_limit() -> None:
    """A reload is the operator's request: automatic_actions: false and the rate limits hold
    back the policy's own actions, not the roll."""
    quiet = EngineRules(automatic=False, max_actions_per_hour=1, action_cooldown_s=3600)
    busy_hour = (9_999.0,)
    (action,) = run(view("e1", config_pending=True, rules=quiet, action_times_s=busy_hour)).actions
    assert (action.kind, action.reason, action.planned) == (A.CONFIG_RESTART, "config_change", True)
    # ...and still within max_unavailable.
    held = run(view("e1", config_pending=True, rules=quiet), view("e2", state=S.BACKOFF))
    assert held.actions == () and "max_unavailable=1" in held.deferred[0].why


@pytest.mark.parametrize("state", [S.STARTING, S.BACKOFF, S.STOPPED, S.FATAL], ids=str)
def test_an_engine_out_of_rotation_gets_its_new_spec_at_once(state: EngineState) -> None:
    """It serves no one: the restart costs no capacity (a stopped or FATAL engine only takes the
    spec and stays as it is: the runner's rule, D5)."""
    decision = run(view("e1", state=state, config_pending=True), view("e2", state=S.BACKOFF))
    (action,) = decision.actions
    assert (action.engine, action.kind, action.planned) == ("e1", A.CONFIG_RESTART, False)


def test_an_engine_draining_or_stopping_is_rolled_after() -> None:
    for state in (S.DRAINING, S.STOPPING):
        assert run(view("e1", state=state, config_pending=True)).actions == ()
    # An operator's drain (held) is out of rotation: its new spec comes at once; it stays held.
    (action,) = run(view("e1", state=S.DRAINING, held_out=True, config_pending=True)).actions
    assert (action.kind, action.planned) == (A.CONFIG_RESTART, False)


def test_a_config_restart_comes_before_the_engines_own_planned_restart() -> None:
    (action,) = run(view("e1", finding(K.MEMORY_GROWTH), config_pending=True, scheduled_due_s=1.0)).actions
    assert action.kind is A.CONFIG_RESTART
    # A broken engine whose roll waits is still restarted at once (on its old spec).
    hung = view("e1", finding(K.HANG, Severity.CRITICAL), config_pending=True)
    decision = run(hung, view("e2", state=S.STARTING))
    assert kinds(decision.actions) == [("e1", A.RESTART, "hang")]
    assert [d.kind for d in decision.deferred] == [A.CONFIG_RESTART]


def test_the_rule_tables_run_in_the_order_the_module_docstring_gives() -> None:
    assert [rule.__name__ for rule in ENGINE_RULES] == [
        "_config_roll",
        "_report_only",
        "_oom_at_start",
        "_starting",
        "_not_serving",
        "_broken",
        "_kv_pressure",
        "_pressure_cleared",
        "_planned_action",
    ]
    assert [rule.__name__ for rule in PLANNED_RULES] == [
        "_step_down",
        "_degradation",
        "_memory_growth",
        "_step_up",
        "_scheduled",
    ]


# Each planned rule alone, on one READY engine one step down with a due schedule at 10,000 s:
# (the rule, the findings, what it wants: (kind, reason), or None).
DOWN_ONE = {"ladder_step": 1, "ladder_steps": 2, "scheduled_due_s": 1.0}
PLANNED_TABLE = [
    ("_step_down", (K.THERMAL,), (A.STEP_DOWN, "thermal")),
    ("_step_down", (K.POWER_THROTTLE,), None),  # the power brake: alerted on only
    ("_degradation", (K.DEGRADATION_TTFT,), (A.RESET_PREFIX_CACHE, "degradation_ttft")),
    ("_degradation", (K.MEMORY_GROWTH,), None),
    ("_memory_growth", (K.MEMORY_GROWTH,), (A.RESTART, "memory_growth")),
    ("_step_up", (), (A.STEP_UP, "calm")),
    ("_step_up", (K.PREEMPTION_STORM,), None),  # never while a step-down cause is active
    ("_scheduled", (), (A.SCHEDULED_RESTART, "schedule")),
]


@pytest.mark.parametrize(("name", "found", "wants"), PLANNED_TABLE)
def test_each_planned_rule_alone(
    name: str, found: tuple[FindingKind, ...], wants: tuple[ActionKind, str] | None
) -> None:
    (rule,) = [r for r in PLANNED_RULES if r.__name__ == name]
    got = rule(view("e1", *(finding(k) for k in found), **DOWN_ONE), 10_000.0, NOON)
    assert ((got.kind, got.reason) if isinstance(got, Action) else got) == wants


def test_a_repair_being_verified_holds_the_later_planned_rules_back() -> None:
    # The prefix cache was reset 200 s ago (repair_verify_s 300): WAIT, and neither the leak nor
    # the due schedule behind it restarts the engine meanwhile.
    verifying = view(
        "e1",
        finding(K.DEGRADATION_THROUGHPUT),
        finding(K.MEMORY_GROWTH),
        prefix_reset_at_s=9_800.0,
        scheduled_due_s=1.0,
        rules=EngineRules(repair_verify_s=300),
    )
    (degradation,) = [r for r in PLANNED_RULES if r.__name__ == "_degradation"]
    assert degradation(verifying, 10_000.0, NOON) == WAIT
    assert run(verifying) == Decision((), ())
