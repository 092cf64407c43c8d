"""The daemon's way in: signals and the control socket, as requests on one queue for the loop.

Signal handlers and the control socket only queue a request (daemon/requests.py); the loop takes
them (``requests``, woken by ``arrived``) and calls ``handle`` for each on its own turn, so a
reload goes one way whether it comes from SIGHUP or from `llm-supervisor reload`. ``status`` and
``events`` and ``logs`` only read (the published statuses, the event and output rings) and are
answered at once. An
engine command becomes engine commands for the fleet and the operator's hold, and its reply says
what was accepted and what it will do; a reload runs as a task of its own, answered when done.
`gpu release` and `gpu take-back` go to the GPU releaser (daemon/gpu_release.py); while a GPU is
released, its engines are not started and reloads wait.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from llmsupervisor import aio, control
from llmsupervisor.daemon.events import EventRing
from llmsupervisor.daemon.fleet import Fleet
from llmsupervisor.daemon.gpu_release import GpuReleaser
from llmsupervisor.daemon.holds import Holds, operator_name
from llmsupervisor.daemon.output_ring import OutputRing, engine_process
from llmsupervisor.daemon.requests import (
    AnyRequest,
    EngineRequest,
    GpuRequest,
    ReloadRequest,
    Request,
    operator_commands,
    refuse,
    what_happens,
)

log = logging.getLogger("llmsupervisor")


class Reload(Protocol):
    """The daemon's reload (Supervisor.reload): with ``dry_run``, what it would do, applied nowhere."""

    def __call__(self, *, dry_run: bool = False) -> Awaitable[dict[str, Any]]: ...


