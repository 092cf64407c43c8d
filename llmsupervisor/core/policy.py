"""What to do about findings: one pure decision over a view of every engine.

The policy never touches a process. The supervisor builds an ``EngineView`` per engine each
tick, calls ``decide``, and hands each ``Action`` to the engine's runner. Decisions depend only
on the views, ``now_s`` (monotonic) and the minute of the local day (for restart windows), so
every rule below is a table test.

Cause first, least disruptive first::

    finding / condition                       action                           capacity
    ──────────────────────────────────────────────────────────────────────────────────────
    hang (CRITICAL), stall                    restart now, no drain            already lost
    gpu fault / gpu lost (CRITICAL)           restart after a drain, mark GPU  already lost
                                              (stopped instead where the mark
                                              sets the node condition)
    kv pressure                               shed: out of rotation, no restart  min_in_rotation
    kv pressure cleared                       back into rotation               -
    preemption storm, thermal (WARNING)       drain-restart one ladder step down  max_unavailable
    calm for ladder_calm_s on a lower step    drain-restart one step up        max_unavailable
    degradation (throughput, TTFT, prefix)    /reset_prefix_cache, then check;   -, then
                                              drain-restart if it did not help   max_unavailable
    memory growth                             drain-restart                    max_unavailable
    restart_every_h due, inside the window    drain-restart (scheduled)        max_unavailable
    a reload changed the spec it runs         drain-restart on the new spec    max_unavailable
                                              (config restart; see below)      only
    out of memory at start                    next start one ladder step down  -
    foreign GPU memory, power brake/cap,      report only                      -
    thermal INFO (SW thermal: Boost), INFO
    GPU lost / needs a reset or a look,       mark GPU (node condition), stop  -
    while STARTING

The table is two tables in the code. ``decide`` takes the engines the policy governs
(``in_policy``) by name, and tries ``ENGINE_RULES`` on each in order until one settles it: the
config roll, report-only, out of memory at start, a GPU lost while starting, not serving (left
alone), broken, KV pressure, pressure cleared, then the one planned action. That one is the first
of ``PLANNED_RULES`` that applies (step down, degradation, memory growth, step up, schedule),
within the rate limits and ``max_unavailable``. An action taken changes the fleet's counts
(``_Tally``) that bound the engines after it.

Rules every decision obeys:
- one action in flight per engine (``EngineView.busy``);
- planned actions (those that take a serving engine away by choice) never make more than
  ``max_unavailable`` engines unavailable, and engines already out of rotation for any reason,
  failures included, count against it. An engine READY again counts as out until it has been
  READY for ``rotation_grace_s`` (its ``drain_grace_s``): the load balancer needs that long to
  see it back, and taking the next engine away sooner leaves the balancer with no server;
- automatic actions are rate limited per engine (``max_actions_per_hour``, ``action_cooldown_s``).
  Restarts of a broken engine (hang, stall, GPU fault) are not: the crash-loop budget bounds them
  (``max_failures`` in ``failure_window_s``, then FATAL), and leaving a hung engine hung is worse;
- shedding (and ending it) is never rate limited: it restarts nothing and follows the finding's
  own hysteresis.

A reload is rolled here too, so that one decider owns capacity (a second one, in the reload,
raced this one: defect E1). The reload gives an engine that is not running its new spec at once;
one that runs keeps its old spec, and its view says ``config_pending`` until a config restart
(``CONFIG_RESTART``, cause ``config_change``) gave it the new one:
- it is the operator's request, so it is exempt from ``automatic_actions: false`` and from the
  rate limits, and bounded by ``max_unavailable`` only, counted as for every planned action
  (engines out for any reason, and commands sent but not yet taken, count);
- an engine that serves is restarted only within ``max_unavailable``; one that does not (starting,
  in backoff, held by the operator, stopped, FATAL) at once, since that takes nothing out of
  rotation (a stopped or FATAL engine gets the spec and stays as it is);
- it comes before the engine's other planned actions (the restart also serves a due schedule);
- the roll halts, as a Kubernetes Deployment's rollout does, while an engine that a config
  restart gave the new spec has failed on it (BACKOFF or FATAL, ``config_rolled``): the others
  keep their old spec running. It goes on once that engine is READY (its own retries, or an
  operator's ``start``), or when a reload changes that engine's spec again (the fix).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from llmsupervisor.core.findings import Blame, Finding, FindingKind, Severity, blame_of
from llmsupervisor.core.node_condition import CONDITION_VERDICTS, gpu_verdicts
from llmsupervisor.core.state import EngineState

K = FindingKind
S = EngineState

# Restart at once; the engine is broken. In this order when several hold.
BROKEN: tuple[FindingKind, ...] = (K.HANG, K.GPU_LOST, K.GPU_FAULT, K.STALL)
# Broken, but in-flight requests may still finish: drain first (bounded by drain_timeout_s).
DRAIN_BEFORE_RESTART: frozenset[FindingKind] = frozenset({K.GPU_FAULT, K.GPU_LOST})
GPU_MARKING: frozenset[FindingKind] = frozenset({K.GPU_FAULT, K.GPU_LOST})
# Too much load for this GPU's settings: fewer tokens per step. Not the power brake: the PSU or
# BMC asserts it, and a smaller batch does not clear it (docs/gpu.md); it is alerted on only.
STEP_DOWN_CAUSES: tuple[FindingKind, ...] = (K.PREEMPTION_STORM, K.THERMAL)
DEGRADATION: tuple[FindingKind, ...] = (
    K.DEGRADATION_PREFIX_CACHE,
    K.DEGRADATION_TTFT,
    K.DEGRADATION_THROUGHPUT,
)
HOUR_S = 3600.0


class ActionKind(enum.Enum):
    RESTART = "restart"
    SHED = "shed"
    UNSHED = "unshed"
    STEP_DOWN = "step_down"
    STEP_UP = "step_up"
    SCHEDULED_RESTART = "scheduled_restart"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    CONFIG_RESTART = "config_restart"

    def __str__(self) -> str:
        return self.value


# Every cause a restart is counted under (the exporter's label values, seeded at 0 so that the
# first restart of each cause is visible to increase()). The runner's own: a crash, a failed
# start, /health 503; the fleet's: a runner task that died; the operator's, a reload's, and the
# policy's (a schedule, a ladder step, or the finding that caused it).
RESTART_CAUSES: tuple[str, ...] = (
    "crash",
    "engine_dead",
    "start_failed",
    "runner_died",
    "operator",
    "config_change",
    "scheduled",
    ActionKind.STEP_DOWN.value,
    ActionKind.STEP_UP.value,
    *(k.value for k in BROKEN),
    *(k.value for k in DEGRADATION),
    K.MEMORY_GROWTH.value,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRules:
    """One engine's policy settings (from its config)."""

    automatic: bool = True  # False: findings are reported, never acted on
    max_actions_per_hour: int = 6
    action_cooldown_s: float = 60.0
    ladder_calm_s: float = 1800.0
    repair_verify_s: float = 300.0
    # Minutes of the local day [start, end); end < start wraps past midnight. None: any time.
    restart_window: tuple[int, int] | None = None
    rotation_grace_s: float = 5.0  # how long a load balancer takes to notice a change


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetRules:
    max_unavailable: int = 1
    min_in_rotation: int = 1  # load shedding keeps at least this many engines in rotation


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineView:
    """What the policy knows of one engine (built by the supervisor from its runner)."""

    name: str
    state: EngineState
    meant_to_serve: bool = True  # one of this run's serving engines (engine/status.py); else ignored
    ready_since_s: float | None = None  # None: READY since before anyone counted (tests)
    findings: tuple[Finding, ...] = ()
    # An action (planned restart, drain, step change, or commands sent but not yet taken) is in
    # flight: the policy leaves the engine alone, and a busy engine already counts against
    # max_unavailable (its restart may not have begun, but it is leaving).
    busy: bool = False
    held_out: bool = False  # held by the operator (drained, stopped): leave it alone
    ladder_step: int = 0  # 0 = the engine's own args; n = n steps down
    ladder_steps: int = 0  # how many steps down exist
    ladder_changed_s: float | None = None
    step_cause_seen_s: float | None = None  # last time a step-down cause was active
    action_times_s: tuple[float, ...] = ()  # automatic actions already taken
    scheduled_due_s: float | None = None
    start_failed_oom: bool = False  # the last start failed out of memory
    prefix_reset_at_s: float | None = None  # the cheap repair, tried during the current degradation
    prefix_reset_supported: bool | None = None  # None: not tried yet
    # A reload changed this engine's spec and it still runs the old one: a config restart is due.
    config_pending: bool = False
    # A config restart gave this engine the spec it runs, and it has not been READY on it since:
    # if it fails (BACKOFF, FATAL), the roll of the others halts.
    config_rolled: bool = False
    rules: EngineRules = EngineRules()


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    engine: str
    kind: ActionKind
    reason: str  # the cause, as a metric label: a FindingKind value, "schedule", "calm", ...
    detail: str  # for the log line: the finding's summary, or why
    drain: bool = True
    failure: bool = False  # the engine is broken: counts against the crash-loop budget
    planned: bool = False  # takes a serving engine away by choice: bounded by max_unavailable
    step: int | None = None  # the ladder step to run at, for step changes
    mark_gpus: bool = False
    # The GPUs the finding names (its "gpus" evidence), for a node condition on those only; None
    # when it names none: then every GPU of the engine.
    fault_gpus: tuple[int, ...] | None = None
    # Per GPU, what the fault leads to ("reset", "restart", "unknown"; core/node_condition.py).
    gpu_verdicts: tuple[tuple[int, str], ...] = ()
    # A hang's or a stall's finding: the process it blames, for the evidence before the kill
    # (whether the API server is cut first; engine/evidence.py). None for every other action.
    blame: Blame | None = None


