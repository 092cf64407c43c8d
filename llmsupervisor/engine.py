"""One engine's life: preflight, spawn, readiness, watch, crash handling, stop ladder.

Each engine is one asyncio task (``EngineRunner.run``) in the daemon's single loop. It owns the
engine's state (changed only through ``state.transition``) and its current process. Commands
reach it as desired-state changes (``request_stop``, ``request_start``) and wake it at once.

A start attempt ends in one of three ways, and the loop below maps each to a state edge:

    ready     STARTING -> READY, then watch until the process dies or /health says dead
    stopped   an operator or shutdown asked: STOPPING -> STOPPED
    failed    unrequested exit (any code: vLLM exits 0 when EngineCore dies), startup deadline,
              failed canary, foreign port holder: -> BACKOFF (delay grows) or FATAL (budget spent)

The policy (policy.py, run by the supervisor) acts through the same commands: a restart (drained
or not, counted as a failure or not), shedding (READY <-> SHEDDING), a ladder step (the next
spawn's flags), a prefix-cache reset. The runner keeps what the policy needs to know: the ladder
step (persisted in STATE_DIR/engines/NAME/ladder.json), its automatic actions, the scheduled
restart time, and whether the last start ran out of memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import random
import re
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import httpx

from llmsupervisor import process
from llmsupervisor.clock import Clock
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.core.policy import DEGRADATION, STEP_DOWN_CAUSES
from llmsupervisor.core.restarts import (
    FailureHistory,
    RestartPolicy,
    backoff_delay_s,
    is_crash_loop,
    should_reset,
)
from llmsupervisor.core.state import EngineState, StateChange, transition
from llmsupervisor.detectors import (
    DetectorConfig,
    Finding,
    FindingTracker,
    Severity,
    counters_progressed,
    detect_all,
    new_window,
)
from llmsupervisor.errors import PortHeld
from llmsupervisor.probes import ProbeFailure, health, host
from llmsupervisor.probes.nvml import GpuEvent, GpuSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics, fetch_metrics

log = logging.getLogger("llmsupervisor.engine")
engine_output_log = logging.getLogger("llmsupervisor.engine.output")

S = EngineState
READINESS_POLL_S: Final = 0.25  # /health while loading: connection refused is cheap; READY sooner
GPU_RELEASE_POLL_S: Final = 0.5
# vLLM/torch out-of-memory at start: CUDA OOM, the KV cache not fitting, CPU KV space too large.
_OOM_RE: Final = re.compile(
    r"out of memory|OutOfMemoryError|No available memory for the cache blocks|"
    r"insufficient memory|is larger than the available KV cache memory",
    re.IGNORECASE,
)
# vLLM log lines: optional "(EngineCore pid=12) " prefix, then the level word.
_LEVEL_RE: Final = re.compile(r"^(?:(?:\x1b\[[\d;]*m)?\(.*?\)\S*\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_LEVELS: Final = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}
OUTPUT_LINE_LIMIT: Final = 64 * 1024


class Outcome(enum.Enum):
    READY = "ready"
    STOP = "stop requested"
    RESTART = "planned restart"
    BROKEN = "restart of a broken engine"  # the policy: hang, stall, GPU fault
    FAILED = "failed"  # exited, missed its deadline, failed a check
    DEAD = "engine dead"  # /health 503: the process lives, the engine core does not


@dataclass(frozen=True, slots=True)
class PlannedRestart:
    cause: str  # metric label: operator, config_change, scheduled, step_down, hang, ...
    reason: str  # for the log
    drain: bool = True
    failure: bool = False  # a broken engine: counts against the failure budget, with backoff


@dataclass(frozen=True, slots=True, kw_only=True)
class StopLadder:
    """SIGTERM the API server (vLLM drains only then), then SIGTERM the group, then SIGKILL it."""

    main_term_timeout_s: float
    group_term_timeout_s: float
    kill_timeout_s: float

    @classmethod
    def for_spec(cls, spec: EngineSpec) -> StopLadder:
        return cls(
            main_term_timeout_s=spec.stop_timeout_s,
            group_term_timeout_s=spec.group_term_timeout_s,
            kill_timeout_s=spec.kill_timeout_s,
        )

    def quick(self) -> StopLadder:
        """For a second SIGINT, or an engine that is already dead: no drain."""
        return StopLadder(
            main_term_timeout_s=min(self.main_term_timeout_s, 1.0),
            group_term_timeout_s=min(self.group_term_timeout_s, 1.0),
            kill_timeout_s=self.kill_timeout_s,
        )


def policy_for(spec: EngineSpec) -> RestartPolicy:
    return RestartPolicy(
        backoff_initial_s=spec.backoff_initial_s,
        backoff_max_s=spec.backoff_max_s,
        backoff_jitter_ratio=spec.backoff_jitter_ratio,
        max_failures=spec.max_failures,
        failure_window_s=spec.failure_window_s,
        stable_after_s=spec.stable_after_s,
    )


class GpuSource(Protocol):
    """What an engine may know of its GPUs: the shared monitor's latest samples and events."""

    def samples_for(self, gpus: Iterable[int]) -> Mapping[int, GpuSample | ProbeFailure]: ...

    def take_events(self, gpus: Iterable[int]) -> tuple[GpuEvent, ...]: ...


