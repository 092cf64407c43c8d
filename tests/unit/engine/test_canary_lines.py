"""The canary's access lines are dropped by the address it sent from, users' requests are kept
(issue 26, point 1: at idle, the canary's `POST /v1/completions` lines were all of the journal)."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import httpx
import pytest

from llmsupervisor.config import EngineSpec
from llmsupervisor.engine.http import VllmHttp
from llmsupervisor.engine.output import OutputForwarder, is_own_canary_line
from llmsupervisor.probes.health import OWN_ADDRESS_TTL_S, OwnAddresses
from llmsupervisor.probes.probe_http import ProbeHttp
from tests.lib.canned_http import serving

OURS = ("127.0.0.1", 40312)


def _own(now: float = 100.0) -> OwnAddresses:
    own = OwnAddresses()
    own.note(OURS, now)
    return own


@pytest.mark.parametrize(
    ("line", "dropped"),
    [
        ('INFO:     127.0.0.1:40312 - "POST /v1/completions HTTP/1.1" 200 OK', True),
        ('INFO:     127.0.0.1:40312 - "POST /v1/chat/completions HTTP/1.1" 200 OK', True),
        ('INFO:     127.0.0.1:40312 - "POST /v1/embeddings HTTP/1.1" 200 OK', True),
        (
            '(APIServer pid=7) INFO 11-23 [h.py:1] 127.0.0.1:40312 - "POST /v1/completions HTTP/1.1" 200',
            True,
        ),
        # A user on the same host, another port; a user elsewhere with the same port number.
        ('INFO:     127.0.0.1:40313 - "POST /v1/completions HTTP/1.1" 200 OK', False),
        ('INFO:     10.0.0.9:40312 - "POST /v1/completions HTTP/1.1" 200 OK', False),
        # A failed canary is worth its line; other paths from our address are not the canary.
        ('INFO:     127.0.0.1:40312 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error', False),
        ('INFO:     127.0.0.1:40312 - "POST /reset_prefix_cache HTTP/1.1" 200 OK', False),
        ('INFO:     127.0.0.1:40312 - "GET /v1/completions HTTP/1.1" 405 Method Not Allowed', False),
        ("INFO 11-23 Added request cmpl-1 from 127.0.0.1:40312", False),
    ],
)
def test_only_the_canarys_own_answered_lines_match(line: str, dropped: bool) -> None:
    assert is_own_canary_line(line, _own(), 101.0) is dropped


def test_an_address_is_forgotten_after_its_last_use() -> None:
    line = 'INFO:     127.0.0.1:40312 - "POST /v1/completions HTTP/1.1" 200 OK'
    own = _own(now=0.0)
    assert is_own_canary_line(line, own, OWN_ADDRESS_TTL_S)
    own.note(OURS, 50.0)  # used again: kept alive
    assert is_own_canary_line(line, own, 50.0 + OWN_ADDRESS_TTL_S)
    assert not is_own_canary_line(line, own, 50.0 + OWN_ADDRESS_TTL_S + 1.0)
    for port in range(200):  # bounded, whatever it is fed
        own.note(("127.0.0.1", port), 1000.0)
    assert not own.holds(*OURS, 1000.0)
    own.note("not an address", 1.0)


def test_the_canary_notes_the_address_the_server_saw_on_new_and_kept_alive_connections() -> None:
    """A real server that writes uvicorn's access line (client IP:PORT) before answering: every
    canary's line matches, over a fresh connection and a reused one; a user's does not."""
    lines: list[str] = []
    body = b'{"choices": [{"text": "x"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ip, port = writer.get_extra_info("peername")[:2]
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                method, path = head.split(" ")[:2]
                length = next(
                    (
                        int(h.split(":")[1])
                        for h in head.split("\r\n")
                        if h.lower().startswith("content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                lines.append(f'INFO:     {ip}:{port} - "{method} {path} HTTP/1.1" 200 OK')
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def go() -> OwnAddresses:
        async with serving(handle) as url, httpx.AsyncClient() as client, httpx.AsyncClient() as user:
            port = int(url.rsplit(":", 1)[1])
            spec = EngineSpec(name="a", model="m", gpus=(), port=port, command=("vllm",))
            http = VllmHttp(client, spec, ProbeHttp(spec.base_url))
            assert (await http.canary(timeout_s=5)).ok
            assert (await http.canary(timeout_s=5)).ok  # the kept-alive connection
            await user.post(f"{url}/v1/completions", json={"prompt": "hi"})
            assert http.own_addresses is not None
            return http.own_addresses

    own = asyncio.run(go())
    assert len(lines) == 3 and lines[0] == lines[1]  # the second canary reused the connection
    assert [is_own_canary_line(line, own, time.monotonic()) for line in lines] == [True, True, False]


def test_the_forwarder_drops_the_canary_lines_and_keeps_the_users(caplog: pytest.LogCaptureFixture) -> None:
    own = OwnAddresses()
    own.note(OURS, time.monotonic())
    written = [
        'INFO:     127.0.0.1:40312 - "POST /v1/completions HTTP/1.1" 200 OK',
        'INFO:     127.0.0.1:40999 - "POST /v1/completions HTTP/1.1" 200 OK',
        'INFO:     127.0.0.1:40312 - "GET /health HTTP/1.1" 200 OK',
    ]

    async def go() -> int:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        forwarder = OutputForwarder("a", 1, (out_r, err_r), lambda _seen: None, own=own)
        os.write(out_w, "".join(line + "\n" for line in written).encode())
        os.close(out_w)
        os.close(err_w)
        await forwarder.close()
        return forwarder.dropped_probe_lines

    with caplog.at_level(logging.INFO, logger="llmsupervisor.engine.output"):
        dropped = asyncio.run(go())
    assert dropped == 2
    assert [r.getMessage() for r in caplog.records] == [written[1]]


def test_the_stats_line_of_an_engine_with_nothing_running_is_thinned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Measured on the real engine: the canary's tokens keep vLLM's 10 s stats line at INFO, six
    lines a minute of nothing. Idle ones go out once per STATS_IDLE_EVERY_S; busy ones always."""
    stats = "(APIServer pid=7) INFO 11-26 [loggers.py:335] Engine 000: Avg prompt throughput: 1.2 tokens/s, "
    idle = stats + "Avg generation throughput: 0.3 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV 0.0%"
    busy = stats + "Avg generation throughput: 9.0 tokens/s, Running: 2 reqs, Waiting: 0 reqs, KV 0.1%"

    async def go() -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        forwarder = OutputForwarder("a", 1, (out_r, err_r), lambda _seen: None, own=OwnAddresses())
        os.write(out_w, "".join(line + "\n" for line in (idle, idle, busy, busy, idle)).encode())
        os.close(out_w)
        os.close(err_w)
        await forwarder.close()

    with caplog.at_level(logging.INFO, logger="llmsupervisor.engine.output"):
        asyncio.run(go())
    assert [r.getMessage() for r in caplog.records] == [idle, busy, busy]


def test_a_connection_the_engine_closed_does_not_lose_the_canarys_answer() -> None:
    """A crashing engine answers and closes: getsockname on that socket raises EBADF. That must
    not escape the canary (it killed the runner task: "runner task died: OSError(9, ...)")."""
    from llmsupervisor.probes.health import _note_stream

    class Closed:
        def get_extra_info(self, name: str) -> object:
            raise OSError(9, "Bad file descriptor")

    own = OwnAddresses()
    _note_stream(own, Closed())  # no exception
    _note_stream(own, None)
