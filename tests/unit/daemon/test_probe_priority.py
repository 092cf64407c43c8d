"""Issue 38, point 1: a rotating slowloris must not take engines out of a balancer's rotation.

The listener holds 64 connections and pushes out the oldest whose request has not arrived within
the silent grace (admission.py). An attacker that closes and opens each of its partial requests
every 0.35 s is never that old: before the fix, `/engines/NAME/ready` answered 200 in 0 of 60
checks and `/healthz` 3 of 10. The daemon's own routes (daemon/endpoints.py) on a real loopback
socket; the attacker is its own process (tests/lib/slowloris.py), the balancer checks one after
another with a generous 5 s timeout each. Every check must be answered 200; the figures (answered,
latency) are printed for docs/reliability.md (`pytest -s`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest

from llmsupervisor.daemon.endpoints import http_api, is_probe
from llmsupervisor.http_api import HttpApi, Response, text
from tests.lib.slowloris import ATTACKS, Check, assert_all_answered, balancer, rotating_slowloris
from tests.lib.sockets import descriptors
from tests.lib.statuses import status

ROUNDS = 20
PATHS = ("/engines/e1/ready", "/healthz")


@pytest.fixture(autouse=True)
def _descriptors() -> Iterator[None]:
    with descriptors(4096):
        yield


class NoExporter:
    content_type = "text/plain"

    def render(self) -> bytes:
        return b""


@pytest.mark.parametrize(("count", "partial"), [pytest.param(c, p, id=i) for i, c, p in ATTACKS])
def test_balancer_checks_are_answered_under_a_rotating_slowloris(count: int, partial: bytes) -> None:
    engines = (status("e1"),)

    async def scenario() -> dict[str, list[Check]]:
        api = http_api(
            exporter=NoExporter(),  # type: ignore[arg-type]
            statuses=lambda: engines,
            last_tick_age_s=lambda: 0.5,
            tick_limit_s=lambda: 10.0,
        )
        await api.start("127.0.0.1", 0)
        try:
            with rotating_slowloris("127.0.0.1", api.port, count, partial=partial):
                await asyncio.sleep(1.0)  # the attack in full swing: every connection rotated
                checks = await asyncio.to_thread(balancer, "127.0.0.1", api.port, PATHS, ROUNDS)
            # The attacker's last connections, still in the listen queue, taken and ended before
            # the close (one taken as the loop ends would never be closed: a ResourceWarning).
            await asyncio.sleep(1.0)
            return checks
        finally:
            await api.close()

    checks = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert_all_answered(checks, f"slowloris {count} ({partial[:20]!r})")


# ---- the rules, one at a time: the cap (1 here) held by a request in its handler ----


async def read_all(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(10):
        return await reader.read()


def held_cap(scenario: Callable[[int], Awaitable[None]], *, probe_reserve: int = 4) -> None:
    """An HttpApi with a cap of 1, held by a request whose handler waits, and probes
    ``/healthz`` (plain) and ``/slow`` (a coroutine); ``scenario(port)`` runs past the cap."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def hold() -> Response:
        entered.set()
        await release.wait()
        return text("released")

    async def slow() -> Response:
        await asyncio.sleep(0.01)
        return text("slow probe")

    async def main() -> None:
        api = HttpApi(
            {"/hold": hold, "/healthz": lambda: text("ok\n"), "/metrics": lambda: text("m"), "/slow": slow},
            max_connections=1,
            probe=lambda path: path in ("/healthz", "/slow"),
            probe_reserve=probe_reserve,
        )
        await api.start("127.0.0.1", 0)
        holder_r, holder_w = await asyncio.open_connection("127.0.0.1", api.port)
        try:
            holder_w.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(10):
                await entered.wait()
            await scenario(api.port)
        finally:
            release.set()
            assert (await read_all(holder_r)).endswith(b"released")
            holder_w.close()
            await api.close()

    asyncio.run(asyncio.wait_for(main(), 60))


async def exchange(port: int, data: bytes, *, pause_s: float = 0.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if pause_s:
            await asyncio.sleep(pause_s)  # connected, silent: its line comes later
        writer.write(data)
        return await read_all(reader)
    finally:
        writer.close()


def test_past_the_cap_a_probe_is_answered_on_its_request_line_alone() -> None:
    async def scenario(port: int) -> None:
        answer = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Never-Ends: ")
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"ok\n")
        head = await exchange(port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
        # A coroutine probe too; and a line that comes after the connection, in the reserve.
        assert (await exchange(port, b"GET /slow HTTP/1.0\r\n\r\n")).endswith(b"slow probe")
        late = await exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n", pause_s=0.2)
        assert late.startswith(b"HTTP/1.1 200 OK")

    held_cap(scenario)


def test_past_the_cap_anything_else_is_busy() -> None:
    async def scenario(port: int) -> None:
        for request in (
            b"GET /metrics HTTP/1.1\r\n\r\n",  # not a probe
            b"POST /healthz HTTP/1.1\r\n\r\n",  # not how a probe is asked
            b"GET /healthz HTTP/9\r\n\r\n",  # not a request line
        ):
            answer = await exchange(port, request)
            assert answer.startswith(b"HTTP/1.1 503 "), (request, answer)
            assert b"too many connections" in answer
        late = await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n", pause_s=0.2)  # in the reserve
        assert late.startswith(b"HTTP/1.1 503 ")

    held_cap(scenario)


def test_a_full_reserve_pushes_out_its_oldest_silent_one_never_a_waiting_probe() -> None:
    async def scenario(port: int) -> None:
        silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.1)  # in the reserve (of 1), its line not there
        # A newcomer whose line is not there either takes its place: the older one is answered
        # busy, and closed the lingering way, so a request it sends now meets no reset.
        newer = asyncio.create_task(exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n", pause_s=0.2))
        await asyncio.sleep(0.1)
        silent_w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_all(silent_r)).startswith(b"HTTP/1.1 503 ")
        silent_w.close()
        assert (await newer).startswith(b"HTTP/1.1 200 OK")

    held_cap(scenario, probe_reserve=1)


def test_without_probes_a_listener_keeps_no_reserve() -> None:
    async def scenario() -> None:
        entered, release = asyncio.Event(), asyncio.Event()

        async def hold() -> Response:
            entered.set()
            await release.wait()
            return text("released")

        api = HttpApi({"/hold": hold, "/healthz": lambda: text("ok\n")}, max_connections=1)
        await api.start("127.0.0.1", 0)
        _, holder_w = await asyncio.open_connection("127.0.0.1", api.port)
        try:
            holder_w.write(b"GET /hold HTTP/1.1\r\n\r\n")
            await asyncio.wait_for(entered.wait(), 10)
            assert (await exchange(api.port, b"GET /healthz HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 503 ")
        finally:
            release.set()
            holder_w.close()
            await api.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_daemons_probes_are_the_balancers_paths() -> None:
    for path in ("/livez", "/healthz", "/readyz", "/engines/gpu0/ready"):
        assert is_probe(path), path
    for path in ("/metrics", "/status", "/engines/gpu0", "/engines/", "/readyz/x"):
        assert not is_probe(path), path
