"""vLLM's HTTP checks: each under one overall deadline, each failure classified, none raising."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from llmsupervisor.probes import health
from llmsupervisor.probes.probe_http import ProbeHttp
from tests.lib.canned_http import canned_server, reply, serving

DRIP_INTERVAL_S = 0.2


@contextlib.asynccontextmanager
async def dripping_server() -> AsyncIterator[str]:
    """A server on 127.0.0.1 that answers any request with 200 and its headers at once, then
    drips the body one byte every 0.2 s: every read finishes well within httpx's per-phase
    timeout, and the whole answer takes minutes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.decode().split("\r\n"):
                name, _, value = line.partition(":")
                if name.lower() == "content-length":
                    await reader.readexactly(int(value))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
            while True:
                await writer.drain()
                await asyncio.sleep(DRIP_INTERVAL_S)
                writer.write(b" ")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async with serving(handle) as url:
        yield url


Check = Callable[[str, float], Awaitable[health.HttpCheck]]


async def _health(url: str, timeout_s: float) -> health.HttpCheck:
    probe = ProbeHttp(url)  # /health goes through the probes' own client
    try:
        return await health.check_health(probe, timeout_s=timeout_s)
    finally:
        probe.close()


async def _models(url: str, timeout_s: float) -> health.HttpCheck:
    async with httpx.AsyncClient() as client:
        return await health.check_models(client, url, "m", timeout_s=timeout_s)


async def _canary(url: str, timeout_s: float) -> health.HttpCheck:
    async with httpx.AsyncClient() as client:
        return await health.canary(client, url, "m", prompt="Hello", timeout_s=timeout_s)


CHECKS: dict[str, Check] = {"health": _health, "models": _models, "canary": _canary}


@pytest.mark.parametrize("name", list(CHECKS))
def test_a_body_that_drips_in_is_a_timeout_at_the_overall_deadline(name: str) -> None:
    async def go() -> Any:
        async with dripping_server() as url:
            # The test's own bound is loose: the check's deadline is 0.5 s.
            async with asyncio.timeout(5.0):
                return await CHECKS[name](url, 0.5)

    result = asyncio.run(go())
    assert not result.ok
    assert result.failure == "timeout", result


def refused_url() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def mock(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def completion(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": "!"}]})


HTTPX_CHECKS: dict[str, Callable[[httpx.AsyncClient], Awaitable[health.HttpCheck]]] = {
    "models": lambda client: health.check_models(client, "http://engine", "m", timeout_s=1.0),
    "canary": lambda client: health.canary(client, "http://engine", "m", prompt="Hello", timeout_s=1.0),
}


@pytest.mark.parametrize(
    ("name", "handler", "failure", "status_code"),
    [
        ("models", lambda r: httpx.Response(200, json={"data": [{"id": "m"}]}), None, 200),
        ("models", lambda r: httpx.Response(200, json={"data": [{"id": "other"}]}), "http", 200),
        ("models", lambda r: httpx.Response(200, text="<html>"), "parse", 200),
        ("models", lambda r: httpx.Response(404), "http", 404),
        ("canary", completion, None, 200),
        ("canary", lambda r: httpx.Response(200, json={"choices": []}), "parse", 200),
        ("canary", lambda r: httpx.Response(200, json=[1]), "parse", 200),
        ("canary", lambda r: httpx.Response(500, text="boom"), "http", 500),
    ],
)
def test_each_failure_is_classified(
    name: str, handler: Callable[[httpx.Request], httpx.Response], failure: str | None, status_code: int
) -> None:
    async def go() -> health.HttpCheck:
        async with mock(handler) as client:
            return await HTTPX_CHECKS[name](client)

    result = asyncio.run(go())
    assert (result.ok, result.failure, result.status_code) == (failure is None, failure, status_code), result


@pytest.mark.parametrize(
    ("raw", "failure", "status_code"),
    [
        (reply(200), None, 200),
        (reply(503), "http", 503),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart", "timeout", None),  # never completes
        (b"garbage\r\n\r\n", "http", None),
        (None, "connect", None),  # closed without a byte, twice
    ],
)
def test_each_health_failure_is_classified(
    raw: bytes | None, failure: str | None, status_code: int | None
) -> None:
    async def go() -> health.HttpCheck:
        async with canned_server(lambda p, h: raw) as server:
            return await _health(server.url, 0.5)

    result = asyncio.run(go())
    assert (result.ok, result.failure, result.status_code) == (failure is None, failure, status_code), result


@pytest.mark.parametrize("name", list(CHECKS))
def test_a_refused_connection_is_connect_not_timeout(name: str) -> None:
    async def go() -> health.HttpCheck:
        return await CHECKS[name](refused_url(), 1.0)

    result = asyncio.run(go())
    assert (result.ok, result.failure, result.status_code) == (False, "connect", None), result


def test_a_phase_timeout_is_a_timeout() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no bytes", request=request)

    async def go() -> health.HttpCheck:
        async with mock(slow) as client:
            return await health.check_models(client, "http://engine", "m", timeout_s=1.0)

    result = asyncio.run(go())
    assert (result.failure, result.detail) == ("timeout", "timed out (ReadTimeout)")


def test_ok_and_failure_agree() -> None:
    with pytest.raises(ValueError, match="ok=True with failure='timeout'"):
        health.HttpCheck(ok=True, detail="", latency_s=0.0, failure="timeout")
    with pytest.raises(ValueError, match="ok=False with failure=None"):
        health.HttpCheck(ok=False, detail="", latency_s=0.0)
