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

Any local client in the group can connect, so a connection is cheap to hold and bounded: its
request must arrive within ``idle_timeout_s`` and fit in ``read_limit_bytes``; at most
``max_connections`` are open, and a new one past that pushes out the oldest that has not sent
its request yet (the CLI sends at once, so it always gets through). Before, 1,100 idle clients
used up the daemon's 1,024 descriptors and the /proc sweep failed for every engine (issue 17).
Whatever arrives gets a JSON answer: malformed or deeply nested JSON is a "bad request", never
an "internal error".
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
IDLE_TIMEOUT_S: Final = 5.0
MAX_CONNECTIONS: Final = 64
# After a refused request: how long and how much to keep reading before closing, so the client
# reads our answer instead of a reset (as http_api's lingering close).
LINGER_S: Final = 1.0
LINGER_BYTES: Final = 4 * 1024 * 1024
Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class ControlError(Exception):
    """A request the daemon refuses; its message goes back to the client."""


def default_socket_path(state_dir: Path) -> Path:
    # systemd's RuntimeDirectory= sets RUNTIME_DIRECTORY; elsewhere the state dir holds it.
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    return (Path(runtime.split(":")[0]) if runtime else state_dir) / "control.sock"


class _TooLarge(Exception):
    pass


class ControlServer:
    def __init__(
        self,
        path: Path,
        handler: Handler,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        read_limit_bytes: int = REQUEST_LIMIT_BYTES,
    ) -> None:
        self.path = path
        self.handler = handler
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.read_limit_bytes = read_limit_bytes
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        # Connections still waiting for their request, oldest first: the ones a new client may push out.
        self._waiting: dict[asyncio.Task[None], None] = {}
        self.refused_total = 0

    @property
    def open_connections(self) -> int:
        return len(self._connections)

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
            # Clients still connected are ended, not waited for (3.12's wait_closed would wait).
            tasks = list(self._connections)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) > self.max_connections and not self._evict_one():
                self.refused_total += 1
                await self._reply(writer, {"ok": False, "error": "too many connections; try again"})
                return
            self._waiting[task] = None
            try:
                line = await self._read_request(reader)
            finally:
                self._waiting.pop(task, None)
            reply = await self._answer(line)
            await self._reply(writer, reply)
        except _TooLarge:
            await self._reply(
                writer, {"ok": False, "error": f"bad request: longer than {self.read_limit_bytes} bytes"}
            )
            await _linger(reader)
        except TimeoutError:
            await self._reply(
                writer, {"ok": False, "error": f"bad request: no request within {self.idle_timeout_s:g} s"}
            )
        except (asyncio.CancelledError, OSError, asyncio.IncompleteReadError):
            pass  # pushed out for a newer client, the server is closing, or the client went away
        finally:
            self._connections.discard(task)
            self._waiting.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    def _evict_one(self) -> bool:
        for task in self._waiting:
            del self._waiting[task]
            task.cancel()
            self.refused_total += 1
            return True
        return False

    async def _read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One line of at most ``read_limit_bytes``, within ``idle_timeout_s``."""
        data = bytearray()
        async with asyncio.timeout(self.idle_timeout_s):
            while not data.endswith(b"\n"):
                chunk = await reader.read(65536)
                if not chunk:
                    break  # EOF: what came so far is the request
                data += chunk
                if len(data) > self.read_limit_bytes:
                    raise _TooLarge
        return bytes(data).split(b"\n", 1)[0]

    async def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line.strip() or b"{}")
            return {"ok": True, "result": await self.handler(_validated(request))}
        except ControlError as exc:
            return {"ok": False, "error": str(exc)}
        except RecursionError:
            return {"ok": False, "error": "bad request: JSON nested too deeply"}
        except UnicodeDecodeError:
            return {"ok": False, "error": "bad request: not UTF-8"}
        except ValueError as exc:
            return {"ok": False, "error": f"bad request: not JSON ({exc})"[:300]}
        except Exception as exc:  # a bug in a handler must not take the daemon down
            log.exception("control request failed")
            return {"ok": False, "error": f"internal error: {exc!r}"}

    async def _reply(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        try:
            data = json.dumps(reply).encode() + b"\n"
        except (TypeError, ValueError) as exc:  # a handler's result JSON cannot say
            log.error("control reply not serializable: %s", exc)
            data = json.dumps({"ok": False, "error": f"internal error: {exc}"}).encode() + b"\n"
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(self.idle_timeout_s):
                writer.write(data)
                await writer.drain()


async def _linger(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(LINGER_S):
            budget = LINGER_BYTES
            while budget > 0 and (chunk := await reader.read(min(budget, 65536))):
                budget -= len(chunk)


def _validated(request: Any) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise ControlError("bad request: expected a JSON object")
    command = request.get("command")
    if command not in COMMANDS:
        raise ControlError(f"unknown command {command!r}; one of {', '.join(COMMANDS)}")
    if command in ENGINE_COMMANDS and not isinstance(request.get("engine"), str):
        raise ControlError(f"{command} needs an engine name")
    if command == "reload" and not isinstance(request.get("dry_run", False), bool):
        raise ControlError("reload: dry_run must be true or false")
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
