"""The real daemon supervising real processes (tests/lib/fake_vllm.py): signals, HTTP, ports, orphans."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from llmsupervisor import process
from llmsupervisor.control import default_socket_path, request
from llmsupervisor.errors import EX_ALREADY_RUNNING
from tests.lib.daemon import FAKE_VLLM, alive, fake_engine, free_port, wait_for

pytestmark = pytest.mark.system


def completion(port: int) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
        timeout=5,
    )


def control(port: int, path: str) -> None:
    """Tell the fake engine to misbehave; it may die before it answers."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"http://127.0.0.1:{port}{path}", timeout=5)


def group_of(pid: int) -> list[int]:
    return [p for p in process.group_members(pid) if alive(p)]


def test_two_engines_ready_then_sigterm_leaves_nothing(daemon_factory):
    p1, p2 = free_port(), free_port()
    d = daemon_factory(
        {"engines": [fake_engine("a", p1, fake_child=True), fake_engine("b", p2, fake_child=True)]}
    )
    d.start()
    a = d.wait_state("a", "ready")
    d.wait_state("b", "ready")
    assert completion(p1).status_code == 200
    assert completion(p2).status_code == 200
    assert len(group_of(a["pid"])) == 2  # API server + its fake EngineCore child
    assert len(d.engine_processes()) == 4
    assert d.stop() == 0
    assert d.engine_processes() == []
    log = d.log()
    assert "[a] READY -> DRAINING: draining: stop requested" in log
    assert "[a] DRAINING -> STOPPING: stop requested" in log
    assert "SIGTERM to the API server" in log
    assert "no engine process left" in log


def test_engine_environment_and_output_forwarding(daemon_factory):
    port = free_port()
    d = daemon_factory({"engines": [fake_engine("envcheck", port, gpus=[], env={"EXTRA": "1"})]})
    os.environ["NOTIFY_SOCKET"] = "/run/fake-notify"  # the child must not inherit it
    try:
        d.start()
    finally:
        del os.environ["NOTIFY_SOCKET"]
    engine = d.wait_state("envcheck", "ready")
    env = psutil.Process(engine["pid"]).environ()
    assert "NOTIFY_SOCKET" not in env
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert env["VLLM_CACHE_ROOT"] == str(d.state_dir.resolve() / "engines" / "envcheck" / "vllm-cache")
    assert env["EXTRA"] == "1"
    assert env[process.MARKER_ENGINE] == "envcheck"
    assert os.getpgid(engine["pid"]) == engine["pid"]  # its own process group
    assert os.getsid(engine["pid"]) == engine["pid"]  # and session
    # Every line of the engine's output is in the daemon's log, tagged with the engine's name.
    d.wait_log("[envcheck] INFO")
    assert "[envcheck] WARNING" in d.log()  # vLLM's own level words map to levels
    assert d.stop() == 0


def test_exit_code_zero_is_a_crash_and_is_restarted(daemon_factory):
    port = free_port()
    d = daemon_factory({"engines": [fake_engine("a", port)]})
    d.start()
    first = d.wait_state("a", "ready")
    control(port, "/fake/crash?code=0")
    again = d.wait_state("a", "ready", restarts=1)
    assert again["pid"] != first["pid"]
    assert "exited with code 0 unexpectedly" in d.log()
    assert completion(port).status_code == 200
    assert d.stop() == 0


def test_health_503_restarts_at_once(daemon_factory):
    port = free_port()
    d = daemon_factory({"engines": [fake_engine("a", port)]})
    d.start()
    d.wait_state("a", "ready")
    control(port, "/fake/die-engine")
    d.wait_state("a", "ready", restarts=1)
    assert "/health 503: engine core is dead" in d.log()
    assert d.stop() == 0


def test_crash_loop_goes_fatal_and_leaves_other_engine_alone(daemon_factory):
    good, bad = free_port(), free_port()
    d = daemon_factory(
        {
            "engines": [
                fake_engine("good", good),
                fake_engine("bad", bad, fake_crash_after_s=0.2, fake_exit_code=1, max_failures=3),
            ]
        }
    )
    d.start()
    steady = d.wait_state("good", "ready")
    fatal = d.wait_state("bad", "fatal")
    assert "3 failures within" in fatal["reason"]
    assert fatal["pid"] is None
    assert d.engine("good")["pid"] == steady["pid"]
    assert d.engine("good")["state"] == "ready"
    assert "[bad] READY -> BACKOFF" in d.log() or "[bad] STARTING -> BACKOFF" in d.log()
    assert completion(good).status_code == 200
    assert d.stop() == 0


