"""The HTTP client of the two probes every round sends: ``GET /health`` and ``GET /metrics``.

Two fixed GETs to one plain-http address, answered with a Content-Length or chunked body: the
smallest useful HTTP/1.1 client, on asyncio streams, with kept-alive connections. It exists
for cost. The profile of the daemon at 8 engines (docs/benchmarks.md, "Faster and cheaper")
put httpx/httpcore's per-request machinery (request and URL objects, the pool's bookkeeping,
the cookie jar, anyio's and h11's layers) at about 0.7 ms of CPU per request, the largest
share of what a round costs; this client spends a fraction of that. The canary, the readiness
checks and the drain stay on httpx: they run rarely, and they POST JSON.

Every call runs under the caller's deadline (``asyncio.timeout``); this module adds none.
Failures are ``ProbeHttpError``s of three kinds, each carrying the probe failure kind the
probes report it as:

``Unreachable``  ``connect``: refused, reset or closed before or during the answer (the crash path)
``BadAnswer``    ``http``: not HTTP/1.x, a malformed head or chunk (a protocol error)
``TooLarge``     ``parse``: the body is over the caller's cap; it is not read further

A connection is reused only after a whole answer that did not say ``Connection: close``; any
failure, cancellation included, closes it. A kept-alive connection the server closed while
idle (uvicorn closes them after 5 s) fails the next request before any byte of the answer:
that one request is retried once on a new connection, which is safe for a GET.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from llmsupervisor.probes import ProbeFailureKind

MAX_HEAD_BYTES = 64 * 1024  # status line and headers together
MAX_HEADERS = 100
MAX_IDLE_CONNECTIONS = 2  # /health and /metrics run concurrently in a round


class ProbeHttpError(Exception):
    kind: ProbeFailureKind


class Unreachable(ProbeHttpError):
    """Refused, reset, or closed before the answer was complete."""

    kind = "connect"


class BadAnswer(ProbeHttpError):
    """Not an HTTP/1.x answer this client can read."""

    kind = "http"


class TooLarge(ProbeHttpError):
    """The body is over the cap."""

    kind = "parse"


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: Mapping[str, str]  # names in lower case; a repeated header keeps its last value
    body: bytes


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ProbeHttp:
    """GETs to one engine's address (``http://host:port``) over at most
    ``MAX_IDLE_CONNECTIONS`` kept-alive connections."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"not a plain http address: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._host_header = parts.netloc
        self._idle: list[_Conn] = []

    async def get(
        self, path: str, *, headers: Mapping[str, str] | None = None, max_body_bytes: int
    ) -> Answer:
        request = self._request(path, headers)
        reused = self._take_idle()
        if reused is not None:
            try:
                return await self._exchange(reused, request, max_body_bytes, retry_if_silent=True)
            except _SilentClose:
                pass  # the server had closed it while idle: once more, on a new connection
        return await self._exchange(await self._connect(), request, max_body_bytes, retry_if_silent=False)

    def close(self) -> None:
        """Close the idle connections (one in use is closed when its exchange ends)."""
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()

    # ---- internals ----

    def _request(self, path: str, headers: Mapping[str, str] | None) -> bytes:
        lines = [f"GET {path} HTTP/1.1", f"Host: {self._host_header}", "Accept-Encoding: identity"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            reader, writer = self._idle.pop()
            if reader.at_eof() or writer.is_closing():
                writer.close()  # closed by the server while idle, and we have seen it
                continue
            return reader, writer
        return None

    async def _connect(self) -> _Conn:
        try:
            return await asyncio.open_connection(self._host, self._port, limit=MAX_HEAD_BYTES)
        except OSError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc.strerror or exc}") from None

    async def _exchange(
        self, conn: _Conn, request: bytes, max_body_bytes: int, *, retry_if_silent: bool
    ) -> Answer:
        reader, writer = conn
        keep = False
        try:
            try:
                writer.write(request)
                line = await reader.readuntil(b"\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if retry_if_silent and not getattr(exc, "partial", b""):
                    raise _SilentClose from None
                raise Unreachable(_closed(exc)) from None
            answer, keep = await _read_answer(reader, line, max_body_bytes)
            return answer
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise Unreachable(_closed(exc)) from None
        except asyncio.LimitOverrunError:
            raise BadAnswer(f"a head line over {MAX_HEAD_BYTES} bytes") from None
        finally:
            if keep and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
            else:
                writer.close()


class _SilentClose(Exception):
    """A reused connection closed before a byte of the answer."""


def _closed(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "connection closed before the answer was complete"
    return f"{type(exc).__name__}: {exc}"


async def _read_answer(
    reader: asyncio.StreamReader, status_line: bytes, max_body_bytes: int
) -> tuple[Answer, bool]:
    """The answer after its status line, and whether the connection may be reused."""
    version, _, rest = status_line.decode("latin-1").rstrip("\r\n").partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise BadAnswer(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    status = int(code)
    headers: dict[str, str] = {}
    head_bytes = len(status_line)
    lines = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        head_bytes += len(line)
        if line == b"\r\n":
            break
        lines += 1
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep or lines > MAX_HEADERS or head_bytes > MAX_HEAD_BYTES:
            raise BadAnswer(f"a malformed or oversized head (at {line[:80]!r})")
        headers[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if status in (204, 304) or 100 <= status < 200:
        return Answer(status, headers, b""), keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Answer(status, headers, await _read_chunked(reader, max_body_bytes)), keep
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise BadAnswer(f"Content-Length {length!r}")
        if int(length) > max_body_bytes:
            raise TooLarge(f"Content-Length {length} is over {max_body_bytes} bytes")
        return Answer(status, headers, await reader.readexactly(int(length))), keep
    # Neither: the body runs to the end of the connection.
    chunks: list[bytes] = []
    size = 0
    while chunk := await reader.read(64 * 1024):
        size += len(chunk)
        if size > max_body_bytes:
            raise TooLarge(f"body over {max_body_bytes} bytes")
        chunks.append(chunk)
    return Answer(status, headers, b"".join(chunks)), False


async def _read_chunked(reader: asyncio.StreamReader, max_body_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        hex_size = line.split(b";", 1)[0].strip()
        try:
            chunk_size = int(hex_size, 16)
        except ValueError:
            raise BadAnswer(f"a bad chunk size {line[:40]!r}") from None
        if chunk_size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers: none that matter here
            return b"".join(chunks)
        size += chunk_size
        if size > max_body_bytes:
            raise TooLarge(f"body over {max_body_bytes} bytes")
        chunks.append(await reader.readexactly(chunk_size))
        if await reader.readexactly(2) != b"\r\n":
            raise BadAnswer("a chunk without its CRLF")


__all__ = ["Answer", "BadAnswer", "ProbeHttp", "ProbeHttpError", "TooLarge", "Unreachable"]
