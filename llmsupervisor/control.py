"""The local control socket: what `llm-supervisor status|restart|drain|stop|start|reload` talk to.

A Unix stream socket (mode 0660, the daemon's group; nothing on the network). One request per
connection: a JSON object on one line, ``{"command": "restart", "engine": "gpu0"}``; one JSON
line back, ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``.

``{"command": "events", "engine": NAME?, "after": SEQ?, "since_s": SECONDS?, "wait_s": S?}``
answers ``{"events": [...], "last_seq": N}`` from the daemon's ring (daemon/events.py); with
``wait_s`` it waits (at most 30 s) for a first new event, so that `events --follow` is a long
poll: one request after another, each with the last seq it got. The server only
parses and hands the request to a callback, which puts it on the daemon's one request queue
(daemon/requests.py) and awaits the loop's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

log = logging.getLogger("llmsupervisor.control")

COMMANDS: Final = ("status", "restart", "drain", "stop", "start", "reload", "events")
ENGINE_COMMANDS: Final = frozenset({"restart", "drain", "stop", "start"})
REQUEST_LIMIT_BYTES: Final = 64 * 1024
Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class ControlError(Exception):
    """A request the daemon refuses; its message goes back to the client."""


def default_socket_path(state_dir: Path) -> Path:
    # systemd's RuntimeDirectory= sets RUNTIME_DIRECTORY; elsewhere the state dir holds it.
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    return (Path(runtime.split(":")[0]) if runtime else state_dir) / "control.sock"


class ControlServer:
    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()  # a stale socket of an earlier run
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The umask is process-wide: bind with no await in between, or other tasks create their
        # files and directories under 0117 meanwhile (start_unix_server yields after binding; the
        # engines' state directories came out drw-rw---- and unusable under the packaged unit).
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)  # created 0660: owner and group only
        try:
            sock.bind(str(self.path))
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        os.chmod(self.path, 0o660)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5.0):
                line = await reader.readline()
            request = json.loads(line[:REQUEST_LIMIT_BYTES] or b"{}")
            reply = {"ok": True, "result": await self.handler(_validated(request))}
        except ControlError as exc:
            reply = {"ok": False, "error": str(exc)}
        except (TimeoutError, ValueError, UnicodeDecodeError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        except Exception as exc:  # a bug in a handler must not take the daemon down
            log.exception("control request failed")
            reply = {"ok": False, "error": f"internal error: {exc!r}"}
        try:
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except OSError:
            pass  # the client went away
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _validated(request: Any) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise ControlError("bad request: expected a JSON object")
    command = request.get("command")
    if command not in COMMANDS:
        raise ControlError(f"unknown command {command!r}; one of {', '.join(COMMANDS)}")
    if command in ENGINE_COMMANDS and not isinstance(request.get("engine"), str):
        raise ControlError(f"{command} needs an engine name")
    if command == "events":
        if request.get("engine") is not None and not isinstance(request["engine"], str):
            raise ControlError("events: engine must be a name")
        for key in ("after", "since_s", "wait_s"):
            value = request.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ControlError(f"events: {key} must be a number")
    return request


def request(path: Path, payload: dict[str, Any], *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Client side (blocking, for the CLI). Raises ControlError with an operator-facing message."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            raise ControlError(f"the daemon is not running (no control socket at {path})") from None
        except ConnectionRefusedError:
            raise ControlError(f"the daemon is not running (stale control socket at {path})") from None
        except PermissionError:
            raise ControlError(
                f"permission denied on {path}: run as root or as a member of the daemon's group"
            ) from None
        sock.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        raise ControlError(f"no answer from the daemon within {timeout_s:g} s") from None
    except OSError as exc:  # reset by a daemon that died mid-answer
        raise ControlError(f"the daemon went away: {exc.strerror or exc}") from None
    finally:
        sock.close()
    if not data.endswith(b"\n"):
        raise ControlError("the daemon went away without answering")
    reply: dict[str, Any] = json.loads(data)
    return reply
