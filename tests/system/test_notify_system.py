"""sd_notify from the real daemon, against a real datagram socket standing in for systemd's: READY=1
and STATUS, and READY=1 again after a bad reload."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.lib.daemon import fake_engine, free_port, wait_for
from tests.lib.sd_notify import Receiver


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
