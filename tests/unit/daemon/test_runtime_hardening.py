"""Issue 17, runtime part: the daemon's own trouble never takes engines down.

Each test here failed before its fix (docs/reliability.md, "Runtime: probes, listeners and
resources"). Tiers: unit (parsing and caps), real sockets (asyncio servers, real TCP and Unix
clients, a fake engine that floods or drips), and the runner loop on virtual time with a sweep
that raises. Timings are never asserted tightly: outcomes are, with generous bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmsupervisor import control, process
from llmsupervisor.admission import SILENT_GRACE_S
from llmsupervisor.core.state import EngineState
from llmsupervisor.http_api import HttpApi, text
from llmsupervisor.probes import PROBE_ERRORS, ProbeFailure, vllm_metrics
from llmsupervisor.probes.host import GroupSweeper, ProcSample, RawProcess
from llmsupervisor.probes.probe_http import ProbeHttp
from llmsupervisor.probes.vllm_metrics import EngineMetrics, fetch_metrics, parse_metrics
from tests.lib.canned_http import canned_server, reply, serving
from tests.lib.paths import FIXTURES, REPO
from tests.lib.runner_harness import Harness, ready_as, spec
from tests.lib.runner_harness import run as run_virtual_test

OUTER_DEADLINE_S = 30.0  # each scenario's own bound; far above what any of them needs


def run(scenario: Any) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(OUTER_DEADLINE_S):
            return await scenario()

    return asyncio.run(bounded())


@pytest.fixture(autouse=True)
def _fresh_probe_errors() -> None:
    PROBE_ERRORS.reset()


# ---- the shared process sweep: an exception is a probe failure, never a stopped engine ----


def emfile_lister(pgids: Collection[int]) -> dict[int, list[RawProcess]]:
    raise OSError(errno.EMFILE, "Too many open files")


def test_a_sweep_that_runs_out_of_descriptors_raises_to_every_asker_and_counts_nothing_itself() -> None:
    # The probe keeps no catch-all of its own: the round's one guard counts it (below), so the
    # same failure has one name wherever it raised (issue 22, E6).
    async def scenario() -> list[BaseException]:
        sweeper = GroupSweeper(max_age_s=0, monotonic=time.monotonic, list_groups=emfile_lister)
        got: list[BaseException] = []
        for _ in range(3):
            with pytest.raises(OSError) as raised:
                await sweeper.sample(123, timeout_s=5.0)
            got.append(raised.value)
        return got

    errors = run(scenario)
    assert [e.errno for e in errors if isinstance(e, OSError)] == [errno.EMFILE] * 3
    assert PROBE_ERRORS.totals() == {}


class RaisingSweeper:
    """What the shared sweeper does when /proc cannot be opened: raise, to the round's guard."""

    def __init__(self) -> None:
        self.calls = 0

    async def sample(
        self, pgid: int, *, timeout_s: float, fresh_after_s: float | None = None
    ) -> ProcSample | ProbeFailure:
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")


def test_an_engine_stays_ready_while_every_process_sweep_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec())
        # Raises as the shared sweep does (the test above), on virtual time (no thread).
        h.runner._sweeper = RaisingSweeper()
        await h.until(ready_as(1))
        # 50 rounds (tick 2 s): every one of them had its sweep raise.
        await h.until(lambda s: s.rounds_total >= 50)
        assert h.status.state is EngineState.READY
        assert h.status.incarnation is not None and h.status.incarnation.number == 1
        assert h.status.restarts_total == 0
        assert EngineState.STOPPING not in h.states
        await h.close()

    with caplog.at_level(logging.WARNING):
        run_virtual_test(scenario)
    # One name for one failure, wherever in the probe it raised (issue 22, E6: it was counted
    # as "proc_sweep" from the shared sweep and as "proc" from the call).
    totals = PROBE_ERRORS.totals()
    assert set(totals) == {("proc_sweep", "EMFILE")} and totals[("proc_sweep", "EMFILE")] >= 50
    loud = [r for r in caplog.records if "file descriptors" in r.getMessage()]
    assert len(loud) == 1, [r.getMessage() for r in caplog.records]  # once in a while, not per round