def _gpu_needs_reset(findings: Sequence[Finding]) -> Finding | None:
    """A CRITICAL GPU_LOST, or a CRITICAL GPU_FAULT with a GPU whose verdict sets the node
    condition (a reset, a field diagnostic, or a look: anything but a restart)."""
    for f in findings:
        if f.severity is not Severity.CRITICAL:
            continue
        if f.kind is K.GPU_LOST or (
            f.kind is K.GPU_FAULT
            and CONDITION_VERDICTS.intersection(gpu_verdicts(f.evidence.get("verdicts")).values())
        ):
            return f
    return None


def _gpu_restart(name: str, broken: Finding) -> Action:
    marking = broken.kind in GPU_MARKING
    return Action(
        engine=name,
        kind=ActionKind.RESTART,
        reason=broken.kind.value,
        detail=broken.summary,
        drain=broken.kind in DRAIN_BEFORE_RESTART,
        failure=True,
        mark_gpus=marking,
        fault_gpus=finding_gpus(broken) if marking else None,
        gpu_verdicts=tuple(sorted(gpu_verdicts(broken.evidence.get("verdicts")).items())) if marking else (),
        blame=blame_of(broken) if broken.kind in (K.HANG, K.STALL) else None,
    )


def finding_gpus(finding: Finding) -> tuple[int, ...] | None:
    """The GPU indices a finding's ``gpus`` evidence names ("1,3"); None when absent or "?"."""
    raw = finding.evidence.get("gpus")
    if not isinstance(raw, str):
        return None
    indices = tuple(int(part) for part in raw.split(",") if part.strip().isdigit())
    return indices or None


