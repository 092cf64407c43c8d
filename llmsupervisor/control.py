"""The local control socket: what `llm-supervisor status|restart|drain|stop|start|reload|gpu` talk to.

A Unix stream socket (mode 0660, the daemon's group; nothing on the network). One request per
connection: a JSON object on one line, ``{"command": "restart", "engine": "gpu0"}``; one JSON
line back, ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``.

``{"command": "events", "engine": NAME?, "after": SEQ?, "since_s": SECONDS?, "wait_s": S?}``
answers ``{"events": [...], "last_seq": N}`` from the daemon's ring (daemon/events.py); with
``wait_s`` it waits (at most 30 s) for a first new event, so that `events --follow` is a long
poll: one request after another, each with the last seq it got.
``{"command": "gpu_release", "gpu": N, "window_s": S?}`` and ``{"command": "gpu_take_back", "gpu":
N}``: `gpu release` and `gpu take-back` (daemon/gpu_release.py), answered once taken; what follows
is in ``status``'s ``gpu_release``.
``{"command": "logs", "engine": NAME, "previous": BOOL?, "lines": N?, "after": SEQ?, "wait_s": S?}``
answers ``{"lines": [...], "last_seq": N, "process": {...}, "journal": CMD?}`` from the engine's
output ring (daemon/output_ring.py), the same long poll for `logs --follow`. The server only
parses and hands the request to a callback, which puts it on the daemon's one request queue
(daemon/requests.py) and awaits the loop's answer. The server adds ``peer_uid`` to the request:
the uid of the process on the other end (SO_PEERCRED, from the kernel; None where it cannot be
read), replacing whatever the client sent under that key. An operator's hold names it
(daemon/holds.py).

Any local client in the group can connect, so a connection is cheap to hold and bounded: its
request must arrive within ``idle_timeout_s`` and fit in ``read_limit_bytes``; at most
``max_connections`` are open, and a new one past that pushes out the oldest whose request has not
arrived within ``silent_grace_s`` (admission.py); when none may make way, the new one is answered
``{"ok": false, "busy": true, ...}`` without being read, and the client (``request``) tries again
until its timeout: the command was not taken. Before issue 17, 1,100 idle clients used up the
daemon's 1,024 descriptors and the /proc sweep failed for every engine; before issue 28, a burst
pushed out connections whose requests had arrived but were not read yet ("the daemon went away
without answering" for 32 of 100 `status` calls).
Whatever arrives gets a JSON answer: malformed or deeply nested JSON is a "bad request", never
an "internal error".

The socket is the daemon's own while it runs: every ``SOCKET_CHECK_S`` (and on SIGHUP) it
looks at its path, and a socket removed from there (a tmp cleaner, an operator's ``rm``) is made
again (``keep``); one that someone else put there is left alone and said once in the log. At
exit only its own is removed, told by device and inode. Before issue 38 a removed socket stayed
gone (every CLI command said "the daemon is not running" while it ran), and the exit removed an
impostor's socket too. The client tells "no socket" from other failures (``SocketGone``), so
that the CLI can say the daemon runs (its state-dir lock is held) but its socket is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from llmsupervisor.admission import LISTEN_BACKLOG, SILENT_GRACE_S, Crowd, RequestReader, protocol_factory
from llmsupervisor.redact import redact_json

log = logging.getLogger("llmsupervisor.control")

COMMANDS: Final = (
    "status",
    "restart",
    "drain",
    "stop",
    "start",
    "reload",
    "events",
    "logs",
    "gpu_release",
    "gpu_take_back",
)
ENGINE_COMMANDS: Final = frozenset({"restart", "drain", "stop", "start"})
GPU_COMMANDS: Final = frozenset({"gpu_release", "gpu_take_back"})
REQUEST_LIMIT_BYTES: Final = 64 * 1024
IDLE_TIMEOUT_S: Final = 5.0
MAX_CONNECTIONS: Final = 64
BUSY_ERROR: Final = "busy: too many connections; try again"
# After a refused request: how long and how much to keep reading before closing, so the client
# reads our answer instead of a reset (as http_api's lingering close).
LINGER_S: Final = 1.0
LINGER_BYTES: Final = 4 * 1024 * 1024
SOCKET_CHECK_S: Final = 5.0  # how often the daemon looks that its socket is still at its path
Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class ControlError(Exception):
    """A request the daemon refuses; its message goes back to the client."""


class SocketGone(ControlError):
    """Nobody listens at the socket's path: no socket there, or a dead one (the client's side)."""


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
        silent_grace_s: float = SILENT_GRACE_S,
    ) -> None:
        self.path = path
        self.handler = handler
        self.idle_timeout_s = idle_timeout_s
        self.read_limit_bytes = read_limit_bytes
        self._server: asyncio.AbstractServer | None = None
        self._crowd = Crowd(max_connections=max_connections, silent_grace_s=silent_grace_s)
        self._own: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound
        self._foreign: tuple[int, int] | None = None  # someone else's at the path, said once
        self._watch: asyncio.Task[None] | None = None

    @property
    def open_connections(self) -> int:
        return len(self._crowd)

    @property
    def refused_total(self) -> int:
        """Connections pushed out or answered "busy"."""
        return self._crowd.pushed_out_total + self._crowd.busy_total

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()  # a stale socket of an earlier run (the state-dir lock is ours)
        await self._listen()
        self._watch = asyncio.create_task(self._keep_watching(), name="control-socket")

    async def keep(self) -> bool:
        """Make the socket again if its path has lost it; True when it did. Someone else's
        socket (or anything else) at the path is left alone and said once in the log."""
        if self._server is None:
            return False
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot look at the control socket %s: %s", self.path, exc.strerror or exc)
            return False
        else:
            found = (st.st_dev, st.st_ino)
            if found != self._own and found != self._foreign:
                self._foreign = found
                log.error(
                    "the control socket %s is not this daemon's (someone replaced it): the CLI reaches "
                    "whatever listens there; remove it and the daemon makes its own again",
                    self.path,
                )
            return False
        old = self._server
        try:
            await self._listen()
        except OSError as exc:
            log.error("the control socket %s is gone and cannot be made again: %s", self.path, exc)
            return False
        old.close()  # its path is gone: stop listening there (its connections go on)
        log.warning("the control socket %s was removed; made again", self.path)
        return True

    async def _keep_watching(self) -> None:
        while True:
            await asyncio.sleep(SOCKET_CHECK_S)
            try:
                await self.keep()
            except Exception:  # a bug here must not end the watch, let alone the daemon
                log.exception("checking the control socket failed")

    async def _listen(self) -> None:
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
        # No limit on the reader: _read_request bounds what it reads itself.
        factory = protocol_factory(self._serve, (b"\n",), limit=2**16)
        self._server = await asyncio.get_running_loop().create_unix_server(
            factory, sock=sock, backlog=LISTEN_BACKLOG
        )
        os.chmod(self.path, 0o660)
        st = self.path.lstat()
        self._own, self._foreign = (st.st_dev, st.st_ino), None

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        if self._server is not None:
            self._server.close()
            # Clients still connected are ended, not waited for (3.12's wait_closed would wait).
            tasks = self._crowd.tasks
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        # Only our own: an impostor's socket (or a newer daemon's) at the path is not ours to remove.
        with contextlib.suppress(FileNotFoundError):
            st = self.path.lstat()
            if (st.st_dev, st.st_ino) == self._own:
                self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            if not self._crowd.join(task, reader):
                self._crowd.refused()
                await self._reply(writer, {"ok": False, "busy": True, "error": BUSY_ERROR})
                self._crowd.answered(task)
                await _linger(reader)  # until the client, which has its answer, closes
                return
            line = await self._read_request(reader)
            reply = await self._answer(line, peer_uid(writer))
            await self._reply(writer, reply)
        except _TooLarge:
            await self._reply(
                writer, {"ok": False, "error": f"bad request: longer than {self.read_limit_bytes} bytes"}
            )
            self._crowd.answered(task)
            await _linger(reader)
        except TimeoutError:
            await self._reply(
                writer, {"ok": False, "error": f"bad request: no request within {self.idle_timeout_s:g} s"}
            )
        except asyncio.CancelledError:
            # Pushed out for a newer client (answered "busy", written as the close ends), or the
            # server is closing.
            if self._crowd.pushed_out(task) and isinstance(reader, RequestReader):
                reader.drop_unread()  # what it sent: the close is then no reset that loses an answer
            if self._crowd.owes_answer(task) and not writer.is_closing():
                writer.write(json.dumps({"ok": False, "busy": True, "error": BUSY_ERROR}).encode() + b"\n")
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            self._crowd.leave(task)
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

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

    async def _answer(self, line: bytes, uid: int | None = None) -> dict[str, Any]:
        try:
            request = json.loads(line.strip() or b"{}")
            return {"ok": True, "result": await self.handler({**_validated(request), "peer_uid": uid})}
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
            # A reply of many lines or events (`logs`, `events`: up to a megabyte or so) is
            # redacted and encoded in a thread, so the loop keeps turning meanwhile (issue 38).
            data = await asyncio.to_thread(_encode, reply) if _bulky(reply) else _encode(reply)
        except (TypeError, ValueError) as exc:  # a handler's result JSON cannot say
            log.error("control reply not serializable: %s", exc)
            data = json.dumps({"ok": False, "error": f"internal error: {exc}"}).encode() + b"\n"
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(self.idle_timeout_s):
                writer.write(data)
                await writer.drain()


BULKY_ITEMS: Final = 64  # a reply listing more lines or events than this is encoded in a thread


def _encode(reply: dict[str, Any]) -> bytes:
    return json.dumps(redact_json(reply)).encode() + b"\n"  # a reason may quote a secret


def _bulky(reply: dict[str, Any]) -> bool:
    result = reply.get("result")
    if not isinstance(result, dict):
        return False
    items = result.get("lines", result.get("events"))
    return isinstance(items, list) and len(items) > BULKY_ITEMS


def peer_uid(writer: asyncio.StreamWriter) -> int | None:
    """The connected client's uid, as the kernel recorded it at connect (SO_PEERCRED: struct
    ucred, three ints: pid, uid, gid; Linux). None where the socket cannot say."""
    sock = writer.get_extra_info("socket")
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (AttributeError, OSError, struct.error):
        return None
    return int(uid)


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
    if command == "logs":
        if not isinstance(request.get("engine"), str):
            raise ControlError("logs needs an engine name")
        for key in ("lines", "after", "wait_s"):
            value = request.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ControlError(f"logs: {key} must be a number")
    if command in GPU_COMMANDS:
        gpu = request.get("gpu")
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise ControlError(f"{command}: gpu must be a GPU index (0, 1, ...)")
        window = request.get("window_s")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int | float)):
            raise ControlError(f"{command}: window_s must be a number")
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
    """Client side (blocking, for the CLI). Raises ControlError with an operator-facing message.

    A full listen backlog (a burst of clients) is retried until ``timeout_s``: with a timeout set,
    an AF_UNIX connect fails at once with EAGAIN instead of waiting for room, and that used to
    drop the command as "the daemon went away" (issue 28). So is a "busy" answer (the daemon
    had too many connections and did not read the command). If it never gets through, the error
    says the daemon is busy and that the command was not sent.
    """
    deadline = time.monotonic() + timeout_s
    pause_s = CONNECT_RETRY_FIRST_S
    while True:
        reply = _exchange(path, payload, timeout_s, deadline)
        left_s = deadline - time.monotonic()
        if not reply.get("busy"):
            return reply
        if left_s <= 0:  # busy: the daemon took the connection but not the command
            raise ControlError(
                f"the daemon is busy: too many connections for {timeout_s:g} s (a burst of clients);"
                " the command was not sent, try again"
            )
        _connect_pause(min(pause_s, left_s))
        pause_s = min(pause_s * 2, CONNECT_RETRY_MAX_S)


def _exchange(path: Path, payload: dict[str, Any], timeout_s: float, deadline: float) -> dict[str, Any]:
    sock = _connect(path, timeout_s, deadline)
    try:
        sock.settimeout(timeout_s)
        # A daemon that answered "busy" without reading may have closed already: read its answer.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(json.dumps(payload).encode() + b"\n")
        data = bytearray()  # grown in place: `bytes +=` copied the whole reply at every chunk
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 20)
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


CONNECT_RETRY_FIRST_S: Final = 0.005
CONNECT_RETRY_MAX_S: Final = 0.1


def _connect_pause(seconds: float) -> None:
    time.sleep(seconds)  # a seam for the tests, which want to know that a retry happened


def _connect(path: Path, timeout_s: float, deadline: float) -> socket.socket:
    pause_s = CONNECT_RETRY_FIRST_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:  # EAGAIN: the listen backlog is full; the daemon is in a burst
            sock.close()
        except FileNotFoundError:
            sock.close()
            raise SocketGone(f"the daemon is not running (no control socket at {path})") from None
        except ConnectionRefusedError:
            sock.close()
            raise SocketGone(f"the daemon is not running (stale control socket at {path})") from None
        except PermissionError:
            sock.close()
            raise ControlError(
                f"permission denied on {path}: run as root or as a member of the daemon's group"
            ) from None
        except TimeoutError:
            sock.close()
            break
        except OSError as exc:
            sock.close()
            raise ControlError(f"cannot connect to the daemon: {exc.strerror or exc}") from None
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            break
        _connect_pause(min(pause_s, left_s))
        pause_s = min(pause_s * 2, CONNECT_RETRY_MAX_S)
    raise ControlError(
        f"the daemon is busy: its control socket took no connection within {timeout_s:g} s"
        " (a burst of clients); the command was not sent, try again"
    )
