"""The daemon: one asyncio loop, one task per engine, commands on one queue.

::

     SIGTERM / SIGINT (x2) ──► Command queue ──► Supervisor.run
                                                   │
                 startup: subreaper, sweep leftovers of earlier runs, guard, status file
                                                   │
                      EngineRunner.run per engine (engine.py): spawn ─► ready ─► watch
                                                   │        crash ─► BACKOFF ─► restart / FATAL
                                                   │
                 shutdown: every engine's stop ladder in parallel, confirm nothing is left, exit 0

Signal handlers only put a ``Command`` on the queue. A misbehaving engine cannot take the daemon
down: each runner is its own task, and a runner that dies of a bug is logged, its processes are
killed by its ``finally``, and it is started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import signal
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import httpx

from llmsupervisor import control, logs, process
from llmsupervisor.clock import Clock, MonotonicClock
from llmsupervisor.config import EngineSpec, SupervisorConfig, load_config
from llmsupervisor.core.policy import (
    Action,
    ActionKind,
    EngineRules,
    EngineView,
    FleetRules,
    back_in_rotation,
    decide,
)
from llmsupervisor.core.state import EngineState, StateChange
from llmsupervisor.engine import EngineRunner
from llmsupervisor.errors import ConfigError
from llmsupervisor.exporter import Exporter
from llmsupervisor.http_api import HttpApi, Response, parse_listen
from llmsupervisor.notify import Notifier
from llmsupervisor.probes.gpus import GpuMonitor
from llmsupervisor.probes.host import GroupSweeper
from llmsupervisor.probes.nvml import GpuReader, GpuSample
from llmsupervisor.snapshot import EngineSnapshot, Snapshot

log = logging.getLogger("llmsupervisor")

RUNNER_RESTART_DELAY_S: Final = 5.0
STATUS_REFRESH_S: Final = 10.0
# Per engine: its probes (/health, /metrics, a canary) and the odd drain or cache reset at once.
ENGINE_HTTP_LIMITS: Final = httpx.Limits(max_connections=8, max_keepalive_connections=4)


def local_minute_of_day() -> int:
    now = time.localtime()
    return now.tm_hour * 60 + now.tm_min


class Command(enum.Enum):
    SHUTDOWN = "shutdown"
    SHUTDOWN_NOW = "shutdown now"  # second SIGINT: skip the drains
    RELOAD = "reload"  # SIGHUP, or `llm-supervisor reload`


class Supervisor:
    def __init__(
        self,
        config: SupervisorConfig,
        *,
        clock: Clock | None = None,
        notifier: Notifier | None = None,
        gpus_of: dict[str, str] | None = None,
        gpu_reader: GpuReader | None = None,
        minute_of_day: Callable[[], int] = local_minute_of_day,
    ) -> None:
        self.config = config
        self.gpus_of = gpus_of if gpus_of is not None else {}  # shared with the journal handler
        self.clock = clock or MonotonicClock()
        self.notifier = notifier or Notifier()
        self._ready_sent = False
        self.state_dir = config.supervisor.state_dir.resolve()
        self.commands: asyncio.Queue[Command] = asyncio.Queue()
        self.control_path = control.default_socket_path(self.state_dir)
        # One HTTP client per engine (by name), closed with the daemon or when the engine is removed.
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._client_stack: contextlib.AsyncExitStack | None = None
        self._tls: ssl.SSLContext | None = None
        self._reload_lock = asyncio.Lock()
        self._roll_task: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[Any]] = set()  # reloads, engines being removed
        self.ticks_total = 0
        self.last_tick_duration_s = 0.0
        self.reloads_total: dict[str, int] = {"ok": 0, "invalid": 0}
        self._reload_problem: str | None = None
        self._status_written: str | None = None
        self._status_written_at_s = 0.0
        self.config_loaded_timestamp_s = time.time()  # wall clock: exported as a timestamp
        if gpu_reader is None:
            from llmsupervisor.probes.nvml import NvmlReader

            gpu_reader = NvmlReader()
        self.gpu_monitor = GpuMonitor(gpu_reader, interval_s=config.supervisor.tick_interval_s)
        # One /proc sweep per tick for all engines: per engine, it cost engines x processes.
        self.sweeper = GroupSweeper(
            max_age_s=config.supervisor.tick_interval_s, monotonic=self.clock.monotonic
        )
        self.exporter = Exporter(self.snapshot, gpu_samples=self.gpu_monitor.exporter_samples)
        self._last_tick_s = self.clock.monotonic()
        self.runners: dict[str, EngineRunner] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._sigint_count = 0
        self._guard_pid: int | None = None
        self._guard_fd: int | None = None
        self._shutting_down = False
        self.minute_of_day = minute_of_day
        self._deferred_logged: dict[str, str] = {}  # engine -> the last "waiting" line logged
        self.gpu_faults_marked: dict[int, int] = self._load_gpu_marks()

    # ---- signals ----

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.commands.put_nowait, Command.SHUTDOWN)
        loop.add_signal_handler(signal.SIGHUP, self.commands.put_nowait, Command.RELOAD)
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)

    def _on_sigint(self) -> None:
        self._sigint_count += 1
        self.commands.put_nowait(Command.SHUTDOWN if self._sigint_count == 1 else Command.SHUTDOWN_NOW)

    # ---- startup ----

    async def _sweep_leftovers(self) -> None:
        """Engines of an earlier run of a daemon on this state dir (one that was SIGKILLed, and
        whose guard did not get to them) are not adopted: we cannot know their spec or drain
        state. Kill them before starting our own."""
        leftovers = process.marker_processes(self.state_dir, exclude_daemon_pid=os.getpid())
        for group in process.recorded_groups(self.state_dir):
            if group.daemon_pid != os.getpid():
                leftovers += [p for p in process.recorded_group_members(group) if p not in leftovers]
                process.forget_group(self.state_dir, group.engine)
        if not leftovers:
            return
        log.warning(
            "killing %d leftover engine process(es) of an earlier run: %s",
            len(leftovers),
            ", ".join(f"{pid} ({process.describe_pid(pid)[:60]})" for pid in leftovers),
        )
        alive = await process.kill_trees(leftovers, timeout_s=10.0)
        if alive:
            log.error("leftover processes survived SIGKILL: %s", alive)

    def _start_guard(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self._guard_pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-m", "llmsupervisor.guard", str(self.state_dir), str(os.getpid())],
                dict(os.environ),
                file_actions=[(os.POSIX_SPAWN_DUP2, read_fd, 0)],
                setsid=True,
            )
        except OSError as exc:
            os.close(write_fd)
            log.warning(
                "cannot start the guard process (%s): engines would outlive a SIGKILLed daemon "
                "until its next start",
                exc,
            )
            return
        finally:
            os.close(read_fd)
        self._guard_fd = write_fd

    def _stop_guard(self) -> None:
        if self._guard_fd is not None:
            os.close(self._guard_fd)
            self._guard_fd = None
        if self._guard_pid is not None:
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    pid, _ = os.waitpid(self._guard_pid, os.WNOHANG)
                    if pid == 0:
                        time.sleep(0.05)
                        continue
                break
            self._guard_pid = None

    # ---- status file ----

    def snapshot(self) -> Snapshot:
        now = self.clock.monotonic()
        return Snapshot(
            engines=tuple(
                EngineSnapshot(
                    name=name,
                    state=r.state,
                    state_reason=r.state_reason,
                    state_age_s=now - r.state_since_s,
                    gpus=r.spec.gpus,
                    port=r.spec.port,
                    pid=r.proc.pid if r.proc is not None else None,
                    restarts_total=r.restarts_total,
                    restarts_by_reason=dict(r.restarts_by_reason),
                    state_changes_total=r.state_changes_total,
                    last_exit=r.last_exit,
                    last_failure=r.last_failure,
                    in_rotation=r.in_rotation,
                    canary_latency_s=r.canary_latency_s,
                    findings=tuple((f.kind.value, f.severity.value, f.summary) for f in r.findings),
                    ladder_step=r.ladder_step,
                    ladder_steps=len(r.spec.ladder),
                    actions_total=dict(r.actions_total),
                    last_action_at=dict(r.last_action_at),
                    gpu_temperature_c=self._gpu_max(r.spec.gpus, "temperature_c"),
                    gpu_power_w=self._gpu_max(r.spec.gpus, "power_w"),
                )
                for name, r in self.runners.items()
            ),
            gpu_faults_marked=dict(self.gpu_faults_marked),
            ticks_total=self.ticks_total,
            last_tick_duration_s=self.last_tick_duration_s,
            notify_failures_total=self.notifier.failures_total,
            config_path=str(self.config.path),
            config_loaded_timestamp_s=self.config_loaded_timestamp_s,
            reloads_total=dict(self.reloads_total),
        )

    def status(self) -> dict[str, Any]:
        """The snapshot as JSON: the status file, and `llm-supervisor status --json`."""
        snap = self.snapshot()
        return {
            "pid": os.getpid(),
            "config": snap.config_path,
            "engines": {
                e.name: {
                    "state": e.state.value,
                    "reason": e.state_reason,
                    "for_s": round(e.state_age_s, 1),
                    "pid": e.pid,
                    "port": e.port,
                    "gpus": list(e.gpus),
                    "in_rotation": e.in_rotation,
                    "restarts": e.restarts_total,
                    "restarts_by_reason": dict(e.restarts_by_reason),
                    "canary_latency_s": e.canary_latency_s,
                    "findings": [
                        {"kind": k, "severity": sev, "summary": text} for k, sev, text in e.findings
                    ],
                    "last_exit": e.last_exit,
                    "last_failure": e.last_failure,
                    "batch_step": e.ladder_step,
                    "batch_steps": e.ladder_steps,
                    "actions": {
                        f"{kind}/{reason}": n for (kind, reason), n in sorted(e.actions_total.items())
                    },
                    "gpu_temperature_c": e.gpu_temperature_c,
                    "gpu_power_w": e.gpu_power_w,
                }
                for e in snap.engines
            },
            "gpu_faults_marked": {str(g): n for g, n in sorted(snap.gpu_faults_marked.items())},
        }

    def _gpu_max(self, gpus: tuple[int, ...], attribute: str) -> float | None:
        values = [
            getattr(sample, attribute)
            for sample in self.gpu_monitor.samples_for(gpus).values()
            if isinstance(sample, GpuSample) and getattr(sample, attribute) is not None
        ]
        return float(max(values)) if values else None

    def _write_status(self) -> None:
        """Rewrite the status file when something in it changed (the ages aside), or every
        STATUS_REFRESH_S for the ages: not a disk write on every tick."""
        status = self.status()
        content = json.dumps(
            {**status, "engines": {n: {**e, "for_s": None} for n, e in status["engines"].items()}},
            sort_keys=True,
        )
        now = self.clock.monotonic()
        if content == self._status_written and now - self._status_written_at_s < STATUS_REFRESH_S:
            return
        path = self.state_dir / "status.json"
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(status, indent=2) + "\n")
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)
            return
        self._status_written, self._status_written_at_s = content, now

    def _on_change(self, change: StateChange) -> None:
        # The policy also runs on every state change, not only on ticks: a decision that belongs
        # to a state (step down before the next start after an OOM) must not race a short backoff.
        if not self._shutting_down:
            self._act()
        self._write_status()

    # ---- run ----

    async def run(self) -> int:
        self._install_signals()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not process.become_subreaper():
            log.warning("cannot become a child subreaper: orphans of crashed engines go to PID 1")
        await self._sweep_leftovers()
        self._start_guard()
        server = control.ControlServer(self.control_path, self._on_control)
        await self.gpu_monitor.start()
        # Engines speak plain http (EngineSpec.base_url), yet every httpx client builds a TLS
        # context (~0.7 MB with the CA bundle): one, shared by all of them.
        self._tls = ssl.create_default_context()
        async with contextlib.AsyncExitStack() as clients:
            self._client_stack = clients
            for spec in self.config.engines:
                self._add_engine(spec)
            self._write_status()
            log.info("supervising %d engine(s): %s", len(self.runners), ", ".join(self.runners))
            try:
                await server.start()
            except OSError as exc:
                log.error(
                    "cannot open the control socket %s: %s; the CLI cannot reach this daemon",
                    self.control_path,
                    exc,
                )
            api = self._http_api()
            host, port = parse_listen(self.config.supervisor.http_listen)
            try:
                await api.start(host, port)
                log.info(
                    "HTTP on %s: /metrics /healthz /readyz /engines/NAME/ready",
                    self.config.supervisor.http_listen,
                )
            except OSError as exc:
                # Engines matter more than the listener: supervise them anyway, loudly.
                log.error(
                    "cannot listen on %s: %s; no metrics or readiness endpoints",
                    self.config.supervisor.http_listen,
                    exc,
                )
            await self._loop()
            await server.close()
            await api.close()
            exit_code = await self._shutdown()
        await self.gpu_monitor.close()
        self._stop_guard()
        return exit_code

    def _http_api(self) -> HttpApi:
        return HttpApi(
            {
                "/metrics": lambda: Response(
                    body=self.exporter.render(), content_type=self.exporter.content_type
                ),
                "/healthz": self._healthz,
                "/readyz": self._readyz,
            },
            {"/engines/": self._engine_ready},
        )

    def _healthz(self) -> Response:
        """Alive means the loop is ticking, not merely that the process answers."""
        age_s = self.clock.monotonic() - self._last_tick_s
        limit_s = max(10.0, 5 * self.config.supervisor.tick_interval_s)
        if age_s > limit_s:
            return _json(503, {"ok": False, "reason": f"no loop tick for {age_s:.1f} s"})
        return _json(200, {"ok": True, "last_tick_age_s": round(age_s, 3)})

    def _readyz(self) -> Response:
        ready = [r.spec.name for r in self.runners.values() if r.in_rotation]
        return _json(200 if ready else 503, {"ready": bool(ready), "engines_in_rotation": ready})

    def _engine_ready(self, rest: str) -> Response:
        """``/engines/NAME/ready``: 200 only when NAME should receive traffic (for HAProxy,
        nginx or Kubernetes); 503 with the reason otherwise."""
        name, _, leaf = rest.partition("/")
        runner = self.runners.get(name)
        if leaf != "ready" or runner is None:
            return _json(404, {"error": f"no such endpoint: /engines/{rest}"})
        body = {"engine": name, "state": runner.state.value, "reason": runner.state_reason}
        return _json(200 if runner.in_rotation else 503, body)

    def _client_for(self, name: str) -> httpx.AsyncClient:
        """The engine's own HTTP client. With one pool for every engine, httpcore scans all of
        its connections on each request (encode/httpcore#1035), and at 64 engines its keep-alive
        limit closed and reopened connections every tick (docs/benchmarks.md)."""
        client = self._clients.get(name)
        if client is None or client.is_closed:
            assert self._client_stack is not None and self._tls is not None
            client = httpx.AsyncClient(limits=ENGINE_HTTP_LIMITS, trust_env=False, verify=self._tls)
            self._client_stack.push_async_callback(client.aclose)  # closing twice is harmless
            self._clients[name] = client
        return client

    def _make_runner(self, spec: EngineSpec) -> EngineRunner:
        return EngineRunner(
            spec,
            state_dir=self.state_dir,
            http=self._client_for(spec.name),
            clock=self.clock,
            tick_interval_s=self.config.supervisor.tick_interval_s,
            on_change=self._on_change,
            gpus=self.gpu_monitor,
            sweeper=self.sweeper,
            on_round=self.exporter.observe_engine_round,
        )

    def _add_engine(self, spec: EngineSpec) -> None:
        runner = self._make_runner(spec)
        self.runners[spec.name] = runner
        self.tasks[spec.name] = asyncio.create_task(runner.run(), name=f"engine:{spec.name}")

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        tick_s = self.config.supervisor.tick_interval_s
        if self.notifier.watchdog_interval_s is not None and tick_s > self.notifier.watchdog_interval_s:
            log.warning(
                "tick_interval_s=%g is longer than half of WatchdogSec: systemd will kill the daemon", tick_s
            )
        next_tick_s = loop.time()
        while True:
            try:
                async with asyncio.timeout(max(0.0, next_tick_s - loop.time())):
                    command = await self.commands.get()
            except TimeoutError:
                self._tick()
                next_tick_s = loop.time() + tick_s
                continue
            if command in (Command.SHUTDOWN, Command.SHUTDOWN_NOW):
                if command is Command.SHUTDOWN_NOW:
                    self.commands.put_nowait(command)  # _shutdown sees it and escalates at once
                return
            if command is Command.RELOAD:
                task = asyncio.create_task(self.reload(), name="reload")
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    # ---- control socket ----

    async def _on_control(self, req: dict[str, Any]) -> Any:
        command = req["command"]
        if command == "status":
            return self.status()
        if command == "reload":
            return await self.reload()
        name = req["engine"]
        runner = self.runners.get(name)
        if runner is None:
            raise control.ControlError(f"no engine named {name!r}; engines: {', '.join(self.runners)}")
        if self._shutting_down:
            raise control.ControlError("the daemon is shutting down")
        log.info("operator: %s", command, extra={"engine": name})
        if command == "restart":
            runner.request_restart("restart requested by operator")
        elif command == "drain":
            runner.request_drain()
        elif command == "stop":
            runner.request_stop()
        elif command == "start":
            runner.request_drain(hold=False)
            runner.request_start()
        return {"engine": name, "state": runner.state.value, "accepted": command}

    # ---- reload ----

    async def reload(self) -> dict[str, Any]:
        """Validate the whole new config first; on any problem keep the old one untouched.
        Otherwise restart only engines whose spec changed, one at a time."""
        async with self._reload_lock:
            self.notifier.reloading()
            path = self.config.path
            try:
                new = await asyncio.to_thread(load_config, path)
            except ConfigError as exc:
                self.reloads_total["invalid"] += 1
                for problem in exc.problems:
                    log.error("reload: %s", problem)
                log.error(
                    "reload rejected: %d problem(s); still running the previous config", len(exc.problems)
                )
                # Kept in STATUS= until a reload succeeds: the operator must see it in systemctl status.
                self._reload_problem = f"reload failed ({len(exc.problems)} problems), old config kept"
                self.notifier.ready(self.summary())
                return {"reloaded": False, "problems": [str(p) for p in exc.problems]}
            if new.supervisor.state_dir.resolve() != self.state_dir:
                log.warning("reload: state_dir changes take effect at the next daemon start")
            old_specs = {r.spec.name: r.spec for r in self.runners.values()}
            new_specs = {spec.name: spec for spec in new.engines}
            removed = [n for n in old_specs if n not in new_specs]
            added = [n for n in new_specs if n not in old_specs]
            changed = [n for n in new_specs if n in old_specs and new_specs[n] != old_specs[n]]
            self.config = new
            self.config_loaded_timestamp_s = time.time()
            self.gpus_of.clear()
            self.gpus_of.update({e.name: ",".join(str(g) for g in e.gpus) for e in new.engines})
            logs.set_level(new.supervisor.log_level)
            for name in removed:
                self._retire(name)
            for name in added:
                self._add_engine(new_specs[name])
            if changed:
                previous = self._roll_task
                self._roll_task = asyncio.create_task(self._roll([new_specs[n] for n in changed], previous))
            self.reloads_total["ok"] += 1
            self._reload_problem = None
            log.info(
                "reloaded %s: %d added, %d removed, %d changed (%s), %d unchanged",
                path,
                len(added),
                len(removed),
                len(changed),
                ", ".join(changed) or "-",
                len(new_specs) - len(added) - len(changed),
            )
            self.notifier.ready(self.summary())
            self._write_status()
            return {"reloaded": True, "added": added, "removed": removed, "changed": changed}

    def _retire(self, name: str) -> None:
        runner = self.runners.pop(name)
        task = self.tasks.pop(name)
        runner.request_stop(shutdown=True)
        log.info("engine removed from the config: stopping it", extra={"engine": name})
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        task.add_done_callback(lambda _: self._forget_engine(name))

    def _forget_engine(self, name: str) -> None:
        """A removed engine's task has ended: close its HTTP client and drop its round histogram,
        unless a later reload has added the engine back meanwhile."""
        if name in self.runners:
            return
        self.exporter.forget_engine(name)
        client = self._clients.pop(name, None)
        if client is not None:
            closing = asyncio.create_task(client.aclose(), name=f"close-http:{name}")
            self._retiring.add(closing)
            closing.add_done_callback(self._retiring.discard)

    async def _roll(self, specs: list[EngineSpec], previous: asyncio.Task[None] | None) -> None:
        """Restart changed engines one at a time: the next one only once the previous is READY
        again (or has failed), so a config change never takes more than one engine away."""
        if previous is not None and not previous.done():
            await asyncio.wait({previous})
        for spec in specs:
            runner = self.runners.get(spec.name)
            if runner is None or self._shutting_down:
                continue
            if not spec.enabled:
                runner.spec = spec
                runner.request_stop()
                continue
            was_running = runner.state not in (EngineState.STOPPED, EngineState.FATAL)
            if was_running:
                await self._await_capacity(runner)
            changes_before = runner.state_changes_total
            runner.request_restart("config changed", cause="config_change", spec=spec)
            if not was_running:
                continue
            deadline = asyncio.get_running_loop().time() + spec.start_timeout_s + spec.drain_timeout_s + 120
            settled = (EngineState.READY, EngineState.FATAL, EngineState.BACKOFF, EngineState.STOPPED)
            while asyncio.get_running_loop().time() < deadline and not self._shutting_down:
                if runner.state_changes_total > changes_before + 1 and runner.state in settled:
                    break
                await asyncio.sleep(0.5)

    async def _await_capacity(self, runner: EngineRunner, timeout_s: float = 600.0) -> None:
        """A config change is a planned action: wait (bounded) while max_unavailable other
        engines are already out of rotation, whatever took them out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        logged = False
        while not self._shutting_down and loop.time() < deadline:
            now_s = self.clock.monotonic()
            out = [
                r.spec.name
                for r in self.runners.values()
                if r is not runner and r.spec.enabled and not back_in_rotation(self._view(r), now_s)
            ]
            if len(out) < self.config.supervisor.max_unavailable:
                return
            if not logged:
                log.info(
                    "config change waits: %s out of rotation (max_unavailable=%d)",
                    ", ".join(out),
                    self.config.supervisor.max_unavailable,
                    extra={"engine": runner.spec.name},
                )
                logged = True
            await asyncio.sleep(0.5)

    def _tick(self) -> None:
        started = time.monotonic()
        for name, task in list(self.tasks.items()):
            if not task.done():
                continue
            exc = task.exception() if not task.cancelled() else None
            log.error(
                "engine task ended unexpectedly%s; restarting it in %g s",
                f": {exc!r}" if exc else "",
                RUNNER_RESTART_DELAY_S,
                extra={"engine": name},
                exc_info=exc,
            )
            self.tasks[name] = asyncio.create_task(self._restart_runner(name), name=f"engine:{name}")
        if not self._shutting_down:
            self._act()
        self._write_status()
        self._notify_progress()
        self.ticks_total += 1
        self.last_tick_duration_s = time.monotonic() - started
        self.exporter.observe_tick(self.last_tick_duration_s)
        self._last_tick_s = self.clock.monotonic()
        # Only after a complete tick: a wedged loop stops the pings and systemd restarts us.
        self.notifier.watchdog()

    # ---- the policy ----

    def _view(self, runner: EngineRunner) -> EngineView:
        spec = runner.spec
        return EngineView(
            name=spec.name,
            state=runner.state,
            enabled=spec.enabled,
            ready_since_s=runner.ready_since_s,
            findings=tuple(runner.findings),
            busy=runner.busy,
            held_out=runner.held_out,
            ladder_step=runner.ladder_step,
            ladder_steps=len(spec.ladder),
            ladder_changed_s=runner.ladder_changed_s,
            step_cause_seen_s=runner.step_cause_seen_s,
            action_times_s=tuple(runner.action_times_s),
            scheduled_due_s=runner.scheduled_due_s,
            start_failed_oom=runner.start_failed_oom,
            prefix_reset_at_s=runner.prefix_reset_at_s,
            prefix_reset_supported=runner.prefix_reset_supported,
            rules=EngineRules(
                automatic=spec.automatic_actions,
                max_actions_per_hour=spec.max_actions_per_hour,
                action_cooldown_s=spec.action_cooldown_s,
                ladder_calm_s=spec.ladder_calm_s,
                repair_verify_s=spec.repair_verify_s,
                restart_window=spec.restart_window,
                rotation_grace_s=spec.drain_grace_s,
            ),
        )

    def _fleet_rules(self) -> FleetRules:
        settings = self.config.supervisor
        return FleetRules(max_unavailable=settings.max_unavailable, min_in_rotation=settings.min_in_rotation)

    def _act(self) -> None:
        """Run the policy over every engine and hand each action to its runner."""
        now_s = self.clock.monotonic()
        decision = decide(
            [self._view(r) for r in self.runners.values()],
            now_s,
            minute_of_day=self.minute_of_day(),
            fleet=self._fleet_rules(),
        )
        waiting: dict[str, str] = {}
        for held in decision.deferred:
            line = f"{held.kind} ({held.reason}) waits: {held.why}"
            waiting[held.engine] = line
            if self._deferred_logged.get(held.engine) != line:
                log.info("%s", line, extra={"engine": held.engine})
        self._deferred_logged = waiting
        for action in decision.actions:
            runner = self.runners.get(action.engine)
            if runner is not None:
                self._apply(runner, action, now_s)

    def _apply(self, runner: EngineRunner, action: Action, now_s: float) -> None:
        kind = action.kind
        log.warning("action %s (%s): %s", kind, action.reason, action.detail, extra={"engine": action.engine})
        # Shedding follows its finding's hysteresis, and a broken engine's restarts are bounded
        # by the failure budget: neither counts toward the rate limit (policy.py).
        rate_limited = kind not in (ActionKind.SHED, ActionKind.UNSHED) and not action.failure
        runner.record_action(
            kind.value, action.reason, now_s=now_s, wall_s=time.time(), rate_limited=rate_limited
        )
        if kind is ActionKind.SHED:
            runner.request_shed(action.detail)
        elif kind is ActionKind.UNSHED:
            runner.request_shed(None)
        elif kind is ActionKind.RESET_PREFIX_CACHE:
            runner.start_prefix_reset(action.detail)
        elif kind in (ActionKind.STEP_DOWN, ActionKind.STEP_UP):
            assert action.step is not None
            runner.set_ladder_step(action.step, f"{action.reason}: {action.detail}")
            if action.planned:  # an OOM at start only changes the next spawn's flags
                runner.request_restart(f"{kind}: {action.detail}", cause=kind.value)
        elif kind in (ActionKind.RESTART, ActionKind.SCHEDULED_RESTART):
            if action.mark_gpus:
                self._mark_gpus(runner.spec.gpus, action.detail)
            cause = "scheduled" if kind is ActionKind.SCHEDULED_RESTART else action.reason
            runner.request_restart(
                f"{cause}: {action.detail}", cause=cause, drain=action.drain, failure=action.failure
            )

    # ---- GPUs the policy restarted engines for ----

    @property
    def _gpu_marks_path(self) -> Path:
        return self.state_dir / "gpu-faults.json"

    def _load_gpu_marks(self) -> dict[int, int]:
        try:
            raw = json.loads(self._gpu_marks_path.read_text())
            return {int(gpu): int(entry["count"]) for gpu, entry in raw.items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}

    def _mark_gpus(self, gpus: tuple[int, ...], detail: str) -> None:
        """Count the fault against each of the engine's GPUs, in the state dir, so that a GPU
        that keeps faulting is visible across restarts (status, metrics, the journal)."""
        try:
            raw = json.loads(self._gpu_marks_path.read_text())
            if not isinstance(raw, dict):
                raw = {}
        except (OSError, ValueError):
            raw = {}
        for gpu in gpus:
            self.gpu_faults_marked[gpu] = self.gpu_faults_marked.get(gpu, 0) + 1
            raw[str(gpu)] = {"count": self.gpu_faults_marked[gpu], "last": detail, "at": time.time()}
            log.error("GPU %d marked: fault %d: %s", gpu, self.gpu_faults_marked[gpu], detail)
        try:
            tmp = self._gpu_marks_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(raw, indent=2) + "\n")
            tmp.replace(self._gpu_marks_path)
        except OSError as exc:
            log.warning("cannot save GPU marks: %s", exc)

    def summary(self) -> str:
        """One line for STATUS=, e.g. ``1/2 engines ready; gpu1 starting (2m10s)``."""
        now = self.clock.monotonic()
        enabled = [r for r in self.runners.values() if r.spec.enabled]
        ready = sum(1 for r in enabled if r.state is EngineState.READY)
        parts = [f"{ready}/{len(enabled)} engines ready"]
        if self._reload_problem:
            parts.insert(0, self._reload_problem)
        for r in self.runners.values():
            if r.state is EngineState.READY or (r.state is EngineState.STOPPED and not r.spec.enabled):
                continue
            age_s = int(now - r.state_since_s)
            text = f"{r.spec.name} {r.state.value} ({age_s // 60}m{age_s % 60:02d}s)"
            if r.state in (EngineState.BACKOFF, EngineState.FATAL) and r.last_failure:
                text += f": {r.last_failure[:80]}"
            elif r.state in (EngineState.SHEDDING, EngineState.DRAINING):
                text += f": {r.state_reason[:80]}"
            parts.append(text)
        return "; ".join(parts)

    def _notify_progress(self) -> None:
        """READY=1 once every enabled engine is READY or has failed; until then keep extending the
        start timeout, since model loads take minutes (host-facts §2.3)."""
        summary = self.summary()
        if self._ready_sent:
            self.notifier.status(summary)
            return
        settled = (EngineState.READY, EngineState.BACKOFF, EngineState.FATAL)
        if all(r.state in settled for r in self.runners.values() if r.spec.enabled):
            self._ready_sent = True
            self.notifier.ready(summary)
            log.info("startup complete: %s", summary)
        else:
            self.notifier.status(summary)
            self.notifier.extend_timeout(max(60.0, 4 * self.config.supervisor.tick_interval_s))

    async def _restart_runner(self, name: str) -> None:
        await self.clock.sleep(RUNNER_RESTART_DELAY_S)
        runner = self.runners[name] = self._make_runner(self.runners[name].spec)
        await runner.run()

    async def _shutdown(self) -> int:
        """Stop every engine in parallel (a rolling stop is for reloads), then confirm that no
        engine process is left before returning 0."""
        self._shutting_down = True
        log.info("shutting down: stopping %d engine(s)", len(self.runners))
        self.notifier.stopping(f"stopping {len(self.runners)} engine(s)")
        for runner in self.runners.values():
            runner.request_stop(shutdown=True)
        pending: set[asyncio.Future[Any]] = set(self.tasks.values())
        deadline = asyncio.get_running_loop().time() + self.config.supervisor.shutdown_timeout_s
        escalated = False
        while pending:
            waiter = asyncio.ensure_future(self.commands.get())
            # Wake at least every 5 s to keep systemd's stop timeout and watchdog from firing
            # while engines drain; the daemon's own deadline is shutdown_timeout_s.
            done, pending = await asyncio.wait(
                pending | {waiter},
                timeout=min(5.0, max(0.0, deadline - asyncio.get_running_loop().time())),
                return_when=asyncio.FIRST_COMPLETED,
            )
            self.notifier.extend_timeout(30.0)
            self.notifier.watchdog()
            self.notifier.status("stopping: " + self.summary())
            if waiter in done:
                if waiter.result() is Command.SHUTDOWN_NOW and not escalated:
                    escalated = True
                    log.warning("second interrupt: stopping engines without draining")
                    for runner in self.runners.values():
                        runner.escalate()
            else:
                waiter.cancel()
            pending.discard(waiter)
            if asyncio.get_running_loop().time() >= deadline and pending:
                log.error(
                    "engines did not stop within shutdown_timeout_s=%g s: killing them",
                    self.config.supervisor.shutdown_timeout_s,
                )
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=30)
                break
        for name, task in self.tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("engine task failed during shutdown: %r", task.exception(), extra={"engine": name})
        self._write_status()
        left = process.marker_processes(self.state_dir)
        if left:
            log.error("engine processes still running after shutdown: %s; killing them", left)
            alive = await process.kill_trees(left, timeout_s=10.0)
            if alive:
                log.critical("processes %s survived SIGKILL", alive)
                return 1
        log.info("all engines stopped; no engine process left")
        return 0


def _json(status: int, body: dict[str, Any]) -> Response:
    return Response(status=status, body=json.dumps(body).encode() + b"\n", content_type="application/json")
