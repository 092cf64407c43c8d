"""A minimal asyncio HTTP/1.1 server for the daemon's read-only endpoints (``/metrics``, status).

One request per connection (``Connection: close``), GET and HEAD only, and every response
carries ``Content-Length``. It is deliberately small: it runs inside the supervisor's event
loop, so a slow or hostile client must cost one bounded task and nothing else.

::

    accept ──► read request line + headers (≤ 16 KiB, ≤ 5 s) ──► parse ──► route ──► handler
                 │ too big: 431   │ too slow: 408               │ bad: 400  │ none: 404
                 │                                              │           │ not GET/HEAD: 405
                 └──────────────────────────────────────────────┴───────────┴──► write (≤ 5 s), close

Every error, the server's own (400, 404, 405, 408, 431, 500, 503) and the endpoints' (``error()``),
is a JSON object ``{"error": DETAIL, "status": N}``.

A handler that raises (or runs past ``handler_timeout_s``) gives 500 (503) and is logged; the
exception never reaches the event loop. Past ``max_connections`` open connections a new one
pushes out one that lingers after an error response, else the oldest whose request head has not
arrived within ``silent_grace_s`` (admission.py); one pushed out gets 503 before it is closed.
A connection whose head has arrived is never pushed out, even before its task has read it: in a
burst that lost requests already sent (issue 28); nor is one whose bytes wait unread in the
kernel (a loop that is behind has not read them yet). When none may make way, the new one gets 503
at once without being read. Before issue 17, 64 idle sockets from any local user took every
engine out of rotation: each check got 503 (docs/reliability.md).

Probes first (issue 38): the paths ``probe`` names (the daemon's: ``/livez``, ``/healthz``,
``/readyz``, ``/engines/NAME/ready``) are what load balancers and kubelets check, and no other
client may starve them. A connection past the cap is looked at before it is refused, in the turn
it is accepted: when its request line already waits in the kernel (MSG_PEEK) and names a probe
(GET or HEAD), it is answered there and then, from that line alone, and closed, without taking
a slot. One whose line is not there yet waits for it in a reserve of ``probe_reserve`` more
connections (admission.py), where it is answered as soon as the line arrives: a probe's answer,
else 503. The reserve makes way by its own rules (the oldest answered, else the oldest whose
line has not arrived, at any age, unless a probe's line waits for it unread; one pushed out is
answered 503 with the lingering close), so a slowloris that rotates its connections every
0.35 s, never old enough to be pushed out of the cap, holds neither. Anything else past the cap
gets 503 as before. Before, ``/engines/NAME/ready`` answered 200 in 0 to 2 of 30 checks under
such an attack of 64 or 256 connections; now 30 of 30 (docs/reliability.md).

Routing: an exact match in ``routes`` first; otherwise the longest key of ``prefix_routes`` that
the path starts with, whose handler gets the rest of the path (``"/engines/"`` + ``"gpu0/ready"``
→ ``handler("gpu0/ready")``). The query string is ignored; the path is not percent-decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final
from urllib.parse import urlsplit

from llmsupervisor.admission import LISTEN_BACKLOG, SILENT_GRACE_S, Crowd, RequestReader, protocol_factory

log = logging.getLogger(__name__)

MAX_HEADER_BYTES: Final = 16 * 1024
READ_TIMEOUT_S: Final = 5.0
WRITE_TIMEOUT_S: Final = 5.0
HANDLER_TIMEOUT_S: Final = 10.0
MAX_CONNECTIONS: Final = 64
PROBE_RESERVE: Final = 64  # connections past the cap that may still be answered a probe
PROBE_LINE_TIMEOUT_S: Final = 1.0  # how long one in the reserve waits for its request line
PROBE_PEEK_BYTES: Final = 2048  # a request line longer than this names no probe
# After an error response: how long and how much to keep reading before closing (see _linger).
LINGER_S: Final = 1.0
LINGER_BYTES: Final = 64 * 1024

ALLOWED_METHODS: Final = ("GET", "HEAD")


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"


Handler = Callable[[], Awaitable[Response] | Response]
PrefixHandler = Callable[[str], Awaitable[Response] | Response]


class _BadRequest(Exception):
    def __init__(self, status: HTTPStatus, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str


def parse_listen(value: str) -> tuple[str, int]:
    """``"127.0.0.1:9400"`` → ``("127.0.0.1", 9400)``; ``"[::1]:9400"`` → ``("::1", 9400)``.

    A bare IPv6 address (``"::1:9400"``) splits at the last colon, as the config check does.
    Port 0 (any free port) is accepted for tests. Raises ``ValueError`` otherwise.
    """
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep or "]" in host:
            raise ValueError(f"must be HOST:PORT or [IPV6]:PORT, got {value!r}")
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            raise ValueError(f"must be HOST:PORT or [IPV6]:PORT, got {value!r}")
    if not host or not port.isascii() or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"must be HOST:PORT or [IPV6]:PORT, got {value!r}")
    return host, int(port)


def text(body: str, status: int = 200) -> Response:
    """A ``text/plain`` response; a convenience for handlers."""
    return Response(status=status, body=body.encode(), content_type="text/plain; charset=utf-8")


class HttpApi:
    """Serves ``routes`` and ``prefix_routes`` (see the module docstring) until ``close()``."""

    def __init__(
        self,
        routes: Mapping[str, Handler],
        prefix_routes: Mapping[str, PrefixHandler] | None = None,
        *,
        read_timeout_s: float = READ_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        handler_timeout_s: float = HANDLER_TIMEOUT_S,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_connections: int = MAX_CONNECTIONS,
        silent_grace_s: float = SILENT_GRACE_S,
        probe: Callable[[str], bool] | None = None,
        probe_reserve: int = PROBE_RESERVE,
    ) -> None:
        self._routes = dict(routes)
        # Longest prefix first, so "/engines/gpu0/" can override "/engines/".
        self._prefixes = sorted((prefix_routes or {}).items(), key=lambda kv: len(kv[0]), reverse=True)
        self._read_timeout_s = read_timeout_s
        self._write_timeout_s = write_timeout_s
        self._handler_timeout_s = handler_timeout_s
        self._max_header_bytes = max_header_bytes
        self._server: asyncio.Server | None = None
        self._probe = probe
        reserve = probe_reserve if probe is not None else 0
        self._crowd = Crowd(max_connections=max_connections, silent_grace_s=silent_grace_s, reserve=reserve)

    @property
    def evicted_total(self) -> int:
        return self._crowd.pushed_out_total

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (port 0: any free port; see ``port``)."""
        if self._server is not None:
            raise RuntimeError("HttpApi already started")
        self._server = await asyncio.get_running_loop().create_server(
            # readuntil() raises LimitOverrunError past the limit, which we answer with 431.
            protocol_factory(self._serve, (b"\n\r\n", b"\n\n"), limit=self._max_header_bytes),
            host,
            port,
            backlog=LISTEN_BACKLOG,
        )

    @property
    def port(self) -> int:
        """The bound port of the first listening socket (the one to use after ``start(host, 0)``)."""
        return self.addresses[0][1]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every listening socket (a name like ``localhost`` may bind several)."""
        if self._server is None:
            raise RuntimeError("HttpApi not started")
        return [(s.getsockname()[0], s.getsockname()[1]) for s in self._server.sockets]

    async def close(self) -> None:
        """Stop listening and end every open connection; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        # Before 3.12 Server.close() leaves accepted connections running: end them ourselves.
        tasks = self._crowd.tasks
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            if self._crowd.join(task, reader):
                await self._exchange(reader, writer)
            else:
                await self._past_the_cap(task, reader, writer)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            # The client went away or stopped reading (HAProxy's health checks reset the
            # connection as soon as they have the status line: ENOTCONN on shutdown); nothing
            # is left to tell it. ConnectionError is an OSError too.
            pass
        except asyncio.CancelledError:
            # close() ends open connections this way, and a connection pushed out for a new one.
            # Ending normally matters: on 3.11, StreamReaderProtocol logs a cancelled connection
            # task as an unhandled error.
            if self._crowd.owes_answer(task) and not writer.is_closing():
                await self._busy_after_push_out(task, reader, writer)
            elif self._crowd.pushed_out(task) and isinstance(reader, RequestReader):
                reader.drop_unread()  # answered already: the close is then no reset that loses it
        except Exception:
            # Never let one connection's failure reach the loop's exception handler.
            log.exception("HTTP connection failed")
        finally:
            self._crowd.leave(task)
            writer.close()
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await writer.wait_closed()
            except TimeoutError:
                writer.transport.abort()  # a client that does not read would hold the socket forever
            except Exception:
                pass  # the connection is gone either way

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head_only = False
        try:
            async with asyncio.timeout(self._read_timeout_s):
                head = await self._read_head(reader)
            request = _parse(head)
        except TimeoutError:
            response = _error(HTTPStatus.REQUEST_TIMEOUT, "request headers too slow")
        except _BadRequest as exc:
            response = _error(exc.status, exc.detail)
        else:
            head_only = request.method == "HEAD"
            response = await self._dispatch(request)
        await self._respond(writer, response, head_only=head_only)
        if response.status >= 400:
            await self._linger(reader)

    async def _busy_after_push_out(
        self, task: asyncio.Task[None], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Pushed out for a newer connection before it was answered: 503, then the lingering
        close of any refusal. Its request may be on its way: closed at once, the request would
        meet a reset, and the client lose the answer (a burst of checks past the cap: 112 of
        400 without a status line when the reserve closed the ones it pushed out)."""
        task.uncancel()
        try:
            await self._respond(writer, _error(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections"))
            await self._linger(reader)
        except (asyncio.CancelledError, OSError, TimeoutError):
            pass  # the server closes, or pushed out again while it lingers, or the client left

    async def _past_the_cap(
        self, task: asyncio.Task[None], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A connection ``join`` did not admit: a probe whose request line is there already is
        answered at once, in this turn, before any other newcomer is looked at; one whose line
        is not there yet waits for it in the reserve; anything else is "busy" (module doc)."""
        assert isinstance(reader, RequestReader)
        line = self._probe_line(reader)
        if line is not None:
            request = _parse(line)
            reader.drop_unread()  # the check's request, read and dropped: the close is a FIN
            # A plain handler (the daemon's probes) is called and its answer written without a
            # yield: no newcomer can push this one out meanwhile.
            response = await self._dispatch(request)
            self._crowd.answered(task)
            await self._respond(writer, response, head_only=request.method == "HEAD")
            return
        if self._probe is not None and self._crowd.take_reserve(task, self._holds_probe):
            await self._probe_exchange(reader, writer)
            return
        self._crowd.refused()
        await self._respond(writer, _error(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections"))
        await self._linger(reader)

    def _probe_line(self, reader: RequestReader) -> bytes | None:
        """The request line waiting unread in the kernel, if it is a whole one naming a probe."""
        if self._probe is None:
            return None
        head = reader.peek_unread(PROBE_PEEK_BYTES).lstrip(b"\r\n")
        line, sep, _ = head.partition(b"\n")
        if not sep:
            return None
        try:
            request = _parse(line + sep)
        except _BadRequest:
            return None
        return line + sep if self._probe(request.path) and request.method in ALLOWED_METHODS else None

    def _holds_probe(self, reader: RequestReader) -> bool:
        return self._probe_line(reader) is not None

    async def _probe_exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """In the reserve: answered on the request line alone, a probe's answer when it names
        one, else 503; then what else the client sends is read and dropped."""
        response, head_only = _error(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections"), False
        try:
            async with asyncio.timeout(PROBE_LINE_TIMEOUT_S):
                request = _parse(await self._read_request_line(reader))
        except (TimeoutError, _BadRequest):
            pass
        else:
            assert self._probe is not None  # a reserve is kept only with probes
            if self._probe(request.path) and request.method in ALLOWED_METHODS:
                head_only = request.method == "HEAD"
                response = await self._dispatch(request)
        await self._respond(writer, response, head_only=head_only)
        await self._linger(reader)

    async def _read_request_line(self, reader: asyncio.StreamReader) -> bytes:
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too large") from None
            if line not in (b"\r\n", b"\n"):  # RFC 9112 §2.2: empty lines before it are ignored
                return line

    async def _linger(self, reader: asyncio.StreamReader) -> None:
        """Read and drop what the client still sends, until it closes or a small budget is spent.

        Closing a socket with unread input makes the kernel send RST, and a client that is still
        sending (a 431 for a huge header, a body we never read) may then lose our response
        instead of reading it. Apache's "lingering close" does the same.
        """
        task = asyncio.current_task()
        assert task is not None
        self._crowd.answered(task)  # answered: the first to make way for a new connection
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(LINGER_S):
                budget = LINGER_BYTES
                while budget > 0 and (chunk := await reader.read(min(budget, 4096))):
                    budget -= len(chunk)

    async def _read_head(self, reader: asyncio.StreamReader) -> bytes:
        lines: list[bytes] = []
        size = 0
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too large") from None
            size += len(line)
            if size > self._max_header_bytes:
                raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too large")
            if line in (b"\r\n", b"\n"):
                if not lines:
                    continue  # RFC 9112 §2.2: ignore empty lines before the request line
                return b"".join(lines)
            lines.append(line)

    async def _dispatch(self, request: _Request) -> Response:
        call: Callable[[], Awaitable[Response] | Response] | None = None
        if request.path in self._routes:
            call = self._routes[request.path]
        else:
            for prefix, prefix_handler in self._prefixes:
                if request.path.startswith(prefix):
                    rest = request.path[len(prefix) :]
                    call = _bind(prefix_handler, rest)
                    break
        if call is None:
            return _error(HTTPStatus.NOT_FOUND, f"no such endpoint: {request.path}")
        if request.method not in ALLOWED_METHODS:
            return _error(HTTPStatus.METHOD_NOT_ALLOWED, f"{request.method} not allowed")
        try:
            async with asyncio.timeout(self._handler_timeout_s):
                result = call()
                if inspect.isawaitable(result):
                    result = await result
        except TimeoutError:
            log.error("HTTP handler for %s timed out after %s s", request.path, self._handler_timeout_s)
            return _error(HTTPStatus.SERVICE_UNAVAILABLE, "handler timed out")
        except Exception:
            log.exception("HTTP handler for %s failed", request.path)
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")
        if not isinstance(result, Response):
            log.error("HTTP handler for %s returned %r, not a Response", request.path, result)
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")
        return result

    async def _respond(
        self, writer: asyncio.StreamWriter, response: Response, *, head_only: bool = False
    ) -> None:
        data = _head_and_body(response, head_only=head_only)
        async with asyncio.timeout(self._write_timeout_s):
            writer.write(data)
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()


def _head_and_body(response: Response, *, head_only: bool = False) -> bytes:
    try:
        reason = HTTPStatus(response.status).phrase
    except ValueError:
        reason = ""
    headers = [
        f"HTTP/1.1 {response.status} {reason}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Connection: close",
        "Cache-Control: no-store",
    ]
    if response.status == HTTPStatus.METHOD_NOT_ALLOWED:
        headers.append("Allow: " + ", ".join(ALLOWED_METHODS))
    data = ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1")
    if not head_only:
        data += response.body
    return data


def _bind(handler: PrefixHandler, rest: str) -> Handler:
    return lambda: handler(rest)


def error(status: int, detail: str, **extra: object) -> Response:
    """An error as JSON, the same shape from every endpoint and from the server itself (a
    client that parses one error parses them all): ``{"error": DETAIL, "status": N, ...}``."""
    body = {"error": detail, "status": status, **extra}
    return Response(status=status, body=json.dumps(body).encode() + b"\n", content_type="application/json")


def _error(status: HTTPStatus, detail: str) -> Response:
    return error(status.value, detail)


def _parse(head: bytes) -> _Request:
    # latin-1 maps every byte to a character, so decoding never fails; bad bytes fail the checks.
    request_line, *header_lines = head.decode("latin-1").split("\n")
    parts = request_line.rstrip("\r").split(" ")
    if len(parts) != 3:
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    if not method.isascii() or not method.isalpha() or not method.isupper():
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "malformed method")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "unsupported HTTP version")
    if target.startswith("/"):
        path = target.split("?", 1)[0]
    elif target.startswith(("http://", "https://")):  # absolute-form, as sent through a proxy
        try:
            path = urlsplit(target).path or "/"
        except ValueError:  # "http://[/x": an unclosed IPv6 bracket (no answer and a traceback before)
            raise _BadRequest(HTTPStatus.BAD_REQUEST, "malformed request target") from None
    else:
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "malformed request target")
    if any(ch.isspace() or not ch.isprintable() for ch in path):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "malformed request target")
    for raw in header_lines:
        line = raw.rstrip("\r")
        if not line:
            continue
        name, sep, _ = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            # No colon, whitespace before the colon, or obsolete line folding (RFC 9112 §5).
            raise _BadRequest(HTTPStatus.BAD_REQUEST, "malformed header")
    return _Request(method=method, path=path)


__all__ = ["Handler", "HttpApi", "PrefixHandler", "Response", "error", "parse_listen", "text"]
