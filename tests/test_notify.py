"""sd_notify: the messages, against a real datagram socket, in process and from the real daemon."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsupervisor.notify import Notifier
from tests.lib.daemon import fake_engine, free_port, wait_for


class Receiver:
    """What systemd's notify socket would receive."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(65536).decode("latin-1"))
            except BlockingIOError:
                return self.messages

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(tmp_path / "notify")
    yield r
    r.close()


def test_messages(receiver: Receiver) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(receiver.path), "WATCHDOG_USEC": "4000000"}, pid=1)
    assert n.enabled
    assert n.watchdog_interval_s == 2.0
    assert n.extend_timeout(1.5)
    assert n.status("0/2 engines ready")
    assert not n.status("0/2 engines ready")  # unchanged: not resent
    assert n.ready("2/2 engines ready;\n gpu1  ok")
    assert n.watchdog()
    assert n.reloading()
    assert n.stopping("stopping 2 engine(s)")
    msgs = receiver.drain()
    assert msgs[0] == "EXTEND_TIMEOUT_USEC=1500000"
    assert msgs[1] == "STATUS=0/2 engines ready"
    assert msgs[2] == "READY=1\nSTATUS=2/2 engines ready; gpu1 ok"  # one line
    assert msgs[3] == "WATCHDOG=1"
    reload_fields = msgs[4].split("\n")
    assert reload_fields[0] == "RELOADING=1"
    assert reload_fields[1].startswith("MONOTONIC_USEC=") and int(reload_fields[1].split("=")[1]) > 0
    assert msgs[5] == "STOPPING=1\nSTATUS=stopping 2 engine(s)"


def test_abstract_socket_name() -> None:
    name = f"llmsup-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready("up")
        assert sock.recv(100) == b"READY=1\nSTATUS=up"
    finally:
        sock.close()


def test_watchdog_only_for_our_pid() -> None:
    env = {"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "12345"}
    assert Notifier(env, pid=999).watchdog_interval_s is None
    assert Notifier(env, pid=12345).watchdog_interval_s == 30.0
    assert Notifier({"NOTIFY_SOCKET": "/x"}).watchdog_interval_s is None


def test_no_socket_is_a_no_op() -> None:
    n = Notifier({})
    assert not n.enabled
    assert not n.ready("x")
    assert n.failures_total == 0


def test_failures_are_logged_and_counted_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    with caplog.at_level(logging.DEBUG, logger="llmsupervisor.notify"):
        assert not n.ready("up")
        assert not n.watchdog()  # no watchdog configured: nothing sent, not a failure
        assert not n.status("still down")
    assert n.failures_total == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sd_notify" in warnings[0].getMessage()


def test_socket_rebound_later_still_receives(tmp_path: Path) -> None:
    """sdnotify connects once per notifier; we build one per message, so a re-bound socket works."""
    path = tmp_path / "notify"
    n = Notifier({"NOTIFY_SOCKET": str(path)})
    first = Receiver(path)
    assert n.status("one")
    first.close()
    path.unlink()
    second = Receiver(path)
    try:
        assert n.status("two")
        assert second.drain() == ["STATUS=two"]
    finally:
        second.close()


@pytest.mark.system
def test_daemon_notifies_systemd(daemon_factory, receiver: Receiver) -> None:
    p1, p2 = free_port(), free_port()
    d = daemon_factory({"engines": [fake_engine("a", p1, fake_startup_delay_s=1.0), fake_engine("b", p2)]})
    d.start({"NOTIFY_SOCKET": str(receiver.path), "WATCHDOG_USEC": "10000000"})
    wait_for(lambda: any(m.startswith("READY=1") for m in receiver.drain()), timeout_s=30, what="READY=1")
    msgs = receiver.drain()
    ready_at = next(i for i, m in enumerate(msgs) if m.startswith("READY=1"))
    assert msgs[ready_at] == "READY=1\nSTATUS=2/2 engines ready"
    # While the models load: progress in STATUS= and the start timeout extended.
    before = msgs[:ready_at]
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in before)
    assert any(m.startswith("STATUS=0/2 engines ready; a starting") for m in before)
    # WATCHDOG=1 after complete ticks, also after READY.
    wait_for(lambda: "WATCHDOG=1" in receiver.drain()[ready_at + 1 :], timeout_s=10, what="WATCHDOG=1")
    d.signal(signal.SIGTERM)
    assert d.wait_exit() == 0
    assert any(m.startswith("STOPPING=1") for m in receiver.drain())


@pytest.mark.system
def test_bad_reload_on_a_live_daemon_sends_ready_again(daemon_factory, receiver: Receiver) -> None:
    """Issue 17: a reload of a file the loader choked on answered "internal error" after
    RELOADING=1 and never sent READY=1, leaving systemd in "reloading"."""
    d = daemon_factory({"engines": [fake_engine("a", free_port())]})
    d.start({"NOTIFY_SOCKET": str(receiver.path)})
    wait_for(lambda: any(m.startswith("READY=1") for m in receiver.drain()), timeout_s=30, what="READY=1")
    good = d.config_path.read_text()
    d.config_path.write_text("a: &a [*a]\n")
    seen = len(receiver.drain())
    out = subprocess.run(
        # The file no longer names the state dir: the CLI is told where the socket is.
        [sys.executable, "-m", "llmsupervisor", "--socket", str(d.state_dir / "control.sock"), "reload"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 78, out.stderr
    assert f"{d.config_path}:1: yaml: alias *a refers to a node that contains it" in out.stderr
    assert "internal error" not in out.stderr
    after = [m.split("\n")[0] for m in receiver.drain()[seen:]]
    assert after[:2] == ["RELOADING=1", "READY=1"], after
    assert d.engine("a")["state"] == "ready"
    d.config_path.write_text(good)
    d.signal(signal.SIGTERM)
    assert d.wait_exit() == 0
