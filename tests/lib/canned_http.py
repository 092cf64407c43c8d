"""A real HTTP/1.1 server on 127.0.0.1 for the probe client's tests: each request is answered
with the raw bytes a handler returns (or the connection is closed when it returns None), over
kept-alive connections, and the server counts the connections and requests it saw."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Reply = bytes | None
Handler = Callable[[str, dict[str, str]], Reply | Awaitable[Reply]]


def reply(
    status: int, body: bytes = b"", *, headers: dict[str, str] | None = None, chunked: bool = False
) -> bytes:
    """The raw bytes of an HTTP/1.1 answer: a Content-Length body, or chunked in 7-byte chunks."""
    head = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    if chunked:
        head.append("Transfer-Encoding: chunked")
        parts = [body[i : i + 7] for i in range(0, len(body), 7)]
        framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nTrailer: x\r\n\r\n"
    else:
        head.append(f"Content-Length: {len(body)}")
        framed = body
    return ("\r\n".join(head) + "\r\n\r\n").encode() + framed


@dataclass
class CannedServer:
    url: str = ""
    connections: int = 0
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)


Connection = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handle: Connection) -> AsyncIterator[str]:
    """A server on 127.0.0.1 running ``handle`` per connection; its URL. Every connection's task
    is cancelled and awaited when the block ends."""
    tasks: set[asyncio.Task[Any]] = set()

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        await handle(reader, writer)

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def canned_server(handler: Handler) -> AsyncIterator[CannedServer]:
    seen = CannedServer()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                first, *lines = head.decode("latin-1").split("\r\n")
                path = first.split(" ")[1]
                headers = {}
                for line in lines:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                seen.requests.append((path, headers))
                answer = handler(path, headers)
                if inspect.isawaitable(answer):
                    answer = await answer
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if b"connection: close" in answer.lower().split(b"\r\n\r\n", 1)[0]:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async with serving(handle) as url:
        seen.url = url
        yield seen
