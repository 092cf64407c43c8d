"""The daemon: one asyncio loop, one request queue, one reconcile step.

::

     SIGTERM / SIGINT / SIGHUP ──┐
                                 ├──► requests ──► Supervisor._loop ◄── changes ◄── runners
     control socket ─────────────┘                     │                 (engine/runner.py)
                                                       │ on a request, a change or a tick
                                                       ▼
         statuses ──► reconcile (policy memory ─► policy ─► actions) ──► commands ──► runners
                                                       │
                                  every tick: status file, sd_notify STATUS/WATCHDOG, metrics

Startup takes the state dir's lock first (cli/main.py), then: subreaper, the sweep of an earlier
run's leftovers, the guard, the runners, the control socket and the HTTP listener. Shutdown
tells every runner (retiring ones too) to stop for good, waits for them under
``shutdown_timeout_s`` (a second SIGINT skips the drains), and confirms that nothing is left.

Signal handlers and the control socket only put a request on the queue (daemon/intake.py), and
only the loop acts on it: a reload goes one way whether it comes from SIGHUP or from
`llm-supervisor reload`. A misbehaving engine cannot take the daemon down: each runner is its own
task, and one that dies of a bug is replaced by the fleet (daemon/fleet.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

from llmsupervisor import aio, control, files, logs, process
from llmsupervisor.config import EngineSpec, SupervisorConfig
from llmsupervisor.core.node_condition import engine_blocked
from llmsupervisor.core.policy import FleetRules
from llmsupervisor.core.policy_memory import PolicyMemory
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.actions import ActionExecutor, GpuMarks, blocked_reason
from llmsupervisor.daemon.agent import AgentServers
from llmsupervisor.daemon.endpoints import http_api
from llmsupervisor.daemon.events import EventRing
from llmsupervisor.daemon.exporter import Exporter, gpu_metric_values
from llmsupervisor.daemon.fleet import Fleet
from llmsupervisor.daemon.gpu_release import GpuReleaser
from llmsupervisor.daemon.guard import GuardProcess
from llmsupervisor.daemon.holds import Holds, desired_at_start
from llmsupervisor.daemon.intake import Intake
from llmsupervisor.daemon.nvml_wait import NvmlGate
from llmsupervisor.daemon.output_ring import OutputRing
from llmsupervisor.daemon.placement import place_on_host
from llmsupervisor.daemon.reconcile import PolicyKey, Reconciler, policy_key
from llmsupervisor.daemon.reload import Reloader
from llmsupervisor.daemon.requests import (
    AnyRequest,
    EngineRequest,
    GpuRequest,
    ReloadRequest,
    Request,
    refuse,
)
from llmsupervisor.daemon.status import (
    DaemonCounters,
    Snapshot,
    StatusFile,
    config_roll,
    descriptor_usage,
    snapshot,
    status_json,
    summary,
)
from llmsupervisor.engine.http import EngineHttp
from llmsupervisor.engine.ledger import Ledger
from llmsupervisor.engine.observer import GroupSampler
from llmsupervisor.engine.processes import HostProcesses, Processes
from llmsupervisor.http_api import parse_listen
from llmsupervisor.notify import Notifier
from llmsupervisor.probes import PROBE_ERRORS
from llmsupervisor.probes.gpu_readings import GpuReader
from llmsupervisor.probes.gpus import GpuMonitor
from llmsupervisor.probes.host import GroupSweeper

log = logging.getLogger("llmsupervisor")

LEFTOVER_KILL_TIMEOUT_S: Final = 10.0
# Past shutdown_timeout_s: how long the cancelled engine stops get to end. With the leftover kill
# after it, a shutdown can outlast shutdown_timeout_s by this plus LEFTOVER_KILL_TIMEOUT_S, which
# a Kubernetes terminationGracePeriodSeconds must allow for (docs/fleet.md).
SHUTDOWN_CANCEL_TIMEOUT_S: Final = 30.0
LOOP_HELD_WARN_S: Final = 2.0  # a tick this late: balancers' checks of the daemon timed out
SHUTDOWN_NOTIFY_S: Final = 1.0  # progress to systemd while engines stop, at most this often


def local_minute_of_day() -> int:
    now = time.localtime()
    return now.tm_hour * 60 + now.tm_min


class Supervisor:
    def __init__(
        self,
        config: SupervisorConfig,
        *,
        notifier: Notifier | None = None,
        gpus_of: dict[str, str] | None = None,
        gpu_reader: GpuReader | None = None,
        procs: Processes | None = None,
        minute_of_day: Callable[[], int] = local_minute_of_day,
        http_for: Callable[[EngineSpec], EngineHttp] | None = None,
        sweeper: GroupSampler | None = None,
    ) -> None:
        self.config = config
        settings = config.supervisor
        # Read once: these take effect at the next start (a reload says so).
        self.state_dir = settings.state_dir.resolve()
        self.tick_s = settings.tick_interval_s
        self.http_listen = settings.http_listen
        self.gpus_of = gpus_of if gpus_of is not None else {}  # shared with the journal handler
        self.notifier = notifier or Notifier()
        self.minute_of_day = minute_of_day
        self.control_path = control.default_socket_path(self.state_dir)
        self.control_server: control.ControlServer | None = None  # from the start of run()
        self._stopping = False
        self._ready_sent = False
        self._config_changed = False  # a reload took a new config: reconcile against it at once
        self.ticks_total = 0
        self.last_tick_duration_s = 0.0
        self.config_loaded_timestamp_s = time.time()  # wall clock: exported as a timestamp
        self._last_tick_s = aio.now()
        self._changes_written = -1
        if gpu_reader is None:
            from llmsupervisor.probes.nvml import NvmlReader

            gpu_reader = NvmlReader()
        self.gpu_monitor = GpuMonitor(
            gpu_reader, interval_s=self.tick_s, hang_misses=settings.nvml_hang_misses
        )
        # One /proc sweep per tick for all engines: per engine, it cost engines x processes.
        self.sweeper = sweeper or GroupSweeper(max_age_s=self.tick_s, monotonic=aio.now)
        self.fleet = Fleet(
            procs=procs or HostProcesses(self.state_dir),
            tick_interval_s=self.tick_s,
            gpus=self.gpu_monitor,
            sweeper=self.sweeper,
            http_for=http_for,  # tests: a scripted server
        )
        self.memory = PolicyMemory()
        self.marks = GpuMarks(self.state_dir / "gpu-faults.json", gpus=self.gpu_monitor.gpus_by_index)
        self.reconcile = Reconciler(
            self.memory, ActionExecutor(self.fleet.send, self.fleet.gpus_of, self.marks)
        )
        self.reloader = Reloader(
            self.fleet,
            self.notifier,
            summary=self.summary,
            stopping=lambda: self._stopping,
            place=lambda config: place_on_host(config, self.gpu_monitor),  # as at start
        )
        self.exporter = Exporter(
            self.snapshot, gpu_samples=lambda: gpu_metric_values(self.gpu_monitor.latest)
        )
        self._rounds_seen: dict[str, int] = {}
        self._policy_keys: dict[str, PolicyKey] = {}  # as the last reconcile saw each engine
        self._changes_seen: dict[str, int] = {}  # state_changes_total as last looked at
        self.reconciles_total = 0
        self.status_file = StatusFile(self.state_dir / "status.json")
        self.holds = Holds(self.state_dir / "holds")  # the operator's stop and drain, kept across restarts
        # Engines named by GPU index wait for NVML at start (daemon/nvml_wait.py).
        self.nvml = NvmlGate(self.gpu_monitor, self.fleet, self.holds, self.marks, settings, self.gpus_of)
        # `gpu release N` / `gpu take-back N`: one GPU reset while the rest serve (daemon/gpu_release.py).
        self.gpu_release = GpuReleaser(self.gpu_monitor, self.fleet, self.holds, self.marks)
        self.guard = GuardProcess(self.state_dir)
        self.agents = AgentServers(self.fleet.status, node_conditions=lambda: self.marks.conditions)
        # The recent transitions, findings and actions, from the log records that report them.
        self.events = EventRing()
        # Each engine's recent output (this incarnation's and the last one's): `logs`, `describe`.
        self.output = OutputRing()
        self.intake = Intake(
            fleet=self.fleet,
            holds=self.holds,
            events=self.events,
            output=self.output,
            journal=logs.resolve_format() == "journal",
            status=self.status,
            stopping=lambda: self._stopping,
            reload=self.reload,
            gpus=self.gpu_release,
        )

    # ---- requests: the one way in ----

    def submit(self, request: AnyRequest) -> None:
        """Queue a request for the loop (daemon/intake.py: signals and the control socket)."""
        self.intake.submit(request)

    # ---- projections ----

    def snapshot(self) -> Snapshot:
        open_fds, fds_limit = descriptor_usage()
        statuses = self.fleet.statuses()
        return snapshot(
            statuses,
            now=aio.now(),
            memory=self.memory,
            gpu_samples=self.gpu_monitor.samples_for,
            gpu_faults_marked=self.marks.counts,
            node_conditions=self.marks.conditions,
            holds={name: hold.as_json() for name in self.fleet.runners if (hold := self.holds.get(name))},
            holds_unsaved={name: why for name in self.fleet.runners if (why := self.holds.unsaved(name))},
            unsaved_files=files.unsaved_files(),
            nvml=self.nvml.health(),
            gpu_release=self.gpu_release.current,
            roll=config_roll(
                statuses, {e.name: e for e in self.config.engines}, self.reconcile.roll_halted_by
            ),
            counters=DaemonCounters(
                ticks_total=self.ticks_total,
                last_tick_duration_s=self.last_tick_duration_s,
                notify_failures_total=self.notifier.failures_total,
                config_path=str(self.config.path),
                config_loaded_timestamp_s=self.config_loaded_timestamp_s,
                reloads_total=dict(self.reloader.totals),
                probe_errors_total=PROBE_ERRORS.totals(),
                open_fds=open_fds,
                fds_limit=fds_limit,
            ),
        )

    def status(self) -> dict[str, Any]:
        return status_json(self.snapshot())

    def summary(self) -> str:
        problem = self.reloader.problem
        if problem is None and (halted_by := self.reconcile.roll_halted_by):
            problem = f"config roll halted: {', '.join(halted_by)} failed on the new config"
        statuses, unsaved = self.fleet.statuses(), files.unsaved_files()
        nvml = "; ".join(line for line in (self.gpu_release.line(), self.nvml.line()) if line) or None
        return summary(statuses, now=aio.now(), reload_problem=problem, unsaved=unsaved, nvml=nvml)

    # ---- run ----

    async def run(self) -> int:
        self.intake.install_signals()
        logging.getLogger("llmsupervisor").addHandler(self.events)
        logging.getLogger("llmsupervisor.engine.output").addHandler(self.output)
        try:
            return await self._run()
        finally:
            logging.getLogger("llmsupervisor").removeHandler(self.events)
            logging.getLogger("llmsupervisor.engine.output").removeHandler(self.output)

    async def _run(self) -> int:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not process.become_subreaper():
            log.warning("cannot become a child subreaper: orphans of crashed engines go to PID 1")
        soft_before, soft_now = process.raise_nofile_limit()
        if soft_now != soft_before:
            log.info("file descriptor limit raised from %d to %d (the hard limit)", soft_before, soft_now)
        # Engines of an earlier daemon on this state dir (SIGKILLed, and its guard did not get to
        # them) are not adopted: their spec and drain state are unknown. The state-dir lock
        # (cli/main.py) guarantees that no live daemon owns them.
        await process.sweep_leftovers(self.state_dir, timeout_s=LEFTOVER_KILL_TIMEOUT_S)
        self.guard.start()
        server = self.control_server = control.ControlServer(self.control_path, self.intake.on_control)
        await self.gpu_monitor.start()
        await self.add_engines()
        self._write_status()
        log.info("supervising %d engine(s): %s", len(self.fleet.runners), ", ".join(self.fleet.runners))
        try:
            await server.start()
        except OSError as exc:
            log.error(
                "cannot open the control socket %s: %s; the CLI cannot reach this daemon",
                self.control_path,
                exc,
            )
        api = http_api(
            exporter=self.exporter,
            statuses=self.fleet.statuses,
            last_tick_age_s=lambda: aio.now() - self._last_tick_s,
            tick_limit_s=lambda: max(10.0, 5 * self.tick_s),
            readyz_requires=lambda: self.config.supervisor.readyz_requires,
            stopping=lambda: self._stopping,
            status=self.status,
            node_conditions=lambda: self.marks.conditions,
        )
        host, port = parse_listen(self.http_listen)
        try:
            await api.start(host, port)
            log.info("HTTP on %s: /metrics /livez /readyz /engines/NAME/ready /status", self.http_listen)
        except OSError as exc:
            # Engines matter more than the listener: supervise them anyway, loudly.
            log.error("cannot listen on %s: %s; no metrics or readiness endpoints", self.http_listen, exc)
        await self.agents.sync(self.config.engines)
        try:
            await self._loop()
        finally:
            await server.close()
            # The HTTP listener stays up through the drain: /readyz and /engines/NAME/ready say
            # 503 (a load balancer or kubelet sees why, not a refused connection) and /livez
            # keeps saying 200 while the shutdown makes progress.
            try:
                exit_code = await self._shutdown()
            finally:
                await api.close()
                await self.agents.close()
            await self.fleet.aclose()
            await self.gpu_release.close()
            await self.gpu_monitor.close()
            self.guard.stop()
        return exit_code

    async def add_engines(self) -> None:
        """Place the configured engines on this host and give each its runner (at start)."""
        self.config = await place_on_host(self.config, self.gpu_monitor)  # GPU UUIDs, MIG, CPUs
        self.nvml.placed(self.config)
        self.gpus_of.update({e.name: ",".join(str(g) for g in e.gpus) for e in self.config.engines})
        self.holds.load(spec.name for spec in self.config.engines)
        for spec in self.config.engines:
            # A GPU condition from earlier in this boot keeps its engine stopped (docs/gpu.md).
            blocked = engine_blocked(spec.gpus, self.marks.conditions) if spec.enabled else None
            why = blocked_reason(blocked) if blocked is not None else None
            if why is not None:
                log.error("engine %s not started: %s", spec.name, why)
            desired = desired_at_start(spec, self.holds.get(spec.name), blocked=why is not None)
            self.fleet.add(
                spec, desired=desired, ledger=Ledger(spec.name, now=aio.now(), reason=why) if why else None
            )

    async def _loop(self) -> None:
        tick_s = self.tick_s
        if self.notifier.watchdog_interval_s is not None and tick_s > self.notifier.watchdog_interval_s:
            log.warning(
                "tick_interval_s=%g is longer than half of WatchdogSec: systemd will kill the daemon", tick_s
            )
        next_tick_s = aio.now()
        while True:
            self.intake.arrived.clear()
            handled = bool(self.intake.requests)
            while self.intake.requests:
                request = self.intake.requests.popleft()
                if request in (Request.SHUTDOWN, Request.SHUTDOWN_NOW):
                    if request is Request.SHUTDOWN_NOW:
                        self.submit(request)  # the shutdown sees it and escalates at once
                    return
                self.intake.handle(request)
            # Only engines that published since the last turn: a publish that changed nothing the policy
            # reads (one per round) costs no reconcile; the tick reconciles for what time decides.
            policy_changed, state_changed = self._look(self.fleet.changes.take_changed())
            tick_due = aio.now() >= next_tick_s
            if tick_due or policy_changed or handled or self._config_changed:
                self._reconcile()
            self.gpu_release.turn()  # a GPU release moves on: its engines stopped, NVML back, a deadline
            if tick_due:
                if (held_s := aio.now() - next_tick_s) > LOOP_HELD_WARN_S:  # a call that blocked the loop
                    log.warning("the daemon's loop ran %.1f s late (blocked, or the host starved it)", held_s)
                self._tick()
                next_tick_s = aio.now() + tick_s
                self.config = await self.nvml.turn(self.config)  # NVML opened late, or its wait ran out
            elif state_changed:
                self._write_status()
            changed = self.fleet.changes.future(self.fleet.changes.version)
            await aio.wait_any(self.intake.arrived.future(), changed, timeout_s=next_tick_s - aio.now())

    def _look(self, changed: set[str] | None) -> tuple[bool, bool]:
        """(did anything the policy reads change, did any engine change state) among the engines
        in ``changed`` (None: every engine), noting each new observation round for the exporter."""
        if changed is None:
            changed = set(self.fleet.runners) | set(self._policy_keys)
        policy_changed = state_changed = False
        for name in changed:
            s = self.fleet.status(name)
            if s is None:  # retired
                policy_changed = state_changed = True
                self._policy_keys.pop(name, None)
                self._changes_seen.pop(name, None)
                continue
            if s.rounds_total != self._rounds_seen.get(name, 0):  # each round once, into the histogram
                self._rounds_seen[name] = s.rounds_total
                self.exporter.observe_engine_round(name, s.last_round_s)
            if self._policy_keys.get(name) != policy_key(s):
                policy_changed = True
            if self._changes_seen.get(name) != s.state_changes_total:
                self._changes_seen[name] = s.state_changes_total
                state_changed = True
        return policy_changed, state_changed

    def _reconcile(self) -> None:
        statuses = self.fleet.statuses()
        if self._stopping:
            return
        self.reconciles_total += 1
        self._config_changed = False
        self._policy_keys = {s.name: policy_key(s) for s in statuses}
        settings = self.config.supervisor
        self.reconcile(
            statuses,
            now=aio.now(),
            minute_of_day=self.minute_of_day(),
            fleet=FleetRules(
                max_unavailable=settings.max_unavailable, min_in_rotation=settings.min_in_rotation
            ),
            pending=self.fleet.pending,
            specs={e.name: e for e in self.config.engines},  # a reload's changes are rolled from here
        )

    def _tick(self) -> None:
        started = time.monotonic()
        self._write_status()
        self._notify_progress()
        self.ticks_total += 1
        self.last_tick_duration_s = time.monotonic() - started
        self.exporter.observe_tick(self.last_tick_duration_s)
        self._last_tick_s = aio.now()
        # Only after a complete tick: a wedged loop stops the pings and systemd restarts us.
        self.notifier.watchdog()

    def _state_changes(self) -> int:
        return sum(s.state_changes_total for s in self.fleet.statuses()) + len(self.fleet.runners)

    def _write_status(self) -> None:
        self._changes_written = self._state_changes()
        self.status_file.write(self.status(), now=aio.now())

    def _notify_progress(self) -> None:
        """READY=1 once every engine meant to serve and not held (it never would be) is READY or has
        failed; until then extend the start timeout: loads take minutes (docs/host-notes.md §2.3)."""
        line = self.summary()
        if self._ready_sent:
            self.notifier.status(line)
            return
        settled = (EngineState.READY, EngineState.BACKOFF, EngineState.FATAL)
        expected = (s for s in self.fleet.statuses() if s.meant_to_serve and not s.held_by_operator)
        if all(s.state in settled for s in expected):
            self._ready_sent = True
            self.notifier.ready(line)
            log.info("startup complete: %s", line)
        else:
            self.notifier.status(line)
            self.notifier.extend_timeout(max(60.0, 4 * self.tick_s))

    # ---- reload ----

    async def reload(self, *, dry_run: bool = False) -> dict[str, Any]:
        """Validate the whole new config first; on any problem keep the old one untouched.
        Otherwise apply the plan; the policy rolls the changed engines that run (within
        max_unavailable), from the next reconcile on, which this wakes at once. READY=1 follows
        here, without waiting for the roll (systemd would wait in "reloading" for minutes).
        ``dry_run``: the same reply, nothing applied. A removed control socket is made again first."""
        if self.control_server is not None:
            await self.control_server.keep()
        new, reply = await self.reloader.reload(self.config, dry_run=dry_run)
        if new is not None:
            removed = {e.name for e in self.config.engines} - {e.name for e in new.engines}
            self.config = new
            self.config_loaded_timestamp_s = time.time()
            self.gpus_of.clear()
            self.gpus_of.update({e.name: ",".join(str(g) for g in e.gpus) for e in new.engines})
            logs.set_level(new.supervisor.log_level)
            for name in removed:
                self.exporter.forget_engine(name)
                self.holds.forget(name)
                await self.holds.persist(name)
            await self.agents.sync(new.engines)
            self._config_changed = True
            self.intake.arrived.set()  # the loop reconciles against it at once
            self._write_status()
            self.notifier.ready(self.summary())
        return reply

    # ---- shutdown ----

    async def _shutdown(self) -> int:
        """Stop every engine in parallel (a rolling stop is for reloads), then confirm that no
        engine process is left before returning 0."""
        self._stopping = True
        self.fleet.stop_all()
        log.info("shutting down: stopping %d engine(s)", len(self.fleet.runners))
        self.notifier.stopping(f"stopping {len(self.fleet.runners)} engine(s)")
        deadline = aio.now() + self.config.supervisor.shutdown_timeout_s
        escalated = False
        notified_s = -SHUTDOWN_NOTIFY_S
        while pending := {t for t in self.fleet.all_tasks() if not t.done()}:
            self._last_tick_s = aio.now()  # a turn of the shutdown loop: /livez stays 200
            self.intake.arrived.clear()
            if self._state_changes() != self._changes_written:
                self._write_status()  # `llm-supervisor status` shows the engines stopping
            seen = self.fleet.changes.version
            # Wake at least every 5 s to keep systemd's stop timeout and watchdog from firing
            # while engines drain; the daemon's own deadline is shutdown_timeout_s.
            await aio.wait_any(
                *pending,
                self.intake.arrived.future(),
                self.fleet.changes.future(seen),
                timeout_s=min(5.0, max(0.0, deadline - aio.now())),
            )
            if aio.now() - notified_s >= SHUTDOWN_NOTIFY_S:
                # Not on every engine change: each message is a blocking datagram to systemd.
                notified_s = aio.now()
                self.notifier.extend_timeout(30.0)
                self.notifier.watchdog()
                self.notifier.status("stopping: " + self.summary())
            while self.intake.requests:
                request = self.intake.requests.popleft()
                if request is Request.SHUTDOWN_NOW and not escalated:
                    escalated = True
                    log.warning("second interrupt: stopping engines without draining")
                    self.fleet.escalate_all()
                elif (
                    isinstance(request, EngineRequest | GpuRequest | ReloadRequest)
                    and request.reply is not None
                ):
                    refuse(request.reply, "the daemon is shutting down")
            if aio.now() >= deadline and any(not t.done() for t in pending):
                log.error(
                    "engines did not stop within shutdown_timeout_s=%g s: killing them",
                    self.config.supervisor.shutdown_timeout_s,
                )
                await self.fleet.cancel(pending, timeout_s=SHUTDOWN_CANCEL_TIMEOUT_S)
                break
        for name, task in self.fleet.tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("engine task failed during shutdown: %r", task.exception(), extra={"engine": name})
        self.intake.cancel_reloads()
        self._write_status()
        await self.status_file.flush()
        left = process.marker_processes(self.state_dir)
        if left:
            log.error("engine processes still running after shutdown: %s; killing them", left)
            alive = await process.kill_trees(left, timeout_s=LEFTOVER_KILL_TIMEOUT_S)
            if alive:
                log.critical("processes %s survived SIGKILL", alive)
                return 1
        log.info("all engines stopped; no engine process left")
        return 0
