"""Issue 28, point 1, against the real daemon over two fake engines: bursts of 100, 400 and 1,000
concurrent requests on each listener while an engine restarts. Every request gets an answer
(200 or 503 on HTTP; through the CLI's client, which retries "busy", every `status` its result)
and nothing in the status is lost: each answer lists both engines, and the restarted engine is
ready again with one restart more."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from llmsupervisor import control
from tests.lib.daemon import Daemon, fake_engine, free_port
from tests.lib.sockets import descriptors

pytestmark = pytest.mark.system

BURSTS = (100, 400, 1000)


@pytest.fixture(autouse=True)
def _descriptors() -> Iterator[None]:
    """1,000 client sockets here, as many in the daemon (which raises its own soft limit)."""
    with descriptors(4096):
        yield


def two_engines(daemon_factory: Any) -> Daemon:
    d: Daemon = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    for name in ("a", "b"):
        d.wait_state(name, "ready")
    return d


async def http_get(host: str, port: int) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(30):
            return await reader.read()
    except ConnectionError:
        return b""
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def restart(d: Daemon) -> int:
    restarts: int = d.engine("a").get("restarts", 0)
    reply = control.request(d.state_dir / "control.sock", {"command": "restart", "engine": "a"})
    assert reply["ok"], reply
    return restarts


def test_http_bursts_while_an_engine_restarts_are_answered_every_one(daemon_factory: Any) -> None:
    d = two_engines(daemon_factory)
    host, port = d.http_url.removeprefix("http://").rsplit(":", 1)
    for burst in BURSTS:
        before = restart(d)

        async def scenario(n: int = burst) -> list[bytes]:
            return await asyncio.gather(*(http_get(host, int(port)) for _ in range(n)))

        lines = [a.split(b"\r\n", 1)[0] for a in asyncio.run(scenario())]
        answered = (b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable")
        unanswered = [line for line in lines if line not in answered]
        assert unanswered == [], f"{len(unanswered)} of {burst} without a status line: {unanswered[:3]}"
        assert b"HTTP/1.1 200 OK" in lines
        d.wait_state("a", "ready", restarts=before + 1)
    assert d.stop() == 0


def test_control_bursts_while_an_engine_restarts_all_get_the_status(daemon_factory: Any) -> None:
    d = two_engines(daemon_factory)
    ask = functools.partial(
        control.request, d.state_dir / "control.sock", {"command": "status"}, timeout_s=60.0
    )
    for burst in BURSTS:
        before = restart(d)
        with ThreadPoolExecutor(min(burst, 200)) as pool:
            futures = [pool.submit(ask) for _ in range(burst)]
            results: list[Any] = []
            for future in futures:
                try:
                    results.append(future.result())
                except control.ControlError as exc:
                    results.append(exc)
        failures = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        assert failures == [], f"{len(failures)} of {burst}: {failures[:3]}"
        for reply in results:
            assert set(reply["result"]["engines"]) == {"a", "b"}, reply  # nothing in status lost
        d.wait_state("a", "ready", restarts=before + 1)
    assert d.stop() == 0