class NoGpus:
    def samples_for(self, gpus: Iterable[int]) -> Mapping[int, GpuSample | ProbeFailure]:
        return {}

    def take_events(self, gpus: Iterable[int]) -> tuple[GpuEvent, ...]:
        return ()


FINDING_LOG_LEVEL: Final = {
    Severity.INFO: logging.INFO,
    Severity.WARNING: logging.WARNING,
    Severity.CRITICAL: logging.ERROR,
}


def engine_log_level(line: str, previous: int) -> int:
    match = _LEVEL_RE.match(line)
    return _LEVELS[match.group(1)] if match else previous


class EngineRunner:
    def __init__(
        self,
        spec: EngineSpec,
        *,
        state_dir: Path,
        http: httpx.AsyncClient,
        clock: Clock,
        tick_interval_s: float,
        on_change: Callable[[StateChange], None] = lambda change: None,
        rng: random.Random | None = None,
        gpus: GpuSource | None = None,
        detector_config: DetectorConfig | None = None,
        sweeper: host.GroupSweeper | None = None,
        on_round: Callable[[str, float], None] = lambda name, seconds: None,
    ) -> None:
        self.spec = spec
        self.state_dir = state_dir
        self.http = http
        self.clock = clock
        self.tick_interval_s = tick_interval_s
        self.on_change = on_change
        self.on_round = on_round  # (engine, seconds) per observation round, for the exporter
        self.rng = rng or random.Random()
        self.gpu_source: GpuSource = gpus or NoGpus()
        # The daemon shares one across engines; alone, an engine sweeps on every look.
        self.sweeper = sweeper or host.GroupSweeper(max_age_s=0.0, monotonic=clock.monotonic)
        self._fixed_detector_config = detector_config
        self.detector_config = detector_config or spec.detectors
        self.window: ObservationWindow = new_window(self.detector_config)
        self.tracker = FindingTracker(self.detector_config)
        self.findings: list[Finding] = []
        self.last_metrics: EngineMetrics | None = None
        self._previous_metrics: EngineMetrics | None = None
        self.policy = policy_for(spec)
        self.state = S.STOPPED
        self.state_since_s = clock.monotonic()
        self.state_reason = "not started"
        self.proc: process.EngineProcess | None = None
        self.failures = FailureHistory()
        self.ready_since_s: float | None = None
        self.restarts_total = 0
        self.restarts_by_reason: dict[str, int] = {}
        self.state_changes_total = 0
        self.canary_latency_s: float | None = None
        self.last_exit: str | None = None
        self.last_failure: str | None = None
        self._want_running = spec.enabled
        self._shutdown = False
        self._restart: PlannedRestart | None = None
        self._hold_drained = False
        self._shed_reason: str | None = None
        # What the policy needs (policy.EngineView), and what it did (exported).
        self.ladder_step = 0
        self.ladder_changed_s: float | None = None
        self.step_cause_seen_s: float | None = None
        self.action_times_s: list[float] = []
        self.actions_total: dict[tuple[str, str], int] = {}  # (kind, reason) -> count
        self.last_action_at: dict[str, float] = {}  # kind -> wall-clock time
        self.scheduled_due_s: float | None = None
        self.start_failed_oom = False
        self.prefix_reset_at_s: float | None = None
        self.prefix_reset_supported: bool | None = None
        self._repair: asyncio.Task[None] | None = None
        self._engine_pids: frozenset[int] = frozenset()
        self._load_ladder()
        self._quick = asyncio.Event()
        self._wake = asyncio.Event()
        self._readers: list[asyncio.Task[None]] = []

    # ---- commands (called from the supervisor; they only set desired state) ----

    def request_stop(self, *, shutdown: bool = False) -> None:
        self._want_running = False
        self._shutdown = self._shutdown or shutdown
        self._wake.set()

    def request_start(self) -> None:
        if not self._shutdown:
            if self.state is S.FATAL:
                self.failures = self.failures.reset()  # the operator vouches for a fresh try
            self._want_running = True
            self._wake.set()

    def request_restart(
        self,
        reason: str,
        *,
        cause: str = "operator",
        spec: EngineSpec | None = None,
        drain: bool = True,
        failure: bool = False,
    ) -> None:
        """A planned restart: drain, stop, start again (with ``spec``, for a config change).
        ``drain=False`` stops at once (nothing in a hung engine can finish); ``failure=True``
        treats it as a failure (backoff, and the failure budget)."""
        if spec is not None:
            self._apply_spec(spec)
        self._restart = PlannedRestart(cause, reason, drain, failure)
        self._want_running = not self._shutdown
        self._wake.set()

    def _apply_spec(self, spec: EngineSpec) -> None:
        ladder_changed = spec.ladder != self.spec.ladder
        self.spec = spec
        self.policy = policy_for(spec)
        if self._fixed_detector_config is None:
            self.detector_config = spec.detectors
        if ladder_changed:
            self._load_ladder()

    def request_shed(self, reason: str | None) -> None:
        """Out of rotation without a restart while ``reason`` holds (None: back in)."""
        self._shed_reason = reason
        self._wake.set()

    @property
    def busy(self) -> bool:
        """An action is in flight: the policy leaves the engine alone until it is done."""
        return self._restart is not None or (self._repair is not None and not self._repair.done())

    @property
    def held_out(self) -> bool:
        return self._hold_drained

    # ---- the batch-size ladder ----

    @property
    def _ladder_path(self) -> Path:
        return self.state_dir / "engines" / self.spec.name / "ladder.json"

    def _load_ladder(self) -> None:
        """The step survives daemon restarts; a changed ladder starts again at the top."""
        self.ladder_step = 0
        try:
            saved = json.loads(self._ladder_path.read_text())
        except (OSError, ValueError):
            return
        ladder = [dict(step) for step in self.spec.ladder]
        if not isinstance(saved, dict) or saved.get("ladder") != ladder:
            if saved.get("step") if isinstance(saved, dict) else None:
                log.info(
                    "ladder changed in the config: back to the top step", extra={"engine": self.spec.name}
                )
            return
        step = saved.get("step")
        if isinstance(step, int) and 0 < step <= len(ladder):
            self.ladder_step = step
            self.ladder_changed_s = self.clock.monotonic()  # calm is counted from now
            log.info(
                "batch-size ladder: resuming at step %d/%d (%s)",
                step,
                len(ladder),
                _flags_text(self.spec.step_args(step)),
                extra={"engine": self.spec.name},
            )

    def set_ladder_step(self, step: int, reason: str) -> None:
        """Record the step the next spawn runs at (persisted); the caller restarts if needed."""
        step = max(0, min(step, len(self.spec.ladder)))
        if step == self.ladder_step:
            return
        log.warning(
            "batch-size ladder: step %d -> %d (%s): %s",
            self.ladder_step,
            step,
            _flags_text(self.spec.step_args(step)) or "the engine's own flags",
            reason,
            extra={"engine": self.spec.name},
        )
        self.ladder_step = step
        self.ladder_changed_s = self.clock.monotonic()
        self.start_failed_oom = False
        path = self._ladder_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, "ladder": [dict(s) for s in self.spec.ladder]}) + "\n")
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot save the ladder step to %s: %s", path, exc, extra={"engine": self.spec.name})

    # ---- actions ----

    def record_action(
        self, kind: str, reason: str, *, now_s: float, wall_s: float, rate_limited: bool
    ) -> None:
        key = (kind, reason)
        self.actions_total[key] = self.actions_total.get(key, 0) + 1
        self.last_action_at[kind] = wall_s
        if rate_limited:
            self.action_times_s = [t for t in self.action_times_s if now_s - t < 3600.0] + [now_s]

    def start_prefix_reset(self, reason: str) -> None:
        """vLLM's cheapest repair: drop the prefix cache (dev-mode route; 404 otherwise)."""
        self.prefix_reset_at_s = self.clock.monotonic()
        self._repair = asyncio.create_task(self._reset_prefix_cache(reason), name=f"repair:{self.spec.name}")

    async def _reset_prefix_cache(self, reason: str) -> None:
        name = self.spec.name
        url = self.spec.base_url + "/reset_prefix_cache"
        for _attempt in range(5):
            try:
                response = await self.http.post(url, timeout=self.spec.health_timeout_s)
            except httpx.HTTPError as exc:
                log.warning("reset_prefix_cache: %s", exc, extra={"engine": name})
                return
            if response.status_code == 404:
                self.prefix_reset_supported = False
                log.info(
                    "reset_prefix_cache is not offered (vLLM dev mode is off): a restart is the repair",
                    extra={"engine": name},
                )
                return
            # vLLM answers success=false while blocks are held (vllm-facts §4): retry shortly.
            ok = response.is_success and "false" not in response.text.lower()
            if ok:
                self.prefix_reset_supported = True
                log.info(
                    "prefix cache reset (%s); checking for %g s whether that helped",
                    reason,
                    self.spec.repair_verify_s,
                    extra={"engine": name},
                )
                return
            await asyncio.sleep(1.0)
        log.warning("reset_prefix_cache kept failing: a restart is the repair", extra={"engine": name})
        self.prefix_reset_supported = False

    def request_drain(self, hold: bool = True) -> None:
        """Take the engine out of rotation and keep it out (``hold=False`` puts it back)."""
        self._hold_drained = hold
        self._wake.set()

    @property
    def in_rotation(self) -> bool:
        return self.state is S.READY

    def escalate(self) -> None:
        """Make a stop in progress quick (second SIGINT)."""
        self._quick.set()
        self._wake.set()

    # ---- state ----

    def _set_state(self, to: EngineState, reason: str) -> None:
        now = self.clock.monotonic()
        change = transition(self.spec.name, self.state, to, reason=reason, now=now)
        level = logging.WARNING if to in (S.BACKOFF, S.FATAL) else logging.INFO
        log.log(level, "%s -> %s: %s", self.state, to, reason, extra={"engine": self.spec.name})
        self.state, self.state_since_s, self.state_reason = to, now, reason
        self.state_changes_total += 1
        if to is not S.DRAINING:
            self.ready_since_s = now if to is S.READY else None
        self.on_change(change)

    # ---- the loop ----

    async def run(self) -> None:
        try:
            while True:
                if not self._want_running:
                    if self.state is S.BACKOFF:
                        self._set_state(S.STOPPED, "stop requested during backoff")
                    if self._shutdown:
                        return
                    await self._wait_wake()
                    continue
                outcome, reason = await self._start_once()
                cause = "start_failed"
                if outcome is Outcome.READY:
                    outcome, reason = await self._serve()
                    cause = "engine_dead" if outcome is Outcome.DEAD else "crash"
                if outcome is Outcome.STOP:
                    await self._drain(reason)
                    await self._stop(reason, to=S.STOPPED)
                    continue
                planned, self._restart = self._restart, None
                if outcome is Outcome.RESTART:
                    planned = planned or PlannedRestart("operator", reason)
                    if planned.drain:
                        await self._drain(reason)
                    await self._stop(reason, to=S.STOPPED, quick=not planned.drain)
                    self._count_restart(planned.cause)
                    continue
                if outcome is Outcome.BROKEN and planned is not None:
                    if planned.drain:
                        await self._drain(reason)
                    cause = planned.cause
                await self._after_failure(reason, cause)
        finally:
            # Whatever happened (a bug, cancellation), leave no process behind.
            if self.proc is not None and not self._group_gone():
                await asyncio.shield(self._terminate(StopLadder.for_spec(self.spec).quick()))

    async def _wait_wake(self, timeout_s: float | None = None) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()

    async def _start_once(self) -> tuple[Outcome, str]:
        spec = self.spec
        reason = "start" if self.state in (S.STOPPED, S.FATAL) else f"restart after: {self.last_failure}"
        self._restart = None  # a restart asked for while stopped is this start
        self.start_failed_oom = False
        if self.ladder_step:
            reason += f" at ladder step {self.ladder_step}/{len(spec.ladder)}"
        self._set_state(S.STARTING, reason)
        try:
            await self._preflight_port()
        except PortHeld as exc:
            return Outcome.FAILED, str(exc)
        cache_dir = self.state_dir / "engines" / spec.name / "vllm-cache"
        cache_dir.mkdir(parents=True, exist_ok=True)
        env = process.engine_environment(
            base=os.environ,
            engine=spec.name,
            gpus=spec.gpus,
            state_dir=self.state_dir,
            cache_dir=cache_dir,
            extra=spec.env,
            daemon_pid=os.getpid(),
        )
        argv = spec.argv(self.ladder_step)
        try:
            self.proc = process.spawn(argv, env)
        except OSError as exc:
            return Outcome.FAILED, f"cannot execute {argv[0]!r}: {exc.strerror or exc}"
        process.record_group(self.state_dir, spec.name, self.proc.pid, os.getpid())
        log.info("spawned pid %d: %s", self.proc.pid, " ".join(argv), extra={"engine": spec.name})
        self._start_readers(self.proc)
        return await self._await_ready(self.proc)

    async def _preflight_port(self) -> None:
        """Before binding: a leftover engine of ours on the port is killed; anyone else fails us."""
        spec = self.spec
        for pid in process.port_holders(spec.port):
            ours, engine = process.is_ours(pid, self.state_dir) if pid is not None else (False, None)
            if pid is None or not ours:
                raise PortHeld(spec.port, pid, process.describe_pid(pid) if pid is not None else "")
            leftovers = [
                pid,
                *process.marker_processes(self.state_dir, engine=engine, exclude_daemon_pid=os.getpid()),
            ]
            log.warning(
                "port %d is held by pid %d, a leftover engine %r of an earlier run: killing its tree",
                spec.port,
                pid,
                engine,
                extra={"engine": spec.name},
            )
            alive = await process.kill_trees(leftovers, timeout_s=spec.kill_timeout_s)
            if alive:
                raise PortHeld(spec.port, alive[0], "leftover engine that survived SIGKILL")

    async def _await_ready(self, proc: process.EngineProcess) -> tuple[Outcome, str]:
        """/health 200, then /v1/models lists the model, then one canary completion; all before
        the startup deadline, while the process lives and nobody asked us to stop."""
        spec = self.spec
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spec.start_timeout_s
        stage = "waiting for /health"
        while True:
            if not self._want_running:
                return Outcome.STOP, "stop requested during start"
            if proc.returned:
                return Outcome.FAILED, f"process {self._exit_text(proc)} during start ({stage})"
            remaining = deadline - loop.time()
            if remaining <= 0:
                return Outcome.FAILED, f"not ready within start_timeout_s={spec.start_timeout_s:g} ({stage})"
            timeout_s = min(spec.health_timeout_s, remaining)
            result = await health.check_health(self.http, spec.base_url, timeout_s=timeout_s)
            if result.ok:
                stage = "checking /v1/models"
                models = await health.check_models(
                    self.http, spec.base_url, spec.model_id, timeout_s=timeout_s
                )
                if not models.ok:
                    return Outcome.FAILED, f"/v1/models: {models.detail}"
                stage = "canary completion"
                result = await health.canary(
                    self.http,
                    spec.base_url,
                    spec.model_id,
                    prompt=spec.canary_prompt,
                    timeout_s=min(spec.canary_timeout_s, max(remaining, 0.1)),
                )
                if result.ok:
                    self.canary_latency_s = result.latency_s
                    return Outcome.READY, (
                        f"/health 200, model listed, canary answered in {result.latency_s * 1000:.0f} ms"
                    )
                return Outcome.FAILED, f"canary failed: {result.detail}"
            await self._wait_exit_or_wake(proc, READINESS_POLL_S)

    async def _wait_exit_or_wake(self, proc: process.EngineProcess, timeout_s: float) -> None:
        self._wake.clear()
        exited = asyncio.ensure_future(proc.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({exited, woken}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (exited, woken):
                task.cancel()

    async def _serve(self) -> tuple[Outcome, str]:
        assert self.proc is not None
        proc = self.proc
        # A new incarnation: its own window (and degradation baseline) and tracker. Before READY,
        # which runs the policy: it must not act again on the last incarnation's findings.
        self.window = new_window(self.detector_config)
        self.tracker = FindingTracker(self.detector_config)
        self._close_findings("engine restarted")
        self._set_state(S.READY, "ready")
        self.last_metrics = self._previous_metrics = None
        self.prefix_reset_at_s = None
        self._shed_reason = None
        last_canary_s = self.clock.monotonic()  # the readiness canary just ran
        self.scheduled_due_s = None
        if self.spec.restart_every_h is not None:
            jitter_s = self.rng.uniform(0.0, self.spec.restart_jitter_s)
            self.scheduled_due_s = last_canary_s + self.spec.restart_every_h * 3600.0 + jitter_s
        while True:
            if proc.returned:
                return Outcome.FAILED, f"process {self._exit_text(proc)} unexpectedly"
            if not self._want_running:
                return Outcome.STOP, "stop requested"
            if self._restart is not None:
                outcome = Outcome.BROKEN if self._restart.failure else Outcome.RESTART
                return outcome, self._restart.reason
            self._follow_rotation()
            wait_started_s = self.clock.monotonic()
            await self._wait_exit_or_wake(proc, self.tick_interval_s)
            if proc.returned or not self._want_running or self._restart is not None:
                continue
            now = self.clock.monotonic()
            # Timed from when the round was due: waking late because the shared loop was busy
            # is part of what a round costs (and what bench/overhead sees from outside).
            round_started_s = min(now, wait_started_s + self.tick_interval_s)
            if self.failures.times_s and should_reset(self.ready_since_s, now, self.policy):
                log.info(
                    "ready for %.0f s: failure count reset",
                    now - (self.ready_since_s or now),
                    extra={"engine": self.spec.name},
                )
                self.failures = self.failures.reset()
            observed = await self._observe_unless_interrupted(proc, last_canary_s)
            if observed is None:
                continue  # a stop or restart came in: act on it now, not after a slow canary
            obs, last_canary_s = observed
            self._detect(obs)
            self.on_round(self.spec.name, self.clock.monotonic() - round_started_s)
            if obs.health is not None and obs.health.engine_dead:
                # vLLM's own watchdog would exit ~5 s later; restart now (vllm-facts §6.3).
                return Outcome.DEAD, "/health 503: engine core is dead"

    async def _observe_unless_interrupted(
        self, proc: process.EngineProcess, last_canary_s: float
    ) -> tuple[Observation, float] | None:
        """``_observe``, abandoned (None) as soon as the engine exits or a stop or restart is
        requested: a hung engine's canary would otherwise hold the restart for its whole
        deadline (live_canary_timeout_s), which the recovery benchmark measured."""
        observing = asyncio.ensure_future(self._observe(proc, last_canary_s))
        while not observing.done():
            await asyncio.wait({observing}, timeout=0.05)
            if proc.returned or not self._want_running or self._restart is not None:
                observing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await observing
                return None
        return observing.result()

    def _follow_rotation(self) -> None:
        """READY, SHEDDING or DRAINING as the operator's hold and the policy's shedding say; the
        operator's drain wins."""
        if self._hold_drained:
            if self.state is not S.DRAINING:
                self._set_state(S.DRAINING, "drain requested: out of rotation until started again")
        elif self._shed_reason is not None:
            if self.state is not S.SHEDDING:
                self._set_state(S.SHEDDING, f"shedding load: {self._shed_reason}")
        elif self.state is not S.READY:
            why = "drain cancelled" if self.state is S.DRAINING else "load shedding over"
            self._set_state(S.READY, f"{why}: back in rotation")

    async def _observe(self, proc: process.EngineProcess, last_canary_s: float) -> tuple[Observation, float]:
        """One look at the engine, every probe at once, each under its own deadline."""
        spec = self.spec
        progressing = bool(
            self._previous_metrics
            and self.last_metrics
            and counters_progressed(self._previous_metrics, self.last_metrics)
        )
        now = self.clock.monotonic()
        # While step counters move the engine is alive: a canary would only queue behind real
        # work and read busy as dead (vllm-facts §7).
        run_canary = not progressing and now - last_canary_s >= spec.canary_interval_s
        probe_timeout_s = spec.health_timeout_s

        async def no_canary() -> None:
            return None

        health_r, metrics_r, proc_r, canary_r = await asyncio.gather(
            health.check_health(self.http, spec.base_url, timeout_s=probe_timeout_s),
            fetch_metrics(self.http, spec.base_url, timeout_s=probe_timeout_s),
            self.sweeper.sample(proc.pgid, timeout_s=probe_timeout_s),
            health.canary(
                self.http,
                spec.base_url,
                spec.model_id,
                prompt=spec.canary_prompt,
                timeout_s=spec.live_canary_timeout_s,
            )
            if run_canary
            else no_canary(),
        )
        if canary_r is not None:
            last_canary_s = self.clock.monotonic()
            if canary_r.ok:
                self.canary_latency_s = canary_r.latency_s
        if isinstance(metrics_r, EngineMetrics):
            self._previous_metrics, self.last_metrics = self.last_metrics, metrics_r
        if isinstance(proc_r, host.ProcSample):
            self._engine_pids = frozenset(proc_r.pids)
        obs = Observation(
            engine=spec.name,
            at_s=self.clock.monotonic(),
            metrics=metrics_r,
            health=health_r,
            canary=canary_r,
            gpus=self.gpu_source.samples_for(spec.gpus),
            gpu_events=self.gpu_source.take_events(spec.gpus),
            proc=proc_r,
            engine_pids=frozenset(proc_r.pids) if isinstance(proc_r, host.ProcSample) else frozenset(),
        )
        self.window.append(obs)
        return obs, last_canary_s

    def _detect(self, obs: Observation) -> None:
        """Findings are logged once when they open and once when they clear, never every tick."""
        update = self.tracker.update(detect_all(self.window, obs.at_s, self.detector_config), obs.at_s)
        for finding in update.opened:
            evidence = ", ".join(f"{k}={v}" for k, v in finding.evidence.items())
            log.log(
                FINDING_LOG_LEVEL[finding.severity],
                "finding %s (%s): %s [%s]",
                finding.kind.value,
                finding.severity.value,
                finding.summary,
                evidence,
                extra={"engine": self.spec.name},
            )
        for finding in update.closed:
            log.info(
                "finding %s cleared after %.0f s",
                finding.kind.value,
                obs.at_s - finding.since_s,
                extra={"engine": self.spec.name},
            )
        self.findings = list(update.active)
        kinds = {f.kind for f in self.findings}
        if kinds & set(STEP_DOWN_CAUSES):
            self.step_cause_seen_s = obs.at_s
        if not kinds & set(DEGRADATION):
            self.prefix_reset_at_s = None  # the next degradation tries the cheap repair again

    def _close_findings(self, why: str) -> None:
        for finding in self.findings:
            log.info("finding %s closed: %s", finding.kind.value, why, extra={"engine": self.spec.name})
        self.findings = []

    async def _drain(self, reason: str) -> None:
        """Out of rotation first, then let the load balancer notice, then let in-flight requests
        finish (or the drain deadline pass). vLLM answers new requests with HTTP 500 once it is
        SIGTERMed and keeps /health at 200, so the engine must be out of rotation before that."""
        proc = self.proc
        if proc is None or proc.returned or self.state not in (S.READY, S.SHEDDING, S.DRAINING):
            return
        if self.state is not S.DRAINING:
            self._set_state(S.DRAINING, f"draining: {reason}")
        loop = asyncio.get_running_loop()
        grace_end = loop.time() + self.spec.drain_grace_s
        while not self._quick.is_set() and not proc.returned and loop.time() < grace_end:
            await self._wait_exit_or_wake(proc, grace_end - loop.time())
        deadline = loop.time() + self.spec.drain_timeout_s
        while not self._quick.is_set() and not proc.returned:
            metrics = await fetch_metrics(self.http, self.spec.base_url, timeout_s=self.spec.health_timeout_s)
            inflight = _inflight(metrics)
            if inflight == 0 or inflight is None or loop.time() >= deadline:
                if inflight:
                    log.warning(
                        "drain deadline: %d request(s) still in flight; vLLM's own drain "
                        "(--shutdown-timeout) gets them next",
                        inflight,
                        extra={"engine": self.spec.name},
                    )
                return
            await self._wait_exit_or_wake(proc, min(1.0, max(0.0, deadline - loop.time())))

    def _count_restart(self, cause: str) -> None:
        self.restarts_total += 1
        self.restarts_by_reason[cause] = self.restarts_by_reason.get(cause, 0) + 1

    async def _after_failure(self, reason: str, cause: str) -> None:
        """Clean up, then restart (at once the first time within the failure window, with a
        growing backoff on repeats), or give up (FATAL)."""
        self.last_failure = reason
        now = self.clock.monotonic()
        self.failures = self.failures.record(now, self.policy)
        count = self.failures.count(now, self.policy)
        give_up = is_crash_loop(self.failures, now, self.policy)
        if self.proc is not None:
            if not self._group_gone():
                # The engine is failing; there is nothing to drain.
                self._set_state(S.STOPPING, f"cleaning up after failure: {reason}")
            await self._terminate(StopLadder.for_spec(self.spec).quick())
        if give_up:
            self._want_running = False
            self._set_state(
                S.FATAL,
                f"{reason}; {count} failures within {self.policy.failure_window_s:g} s, "
                f"giving up (llm-supervisor start {self.spec.name} retries)",
            )
            return
        # One failure of an engine that was running is not a loop: waiting only adds downtime
        # (a crash, a hang, a GPU fault alike). The backoff starts with the second failure.
        delay_s = 0.0 if count == 1 else backoff_delay_s(count - 1, self.policy, self.rng.random())
        self._set_state(
            S.BACKOFF, f"{reason}; failure {count}/{self.policy.max_failures}, restarting in {delay_s:.1f} s"
        )
        deadline = self.clock.monotonic() + delay_s
        while self._want_running and (left := deadline - self.clock.monotonic()) > 0:
            await self._wait_wake(left)
        if self._want_running:
            self._count_restart(cause)

    async def _stop(self, reason: str, *, to: EngineState, quick: bool = False) -> None:
        self._set_state(S.STOPPING, reason)
        ladder = StopLadder.for_spec(self.spec)
        await self._terminate(ladder.quick() if quick else ladder)
        self._set_state(to, f"{reason}: stopped")

    # ---- processes ----

    def _exit_text(self, proc: process.EngineProcess) -> str:
        assert proc.exit_status is not None
        self.last_exit = proc.exit_status.describe()
        return self.last_exit

    def _group_gone(self) -> bool:
        return self.proc is None or (self.proc.returned and not process.group_members(self.proc.pgid))

    async def _terminate(self, ladder: StopLadder) -> None:
        """Run the stop ladder on the current incarnation; return once no process of it is left."""
        proc = self.proc
        if proc is None:
            return
        name = self.spec.name
        if self._quick.is_set():
            ladder = ladder.quick()
        steps: list[tuple[str, Callable[[], None], float]] = [
            (
                "SIGTERM to the API server",
                lambda: proc.signal_main(signal.SIGTERM),
                ladder.main_term_timeout_s,
            ),
            (
                "SIGTERM to the process group",
                lambda: proc.signal_group(signal.SIGTERM),
                ladder.group_term_timeout_s,
            ),
            (
                "SIGKILL to the process group",
                lambda: proc.signal_group(signal.SIGKILL),
                ladder.kill_timeout_s,
            ),
        ]
        for i, (what, send, timeout_s) in enumerate(steps):
            if i == 0 and proc.returned:
                continue  # the leader is gone: its orphans get the group signals
            log.info("%s (pid %d), waiting up to %g s", what, proc.pid, timeout_s, extra={"engine": name})
            send()
            if await self._wait_group_gone(proc, timeout_s, escalatable=i < 2):
                break
        else:
            left = process.group_members(proc.pgid)
            log.error("processes %s of the engine survived SIGKILL", left, extra={"engine": name})
        # Processes that left the group (setsid) but carry this engine's marker.
        strays = [p for p in process.marker_processes(self.state_dir, engine=name) if p != proc.pid]
        if strays:
            log.warning(
                "killing %d stray process(es) of the engine outside its group: %s",
                len(strays),
                strays,
                extra={"engine": name},
            )
            await process.kill_trees(strays, timeout_s=ladder.kill_timeout_s)
        await self._stop_readers()
        if not process.group_members(proc.pgid):
            process.forget_group(self.state_dir, name)
        if proc.exit_status is not None:
            log.info(
                "engine processes gone (API server %s)", proc.exit_status.describe(), extra={"engine": name}
            )
        self.proc = None
        await self._await_gpu_release(self._engine_pids | {proc.pid})

    async def _await_gpu_release(self, pids: frozenset[int]) -> None:
        """Where NVML can list compute processes: wait until none of the stopped engine's
        processes holds memory on its GPUs, so the next start does not fail for want of it."""
        spec = self.spec
        if not spec.gpus or spec.gpu_release_timeout_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spec.gpu_release_timeout_s
        while True:
            holders = sorted(
                {
                    p.pid
                    for sample in self.gpu_source.samples_for(spec.gpus).values()
                    if isinstance(sample, GpuSample) and sample.processes
                    for p in sample.processes
                    if p.pid in pids
                }
            )
            if not holders:
                return
            if loop.time() >= deadline:
                log.warning(
                    "GPU memory still held by stopped engine pid(s) %s after %g s; starting anyway",
                    holders,
                    spec.gpu_release_timeout_s,
                    extra={"engine": spec.name},
                )
                return
            await asyncio.sleep(GPU_RELEASE_POLL_S)

    async def _wait_group_gone(
        self, proc: process.EngineProcess, timeout_s: float, *, escalatable: bool
    ) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            members = process.group_members(proc.pgid)
            process.reap_adopted(members, skip=proc.pid)
            if proc.returned and not [p for p in members if p != proc.pid and process.alive(p)]:
                return True
            if loop.time() >= deadline or (escalatable and self._quick.is_set()):
                return False
            await asyncio.sleep(0.1)

    # ---- output ----

    def _start_readers(self, proc: process.EngineProcess) -> None:
        self._readers = [
            asyncio.create_task(self._forward(proc.stdout_fd, logging.INFO, proc.pid)),
            asyncio.create_task(self._forward(proc.stderr_fd, logging.WARNING, proc.pid)),
        ]

    async def _stop_readers(self) -> None:
        if not self._readers:
            return
        _done, pending = await asyncio.wait(self._readers, timeout=2.0)
        for task in pending:
            task.cancel()
        self._readers = []

    async def _forward(self, fd: int, default_level: int, pid: int) -> None:
        """Forward one pipe line by line into the daemon's log, tagged with the engine's name."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=OUTPUT_LINE_LIMIT, loop=loop)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(fd, "rb", buffering=0)
        )
        level = default_level
        extra = {"engine": self.spec.name, "engine_pid": pid}
        try:
            while True:
                try:
                    raw = await reader.readline()
                except ValueError:  # a line longer than the limit: forward what fits
                    raw = await reader.read(OUTPUT_LINE_LIMIT)
                if not raw:
                    return
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if not line:
                    continue
                # Continuation lines (tracebacks) keep the level of the line that began them.
                level = engine_log_level(
                    line, level if line[:1].isspace() or line.startswith("Traceback") else default_level
                )
                engine_output_log.log(level, "%s", line, extra=extra)
                if self.state is S.STARTING and not self.start_failed_oom and _OOM_RE.search(line):
                    self.start_failed_oom = True
        finally:
            transport.close()


def _flags_text(args: Mapping[str, object]) -> str:
    return " ".join(f"--{k} {v}" for k, v in args.items())


def _inflight(metrics: EngineMetrics | ProbeFailure) -> int | None:
    """Running plus waiting requests; None when unknown (no answer, or the gauges are absent, as
    in multi-API-server mode before the first request)."""
    if (
        isinstance(metrics, ProbeFailure)
        or metrics.requests_running is None
        or metrics.requests_waiting is None
    ):
        return None
    return metrics.requests_running + metrics.requests_waiting