@dataclass(frozen=True, slots=True)
class Deferred:
    """An action the policy wanted but held back, and why (logged once by the supervisor)."""

    engine: str
    kind: ActionKind
    reason: str
    why: str


@dataclass(frozen=True, slots=True)
class Decision:
    actions: tuple[Action, ...]
    deferred: tuple[Deferred, ...]
    roll_halted_by: tuple[str, ...] = ()  # engines that failed on their new config: the roll waits


def in_window(minute_of_day: int, window: tuple[int, int] | None) -> bool:
    if window is None:
        return True
    start, end = window
    if start <= end:
        return start <= minute_of_day < end
    return minute_of_day >= start or minute_of_day < end


def rate_limit(view: EngineView, now_s: float) -> str | None:
    """Why an automatic action must wait, or None."""
    rules = view.rules
    recent = [t for t in view.action_times_s if now_s - t < HOUR_S]
    if len(recent) >= rules.max_actions_per_hour:
        return (
            f"rate limit: {len(recent)} actions in the last hour "
            f"(max_actions_per_hour={rules.max_actions_per_hour})"
        )
    if recent and now_s - max(recent) < rules.action_cooldown_s:
        return (
            f"rate limit: last action {now_s - max(recent):.0f} s ago "
            f"(action_cooldown_s={rules.action_cooldown_s:g})"
        )
    return None