class Intake:
    def __init__(
        self,
        *,
        fleet: Fleet,
        holds: Holds,
        events: EventRing,
        output: OutputRing,
        journal: bool,
        status: Callable[[], dict[str, Any]],
        stopping: Callable[[], bool],
        reload: Reload,
        gpus: GpuReleaser,
    ) -> None:
        self._fleet = fleet
        self._gpus = gpus
        self._holds = holds
        self._events = events
        self._output = output
        self._journal = journal  # logging to the journal: `logs` names the journalctl command
        self._status = status
        self._stopping = stopping
        self._reload = reload
        self.requests: collections.deque[AnyRequest] = collections.deque()
        self.arrived = aio.Flag()
        self._sigint_count = 0
        self._background: set[asyncio.Task[Any]] = set()  # reloads

    def submit(self, request: AnyRequest) -> None:
        """Queue a request for the loop (signal handlers and the control socket)."""
        self.requests.append(request)
        self.arrived.set()

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.submit, Request.SHUTDOWN)
        loop.add_signal_handler(signal.SIGHUP, self.submit, ReloadRequest())
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)

    def _on_sigint(self) -> None:
        self._sigint_count += 1
        self.submit(Request.SHUTDOWN if self._sigint_count == 1 else Request.SHUTDOWN_NOW)

    async def on_control(self, req: dict[str, Any]) -> Any:
        """One control-socket request (control.ControlServer's handler)."""
        command = req["command"]
        if command == "status":
            return self._status()  # read-only: answered from the published statuses
        if command == "events":  # read-only too
            return await self._select_events(req)
        if command == "logs":  # and so is this
            return await self._logs(req)
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if command == "reload":
            # Who asked, as for the engine commands (the peer's uid from SO_PEERCRED).
            by = await operator_name(req.get("peer_uid"))
            log.info("operator: reload (by %s)", by, extra={"event": "operator"})
            events_seq = self._events.last_seq  # `reload --wait` follows what happens from here
            self.submit(ReloadRequest(reply, dry_run=bool(req.get("dry_run"))))
            result = await reply
            return {**result, "events_seq": events_seq} if isinstance(result, dict) else result
        if command in control.GPU_COMMANDS:
            return await self._gpu_command(req, reply)
        name = req["engine"]
        self.submit(EngineRequest(command, name, reply, by=await operator_name(req.get("peer_uid"))))
        result = await reply
        # Before the operator hears "accepted": on disk, or why not yet (a full disk). The command
        # acts either way, and the hold is written once the disk has room (daemon/holds.py).
        unsaved = await self._holds.persist(name)
        if isinstance(result, dict):
            result = {**result, "hold_unsaved": unsaved}
        return result

    async def _gpu_command(self, req: dict[str, Any], reply: asyncio.Future[Any]) -> Any:
        by = await operator_name(req.get("peer_uid"))
        window = req.get("window_s")
        events_seq = self._events.last_seq
        self.submit(
            GpuRequest(req["command"], req["gpu"], reply, by, None if window is None else float(window))
        )
        result = await reply
        # The holds of the engines it stopped, on disk before the operator hears it (as for `stop`).
        unsaved = {n: why for n in result.get("engines", ()) if (why := await self._holds.persist(n))}
        return {**result, "holds_unsaved": unsaved, "events_seq": events_seq}

    async def _select_events(self, req: dict[str, Any]) -> dict[str, Any]:
        since_s = req.get("since_s")
        name = req.get("engine")
        # A typo must not print nothing (or, with --follow, wait forever): a name is one the
        # fleet runs now or one the ring still has events of (an engine a reload removed).
        if name is not None and name not in self._fleet.runners and not self._events.select(engine=name):
            raise control.ControlError(self._no_engine(name))
        found = await self._events.wait_select(
            engine=req.get("engine"),
            after_seq=int(req.get("after") or 0),
            since_time_s=time.time() - float(since_s) if since_s is not None else None,
            wait_s=float(req.get("wait_s") or 0.0),
        )
        return {"events": [e.as_json() for e in found], "last_seq": self._events.last_seq}

    async def _logs(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req["engine"]
        status = self._fleet.status(name)
        if status is None:
            raise control.ControlError(self._no_engine(name))
        previous, after = bool(req.get("previous")), int(req.get("after") or 0)
        lines = req.get("lines")
        if previous or not req.get("wait_s"):
            found = self._output.select(name, previous=previous, last=None if lines is None else int(lines))
            found = [line for line in found if line.seq > after]
        else:
            found = await self._output.wait_select(name, after_seq=after, wait_s=float(req["wait_s"]))
        return {
            "engine": name,
            "lines": [line.as_json() for line in found],
            "last_seq": self._output.last_seq,
            "process": await self._engine_process(status.pid),
            # Under systemd the journal holds the same lines, and more of them.
            "journal": f"journalctl -u llm-supervisor ENGINE={name}" if self._journal else None,
        }

    async def _engine_process(self, pid: int | None) -> dict[str, Any] | None:
        if pid is None:
            return None
        try:
            async with asyncio.timeout(2.0):
                return await asyncio.to_thread(engine_process, pid)
        except TimeoutError:
            return {"pid": pid, "command": None, "rss_bytes": None}

    def handle(self, request: AnyRequest) -> None:
        """Act on one queued request, on the loop's turn (never for SHUTDOWN: the loop ends on it)."""
        if isinstance(request, ReloadRequest):
            if self._stopping():
                refuse(request.reply, "the daemon is shutting down")
                return
            if (why := self._gpus.blocks_reload()) is not None:
                log.warning("reload refused: %s", why, extra={"event": "reload"})
                refuse(request.reply, f"reload refused: {why}")
                return
            task = asyncio.create_task(
                self._answer_reload(request.reply, dry_run=request.dry_run), name="reload"
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif isinstance(request, EngineRequest):
            try:
                request.reply.set_result(self.engine_command(request.command, request.engine, request.by))
            except control.ControlError as exc:
                request.reply.set_exception(exc)
        elif isinstance(request, GpuRequest):
            try:
                if self._stopping():
                    raise control.ControlError("the daemon is shutting down")
                if request.command == "gpu_release":
                    result = self._gpus.release(request.gpu, by=request.by, window_s=request.window_s)
                else:
                    result = self._gpus.take_back(request.gpu, by=request.by)
                request.reply.set_result(result)
            except control.ControlError as exc:
                request.reply.set_exception(exc)

    async def _answer_reload(self, reply: asyncio.Future[Any] | None, *, dry_run: bool = False) -> None:
        try:
            result = await self._reload(dry_run=dry_run)
        except Exception as exc:  # a bug in the reload must not go unanswered
            log.exception("reload failed")
            if reply is not None and not reply.done():
                reply.set_exception(control.ControlError(f"reload failed: {exc!r}"))
            return
        if reply is not None and not reply.done():
            reply.set_result(result)

    def _no_engine(self, name: str) -> str:
        return f"no engine named {name!r}; engines: {', '.join(self._fleet.runners)}"

    def cancel_reloads(self) -> None:
        """At shutdown: a reload still running is not finished."""
        for task in list(self._background):
            task.cancel()

    def engine_command(self, command: str, name: str, by: str = "operator") -> dict[str, Any]:
        status = self._fleet.status(name)
        if status is None:
            raise control.ControlError(self._no_engine(name))
        if self._stopping():
            raise control.ControlError("the daemon is shutting down")
        if command in ("start", "restart") and (why := self._gpus.blocks(status.spec.gpus)) is not None:
            raise control.ControlError(f"{name} is not started: {why}")
        log.info("operator: %s (by %s)", command, by, extra={"engine": name, "event": "operator"})
        commands = operator_commands(command, status)
        for cmd in commands:
            self._fleet.send(name, cmd)
        hold = self._holds.note(name, commands, by=by, now=time.time())
        # "state" is the state when the command was taken (the command acts after this reply);
        # incarnation, state_changes and events_seq let `--wait` tell what happened since.
        return {
            "engine": name,
            "accepted": command,
            "state": status.state.value,
            "doing": what_happens(command, status),
            "incarnation": status.incarnation.number if status.incarnation is not None else None,
            "state_changes": status.state_changes_total,
            "events_seq": self._events.last_seq,
            "hold": hold.as_json() if hold is not None else None,
        }
