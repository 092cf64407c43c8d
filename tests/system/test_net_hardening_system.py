"""Issue 38, points 1, 5, 8, 10 against the real daemon over fake engines (point 9's system test
is in test_system_fake.py, beside the foreign holder it changed).

Each test failed before its fix: a rotating slowloris of 64 or 256 connections took an engine
out of a balancer's rotation (1); a listener on ``[::1]`` only kept an engine on 127.0.0.1 from
ever starting (10); a removed control socket never came back, the CLI said "not running"
meanwhile, and the daemon's exit removed an impostor's socket (8); `logs NAME` after long lines
made a reply of tens of megabytes (5: 20.7 MB here for 400 lines of 100 KiB).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import control
from llmsupervisor.daemon.output_ring import BYTES_KEPT
from tests.lib.daemon import cli, fake_engine, free_port, wait_for
from tests.lib.slowloris import ATTACKS, assert_all_answered, balancer, rotating_slowloris
from tests.lib.sockets import has_ipv6_loopback

pytestmark = pytest.mark.system


@pytest.mark.parametrize(("count", "partial"), [pytest.param(c, p, id=i) for i, c, p in ATTACKS])
def test_a_rotating_slowloris_leaves_every_balancer_check_answered(
    daemon_factory: Any, count: int, partial: bytes
) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port())]})
    d.start()
    d.wait_state("a", "ready")
    host, port = d.http_url.removeprefix("http://").rsplit(":", 1)
    with rotating_slowloris(host, int(port), count, partial=partial):
        time.sleep(1.0)  # the attack in full swing first: every connection rotated once
        checks = balancer(host, int(port), ("/engines/a/ready", "/healthz"), 30)
    assert_all_answered(checks, f"daemon, slowloris {count} ({partial[:20]!r})")
    assert d.engine("a")["state"] == "ready"
    assert d.stop() == 0


V6ONLY_LISTENER = """
import socket, sys, time
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s.bind(("::1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(3600)
"""


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_listener_on_ipv6_loopback_only_does_not_keep_an_engine_on_ipv4_loopback_down(
    daemon_factory: Any,
) -> None:
    port = free_port()
    holder = subprocess.Popen(
        [sys.executable, "-c", V6ONLY_LISTENER, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "listening\n"
        d = daemon_factory({"engines": [fake_engine("a", port, host="127.0.0.1", max_failures=2)]})
        d.start()
        ready = d.wait_state("a", "ready")
        assert "held by" not in d.log(), ready
        assert holder.poll() is None
        assert d.stop() == 0
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def dead_socket(path: Path) -> socket.socket:
    """A socket file nobody listens on (connect: refused): someone else's, not the daemon's."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    return s


def test_a_removed_control_socket_comes_back_and_the_exit_leaves_someone_elses(daemon_factory: Any) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port())]})
    d.start()
    d.wait_state("a", "ready")
    path = d.state_dir / "control.sock"
    assert cli(d, "status").returncode == 0
    path.unlink()
    impostor = dead_socket(path)  # deterministic: the daemon leaves someone else's alone
    try:
        gone = cli(d, "status")
        assert gone.returncode == 69, gone
        assert f"the daemon runs (pid {d.pid}, lock held) but its control socket" in gone.stderr
        assert "not running" not in gone.stderr
        d.wait_log("is not this daemon's")
        # Gone altogether: the daemon notices by itself and makes its own again.
        path.unlink()
        wait_for(lambda: cli(d, "status").returncode == 0, timeout_s=30, what="the socket made again")
        assert "was removed; made again" in d.log()
        # At exit only its own is removed: someone else's stays.
        path.unlink()
        impostor.close()
        impostor = dead_socket(path)
        inode = path.stat().st_ino
        assert d.stop() == 0
        assert path.exists() and path.stat().st_ino == inode
    finally:
        impostor.close()


def test_logs_after_long_lines_is_a_bounded_reply(daemon_factory: Any) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port(), fake_long_lines=400)]})
    d.start()
    d.wait_state("a", "ready")
    d.wait_log("long lines done", timeout_s=120)
    reply = control.request(d.state_dir / "control.sock", {"command": "logs", "engine": "a"}, timeout_s=60)
    assert reply["ok"], reply
    size = len(json.dumps(reply))
    lines = reply["result"]["lines"]
    # 400 lines of 100 KiB were forwarded (64 KiB at most each): 20.7 MB before the fix.
    assert size <= BYTES_KEPT + 200 * len(lines), size
    assert any("bytes cut; the journal has the whole line" in line["text"] for line in lines)
    shown = cli(d, "logs", "a")
    assert shown.returncode == 0, shown.stderr
    assert d.stop() == 0