def back_in_rotation(view: EngineView, now_s: float) -> bool:
    """READY, and for long enough that the load balancer sends it traffic again."""
    return (
        view.state is S.READY
        and not view.busy
        and (view.ready_since_s is None or now_s - view.ready_since_s >= view.rules.rotation_grace_s)
    )


def _first(
    findings: Iterable[Finding], kinds: Sequence[FindingKind], *, min_severity: Severity
) -> Finding | None:
    order = [Severity.INFO, Severity.WARNING, Severity.CRITICAL]
    by_kind = {f.kind: f for f in findings if order.index(f.severity) >= order.index(min_severity)}
    for kind in kinds:
        if kind in by_kind:
            return by_kind[kind]
    return None


# What a planned rule says: the action it wants; WAIT, when the engine wants nothing now and no
# later rule may ask for it either (a repair being verified); None, when the rule does not apply.
WAIT: Final = "wait"
Wanted = Action | Literal["wait"] | None


def _step_down(view: EngineView, now_s: float, minute_of_day: int) -> Wanted:
    """Too much load for this GPU's settings (preemption storm, thermal): one ladder step down."""
    cause = _first(view.findings, STEP_DOWN_CAUSES, min_severity=Severity.WARNING)
    if cause is None or view.ladder_step >= view.ladder_steps:
        return None
    return Action(
        engine=view.name,
        kind=ActionKind.STEP_DOWN,
        reason=cause.kind.value,
        detail=cause.summary,
        planned=True,
        step=view.ladder_step + 1,
    )


def _degradation(view: EngineView, now_s: float, minute_of_day: int) -> Wanted:
    """Slower than its baseline: reset the prefix cache first, then, if that did not help within
    ``repair_verify_s`` (or the engine has no reset), a restart. WAIT while the reset is verified."""
    degraded = _first(view.findings, DEGRADATION, min_severity=Severity.WARNING)
    if degraded is None:
        return None
    if view.prefix_reset_supported is not False and view.prefix_reset_at_s is None:
        return Action(
            engine=view.name,
            kind=ActionKind.RESET_PREFIX_CACHE,
            reason=degraded.kind.value,
            detail=degraded.summary,
            drain=False,
        )
    tried_s = view.prefix_reset_at_s
    if tried_s is not None and now_s - tried_s < view.rules.repair_verify_s:
        return WAIT
    tried = "" if tried_s is None else " (resetting the prefix cache did not help)"
    return Action(
        engine=view.name,
        kind=ActionKind.RESTART,
        reason=degraded.kind.value,
        detail=degraded.summary + tried,
        planned=True,
    )


def _memory_growth(view: EngineView, now_s: float, minute_of_day: int) -> Wanted:
    """A leak: a drain-restart."""
    leak = _first(view.findings, (K.MEMORY_GROWTH,), min_severity=Severity.WARNING)
    if leak is None:
        return None
    return Action(
        engine=view.name, kind=ActionKind.RESTART, reason=leak.kind.value, detail=leak.summary, planned=True
    )


