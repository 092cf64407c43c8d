"""sd_notify: the messages, against a real datagram socket, in process (from the real daemon:
tests/system/test_notify_system.py)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from llmsupervisor.notify import Notifier
from tests.lib.sd_notify import Receiver


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
