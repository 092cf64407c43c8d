"""The daemon's HTTP server on a real loopback socket: routing, methods, and hostile clients.

Each test runs its own event loop (``asyncio.run``) with the server on port 0; deadlines are
short and explicit, so nothing here waits on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from llmsupervisor.http_api import Handler, HttpApi, PrefixHandler, Response, parse_listen, text
from tests.lib.sockets import has_ipv6_loopback

DEADLINE_S = 5.0


@asynccontextmanager
async def serving(
    routes: Mapping[str, Handler],
    prefix_routes: Mapping[str, PrefixHandler] | None = None,
    *,
    host: str = "127.0.0.1",
    **kwargs: Any,
) -> AsyncIterator[tuple[HttpApi, httpx.AsyncClient]]:
    api = HttpApi(routes, prefix_routes, **kwargs)
    await api.start(host, 0)
    netloc = f"[{host}]" if ":" in host else host
    try:
        async with httpx.AsyncClient(base_url=f"http://{netloc}:{api.port}", timeout=DEADLINE_S) as client:
            yield api, client
    finally:
        await api.close()


@pytest.fixture(autouse=True)
def _no_asyncio_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A connection task that dies badly shows up only as an asyncio log record: fail on it."""
    yield
    errors = [r.getMessage() for r in caplog.get_records("call") if r.name == "asyncio"]
    assert errors == []


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(30):
            await scenario()

    asyncio.run(bounded())


