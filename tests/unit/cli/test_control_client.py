"""The CLI's control-socket client when the daemon's listen backlog is full (issue 28, point 2).

An AF_UNIX connect to a listening socket whose backlog is full fails at once with EAGAIN on a
socket with a timeout (Linux: net/unix/af_unix.c, unix_stream_connect; a blocking one would wait).
The client used to report that as "the daemon went away" and drop the command; it now retries
until its timeout and says the daemon is busy, and a command is delivered as soon as the daemon
takes it. A real listening socket that nobody accepts stands in for a daemon in a burst.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsupervisor import control


@contextlib.contextmanager
def full_backlog(path: Path) -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    """A listening socket with the smallest backlog, filled with connections nobody accepts."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)
    waiting: list[socket.socket] = []
    try:
        while len(waiting) < 64:  # backlog 0 holds one on Linux; bounded either way
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(path))
            except BlockingIOError:
                s.close()
                break
            waiting.append(s)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        with pytest.raises(BlockingIOError), contextlib.closing(probe):
            probe.connect(str(path))  # the backlog is full: what the CLI met in a burst
        yield server, waiting
    finally:
        for s in waiting:
            s.close()
        server.close()


def test_a_full_backlog_that_never_drains_is_busy_not_gone(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    with full_backlog(path), pytest.raises(control.ControlError) as caught:
        control.request(path, {"command": "restart", "engine": "a"}, timeout_s=0.3)
    message = str(caught.value)
    assert "busy" in message, message
    assert "went away" not in message
    assert "not sent" in message  # the operator knows the command did not reach the daemon


def test_a_command_waits_for_a_full_backlog_and_is_delivered(tmp_path: Path) -> None:
    """The daemon takes its backlog only after the client's first try: the command still arrives."""
    path = tmp_path / "control.sock"
    received: list[dict[str, object]] = []
    with full_backlog(path) as (server, fillers):
        tried = threading.Event()

        def daemon() -> None:
            tried.wait(5.0)
            server.settimeout(5.0)
            for _ in fillers:  # the connections that filled the backlog come first: silent ones
                server.accept()[0].close()
            conn, _ = server.accept()
            with conn:
                conn.settimeout(5.0)
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                received.append(json.loads(data))
                conn.sendall(b'{"ok": true, "result": "restarting"}\n')

        thread = threading.Thread(target=daemon, daemon=True)
        thread.start()
        real_pause = control._connect_pause

        def pause(seconds: float) -> None:  # the client met the full backlog and waits to retry
            tried.set()
            real_pause(seconds)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(control, "_connect_pause", pause)
            reply = control.request(path, {"command": "restart", "engine": "a"}, timeout_s=5.0)
        thread.join(5.0)
    assert tried.is_set()
    assert reply == {"ok": True, "result": "restarting"}
    assert received == [{"command": "restart", "engine": "a"}]