def test_ready_but_dead_canary_keeps_engine_out_of_ready(daemon_factory):
    port = free_port()
    d = daemon_factory({"engines": [fake_engine("a", port, fake_refuse_canary=True, max_failures=2)]})
    d.start()
    fatal = d.wait_state("a", "fatal")
    log = d.log()
    assert "canary failed: HTTP 500" in log
    assert "-> READY" not in log
    assert "canary failed" in fatal["reason"]
    assert d.stop() == 0


def test_startup_deadline(daemon_factory):
    port = free_port()
    d = daemon_factory(
        {"engines": [fake_engine("slow", port, fake_startup_delay_s=60, start_timeout_s=1, max_failures=1)]}
    )
    d.start()
    fatal = d.wait_state("slow", "fatal")
    assert "not ready within start_timeout_s=1" in fatal["reason"]
    assert d.engine_processes() == []  # the slow starter was killed, not left loading
    assert d.stop() == 0


def test_sigkill_of_api_server_leaves_no_orphan(daemon_factory):
    port = free_port()
    d = daemon_factory({"engines": [fake_engine("a", port, fake_child=True)]})
    d.start()
    first = d.wait_state("a", "ready")
    members = group_of(first["pid"])
    orphan = next(p for p in members if p != first["pid"])
    os.kill(first["pid"], signal.SIGKILL)
    d.wait_state("a", "ready", restarts=1)
    assert not alive(orphan), "the old EngineCore stand-in outlived its API server"
    assert "killed by SIGKILL" in d.log()
    assert d.stop() == 0


def test_foreign_port_holder_holds_only_that_engine_and_it_starts_once_the_port_is_free(daemon_factory):
    """Issue 38, point 9: a foreign holder is no failure of the engine's (it used to be FATAL
    after max_failures preflights, and stay FATAL once the port was free)."""
    held, free = free_port(), free_port()
    holder = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(held)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: process.port_holders(held), timeout_s=10, what="http.server to listen")
        d = daemon_factory(
            {"engines": [fake_engine("blocked", held, max_failures=2), fake_engine("ok", free)]}
        )
        d.start()
        d.wait_state("ok", "ready")
        waiting = d.wait_reason("blocked", "waiting for it to be free")
        assert waiting["state"] == "starting"
        assert f"port {held} is held by pid {holder.pid}" in waiting["reason"]
        assert "http.server" in waiting["reason"]
        # Past the 2 failures that used to make it FATAL (a look every 1, 2, 4 s).
        time.sleep(8)
        blocked = d.engine("blocked")
        assert blocked["state"] == "starting" and blocked["last_failure"] is None, blocked
        assert holder.poll() is None, "a foreign process must never be killed"
        assert d.engine("ok")["state"] == "ready"
        holder.kill()
        holder.wait()
        d.wait_state("blocked", "ready", timeout_s=60)
        assert d.stop() == 0
    finally:
        holder.kill()
        holder.wait()


