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
import sys
import time
from typing import Any, Final

import httpx

from llmsupervisor import process
from llmsupervisor.clock import Clock, MonotonicClock
from llmsupervisor.config import SupervisorConfig
from llmsupervisor.engine import EngineRunner
from llmsupervisor.notify import Notifier
from llmsupervisor.state import EngineState, StateChange

log = logging.getLogger("llmsupervisor")

RUNNER_RESTART_DELAY_S: Final = 5.0


class Command(enum.Enum):
    SHUTDOWN = "shutdown"
    SHUTDOWN_NOW = "shutdown now"  # second SIGINT: skip the drains


class Supervisor:
    def __init__(
        self, config: SupervisorConfig, *, clock: Clock | None = None, notifier: Notifier | None = None
    ) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.notifier = notifier or Notifier()
        self._ready_sent = False
        self.state_dir = config.supervisor.state_dir.resolve()
        self.commands: asyncio.Queue[Command] = asyncio.Queue()
        self.runners: dict[str, EngineRunner] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._sigint_count = 0
        self._guard_pid: int | None = None
        self._guard_fd: int | None = None
        self._shutting_down = False

    # ---- signals ----

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.commands.put_nowait, Command.SHUTDOWN)
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

    def status(self) -> dict[str, Any]:
        now = self.clock.monotonic()
        return {
            "pid": os.getpid(),
            "config": str(self.config.path),
            "engines": {
                name: {
                    "state": r.state.value,
                    "reason": r.state_reason,
                    "for_s": round(now - r.state_since_s, 1),
                    "pid": r.proc.pid if r.proc is not None else None,
                    "port": r.spec.port,
                    "gpus": list(r.spec.gpus),
                    "restarts": r.restarts_total,
                    "last_exit": r.last_exit,
                    "last_failure": r.last_failure,
                }
                for name, r in self.runners.items()
            },
        }

    def _write_status(self) -> None:
        path = self.state_dir / "status.json"
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(self.status(), indent=2) + "\n")
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)

    def _on_change(self, change: StateChange) -> None:
        self._write_status()

    # ---- run ----

    async def run(self) -> int:
        self._install_signals()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not process.become_subreaper():
            log.warning("cannot become a child subreaper: orphans of crashed engines go to PID 1")
        await self._sweep_leftovers()
        self._start_guard()
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
        async with httpx.AsyncClient(limits=limits, trust_env=False) as http:
            for spec in self.config.engines:
                runner = EngineRunner(
                    spec,
                    state_dir=self.state_dir,
                    http=http,
                    clock=self.clock,
                    tick_interval_s=self.config.supervisor.tick_interval_s,
                    on_change=self._on_change,
                )
                self.runners[spec.name] = runner
                self.tasks[spec.name] = asyncio.create_task(runner.run(), name=f"engine:{spec.name}")
            self._write_status()
            log.info("supervising %d engine(s): %s", len(self.runners), ", ".join(self.runners))
            await self._loop()
            exit_code = await self._shutdown()
        self._stop_guard()
        return exit_code

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

    def _tick(self) -> None:
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
        self._write_status()
        self._notify_progress()
        # Only after a complete tick: a wedged loop stops the pings and systemd restarts us.
        self.notifier.watchdog()

    def summary(self) -> str:
        """One line for STATUS=, e.g. ``1/2 engines ready; gpu1 starting (2m10s)``."""
        now = self.clock.monotonic()
        enabled = [r for r in self.runners.values() if r.spec.enabled]
        ready = sum(1 for r in enabled if r.state is EngineState.READY)
        parts = [f"{ready}/{len(enabled)} engines ready"]
        for r in self.runners.values():
            if r.state is EngineState.READY or (r.state is EngineState.STOPPED and not r.spec.enabled):
                continue
            age_s = int(now - r.state_since_s)
            text = f"{r.spec.name} {r.state.value} ({age_s // 60}m{age_s % 60:02d}s)"
            if r.state in (EngineState.BACKOFF, EngineState.FATAL) and r.last_failure:
                text += f": {r.last_failure[:80]}"
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
        old = self.runners[name]
        runner = EngineRunner(
            old.spec,
            state_dir=self.state_dir,
            http=old.http,
            clock=self.clock,
            tick_interval_s=old.tick_interval_s,
            on_change=self._on_change,
        )
        self.runners[name] = runner
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
        left = [pid for pid in left if pid != self._guard_pid]
        if left:
            log.error("engine processes still running after shutdown: %s; killing them", left)
            alive = await process.kill_trees(left, timeout_s=10.0)
            if alive:
                log.critical("processes %s survived SIGKILL", alive)
                return 1
        log.info("all engines stopped; no engine process left")
        return 0