# ---- the daemon's own descriptor limit ----


def test_the_soft_descriptor_limit_is_raised_to_the_hard_limit() -> None:
    """In a child process (a limit is process-wide): soft 64 -> the hard limit."""
    code = (
        "import resource\n"
        "from llmsupervisor import process\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "before, after = process.raise_nofile_limit()\n"
        "print(before, after, hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout.split()
    before, after, hard, now = (int(x) for x in out)
    assert before == 64
    assert after == now == min(hard, process.NOFILE_CEILING)


def test_raising_the_limit_never_fails() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        before, after = process.raise_nofile_limit()
        assert before == soft
        assert after >= soft
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---- the HTTP listener: idle and slow clients must not starve readiness checks ----


async def idle_tcp(port: int, count: int, *, partial: bytes = b"") -> list[socket.socket]:
    """``count`` connections that send ``partial`` (nothing by default) and then sit idle."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        if partial:
            s.sendall(partial)
        socks.append(s)
        await asyncio.sleep(0)  # let the server accept it
    await asyncio.sleep(0.05)
    return socks


@pytest.mark.parametrize(
    "partial",
    [pytest.param(b"", id="silent"), pytest.param(b"GET /readyz HTTP/1.1\r\nHost: x\r\n", id="slowloris")],
)
def test_idle_connections_past_the_cap_do_not_starve_readiness_checks(partial: bytes) -> None:
    async def scenario() -> None:
        api = HttpApi({"/readyz": lambda: text("ready\n")})  # the daemon's defaults: 64, 5 s
        await api.start("127.0.0.1", 0)
        socks = await idle_tcp(api.port, 3 * 64, partial=partial)
        # Idle is "no request within the grace": a younger connection may be one whose request
        # is on its way, and is not pushed out (issue 28).
        await asyncio.sleep(SILENT_GRACE_S)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api.port}", timeout=5.0) as client:
                for _ in range(10):  # a load balancer's checks, one after another
                    r = await client.get("/readyz")
                    assert r.status_code == 200, r.text
        finally:
            for s in socks:
                s.close()
            await api.close()

    run(scenario)


def test_connections_busy_in_a_handler_still_get_503_past_the_cap() -> None:
    """Only connections that have not sent a request can be pushed out; work in progress is not."""
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> Any:
        entered.set()
        await release.wait()
        return text("released")

    async def scenario() -> None:
        api = HttpApi({"/hold": hold, "/readyz": lambda: text("ready\n")}, max_connections=1)
        await api.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api.port}", timeout=5.0) as client:
                held = asyncio.create_task(client.get("/hold"))
                await entered.wait()
                assert (await client.get("/readyz")).status_code == 503
                release.set()
                assert (await held).status_code == 200
        finally:
            await api.close()

    run(scenario)


# ---- the control socket: bounded connections, idle timeout, clear errors ----


@contextlib.asynccontextmanager
async def control_server(tmp_path: Path, **kwargs: Any) -> AsyncIterator[control.ControlServer]:
    async def handler(request: dict[str, Any]) -> Any:
        return {"echo": request["command"]}

    server = control.ControlServer(tmp_path / "control.sock", handler, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def ask(path: Path, payload: bytes) -> dict[str, Any]:
    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 20)
    try:
        writer.write(payload)
        await writer.drain()
        reply: dict[str, Any] = json.loads(await reader.readline())
        return reply
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000 + b"\n", id="deeply-nested-list"),
        pytest.param(b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"\n", id="deeply-nested-object"),
        pytest.param(b"{not json\n", id="malformed"),
        pytest.param(b"\xff\xfe\n", id="not-utf8"),
        pytest.param(b'{"command": "restart", "engine": ["x"]}\n', id="engine-not-a-string"),
        pytest.param(b'{"command": {"nested": 1}}\n', id="command-not-a-string"),
    ],
)
def test_bad_control_requests_get_a_clear_error_not_internal_error(tmp_path: Path, payload: bytes) -> None:
    async def scenario() -> dict[str, Any]:
        async with control_server(tmp_path, read_limit_bytes=1 << 20) as server:
            reply = await ask(server.path, payload)
            # ... and the server still answers the next client.
            assert await ask(server.path, b'{"command": "status"}\n') == {
                "ok": True,
                "result": {"echo": "status"},
            }
            return reply

    reply = run(scenario)
    assert reply["ok"] is False
    assert "internal error" not in reply["error"]
    assert reply["error"].startswith(("bad request", "unknown command", "restart needs")), reply


def test_an_oversized_control_request_gets_a_clear_error(tmp_path: Path) -> None:
    async def scenario() -> dict[str, Any]:
        async with control_server(tmp_path) as server:
            return await ask(server.path, b'{"command": "' + b"x" * (1 << 20) + b'"}\n')

    reply = run(scenario)
    assert reply["ok"] is False
    assert reply["error"].startswith("bad request"), reply


def test_an_idle_control_connection_times_out(tmp_path: Path) -> None:
    async def scenario() -> bytes:
        async with control_server(tmp_path, idle_timeout_s=0.2) as server:
            reader, writer = await asyncio.open_unix_connection(str(server.path))
            try:
                async with asyncio.timeout(5.0):  # far past the 0.2 s the server allows
                    return await reader.read()
            finally:
                writer.close()

    reply = json.loads(run(scenario))
    assert reply["ok"] is False
    assert "no request within" in reply["error"]


def test_control_connections_are_bounded_and_idle_ones_make_way(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with control_server(tmp_path, max_connections=8) as server:
            idle = [await asyncio.open_unix_connection(str(server.path)) for _ in range(40)]
            await asyncio.sleep(0.1)
            try:
                # At most 8 are held; the others were closed (each with a short reply), so no
                # number of idle clients can exhaust the daemon's descriptors.
                async with asyncio.timeout(5.0):
                    closed = 0
                    for reader, _ in idle[:32]:
                        await reader.read()
                        closed += 1
                assert closed == 32
                assert server.open_connections <= 8
                # The CLI still gets through.
                assert (await ask(server.path, b'{"command": "status"}\n'))["ok"] is True
            finally:
                for _, writer in idle:
                    writer.close()

    run(scenario)


# ---- /metrics: body cap, parsing off the loop, series caps, absurd histograms ----


@contextlib.asynccontextmanager
async def flooding_server() -> AsyncIterator[str]:
    """Answers 200 with an endless chunked body of valid-looking metric lines, as fast as it can."""
    chunk = b"".join(b'other_metric{i="%d"} 1\n' % i for i in range(2000))
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(framed)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async with serving(handle) as url:
        yield url


def test_a_metrics_body_over_the_cap_is_a_clear_failure_read_no_further() -> None:
    async def scenario() -> tuple[EngineMetrics | ProbeFailure, float]:
        async with flooding_server() as url:
            started = time.monotonic()
            result = await fetch_metrics(ProbeHttp(url), timeout_s=20.0, max_body_bytes=1 << 20)
            return result, time.monotonic() - started

    result, took_s = run(scenario)
    assert isinstance(result, ProbeFailure), result
    assert result.kind == "parse"
    assert "1048576" in result.detail and "bytes" in result.detail
    assert took_s < 10.0  # stopped at the cap, not at the 20 s deadline


def test_a_body_within_the_cap_is_read() -> None:
    text_body = (FIXTURES / "metrics" / "vllm-0.32.0-cpu.txt").read_text()

    async def scenario() -> EngineMetrics | ProbeFailure:
        async with canned_server(lambda p, h: reply(200, text_body.encode())) as server:
            probe = ProbeHttp(server.url)
            try:
                return await fetch_metrics(probe, timeout_s=5.0, max_body_bytes=len(text_body.encode()))
            finally:
                probe.close()

    assert isinstance(run(scenario), EngineMetrics)


def test_a_slow_parse_does_not_block_the_loop_and_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_parse(body: str) -> EngineMetrics | ProbeFailure:
        time.sleep(2.0)  # what a hostile 50 MB body cost on the loop: 29 s
        return ProbeFailure("parse", "slow")

    monkeypatch.setattr(vllm_metrics, "parse_metrics", slow_parse)
    # A body that could be slow: one the loop would not parse itself (too large, or new keys).
    monkeypatch.setattr(vllm_metrics, "parse_familiar", lambda body: None)

    async def scenario() -> tuple[EngineMetrics | ProbeFailure, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        async with canned_server(lambda p, h: reply(200, b"x 1\n")) as server:
            probe = ProbeHttp(server.url)
            result = await fetch_metrics(probe, timeout_s=0.5)
            probe.close()
        ticking.cancel()
        return result, ticks

    result, ticks = run(scenario)
    assert isinstance(result, ProbeFailure) and result.kind == "timeout", result
    assert ticks >= 5  # the loop kept running while the parse did (0 when it ran on the loop)


def _fetch_in(monkeypatch: pytest.MonkeyPatch, body: str) -> tuple[EngineMetrics | ProbeFailure, list[str]]:
    """``fetch_metrics`` of ``body``, and the threads its parse ran in (none: on the loop)."""
    threads: list[str] = []
    real = vllm_metrics.parse_metrics

    def parse_in_thread(text_body: str) -> EngineMetrics | ProbeFailure:
        threads.append(threading.current_thread().name)
        return real(text_body)

    monkeypatch.setattr(vllm_metrics, "parse_metrics", parse_in_thread)

    async def scenario() -> EngineMetrics | ProbeFailure:
        async with canned_server(lambda p, h: reply(200, body.encode())) as server:
            probe = ProbeHttp(server.url)
            try:
                return await fetch_metrics(probe, timeout_s=5.0)
            finally:
                probe.close()

    return run(scenario), threads


def test_a_body_of_keys_seen_before_is_parsed_on_the_loop_like_in_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every scrape of a running vLLM after its first: cheaper than the hop to a thread."""
    body = (FIXTURES / "metrics" / "vllm-0.32.0-cpu.txt").read_text()
    in_thread = parse_metrics(body)  # its keys are seen now
    on_loop, threads = _fetch_in(monkeypatch, body)
    assert threads == [] and on_loop == in_thread
    assert vllm_metrics.parse_familiar(body) == in_thread


def test_a_body_of_new_keys_or_a_large_one_is_parsed_in_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def new_keys(tag: str) -> str:  # series keys no earlier parse has seen
        return "".join(
            f'vllm:num_requests_running{{engine="{i}",pod="{tag}{time.monotonic_ns()}"}} 1\n'
            for i in range(vllm_metrics.INLINE_NEW_KEYS_MAX + 1)
        )

    assert vllm_metrics.parse_familiar(new_keys("a")) is None  # gave up at the key over the cap
    body = new_keys("b")
    result, threads = _fetch_in(monkeypatch, body)
    assert isinstance(result, EngineMetrics)
    assert result.requests_running == vllm_metrics.INLINE_NEW_KEYS_MAX + 1
    assert [t.startswith("metrics-parse") for t in threads] == [True]

    # Its keys seen now, but larger than the loop parses: a thread too.
    padding = "# " + "p" * vllm_metrics.INLINE_PARSE_MAX_BYTES + "\n"
    assert vllm_metrics.parse_familiar(body) is not None
    result, threads = _fetch_in(monkeypatch, body + padding)
    assert isinstance(result, EngineMetrics) and len(threads) == 1


def test_too_many_series_of_a_read_family_is_a_parse_failure() -> None:
    body = "".join(
        f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(vllm_metrics.MAX_SERIES + 1)
    )
    result = parse_metrics(body)
    assert isinstance(result, ProbeFailure) and result.kind == "parse", result
    assert "series" in result.detail


def test_finished_reasons_are_capped_and_their_sum_kept() -> None:
    n = 1000
    body = "".join(f'vllm:request_success_total{{finished_reason="r{i}"}} 2\n' for i in range(n))
    result = parse_metrics(body)
    assert isinstance(result, EngineMetrics)
    assert result.request_success_total_by_reason is not None
    assert len(result.request_success_total_by_reason) <= vllm_metrics.MAX_LABEL_VALUES + 1
    assert result.requests_finished_total == 2 * n


def test_a_histogram_with_too_many_buckets_is_dropped_not_kept() -> None:
    lines = [
        f'vllm:e2e_request_latency_seconds_bucket{{le="{i / 1000}"}} {i}\n'
        for i in range(vllm_metrics.MAX_BUCKETS + 1)
    ]
    result = parse_metrics("".join(lines) + "vllm:num_requests_running 3\n")
    assert isinstance(result, EngineMetrics)
    assert result.e2e_latency_seconds is None
    assert result.requests_running == 3


GOOD_TTFT = (
    'vllm:time_to_first_token_seconds_bucket{le="0.1"} 1\n'
    'vllm:time_to_first_token_seconds_bucket{le="1.0"} 3\n'
    'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 4\n'
    "vllm:time_to_first_token_seconds_count 4\n"
    "vllm:time_to_first_token_seconds_sum 2.5\n"
)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param('vllm:e2e_request_latency_seconds_bucket{le="soon"} 1\n', id="non-numeric-le"),
        pytest.param('vllm:e2e_request_latency_seconds_bucket{le="NaN"} 1\n', id="nan-le"),
        pytest.param('vllm:e2e_request_latency_seconds_bucket{engine="0"} 1\n', id="missing-le"),
        pytest.param('vllm:e2e_request_latency_seconds_bucket{le="1.0"} -5\n', id="negative-count"),
        pytest.param('vllm:e2e_request_latency_seconds_bucket{le="1.0"} NaN\n', id="nan-count"),
        pytest.param(
            'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 5\n'
            'vllm:e2e_request_latency_seconds_bucket{le="2.0"} 3\n',
            id="non-monotonic",
        ),
        pytest.param(
            'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 5\n'
            "vllm:e2e_request_latency_seconds_count -1\n",
            id="negative-total",
        ),
    ],
)
def test_one_absurd_histogram_drops_that_series_not_the_scrape(bad: str) -> None:
    result = parse_metrics(bad + GOOD_TTFT + "vllm:num_requests_running 3\n")
    assert isinstance(result, EngineMetrics), result
    assert result.e2e_latency_seconds is None
    assert result.requests_running == 3
    assert result.ttft_seconds is not None and result.ttft_seconds.count == 4


# ---- the daemon says it is short of descriptors: a metric as well as a log line ----


def test_probe_errors_and_descriptors_are_exported() -> None:
    from llmsupervisor.daemon.exporter import Exporter
    from llmsupervisor.daemon.status import DaemonCounters, Snapshot

    counters = DaemonCounters(probe_errors_total={("proc_sweep", "EMFILE"): 3}, open_fds=1000, fds_limit=1024)
    snap = Snapshot(engines=(), counters=counters)
    rendered = Exporter(lambda: snap).render().decode()
    assert 'llmsupervisor_probe_errors_total{error="EMFILE",probe="proc_sweep"} 3.0' in rendered
    assert "llmsupervisor_open_fds 1000.0" in rendered
    assert "llmsupervisor_max_fds 1024.0" in rendered


def test_the_supervisor_snapshot_carries_probe_errors_and_descriptors() -> None:
    from llmsupervisor.daemon.status import descriptor_usage

    PROBE_ERRORS.record("proc_sweep", OSError(errno.EMFILE, "Too many open files"))
    open_fds, limit = descriptor_usage()
    assert open_fds is not None and open_fds > 0
    assert limit == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert PROBE_ERRORS.totals() == {("proc_sweep", "EMFILE"): 1}