def _step_up(view: EngineView, now_s: float, minute_of_day: int) -> Wanted:
    """On a lower step with no step-down cause for ``ladder_calm_s``: one step back up."""
    if (
        view.ladder_step <= 0
        or _first(view.findings, STEP_DOWN_CAUSES, min_severity=Severity.WARNING) is not None
    ):
        return None
    calm_since_s = max(t for t in (view.ladder_changed_s, view.step_cause_seen_s, 0.0) if t is not None)
    if now_s - calm_since_s < view.rules.ladder_calm_s:
        return None
    return Action(
        engine=view.name,
        kind=ActionKind.STEP_UP,
        reason="calm",
        detail=f"no throttling or preemption storm for {now_s - calm_since_s:.0f} s",
        planned=True,
        step=view.ladder_step - 1,
    )


def _scheduled(view: EngineView, now_s: float, minute_of_day: int) -> Wanted:
    """``restart_every_h`` due, inside the restart window."""
    due_s = view.scheduled_due_s
    if due_s is None or now_s < due_s or not in_window(minute_of_day, view.rules.restart_window):
        return None
    return Action(
        engine=view.name,
        kind=ActionKind.SCHEDULED_RESTART,
        reason="schedule",
        detail="periodic restart (restart_every_h)",
        planned=True,
    )


# The planned (or cheap) actions a serving engine may want, cause first: the first rule that
# applies gives the one action, before rate limits and capacity.
PLANNED_RULES: Final[tuple[Callable[[EngineView, float, int], Wanted], ...]] = (
    _step_down,
    _degradation,
    _memory_growth,
    _step_up,
    _scheduled,
)


def _planned(view: EngineView, now_s: float, minute_of_day: int) -> Action | None:
    """The one planned (or cheap) action this engine wants, before rate limits and capacity."""
    for rule in PLANNED_RULES:
        wanted = rule(view, now_s, minute_of_day)
        if wanted is not None:
            return wanted if isinstance(wanted, Action) else None
    return None


# Where a config restart takes nothing out of rotation: the engine serves no one now.
_NOT_SERVING = frozenset({S.STARTING, S.BACKOFF, S.STOPPED, S.FATAL})


def roll_failures(views: Iterable[EngineView]) -> tuple[str, ...]:
    """The engines that failed on the spec a config restart gave them: the roll halts for them."""
    return tuple(
        sorted(
            v.name
            for v in views
            if v.config_rolled and not v.config_pending and v.state in (S.BACKOFF, S.FATAL)
        )
    )


def _config_restart(view: EngineView, halted_by: tuple[str, ...]) -> Action | Deferred | None:
    """The config restart this engine is due, before capacity; None when now is not the time
    (draining, stopping: the engine is busy with something else and is looked at again)."""
    name = view.name
    if halted_by:
        why = f"roll halted: {', '.join(halted_by)} failed to start on the new config"
        return Deferred(name, ActionKind.CONFIG_RESTART, "config_change", why)
    serving = view.state in (S.READY, S.SHEDDING) and not view.held_out
    if not serving and view.state not in _NOT_SERVING and not (view.held_out and view.state is S.DRAINING):
        return None
    return Action(
        engine=name,
        kind=ActionKind.CONFIG_RESTART,
        reason="config_change",
        detail="config changed",
        planned=serving,
    )


def in_policy(view: EngineView) -> bool:
    """Whether the policy acts on this engine and counts it in the fleet's bounds: the one test
    of which engines the policy governs."""
    return view.meant_to_serve


