"""The real thing: the daemon supervising the vLLM CPU build serving a tiny model built here.

One daemon for the module (each vLLM start costs a minute or two on 2 cores), four engines:

    e1, e2     the tiny model: both must reach READY and answer completions; e1 demands an API
               key (api_key_file), which must show in none of the daemon's output
    held       its port is held by a foreign process: waits alone, the foreign process lives
    broken     head_dim 16, which the CPU attention kernel rejects on the first request while
               /health already says 200: the canary keeps it out of READY, it goes FATAL

The tests run in file order against that daemon: kill a worker, SIGKILL an API server,
SIGTERM the daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from llmsupervisor import process
from llmsupervisor.probes.vllm_metrics import EngineMetrics, parse_metrics
from tests.lib.daemon import Daemon, alive, free_port, wait_for
from tests.lib.vllm_env import (
    API_KEY,
    READY_TIMEOUT_S,
    build_model,
    complete,
    vllm_engine,
    vllm_python,
)

pytestmark = pytest.mark.vllm_cpu


def vllm_processes(d: Daemon) -> dict[int, str]:
    """Live VLLM::* processes (EngineCore, Worker) of engines this daemon spawned, by title.

    By session, not by environment marker: setproctitle hides their environment."""
    sessions = d.spawned_sessions()
    found = {}
    for proc in psutil.process_iter():
        try:
            title = " ".join(proc.cmdline())
            if (
                title.startswith("VLLM::")
                and proc.status() != psutil.STATUS_ZOMBIE
                and os.getsid(proc.pid) in sessions
            ):
                found[proc.pid] = title
        except (psutil.Error, ProcessLookupError):
            continue
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    python = vllm_python()
    model = build_model(python, "tiny")
    broken = build_model(python, "tiny-head-dim-16", "--broken")
    tmp = tmp_path_factory.mktemp("vllm")
    home = tmp / "home"
    home.mkdir()
    ports = {name: free_port() for name in ("e1", "e2", "held", "broken")}
    holder = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(ports["held"])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: process.port_holders(ports["held"]), timeout_s=10, what="foreign holder to listen")
    key_file = tmp / "e1.key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    config = {
        "supervisor": {"tick_interval_s": 1.0, "shutdown_timeout_s": 120},
        "engines": [
            vllm_engine("e1", ports["e1"], model, home, api_key_file=str(key_file)),
            vllm_engine("e2", ports["e2"], model, home),
            vllm_engine("held", ports["held"], model, home, max_failures=1),
            vllm_engine("broken", ports["broken"], broken, home, max_failures=1),
        ],
    }
    daemon = Daemon(tmp, config)
    daemon.start()
    try:
        yield {"daemon": daemon, "ports": ports, "holder": holder}
    finally:
        daemon.cleanup()
        holder.kill()
        holder.wait()


def test_two_real_engines_reach_ready_and_answer(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    ports = stack["ports"]
    held = d.wait_reason("held", "waiting for it to be free", timeout_s=60)
    assert held["state"] == "starting"
    assert f"port {ports['held']} is held by pid {stack['holder'].pid}" in held["reason"]
    e1 = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    e2 = d.wait_state("e2", "ready", timeout_s=READY_TIMEOUT_S)
    for port in (ports["e1"], ports["e2"]):
        body = complete(port)
        assert body["choices"][0]["text"] is not None
    # Each engine is its own process group, with vLLM's EngineCore and Worker inside it.
    for engine in (e1, e2):
        titles = [
            " ".join(psutil.Process(p).cmdline()) for p in process.group_members(engine["pid"]) if alive(p)
        ]
        assert any(t.startswith("VLLM::EngineCore") for t in titles), titles
        assert any(t.startswith("VLLM::Worker") for t in titles), titles
    # A foreign port holder fails only its engine and is never killed.
    assert stack["holder"].poll() is None


def test_an_engine_with_an_api_key_is_ready_and_its_probes_are_out_of_the_log(stack: dict[str, Any]) -> None:
    """vLLM started with a key (VLLM_API_KEY from api_key_file) guards /v1/*: READY means the
    supervisor's /v1/models and canary carried it. The key is in none of the daemon's output, and
    vLLM logs no access line for the supervisor's probes (--disable-access-log-for-endpoints,
    which 0.32 has) while a client's requests keep theirs."""
    d: Daemon = stack["daemon"]
    port = stack["ports"]["e1"]
    e1 = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    assert psutil.Process(e1["pid"]).environ()["VLLM_API_KEY"] == API_KEY
    denied = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=60
    )
    assert denied.status_code == 401
    complete(port)
    # uvicorn writes its access line after the response: give the forwarder a moment.
    wait_for(
        lambda: '"POST /v1/completions HTTP/1.1" 200' in d.log(),
        timeout_s=30,
        what="the client's access line",
    )
    log = d.log()
    assert "--disable-access-log-for-endpoints /health,/metrics,/v1/models" in log  # e1's spawn line
    e1_lines = [line for line in log.splitlines() if "[e1]" in line]
    assert any('"POST /v1/completions HTTP/1.1" 401' in line for line in e1_lines)
    for path in ("/health", "/metrics", "/v1/models"):
        assert not any(f'"GET {path} HTTP/1.1"' in line for line in e1_lines), path
    metrics = httpx.get(d.http_url + "/metrics", timeout=10).text
    status_file = (d.state_dir / "status.json").read_text()
    for where, text in {"log": log, "status.json": status_file, "/metrics": metrics}.items():
        assert API_KEY not in text, where
    for pid in [e1["pid"], *process.group_members(e1["pid"])]:
        with contextlib.suppress(psutil.Error):
            assert API_KEY not in " ".join(psutil.Process(pid).cmdline())


def test_ready_but_dead_model_never_enters_ready(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    broken = d.wait_state("broken", "fatal", timeout_s=READY_TIMEOUT_S)
    assert "canary failed" in broken["reason"]
    assert "[broken] STARTING -> READY" not in d.log()
    assert d.engine("e1")["state"] == "ready"


def test_killed_worker_is_restarted_to_ready(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    e1 = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    workers = [
        p
        for p in process.group_members(e1["pid"])
        if alive(p) and " ".join(psutil.Process(p).cmdline()).startswith("VLLM::Worker")
    ]
    assert workers
    os.kill(workers[0], signal.SIGKILL)
    again = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S, restarts=e1["restarts"] + 1)
    assert again["pid"] != e1["pid"]
    assert not alive(e1["pid"])
    complete(stack["ports"]["e1"])


def test_sigkill_of_api_server_leaves_no_orphaned_vllm_process(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    e2 = d.wait_state("e2", "ready", timeout_s=READY_TIMEOUT_S)
    old = {p: t for p, t in vllm_processes(d).items() if os.getpgid(p) == e2["pid"]}
    assert any(t.startswith("VLLM::EngineCore") for t in old.values())
    os.kill(e2["pid"], signal.SIGKILL)  # vLLM leaves EngineCore and Worker running after this
    d.wait_state("e2", "ready", timeout_s=READY_TIMEOUT_S, restarts=e2["restarts"] + 1)
    survivors = {p: t for p, t in old.items() if alive(p)}
    assert survivors == {}, f"orphaned vLLM processes: {survivors}"
    complete(stack["ports"]["e2"])


def _metrics(port: int) -> EngineMetrics:
    parsed = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    assert isinstance(parsed, EngineMetrics), parsed
    return parsed


def test_counters_read_from_the_live_engine_match_the_requests(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    port = stack["ports"]["e2"]
    d.wait_state("e2", "ready", timeout_s=READY_TIMEOUT_S)
    before = _metrics(port)
    bodies = []
    for i in range(4):
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=120,
            json={
                "model": "tiny",
                "prompt": f"request number {i} says hello",
                "max_tokens": 16,
                "ignore_eos": True,
            },
        )
        assert resp.status_code == 200, resp.text
        bodies.append(resp.json()["usage"])
    after = _metrics(port)
    generated = sum(u["completion_tokens"] for u in bodies)
    prompted = sum(u["prompt_tokens"] for u in bodies)
    assert generated == 64
    assert before.generation_tokens_total is not None and after.generation_tokens_total is not None
    assert before.prompt_tokens_total is not None and after.prompt_tokens_total is not None
    # The supervisor's own one-token canaries may land in between; nothing else talks to e2.
    assert 0 <= (after.generation_tokens_total - before.generation_tokens_total) - generated <= 10
    assert 0 <= (after.prompt_tokens_total - before.prompt_tokens_total) - prompted <= 60
    assert after.requests_running == 0 and after.requests_waiting == 0
    assert after.kv_usage_ratio is not None and 0.0 <= after.kv_usage_ratio < 0.01


def test_busy_engine_is_not_called_hung(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    port = stack["ports"]["e2"]
    d.wait_state("e2", "ready", timeout_s=READY_TIMEOUT_S)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=300,
                json={"model": "tiny", "prompt": "keep busy", "max_tokens": 200, "ignore_eos": True},
            )

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        # Long enough for several canary intervals and the idle-hang threshold.
        wait_for(lambda: _metrics(port).requests_running, timeout_s=60, what="requests running")
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            assert "[e2] finding hang" not in d.log()
            time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert "[e2] finding hang" not in d.log()
    assert d.engine("e2")["state"] == "ready"


def test_sigstopped_worker_is_found_hung_while_health_is_200_and_restarted(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    port = stack["ports"]["e1"]
    e1 = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    worker = next(
        p
        for p in process.group_members(e1["pid"])
        if alive(p) and " ".join(psutil.Process(p).cmdline()).startswith("VLLM::Worker")
    )
    seen = len(d.log())  # this hang's finding, not an earlier test's
    os.kill(worker, signal.SIGSTOP)
    try:
        health_codes = []

        def found() -> bool:
            if "[e1] finding hang (critical)" in d.log()[seen:]:
                return True
            health_codes.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code)
            return False

        wait_for(found, timeout_s=60, what="the hang finding", poll_s=0.5)
        # Every /health answer until the hang was found said the engine was fine.
        assert health_codes and set(health_codes) == {200}
        # The policy restarts it at once (no drain: nothing in a frozen engine can finish).
        d.wait_log("[e1] action restart (hang)", timeout_s=30, after=seen)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
    again = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S, restarts=e1["restarts"] + 1)
    assert again["pid"] != e1["pid"] and again["restarts_by_reason"].get("hang") == 1
    assert not alive(worker)
    complete(port)


def test_sigterm_to_daemon_leaves_no_engine_process(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    assert d.stop() == 0
    assert d.engine_processes() == []
    assert vllm_processes(d) == {}
    assert "no engine process left" in d.log()