async def raw_exchange(port: int, data: bytes, *, close_write: bool = False) -> bytes:
    """Send ``data`` on a plain TCP connection and read the whole answer (the server closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if close_write:
            writer.write_eof()
        async with asyncio.timeout(DEADLINE_S):
            return await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def headers_of(raw: bytes) -> dict[str, str]:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head)}


async def hello_async() -> Response:
    await asyncio.sleep(0)
    return Response(body=b'{"ok": true}', content_type="application/json")


ROUTES: Mapping[str, Handler] = {
    "/": lambda: text("root\n"),
    "/hello": hello_async,
    "/teapot": lambda: Response(status=418, body=b"short and stout"),
}


def test_exact_routes_sync_and_async_handlers() -> None:
    async def scenario() -> None:
        async with serving(ROUTES) as (_, client):
            r = await client.get("/")
            assert (r.status_code, r.text) == (200, "root\n")
            assert r.headers["content-type"] == "text/plain; charset=utf-8"
            assert r.headers["content-length"] == "5"
            assert r.headers["connection"] == "close"
            r = await client.get("/hello?verbose=1")  # the query string does not change the route
            assert r.status_code == 200
            assert r.json() == {"ok": True}
            assert r.headers["content-type"] == "application/json"
            r = await client.get("/teapot")
            assert (r.status_code, r.content) == (418, b"short and stout")

    run(scenario)


def test_prefix_routes_get_the_rest_of_the_path_longest_prefix_first() -> None:
    seen: list[tuple[str, str]] = []

    def engines(rest: str) -> Response:
        seen.append(("engines", rest))
        return text(f"engine path {rest}")

    async def special(rest: str) -> Response:
        seen.append(("special", rest))
        return text("special")

    async def scenario() -> None:
        async with serving(ROUTES, {"/engines/": engines, "/engines/gpu9/": special}) as (_, client):
            r = await client.get("/engines/gpu0/ready")
            assert (r.status_code, r.text) == (200, "engine path gpu0/ready")
            r = await client.get("/engines/gpu9/ready")
            assert r.text == "special"
            r = await client.get("/engines/")
            assert r.text == "engine path "

    run(scenario)
    assert seen == [("engines", "gpu0/ready"), ("special", "ready"), ("engines", "")]


def test_unknown_path_is_404_and_other_methods_are_405() -> None:
    async def scenario() -> None:
        async with serving(ROUTES, {"/engines/": lambda rest: text(rest)}) as (_, client):
            r = await client.get("/nope")
            assert r.status_code == 404
            assert r.headers["content-length"] == str(len(r.content))
            r = await client.get("/engine")  # not under the prefix
            assert r.status_code == 404
            r = await client.post("/", content=b"x" * 1000)
            assert r.status_code == 405
            assert r.headers["allow"] == "GET, HEAD"
            r = await client.delete("/engines/gpu0")
            assert r.status_code == 405

    run(scenario)


def test_head_has_the_get_headers_and_no_body() -> None:
    async def scenario() -> None:
        async with serving(ROUTES) as (api, client):
            r = await client.head("/hello")
            assert r.status_code == 200
            assert r.content == b""
            assert r.headers["content-length"] == str(len(b'{"ok": true}'))
            # On the wire too: nothing after the blank line.
            raw = await raw_exchange(api.port, b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n")
            assert raw.endswith(b"\r\n\r\n")
            assert headers_of(raw)["content-length"] == "12"

    run(scenario)


def test_a_raising_handler_gives_500_is_logged_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> Response:
        raise RuntimeError("handler bug")

    async def broken_async(rest: str) -> Response:
        raise KeyError(rest)

    def not_a_response() -> Response:
        return "oops"  # type: ignore[return-value]

    async def scenario() -> None:
        routes = {**ROUTES, "/broken": broken, "/bad-type": not_a_response}
        async with serving(routes, {"/x/": broken_async}) as (_, client):
            for path in ("/broken", "/x/y", "/bad-type"):
                r = await client.get(path)
                assert r.status_code == 500
                assert "handler bug" not in r.text  # no internals to the client
            r = await client.get("/")
            assert r.status_code == 200

    with caplog.at_level(logging.ERROR, logger="llmsupervisor.http_api"):
        run(scenario)
    messages = [r.getMessage() for r in caplog.records]
    assert "HTTP handler for /broken failed" in messages
    assert "HTTP handler for /x/y failed" in messages
    assert any(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in caplog.records)
    assert any("not a Response" in m for m in messages)


def test_a_handler_past_its_deadline_gives_503() -> None:
    never = asyncio.Event()

    async def stuck() -> Response:
        await never.wait()
        return text("unreachable")

    async def scenario() -> None:
        async with serving({**ROUTES, "/stuck": stuck}, handler_timeout_s=0.05) as (_, client):
            r = await client.get("/stuck")
            assert r.status_code == 503
            assert (await client.get("/")).status_code == 200

    run(scenario)


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"\x00\x01\x02garbage\r\n\r\n", id="binary"),
        pytest.param(b"GET /\r\n\r\n", id="http09"),
        pytest.param(b"GET / HTTP/2.0\r\n\r\n", id="version"),
        pytest.param(b"GET  / HTTP/1.1\r\n\r\n", id="double-space"),
        pytest.param(b"get / HTTP/1.1\r\n\r\n", id="lowercase-method"),
        pytest.param(b"GET foo HTTP/1.1\r\n\r\n", id="relative-target"),
        pytest.param(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", id="header-no-colon"),
        pytest.param(b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", id="space-before-colon"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", id="obs-fold"),
        # urlsplit raises ValueError on these: no answer and a traceback before issue 28.
        pytest.param(b"GET http://[/healthz HTTP/1.1\r\nHost: x\r\n\r\n", id="absolute-form-open-bracket"),
        pytest.param(b"GET http://[::1/healthz HTTP/1.1\r\nHost: x\r\n\r\n", id="absolute-form-ipv6"),
        pytest.param(b"GET https://a]/x HTTP/1.1\r\nHost: x\r\n\r\n", id="absolute-form-stray-bracket"),
    ],
)
def test_malformed_requests_get_400(request_bytes: bytes, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serving(ROUTES) as (api, client):
            raw = await raw_exchange(api.port, request_bytes)
            assert status_of(raw) == 400
            body = raw.split(b"\r\n\r\n", 1)[1]
            assert headers_of(raw)["content-length"] == str(len(body))
            assert json.loads(body)["status"] == 400  # every error is JSON (issue 26)
            assert (await client.get("/")).status_code == 200

    run(scenario)
    # A bad request is the client's mistake: nothing logged as an error, no traceback.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_lenient_but_valid_requests_are_served() -> None:
    async def scenario() -> None:
        async with serving(ROUTES) as (api, _):
            for request in (
                b"GET / HTTP/1.0\r\n\r\n",  # no Host header in HTTP/1.0
                b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a leading empty line is ignored
                b"GET / HTTP/1.1\nHost: x\n\n",  # bare LF line ends
                b"GET http://example.invalid/hello?x=1 HTTP/1.1\r\nHost: x\r\n\r\n",  # absolute-form
            ):
                raw = await raw_exchange(api.port, request)
                assert status_of(raw) == 200, request

    run(scenario)


def test_a_client_that_never_finishes_its_headers_gets_408_without_blocking_others() -> None:
    async def scenario() -> None:
        async with serving(ROUTES, read_timeout_s=0.3) as (api, client):
            reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
            try:
                writer.write(b"GET / HTTP/1.1\r\nHost: slow")
                await writer.drain()
                # While the slow client holds its connection, others are served at once.
                for _ in range(3):
                    assert (await client.get("/")).status_code == 200
                async with asyncio.timeout(DEADLINE_S):
                    raw = await reader.read()
            finally:
                writer.close()
                await writer.wait_closed()
            assert status_of(raw) == 408
            assert (await client.get("/")).status_code == 200

    run(scenario)


def test_a_client_that_sends_nothing_gets_408() -> None:
    async def scenario() -> None:
        async with serving(ROUTES, read_timeout_s=0.2) as (api, _):
            raw = await raw_exchange(api.port, b"")
            assert status_of(raw) == 408

    run(scenario)


def test_a_client_that_hangs_up_mid_request_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serving(ROUTES) as (api, client):
            for partial in (b"", b"GET / HT", b"GET / HTTP/1.1\r\nHost: x\r\n"):
                raw = await raw_exchange(api.port, partial, close_write=True)
                assert raw == b""  # nobody left to answer
            assert (await client.get("/")).status_code == 200

    with caplog.at_level(logging.DEBUG, logger="llmsupervisor.http_api"):
        run(scenario)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_oversized_headers_get_431() -> None:
    async def scenario() -> None:
        async with serving(ROUTES) as (api, client):
            # One header line longer than the whole limit (the reader's limit trips)...
            r = await client.get("/", headers={"X-Big": "a" * 20_000})
            assert r.status_code == 431
            # ...and many small lines that add up past 16 KiB (our own count trips).
            many = {f"X-H{i}": "b" * 100 for i in range(200)}
            r = await client.get("/", headers=many)
            assert r.status_code == 431
            # A long request line counts as well.
            raw = await raw_exchange(api.port, b"GET /" + b"c" * 17_000 + b" HTTP/1.1\r\n\r\n")
            assert status_of(raw) == 431
            # Just under the limit is fine.
            r = await client.get("/", headers={"X-Fits": "d" * 15_000})
            assert r.status_code == 200

    run(scenario)


def test_connections_past_the_limit_get_503_and_close_ends_open_ones() -> None:
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> Response:
        entered.set()
        await release.wait()
        return text("released")

    async def scenario() -> None:
        api = HttpApi({**ROUTES, "/hold": hold}, max_connections=1)
        await api.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{api.port}", timeout=DEADLINE_S
            ) as client:
                held = asyncio.create_task(client.get("/hold"))
                async with asyncio.timeout(DEADLINE_S):
                    await entered.wait()
                r = await client.get("/")
                assert r.status_code == 503
                release.set()
                assert (await held).text == "released"
                assert (await client.get("/")).status_code == 200
                # close() ends a connection whose handler is still running; it does not wait
                # for the handler or the client.
                entered.clear()
                release.clear()
                reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
                try:
                    writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
                    await writer.drain()
                    async with asyncio.timeout(DEADLINE_S):
                        await entered.wait()
                        await api.close()
                        assert await reader.read() == b""
                finally:
                    writer.close()
                    await writer.wait_closed()
        finally:
            await api.close()  # idempotent

    run(scenario)


def test_after_close_the_port_is_released() -> None:
    async def scenario() -> None:
        api = HttpApi(ROUTES)
        await api.start("127.0.0.1", 0)
        port = api.port
        await api.close()
        with pytest.raises(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
        # The same port can be bound again at once.
        again = HttpApi(ROUTES)
        await again.start("127.0.0.1", port)
        try:
            assert again.port == port
        finally:
            await again.close()

    run(scenario)


def test_start_twice_and_port_before_start_are_errors() -> None:
    async def scenario() -> None:
        api = HttpApi(ROUTES)
        with pytest.raises(RuntimeError):
            _ = api.port
        await api.start("127.0.0.1", 0)
        try:
            with pytest.raises(RuntimeError):
                await api.start("127.0.0.1", 0)
        finally:
            await api.close()

    run(scenario)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_serves_on_ipv6_loopback_from_a_bracketed_listen_string() -> None:
    host, port = parse_listen("[::1]:0")

    async def scenario() -> None:
        api = HttpApi(ROUTES)
        await api.start(host, port)
        try:
            assert api.addresses[0][0] == "::1"
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                r = await client.get(f"http://[::1]:{api.port}/")
                assert (r.status_code, r.text) == (200, "root\n")
        finally:
            await api.close()

    run(scenario)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:9400", ("127.0.0.1", 9400)),
        ("localhost:1", ("localhost", 1)),
        ("0.0.0.0:65535", ("0.0.0.0", 65535)),
        ("[::1]:9400", ("::1", 9400)),
        ("[::]:80", ("::", 80)),
        ("[fe80::1%eth0]:9400", ("fe80::1%eth0", 9400)),
        ("::1:9400", ("::1", 9400)),  # unbracketed: the last colon splits, as the config check does
        ("127.0.0.1:0", ("127.0.0.1", 0)),
    ],
)
def test_parse_listen(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen(value) == expected


@pytest.mark.parametrize(
    "value",
    ["", "9400", ":9400", "127.0.0.1", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:65536", "127.0.0.1:-1",
     "[::1]", "[::1]9400", "[::1:9400", "[]:9400", "[::1]]:9400", "127.0.0.1:\uff19\uff14\uff10\uff10"],
)  # fmt: skip
def test_parse_listen_rejects(value: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen(value)


def test_a_client_that_resets_after_the_request_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """Clients that reset the connection (SO_LINGER 0) are leaving, not a server error. HAProxy's
    health checks do this; against real HAProxy the server's shutdown(SHUT_WR) then failed with
    ENOTCONN, logged as an error per check until OSError was treated as the client leaving. This
    loopback test does not hit that exact timing; tests/vllm/test_haproxy_vllm.py does."""

    async def slow(rest: str) -> Response:
        await asyncio.sleep(0.2)  # the reset arrives before the answer is written
        return Response(body=b"ok\n")

    async def scenario() -> None:
        async with serving(ROUTES, {"/slow/": slow}) as (api, client):
            for _ in range(5):
                sock = socket.create_connection(("127.0.0.1", api.port))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.sendall(b"GET /slow/x HTTP/1.1\r\nHost: x\r\n\r\n")
                await asyncio.sleep(0.05)
                sock.close()  # RST
            await asyncio.sleep(0.5)
            assert (await client.get("/")).status_code == 200

    with caplog.at_level(logging.DEBUG, logger="llmsupervisor.http_api"):
        run(scenario)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