@dataclass(slots=True, kw_only=True)
class _Tally:
    """One decision while it is made: the fleet's counts, which each action taken changes for the
    engines after it, and what was decided so far."""

    fleet: FleetRules
    now_s: float
    minute_of_day: int
    governed: int  # engines the policy counts (in_policy)
    in_rotation: int  # READY
    unavailable: int  # not back in rotation (back_in_rotation), or leaving by an action taken
    halted_by: tuple[str, ...]  # roll_failures
    actions: list[Action] = field(default_factory=list)
    deferred: list[Deferred] = field(default_factory=list)

    @classmethod
    def count(
        cls, views: Sequence[EngineView], now_s: float, minute_of_day: int, fleet: FleetRules
    ) -> _Tally:
        return cls(
            fleet=fleet,
            now_s=now_s,
            minute_of_day=minute_of_day,
            governed=len(views),
            in_rotation=sum(1 for v in views if v.state is S.READY),
            unavailable=len(views) - sum(1 for v in views if back_in_rotation(v, now_s)),
            halted_by=roll_failures(views),
        )

    def act(self, action: Action) -> bool:
        self.actions.append(action)
        return True

    def defer(self, action: Action, why: str) -> None:
        self.deferred.append(Deferred(action.engine, action.kind, action.reason, why))

    def take_out(self, action: Action) -> None:
        """An action that takes an engine in rotation out of it."""
        self.actions.append(action)
        self.in_rotation -= 1
        self.unavailable += 1

    def take_out_within_capacity(self, action: Action) -> bool:
        """A planned action on an engine in rotation: taken within ``max_unavailable``, else
        deferred. Whether it was taken."""
        if self.unavailable >= self.fleet.max_unavailable:
            self.defer(
                action,
                f"max_unavailable={self.fleet.max_unavailable}: "
                f"{self.unavailable} engine(s) already out of rotation",
            )
            return False
        self.take_out(action)
        return True

    def decision(self) -> Decision:
        return Decision(tuple(self.actions), tuple(self.deferred), self.halted_by)


# A rule for one engine: True when it settled the engine for this decision (an action taken or
# deferred, or the engine left alone), so that no later rule is tried.
EngineRule = Callable[[EngineView, _Tally], bool]


def _config_roll(view: EngineView, t: _Tally) -> bool:
    """A reload's config restart: the operator's request, so before ``automatic_actions`` and the
    rate limits. Not rolled now, the engine's automatic rules still apply, on its old spec."""
    if not view.config_pending or view.busy:
        return False
    rolled = _config_restart(view, t.halted_by)
    if isinstance(rolled, Deferred):
        t.deferred.append(rolled)
        return False
    if rolled is None:
        return False
    if rolled.planned and view.state is S.READY and not back_in_rotation(view, t.now_s):
        # READY again only rotation_grace_s ago: it serves, and it is counted as out of rotation
        # until the balancer is sure of it; restarting it now would be free by that count and
        # take a second engine out (two engines that became READY together were both restarted
        # with max_unavailable 1). Its turn comes when it is back in rotation, under the
        # capacity check below.
        t.defer(rolled, "back in rotation only just now")
        return False
    if not rolled.planned or not back_in_rotation(view, t.now_s):
        return t.act(rolled)  # out of rotation already (shedding, not serving): free
    return t.take_out_within_capacity(rolled)


def _report_only(view: EngineView, t: _Tally) -> bool:
    """``automatic_actions: false``: findings are reported, never acted on."""
    return not view.rules.automatic


def _oom_at_start(view: EngineView, t: _Tally) -> bool:
    """The last start ran out of memory: the next one starts a ladder step down (if any)."""
    if not view.start_failed_oom or view.state is not S.BACKOFF or view.busy:
        return False
    if view.ladder_step < view.ladder_steps:
        t.act(
            Action(
                engine=view.name,
                kind=ActionKind.STEP_DOWN,
                reason="oom_at_start",
                detail="the last start ran out of memory: the next one starts a step down",
                drain=False,
                step=view.ladder_step + 1,
            )
        )
    return True


