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
pushes out the oldest connection that is still *waiting* (has not sent a complete request head,
or lingers after an error response): such a client costs nothing to drop, and one that sends its
request at once (a load balancer's check) is never waiting for long. Only when every connection
is busy (in a handler or writing) does the new one get 503 at once without being read. Before,
64 idle sockets from any local user took every engine out of rotation: each check got 503
(issue 17, docs/reliability.md).

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
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

MAX_HEADER_BYTES: Final = 16 * 1024
READ_TIMEOUT_S: Final = 5.0
WRITE_TIMEOUT_S: Final = 5.0
HANDLER_TIMEOUT_S: Final = 10.0
MAX_CONNECTIONS: Final = 64
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
    ) -> None:
        self._routes = dict(routes)
        # Longest prefix first, so "/engines/gpu0/" can override "/engines/".
        self._prefixes = sorted((prefix_routes or {}).items(), key=lambda kv: len(kv[0]), reverse=True)
        self._read_timeout_s = read_timeout_s
        self._write_timeout_s = write_timeout_s
        self._handler_timeout_s = handler_timeout_s
        self._max_header_bytes = max_header_bytes
        self._max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        # Connections that may be pushed out for a new one, oldest first (dicts keep order).
        self._waiting: dict[asyncio.Task[None], None] = {}
        self.evicted_total = 0

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (port 0: any free port; see ``port``)."""
        if self._server is not None:
            raise RuntimeError("HttpApi already started")
        self._server = await asyncio.start_server(
            self._serve,
            host,
            port,
            # readuntil() raises LimitOverrunError past this, which we answer with 431.
            limit=self._max_header_bytes,
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
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) > self._max_connections and not self._evict_one():
                await self._respond(writer, _error(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections"))
                await self._linger(reader)
                return
            await self._exchange(reader, writer)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            # The client went away or stopped reading (HAProxy's health checks reset the
            # connection as soon as they have the status line: ENOTCONN on shutdown); nothing
            # is left to tell it. ConnectionError is an OSError too.
            pass
        except asyncio.CancelledError:
            # close() ends open connections this way. Ending normally matters: on 3.11,
            # StreamReaderProtocol logs a cancelled connection task as an unhandled error.
            pass
        except Exception:
            # Never let one connection's failure reach the loop's exception handler.
            log.exception("HTTP connection failed")
        finally:
            self._connections.discard(task)
            self._waiting.pop(task, None)
            writer.close()
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await writer.wait_closed()
            except TimeoutError:
                writer.transport.abort()  # a client that does not read would hold the socket forever
            except Exception:
                pass  # the connection is gone either way

    def _evict_one(self) -> bool:
        """Cancel the oldest waiting connection to make room; False when none is waiting."""
        for task in self._waiting:
            del self._waiting[task]
            task.cancel()
            self.evicted_total += 1
            return True
        return False

    @contextlib.contextmanager
    def _evictable(self) -> Iterator[None]:
        task = asyncio.current_task()
        assert task is not None
        self._waiting[task] = None
        try:
            yield
        finally:
            self._waiting.pop(task, None)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head_only = False
        try:
            with self._evictable():
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

    async def _linger(self, reader: asyncio.StreamReader) -> None:
        """Read and drop what the client still sends, until it closes or a small budget is spent.

        Closing a socket with unread input makes the kernel send RST, and a client that is still
        sending (a 431 for a huge header, a body we never read) may then lose our response
        instead of reading it. Apache's "lingering close" does the same.
        """
        with self._evictable(), contextlib.suppress(TimeoutError, ConnectionError):
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
        async with asyncio.timeout(self._write_timeout_s):
            writer.write(data)
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()


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
        path = urlsplit(target).path or "/"
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
