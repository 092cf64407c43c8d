"""HAProxy's agent-check against the daemon's per-engine agent ports, with real HAProxy and two
fake vLLM engines: a drain of one moves the traffic to the other with no failed request, and the
engine comes back on its own when started again; a stopped engine goes to MAINT and back.

HAProxy's own view is read from its stats socket (``show stat``): the server's status (UP,
DRAIN, MAINT, DOWN), its weight and its session count.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lib.daemon import FAST_DETECTORS, Daemon, fake_engine, free_port, wait_for, write_gpu
from tests.lib.haproxy import haproxy, stat
from tests.lib.load import Load

pytestmark = pytest.mark.system

HAPROXY_CFG = """\
global
    maxconn 256
    stats socket {stats_socket} level admin
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    timeout check 2s
    retries 0                       # no retry may hide a failed request from this test
frontend llm
    bind 127.0.0.1:{frontend_port}
    default_backend engines
backend engines
    balance roundrobin
    # A TCP check of vLLM's port, and the supervisor's agent on the engine's agent port.
    default-server check inter 500ms fall 2 rise 1 weight 100
    default-server agent-check agent-inter 200ms agent-addr 127.0.0.1
    server a 127.0.0.1:{a_port} agent-port {a_agent}
    server b 127.0.0.1:{b_port} agent-port {b_agent}
"""


@pytest.fixture
def lb(daemon_factory, tmp_path: Path) -> Iterator[dict[str, Any]]:
    haproxy_bin = haproxy()
    ports = {k: free_port() for k in ("a", "b", "a_agent", "b_agent", "frontend")}
    engines = [
        fake_engine(
            name,
            ports[name],
            agent_port=ports[f"{name}_agent"],
            fake_completion_delay_s=0.2,  # requests are in flight when the drain comes
            drain_grace_s=1,
            drain_timeout_s=10,
        )
        for name in ("a", "b")
    ]
    # a sits on (fake) GPU 0 with a one-step batch-size ladder, for the weight test.
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu, temperature_c=50)
    engines[0].update(
        gpus=[0],
        ladder=[{"max-num-seqs": 4}],
        ladder_calm_s=3600,
        action_cooldown_s=0,
        detectors=FAST_DETECTORS,
    )
    daemon: Daemon = daemon_factory({"engines": engines}, run_args=("--fake-gpu", str(gpu)))
    stats_socket = tmp_path / "haproxy.sock"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(
        HAPROXY_CFG.format(
            stats_socket=stats_socket,
            frontend_port=ports["frontend"],
            a_port=ports["a"],
            b_port=ports["b"],
            a_agent=ports["a_agent"],
            b_agent=ports["b_agent"],
        )
    )
    subprocess.run([haproxy_bin, "-c", "-f", str(cfg)], check=True, capture_output=True)
    daemon.start()
    proxy = subprocess.Popen(
        [haproxy_bin, "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        daemon.wait_state("a", "ready")
        daemon.wait_state("b", "ready")
        wait_for(lambda: stats_socket.exists(), timeout_s=10, what="HAProxy's stats socket")
        yield {"daemon": daemon, "ports": ports, "stats": stats_socket, "gpu": gpu}
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)


def _agent_line(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        return sock.makefile().readline().strip()


def _status_is(stats: Path, server: str, status: str) -> bool:
    """HAProxy says who set it: "DRAIN (agent)", "MAINT (agent)"."""
    return stat(stats)[server]["status"].split(" ")[0] == status


def test_a_drain_moves_traffic_to_the_other_engine_with_no_failed_request(lb: dict[str, Any]) -> None:
    d, ports, stats = lb["daemon"], lb["ports"], lb["stats"]
    assert _agent_line(ports["a_agent"]) == "ready up 100%"
    wait_for(lambda: all(r["status"] == "UP" for r in stat(stats).values()), timeout_s=20, what="both UP")
    assert {r["weight"] for r in stat(stats).values()} == {"100"}  # "up 100%" of weight 100
    url = f"http://127.0.0.1:{ports['frontend']}/v1/completions"
    with Load(url) as load:
        wait_for(lambda: int(stat(stats)["a"]["stot"]) >= 5, timeout_s=20, what="a serving")

        d.cli_ok("drain", "a")
        wait_for(lambda: _status_is(stats, "a", "DRAIN"), timeout_s=10, what="a in DRAIN")
        assert _agent_line(ports["a_agent"]) == "drain"
        # No new session goes to a from here on; b takes them all.
        a_sessions, b_sessions = int(stat(stats)["a"]["stot"]), int(stat(stats)["b"]["stot"])
        wait_for(lambda: int(stat(stats)["b"]["stot"]) >= b_sessions + 20, timeout_s=30, what="b serving")
        assert int(stat(stats)["a"]["stot"]) == a_sessions

        # Started again, a is served again without anyone touching HAProxy ("ready" clears DRAIN).
        d.cli_ok("start", "a")
        wait_for(lambda: _status_is(stats, "a", "UP"), timeout_s=20, what="a UP again")
        wait_for(lambda: int(stat(stats)["a"]["stot"]) > a_sessions, timeout_s=20, what="a serving again")
    assert load.failures == [], load.results
    assert load.results["ok"] >= 40


def test_a_stopped_engine_goes_to_maint_and_comes_back(lb: dict[str, Any]) -> None:
    d, ports, stats = lb["daemon"], lb["ports"], lb["stats"]
    wait_for(lambda: _status_is(stats, "a", "UP"), timeout_s=20, what="a UP")
    d.cli_ok("stop", "a")
    d.wait_state("a", "stopped")
    assert _agent_line(ports["a_agent"]) == "maint"
    wait_for(lambda: _status_is(stats, "a", "MAINT"), timeout_s=10, what="a in MAINT")
    d.cli_ok("start", "a")
    d.wait_state("a", "ready")
    wait_for(lambda: _status_is(stats, "a", "UP"), timeout_s=20, what="a out of MAINT")
    assert _status_is(stats, "b", "UP")
    assert d.stop() == 0


def test_a_stepped_down_engine_gets_a_lower_weight_in_haproxy(lb: dict[str, Any]) -> None:
    d, ports, stats = lb["daemon"], lb["ports"], lb["stats"]
    wait_for(lambda: stat(stats)["a"]["weight"] == "100", timeout_s=20, what="a at weight 100")
    # A thermal throttle: the daemon steps a down its one-step ladder (drained, restarted).
    write_gpu(lb["gpu"], temperature_c=91, clock_event_reasons=["hw_thermal"])
    d.wait_log("action step_down (thermal)", timeout_s=20)
    d.wait_state("a", "ready", timeout_s=30, batch_step=1)
    # Still hot: step 1 of 1 (50 %) and the open thermal finding (x 0.5).
    wait_for(lambda: _agent_line(ports["a_agent"]) == "ready up 25%", timeout_s=20, what="25%")
    wait_for(lambda: stat(stats)["a"]["weight"] == "25", timeout_s=10, what="a at weight 25 in HAProxy")
    # Cooled down: the finding clears, the step stays (ladder_calm_s is an hour).
    write_gpu(lb["gpu"], temperature_c=50)
    wait_for(lambda: _agent_line(ports["a_agent"]) == "ready up 50%", timeout_s=20, what="50%")
    wait_for(lambda: stat(stats)["a"]["weight"] == "50", timeout_s=10, what="a at weight 50 in HAProxy")
    assert _status_is(stats, "a", "UP") and stat(stats)["b"]["weight"] == "100"
    assert d.stop() == 0