def _starting(view: EngineView, t: _Tally) -> bool:
    """A starting engine's errors are its own (the start-failure budget handles them), but a GPU
    that is lost or says it needs a reset is the GPU's, whatever the engine is doing: mark it, so
    that the node condition is set (the executor then stops the engine instead of restarting it)."""
    if view.state not in (S.STARTING, S.BACKOFF) or view.busy or view.held_out:
        return False
    gpu_broken = _gpu_needs_reset(view.findings)
    if gpu_broken is not None:
        t.act(_gpu_restart(view.name, gpu_broken))
    return True


def _not_serving(view: EngineView, t: _Tally) -> bool:
    """Only an engine that serves (READY, SHEDDING), with no action in flight and not held out by
    the operator, is acted on by the rules below."""
    return view.state not in (S.READY, S.SHEDDING) or view.busy or view.held_out


def _broken(view: EngineView, t: _Tally) -> bool:
    """Hang, GPU lost, GPU fault (CRITICAL) or stall: restart now, whatever the rate limits."""
    broken = _first(view.findings, BROKEN, min_severity=Severity.WARNING)
    if broken is None or not (broken.kind is K.STALL or broken.severity is Severity.CRITICAL):
        return False
    return t.act(_gpu_restart(view.name, broken))


def _kv_pressure(view: EngineView, t: _Tally) -> bool:
    """KV-cache pressure on a READY engine: shed it, keeping ``min_in_rotation`` in rotation."""
    pressure = _first(view.findings, (K.KV_PRESSURE,), min_severity=Severity.WARNING)
    if pressure is None or view.state is not S.READY:
        return False
    shed = Action(
        engine=view.name,
        kind=ActionKind.SHED,
        reason=pressure.kind.value,
        detail=pressure.summary,
        drain=False,
    )
    left = t.in_rotation - 1
    if left >= 0 and left >= min(t.fleet.min_in_rotation, t.governed):
        t.take_out(shed)
    else:
        t.defer(shed, f"min_in_rotation={t.fleet.min_in_rotation}: it is the last engine in rotation")
    return True


def _pressure_cleared(view: EngineView, t: _Tally) -> bool:
    """A shedding engine whose KV-cache pressure cleared: back into rotation."""
    pressure = _first(view.findings, (K.KV_PRESSURE,), min_severity=Severity.WARNING)
    if view.state is not S.SHEDDING or pressure is not None:
        return False
    t.act(
        Action(
            engine=view.name,
            kind=ActionKind.UNSHED,
            reason=K.KV_PRESSURE.value,
            detail="KV-cache pressure cleared",
            drain=False,
        )
    )
    t.in_rotation += 1
    t.unavailable -= 1
    return True


def _planned_action(view: EngineView, t: _Tally) -> bool:
    """The one planned (or cheap) action the engine wants (PLANNED_RULES), within the rate limits
    and, for one that takes an engine in rotation away, ``max_unavailable``."""
    wanted = _planned(view, t.now_s, t.minute_of_day)
    if wanted is None:
        return False
    limited = rate_limit(view, t.now_s)
    if limited is not None:
        t.defer(wanted, limited)
    elif wanted.planned and back_in_rotation(view, t.now_s):
        t.take_out_within_capacity(wanted)
    else:
        t.act(wanted)
    return True


# Per engine, in this order; the first rule that settles the engine ends its turn.
ENGINE_RULES: Final[tuple[EngineRule, ...]] = (
    _config_roll,
    _report_only,
    _oom_at_start,
    _starting,
    _not_serving,
    _broken,
    _kv_pressure,
    _pressure_cleared,
    _planned_action,
)


def decide(views: Sequence[EngineView], now_s: float, *, minute_of_day: int, fleet: FleetRules) -> Decision:
    """Every engine the policy governs (``in_policy``), by name, through ENGINE_RULES; an action
    taken for one changes the fleet's counts the next ones are bounded by."""
    governed = [v for v in views if in_policy(v)]
    tally = _Tally.count(governed, now_s, minute_of_day, fleet)
    for view in sorted(governed, key=lambda v: v.name):
        for rule in ENGINE_RULES:
            if rule(view, tally):
                break
    return tally.decision()
