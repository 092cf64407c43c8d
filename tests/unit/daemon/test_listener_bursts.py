"""Bursts on the daemon's two listeners: every request sent gets an answer (issue 28, point 1).

Before, a connection counted as idle until its task had *read* its request; in a burst the oldest
accepted connections are not scheduled yet while their requests sit in their buffers, so each
accept past the cap pushed out one of them: 32 of 100 `status` calls got no answer, 161 of 400
`GET /healthz` no status line. Real servers (the daemon's defaults: 64 connections) and real
sockets in one process; each client sends its request at once and reads to the end. An answer is
200 or 503 on HTTP, ``ok`` or ``busy`` on the control socket; a close without one fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import control
from llmsupervisor.http_api import HttpApi, text
from tests.lib.sockets import descriptors

BURSTS = (100, 400, 1000)


@pytest.fixture(autouse=True)
def _descriptors() -> Iterator[None]:
    """A burst of 1,000 holds ~2,000 descriptors here (both ends): raise the soft limit."""
    with descriptors(4096):
        yield


def run(scenario: Any) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(60):
            return await scenario()

    return asyncio.run(bounded())


async def http_get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        return await reader.read()
    except ConnectionError:
        return b""  # a reset: no answer, which the test counts
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.mark.parametrize("burst", BURSTS)
def test_a_burst_of_http_requests_is_answered_every_one(burst: int) -> None:
    async def scenario() -> list[bytes]:
        api = HttpApi({"/healthz": lambda: text("ok\n")})
        await api.start("127.0.0.1", 0)
        try:
            return await asyncio.gather(*(http_get(api.port) for _ in range(burst)))
        finally:
            await api.close()

    answers = run(scenario)
    lines = [a.split(b"\r\n", 1)[0] for a in answers]
    unanswered = [
        line for line in lines if line not in (b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable")
    ]
    assert unanswered == [], f"{len(unanswered)} of {burst} without a status line"
    assert lines.count(b"HTTP/1.1 200 OK") >= 64  # the cap's worth at least is served


async def control_ask(path: Path) -> dict[str, Any] | None:
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(b'{"command": "status"}\n')
        await writer.drain()
        line = await reader.readline()
        return json.loads(line) if line else None
    except ConnectionError:
        return None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.mark.parametrize("burst", BURSTS)
def test_a_burst_of_control_requests_is_answered_every_one(tmp_path: Path, burst: int) -> None:
    async def handler(request: dict[str, Any]) -> Any:
        await asyncio.sleep(0)
        return {"engines": ["a", "b"]}

    async def scenario() -> list[dict[str, Any] | None]:
        server = control.ControlServer(tmp_path / "control.sock", handler)
        await server.start()
        try:
            return await asyncio.gather(*(control_ask(server.path) for _ in range(burst)))
        finally:
            await server.close()

    replies = run(scenario)
    unanswered = [r for r in replies if r is None]
    assert unanswered == [], f"{len(unanswered)} of {burst} closed without an answer"
    for reply in replies:
        assert reply is not None
        assert reply == {"ok": True, "result": {"engines": ["a", "b"]}} or reply.get("busy") is True, reply
    assert sum(1 for r in replies if r and r["ok"]) >= 64


@pytest.mark.parametrize("burst", BURSTS)
def test_a_burst_of_cli_requests_through_the_client_all_get_their_result(tmp_path: Path, burst: int) -> None:
    """The CLI's client retries a "busy" answer and a full backlog: every command is taken."""

    async def handler(request: dict[str, Any]) -> Any:
        return {"engines": ["a", "b"]}

    async def scenario() -> list[Any]:
        server = control.ControlServer(tmp_path / "control.sock", handler)
        await server.start()
        loop = asyncio.get_running_loop()
        try:
            with ThreadPoolExecutor(min(burst, 200)) as pool:
                ask = functools.partial(control.request, server.path, {"command": "status"}, timeout_s=30.0)
                calls = [loop.run_in_executor(pool, ask) for _ in range(burst)]
                return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            await server.close()

    results = run(scenario)
    failures = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
    assert failures == [], f"{len(failures)} of {burst}: {failures[:3]}"
