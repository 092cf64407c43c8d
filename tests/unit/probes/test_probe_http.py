"""The probes' own HTTP/1.1 client (probes/probe_http.py) against a real local server: bodies
by Content-Length, chunked and to the end, kept-alive reuse, a connection the server closed
while idle, and every failure as its exception."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from llmsupervisor.probes.probe_http import Answer, BadAnswer, ProbeHttp, TooLarge, Unreachable
from tests.lib.canned_http import CannedServer, Handler, Reply, canned_server, reply

T = TypeVar("T")
BIG = 1 << 20


def run(handler: Handler, use: Callable[[ProbeHttp, CannedServer], Awaitable[T]]) -> tuple[T, CannedServer]:
    async def go() -> tuple[T, CannedServer]:
        async with canned_server(handler) as server:
            probe = ProbeHttp(server.url)
            try:
                return await use(probe, server), server
            finally:
                probe.close()

    return asyncio.run(go())


async def get(probe: ProbeHttp, server: CannedServer) -> Answer:
    return await probe.get("/metrics", max_body_bytes=BIG)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_by_length_or_chunked(chunked: bool) -> None:
    body = b"vllm:num_requests_running 3\n" * 10
    answer, server = run(lambda p, h: reply(200, body, chunked=chunked), get)
    assert (answer.status, answer.body) == (200, body)
    path, headers = server.requests[0]
    assert path == "/metrics" and headers["host"] == server.url.removeprefix("http://")


def test_a_body_to_the_end_of_the_connection() -> None:
    raw = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nall of it"

    async def twice(probe: ProbeHttp, server: CannedServer) -> list[bytes]:
        return [(await get(probe, server)).body, (await get(probe, server)).body]

    bodies, server = run(lambda p, h: raw, twice)
    assert bodies == [b"all of it", b"all of it"]
    assert server.connections == 2  # HTTP/1.0 without keep-alive: never reused


def test_one_connection_is_kept_and_reused_and_headers_go_with_each_request() -> None:
    async def many(probe: ProbeHttp, server: CannedServer) -> list[int]:
        statuses = []
        for _ in range(5):
            answer = await probe.get("/health", headers={"Authorization": "Bearer k"}, max_body_bytes=BIG)
            statuses.append(answer.status)
        return statuses

    statuses, server = run(lambda p, h: reply(200), many)
    assert statuses == [200] * 5
    assert server.connections == 1
    assert all(h["authorization"] == "Bearer k" for _, h in server.requests)


def test_two_at_once_use_two_connections_and_both_are_kept() -> None:
    async def slow(path: str, headers: dict[str, str]) -> Reply:
        await asyncio.sleep(0.05)
        return reply(200, path.encode())

    async def rounds(probe: ProbeHttp, server: CannedServer) -> list[bytes]:
        bodies = []
        for _ in range(3):
            pair = await asyncio.gather(
                probe.get("/health", max_body_bytes=BIG), probe.get("/metrics", max_body_bytes=BIG)
            )
            bodies += [a.body for a in pair]
        return bodies

    bodies, server = run(slow, rounds)
    assert bodies == [b"/health", b"/metrics"] * 3
    assert server.connections == 2


def test_connection_close_is_honoured() -> None:
    async def twice(probe: ProbeHttp, server: CannedServer) -> None:
        await get(probe, server)
        await get(probe, server)

    _, server = run(lambda p, h: reply(200, b"x", headers={"Connection": "close"}), twice)
    assert server.connections == 2


def test_a_kept_connection_the_server_dropped_is_replaced_once() -> None:
    """The server answers the first request of each connection and drops the second without a
    byte (as a keep-alive timeout racing our request does): the client asks again, once, on a
    new connection, and the caller sees only answers."""
    calls: list[str] = []

    def first_only(path: str, headers: dict[str, str]) -> Reply:
        calls.append(path)
        return reply(200, b"ok") if len(calls) % 2 == 1 else None

    async def three(probe: ProbeHttp, server: CannedServer) -> list[int]:
        return [(await get(probe, server)).status for _ in range(3)]

    statuses, server = run(first_only, three)
    assert statuses == [200, 200, 200]
    assert server.connections == 3
    assert len(server.requests) == 5  # two of them dropped and asked again


def test_a_connection_that_always_drops_is_unreachable_not_a_loop() -> None:
    async def two(probe: ProbeHttp, server: CannedServer) -> BaseException | None:
        await get(probe, server)
        try:
            await get(probe, server)
        except Unreachable as exc:
            return exc
        return None

    calls = []

    def once_then_drop(path: str, headers: dict[str, str]) -> Reply:
        calls.append(path)
        return reply(200) if len(calls) == 1 else None

    failure, server = run(once_then_drop, two)
    assert isinstance(failure, Unreachable)
    assert len(server.requests) == 3  # the first, the dropped one, and its one retry


def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_refused_is_unreachable() -> None:
    async def go() -> None:
        await ProbeHttp(refused_url()).get("/health", max_body_bytes=BIG)

    with pytest.raises(Unreachable, match="ConnectionRefusedError"):
        asyncio.run(go())


@pytest.mark.parametrize(
    ("raw", "error", "match"),
    [
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", BadAnswer, "status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", BadAnswer, "malformed"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", BadAnswer, "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", BadAnswer, "chunk size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2000000\r\n\r\n", TooLarge, "2000000"),
        (reply(200, b"y" * (BIG + 1), chunked=True), TooLarge, "over"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part", Unreachable, "closed before"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", BadAnswer, "oversized"),
    ],
)
def test_each_bad_answer_is_its_error(raw: bytes, error: type[Exception], match: str) -> None:
    failure = asyncio.run(_partial(raw))
    assert isinstance(failure, error), failure
    assert match in str(failure)


async def _partial(raw: bytes) -> Exception | None:
    """A server that sends part of an answer, then closes the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(raw)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        probe = ProbeHttp(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            await probe.get("/metrics", max_body_bytes=BIG)
        except Exception as exc:
            return exc
        return None
    finally:
        server.close()
        await server.wait_closed()


def test_a_cancelled_request_closes_its_connection() -> None:
    async def never(path: str, headers: dict[str, str]) -> Reply:
        await asyncio.sleep(30)
        return None

    async def cancelled(probe: ProbeHttp, server: CannedServer) -> int:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await get(probe, server)
        return len(probe._idle)

    idle, _ = run(never, cancelled)
    assert idle == 0


def test_only_plain_http_addresses() -> None:
    with pytest.raises(ValueError, match="plain http"):
        ProbeHttp("https://engine:8000")