def test_leftover_engine_of_ours_on_the_port_is_killed(daemon_factory, tmp_path: Path):
    port = free_port()
    state_dir = (tmp_path / "state").resolve()
    state_dir.mkdir()
    # A leftover: an engine of an earlier run on this state dir, still holding the port.
    env = {
        **os.environ,
        process.MARKER_STATE_DIR: str(state_dir),
        process.MARKER_ENGINE: "a",
        process.MARKER_DAEMON_PID: "999999",
    }
    leftover = subprocess.Popen(
        [sys.executable, str(FAKE_VLLM), "--model", "tiny", "--port", str(port), "--fake-child"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: process.port_holders(port), timeout_s=10, what="leftover to listen")
        leftover_group = group_of(leftover.pid)
        d = daemon_factory({"engines": [fake_engine("a", port)]})
        d.start()
        engine = d.wait_state("a", "ready")
        assert engine["pid"] != leftover.pid
        wait_for(lambda: leftover.poll() is not None, timeout_s=10, what="leftover reaped")
        assert not any(alive(p) for p in leftover_group)
        assert "leftover engine" in d.log()
        assert d.stop() == 0
    finally:
        if leftover.poll() is None:
            leftover.kill()
        leftover.wait()


def test_daemon_sigkill_takes_engines_with_it(daemon_factory):
    """Chosen design: a guard process (own session, reading a pipe only the daemon holds) kills
    the run's engines when the daemon dies, however it dies."""
    p1, p2 = free_port(), free_port()
    d = daemon_factory(
        {"engines": [fake_engine("a", p1, fake_child=True), fake_engine("b", p2, fake_child=True)]}
    )
    d.start()
    d.wait_state("a", "ready")
    d.wait_state("b", "ready")
    assert len(d.engine_processes()) == 4
    d.signal(signal.SIGKILL)
    d.wait_exit()
    wait_for(lambda: not d.engine_processes(), timeout_s=15, what="engines to die with the daemon")
    d.wait_log("is gone; killed")


def test_next_start_cleans_engines_of_a_killed_daemon(daemon_factory):
    """Belt and braces: if the guard was killed too, the next daemon kills the leftovers."""
    port = free_port()
    d = daemon_factory({"engines": [fake_engine("a", port, fake_child=True)]})
    d.start()
    first = d.wait_state("a", "ready")
    guard = next(
        p for p in psutil.Process(d.pid).children() if "llmsupervisor.daemon.guard" in " ".join(p.cmdline())
    )
    guard.kill()
    d.signal(signal.SIGKILL)
    d.wait_exit()
    old = group_of(first["pid"])
    assert old, "engines should still run: nothing supervises them now"
    d2 = daemon_factory({"engines": [fake_engine("a", port, fake_child=True)]}, name="daemon2")
    d2.start()
    d2.wait_state("a", "ready")
    assert not any(alive(p) for p in old)
    assert "leftover engine process(es) of an earlier run" in d2.log()
    assert d2.stop() == 0


def test_second_daemon_on_the_same_state_dir_exits_and_touches_nothing(daemon_factory):
    """An operator types plain ``llm-supervisor`` (``run`` is the default) while the service runs:
    the second daemon must exit at once with 75, naming the running one, before it sweeps
    "leftovers" (the running daemon's engines), binds the control socket or starts engines."""
    port = free_port()
    d = daemon_factory({"engines": [fake_engine("a", port, fake_child=True)]})
    d.start()
    first = d.wait_state("a", "ready")
    group = group_of(first["pid"])
    assert len(group) == 2
    socket_path = default_socket_path(d.state_dir.resolve())
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSUPERVISOR_")}
    second = subprocess.Popen(
        [sys.executable, "-m", "llmsupervisor", "--config", str(d.config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = second.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        second.terminate()
        out, err = second.communicate(timeout=60)
        pytest.fail(f"the second daemon did not exit at once; it ran until SIGTERM:\n{err[-3000:]}")
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert second.returncode == EX_ALREADY_RUNNING, err
    assert (
        f"llm-supervisor: another daemon (pid {d.pid}) is running on state dir {d.state_dir.resolve()};"
        f" not starting (exit {EX_ALREADY_RUNNING})"
    ) in err
    assert "leftover" not in err + out
    # The running daemon lost nothing: same engine processes, still serving, socket answering.
    assert d.proc is not None and d.proc.poll() is None
    assert all(alive(p) for p in group), "the second daemon killed the running daemon's engine"
    assert completion(port).status_code == 200
    engine = d.engine("a")
    assert engine["state"] == "ready" and engine["pid"] == first["pid"] and engine["restarts"] == 0
    reply = request(socket_path, {"command": "status"})
    assert reply["ok"] and reply["result"]["engines"]["a"]["pid"] == first["pid"]
    assert "leftover" not in d.log()
    assert (d.state_dir / "daemon.lock").read_text().strip() == str(d.pid)
    assert d.stop() == 0
    assert d.engine_processes() == []


def test_engine_ignoring_sigterm_is_escalated(daemon_factory):
    port = free_port()
    d = daemon_factory(
        {
            "engines": [
                fake_engine(
                    "stubborn",
                    port,
                    fake_ignore_sigterm=True,
                    fake_child=True,
                    stop_timeout_s=1,
                    group_term_timeout_s=1,
                )
            ]
        }
    )
    d.start()
    d.wait_state("stubborn", "ready")
    assert d.stop() == 0
    log = d.log()
    assert "SIGTERM to the API server" in log
    assert "SIGKILL to the process group" in log
    assert d.engine_processes() == []


def test_second_sigint_skips_the_drain(daemon_factory):
    port = free_port()
    # A stop ladder that would take ten minutes if nobody hurried it.
    d = daemon_factory(
        {
            "engines": [
                fake_engine(
                    "stubborn", port, fake_ignore_sigterm=True, stop_timeout_s=600, group_term_timeout_s=600
                )
            ]
        }
    )
    d.start()
    d.wait_state("stubborn", "ready")
    d.signal(signal.SIGINT)
    d.wait_state("stubborn", "stopping")
    d.signal(signal.SIGINT)
    assert d.wait_exit(timeout_s=60) == 0
    assert "second interrupt" in d.log()
    assert d.engine_processes() == []


def test_invalid_config_exits_78(daemon_factory):
    d = daemon_factory({"engines": [{"name": "a", "model": "tiny", "port": "nope"}]})
    d.start()
    assert d.wait_exit() == 78
    assert "engines[0].port: must be an integer" in d.log()


def test_operator_time_is_not_spent_in_backoff_after_stop(daemon_factory):
    """SIGTERM during a long backoff stops at once."""
    port = free_port()
    d = daemon_factory(
        {
            "engines": [
                fake_engine("a", port, fake_crash_after_s=0.1, backoff_initial_s=600, backoff_max_s=600)
            ]
        }
    )
    d.start()
    d.wait_state("a", "backoff")
    started = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - started < 300  # far below the 600 s backoff: the wait was interrupted
    assert "BACKOFF -> STOPPED" in d.log()


def test_hang_is_found_while_health_says_200(daemon_factory):
    port = free_port()
    # Report-only: this test is about the finding; the restart that follows it by default
    # (test_actions.py) would race the /health and status checks below.
    engine = fake_engine("a", port, canary_interval_s=0.5, live_canary_timeout_s=1, automatic_actions=False)
    d = daemon_factory({"engines": [engine]})
    d.start()
    d.wait_state("a", "ready")
    control(port, "/fake/hang")
    d.wait_log("[a] finding hang (critical)", timeout_s=40)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    wait_for(lambda: [f["kind"] for f in d.engine("a")["findings"]] == ["hang"], timeout_s=10, what="status")
    metrics = httpx.get(d.http_url + "/metrics", timeout=5).text
    assert 'llmsupervisor_finding_active{engine="a",finding="hang",severity="critical"} 1.0' in metrics
    # Logged once, not every tick.
    assert d.log().count("finding hang (critical)") == 1
    assert d.stop() == 0


def test_sigstopped_engine_core_is_found_hung_by_its_process_state(daemon_factory):
    """The fake's EngineCore child frozen with SIGSTOP: the API server (the fake itself) still
    answers /health and every canary, so only /proc can tell; the process sweep sees it stopped."""
    port = free_port()
    engine = fake_engine("a", port, fake_child=True, automatic_actions=False)
    d = daemon_factory({"engines": [engine]})
    d.start()
    e = d.wait_state("a", "ready")
    core = next(p for p in group_of(e["pid"]) if "fake-enginecore" in " ".join(psutil.Process(p).cmdline()))
    os.kill(core, signal.SIGSTOP)
    try:
        d.wait_log("[a] finding hang (critical)", timeout_s=30)
        line = next(x for x in d.log().splitlines() if "[a] finding hang (critical)" in x)
        assert "rule stopped" in line and f"stopped pid {core}" in line, line
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert completion(port).status_code == 200
    finally:
        os.kill(core, signal.SIGCONT)
    # Running again: the finding clears after clear_s (30 s), not asserted here.
    assert d.stop() == 0
