"""Issue 17 against the real daemon: hostile local clients and a descriptor limit never take
engines down. The daemon runs with two fake engines; its RLIMIT_NOFILE is lowered from outside
(prlimit), then idle clients pile up on its control socket and HTTP listener."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.lib.daemon import Daemon, fake_engine, free_port, wait_for
from tests.lib.paths import REPO

pytestmark = pytest.mark.system

HOLD_S = 3.0  # ten ticks of 0.3 s with the clients held


def two_engines(daemon_factory: Any) -> tuple[Daemon, dict[str, int]]:
    d = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    pids = {name: d.wait_state(name, "ready")["pid"] for name in ("a", "b")}
    wait_for(lambda: _status_code(d.http_url + "/readyz") == 200, timeout_s=10, what="/readyz")
    return d, pids


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def set_soft_limit(pid: int, soft: int) -> None:
    """The soft limit only: lowering the hard one could not be undone without CAP_SYS_RESOURCE."""
    hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (min(soft, hard), hard))


@contextlib.contextmanager
def idle_clients(family: int, address: Any, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections that send nothing. Connecting can succeed in the kernel's backlog
    even when the daemon cannot accept; that is the point."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            deadline = time.monotonic() + 2.0
            while True:
                s = socket.socket(family, socket.SOCK_STREAM)
                s.settimeout(5.0)
                try:
                    s.connect(address)
                    socks.append(s)
                    break
                except OSError:  # the listen backlog is full: give the daemon a moment
                    s.close()
                    if time.monotonic() > deadline:
                        break  # it is not accepting any more; enough are waiting
                    time.sleep(0.01)
        yield socks
    finally:
        for s in socks:
            s.close()


def _status_code(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def cli_status(d: Daemon) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmsupervisor", "--config", str(d.config_path), "status"],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def assert_kept(d: Daemon, pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        engine = d.engine(name)
        assert engine.get("state") == "ready", (name, engine, d.log()[-3000:])
        assert engine.get("pid") == pid, (name, engine)
        assert engine.get("restarts_total", 0) == 0, (name, engine)


def test_the_daemon_raises_its_own_soft_descriptor_limit(daemon_factory: Any) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by the daemon
    try:
        d, _ = two_engines(daemon_factory)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert resource.prlimit(d.pid, resource.RLIMIT_NOFILE)[0] == min(hard, 1 << 20)
    assert d.stop() == 0


def test_1100_idle_control_clients_at_1024_descriptors_leave_engines_serving(daemon_factory: Any) -> None:
    """The issue's case: the default soft limit (1024) and 1,100 idle clients of the control socket."""
    d, pids = two_engines(daemon_factory)
    set_soft_limit(d.pid, 1024)
    with idle_clients(socket.AF_UNIX, str(d.state_dir / "control.sock"), 1100):
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            assert_kept(d, pids)
            time.sleep(0.3)
        assert open_fds(d.pid) < 1024 - 100  # bounded: nowhere near the limit
        status = cli_status(d)  # the CLI still gets through the crowd
        assert status.returncode == 0, status.stderr
    assert_kept(d, pids)
    assert d.stop() == 0


def test_engines_stay_ready_while_the_daemon_is_out_of_descriptors(daemon_factory: Any) -> None:
    """No headroom at all: every probe that needs a descriptor fails with EMFILE for a while.
    That is the daemon's trouble, logged and counted; the engines keep serving."""
    d, pids = two_engines(daemon_factory)
    set_soft_limit(d.pid, open_fds(d.pid) + 10)
    http_host, http_port = d.http_url.removeprefix("http://").rsplit(":", 1)
    with (
        idle_clients(socket.AF_UNIX, str(d.state_dir / "control.sock"), 100),
        idle_clients(socket.AF_INET, (http_host, int(http_port)), 100),
    ):
        wait_for(
            lambda: "out of file descriptors" in d.log(), timeout_s=20, what="the out-of-descriptors log line"
        )
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            assert_kept(d, pids)
            time.sleep(0.3)
    set_soft_limit(d.pid, 4096)
    wait_for(lambda: _status_code(d.http_url + "/readyz") == 200, timeout_s=10, what="/readyz again")
    metrics = httpx.get(d.http_url + "/metrics", timeout=5).text
    assert 'llmsupervisor_probe_errors_total{error="EMFILE"' in metrics, metrics[-2000:]
    assert d.log().count("out of file descriptors") <= 4  # once a minute per probe, not per tick
    assert_kept(d, pids)
    assert d.stop() == 0
