"""What reaches the daemon from outside: signals and the control socket, as requests on one queue.

Signal handlers and the control socket only queue a request (daemon/intake.py); the daemon's
loop acts on it. A reload therefore goes one way whether it comes from SIGHUP or from
`llm-supervisor reload`, and an operator's command for an engine becomes engine commands in one
place (``operator_commands``), like the policy's actions do in daemon/actions.py.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from llmsupervisor.control import ControlError
from llmsupervisor.core.state import SERVING, EngineState
from llmsupervisor.engine.commands import Command, Hold, Restart, Start, Stop
from llmsupervisor.engine.status import EngineStatus


class Request(enum.Enum):
    SHUTDOWN = "shutdown"
    SHUTDOWN_NOW = "shutdown now"  # second SIGINT: skip the drains


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """An operator's command for one engine, from the control socket."""

    command: str  # restart, drain, stop, start
    engine: str
    reply: asyncio.Future[Any] = field(compare=False)
    by: str = "operator"  # who sent it (daemon/holds.py operator_name)


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """An operator's `gpu release` or `gpu take-back`, from the control socket."""

    command: str  # gpu_release, gpu_take_back
    gpu: int
    reply: asyncio.Future[Any] = field(compare=False)
    by: str = "operator"
    window_s: float | None = None  # gpu_release: how long NVML may stay closed


@dataclass(frozen=True, slots=True)
class ReloadRequest:
    reply: asyncio.Future[Any] | None = field(default=None, compare=False)  # None: from SIGHUP
    dry_run: bool = False  # `reload --dry-run`: say what would happen, apply nothing


AnyRequest = Request | EngineRequest | GpuRequest | ReloadRequest


def operator_commands(command: str, status: EngineStatus) -> list[Command]:
    """An operator's `restart`, `drain`, `stop` or `start` as engine commands."""
    if command == "restart":
        # Restarting a stopped (or FATAL) engine starts it, as `systemctl restart` does.
        if not status.running:
            return [Start()]
        return [Restart(cause="operator", reason="restart requested by operator")]
    if command == "drain":
        return [Hold(True)]
    if command == "stop":
        return [Stop()]
    if command == "start":
        return [Start()]
    raise ControlError(f"unknown command {command!r}")


def what_happens(command: str, status: EngineStatus) -> str:
    """What an accepted command does to the engine as it is now, for the operator's one line
    (`gpu1: restart accepted; draining, 3 requests in flight`)."""
    state, serving = status.state, status.state in SERVING
    in_flight = status.load.requests_running if status.load is not None else None
    draining = "draining" + (f", {in_flight} requests in flight" if in_flight else "")
    if command == "restart":
        if not status.running:
            return "starting"
        # A restart keeps the operator's drain: the new incarnation stays out of rotation.
        kept = "; it stays drained (out of rotation) until `start`" if status.held else ""
        if serving:
            return (
                f"{draining}, then restarting" if status.spec.drain_timeout_s > 0 else "restarting"
            ) + kept
        if state is EngineState.STARTING:
            return "abandoning this start, starting again" + kept
        return "starting now" + kept
    if command == "drain":
        if serving:
            return f"out of rotation, {draining}" if state is not EngineState.DRAINING else "already draining"
        return "held: it stays out of rotation once it is ready"
    if command == "stop":
        if state is EngineState.FATAL and status.incarnation is None:
            return "was FATAL: now STOPPED, held until `start`"
        if state is EngineState.STOPPED and status.incarnation is None:
            return "already stopped; held until `start`"
        return f"{draining}, then stopping" if serving else "stopping"
    if command == "start":
        if state is EngineState.BACKOFF and status.running:
            return "starting after its backoff"
        if status.running and state is not EngineState.DRAINING:
            return f"already {state.value}"
        return "back in rotation" if state is EngineState.DRAINING else "starting"
    return command


def refuse(reply: asyncio.Future[Any] | None, why: str) -> None:
    if reply is not None and not reply.done():
        reply.set_exception(ControlError(why))
