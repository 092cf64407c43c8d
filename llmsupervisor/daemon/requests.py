"""What reaches the daemon from outside: signals and the control socket, as requests on one queue.

Signal handlers and the control socket only queue a request; the daemon's loop acts on it. A
reload therefore goes one way whether it comes from SIGHUP or from `llm-supervisor reload`, and
an operator's command for an engine becomes engine commands in one place
(``operator_commands``), like the policy's actions do in daemon/actions.py.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from llmsupervisor.control import ControlError
from llmsupervisor.core.state import EngineState
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


@dataclass(frozen=True, slots=True)
class ReloadRequest:
    reply: asyncio.Future[Any] | None = field(default=None, compare=False)  # None: from SIGHUP


AnyRequest = Request | EngineRequest | ReloadRequest


def operator_commands(command: str, status: EngineStatus) -> list[Command]:
    """An operator's `restart`, `drain`, `stop` or `start` as engine commands."""
    if command == "restart":
        running = status.wants_run and status.state not in (EngineState.STOPPED, EngineState.FATAL)
        # Restarting a stopped (or FATAL) engine starts it, as `systemctl restart` does.
        return [Restart(cause="operator", reason="restart requested by operator")] if running else [Start()]
    if command == "drain":
        return [Hold(True)]
    if command == "stop":
        return [Stop()]
    if command == "start":
        return [Start()]
    raise ControlError(f"unknown command {command!r}")


def refuse(reply: asyncio.Future[Any] | None, why: str) -> None:
    if reply is not None and not reply.done():
        reply.set_exception(ControlError(why))
