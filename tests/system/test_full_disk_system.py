"""Issue 38, points 2 and 4, with the real daemon over fake engines and a real full disk: the
state dir is a small tmpfs, filled to its last block. A daemon started on it supervises its
engines (it exited 1, and under systemd every engine stayed down) and writes its files once
there is room; an operator's stop and drain given while it is full act at once, say that they
are not saved yet, land once there is room, and hold across a daemon restart.

Mounting a tmpfs needs root: skipped otherwise (the unit tier covers the same with a simulated
full disk, tests/unit/test_full_disk.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lib.daemon import Daemon, cli, fake_engine, free_port, wait_for

pytestmark = pytest.mark.system

NO_SPACE = os.strerror(errno.ENOSPC)
ROOM_WITHIN_S = 60.0  # a kept write is tried again at least every 30 s


class SmallDisk:
    """A 4 MiB tmpfs at ``path``. ``fill`` fills it to the last page and keeps it full (a thread
    takes every page freed, as a runaway log does: an engine's stop frees its group record's
    page) until ``free`` empties it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self._filler: threading.Thread | None = None

    def _take_all(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)

    def _keep_full(self, fd: int) -> None:
        while not self._stop.wait(0.001):
            self._take_all(fd)

    def fill(self) -> None:
        fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._take_all(fd)
        self._stop.clear()
        self._filler = threading.Thread(target=self._keep_full, args=(fd,), daemon=True)
        self._filler.start()
        self._fd = fd

    def free(self) -> None:
        if self._filler is not None:
            self._stop.set()
            self._filler.join()
            self._filler = None
            os.close(self._fd)
        (self.path / "filler").unlink(missing_ok=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    state = tmp_path / "state"  # the Daemon helper's state dir
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0750", "tmpfs", str(state)], check=True)
    disk = SmallDisk(state)
    try:
        yield disk
    finally:
        disk.free()
        subprocess.run(["umount", "-l", str(state)], check=False)


def status(d: Daemon) -> dict[str, Any]:
    """The daemon's status over the control socket (status.json may not be written: the disk is full)."""
    out = cli(d, "status", "--json")
    try:
        doc: dict[str, Any] = json.loads(out.stdout)
    except ValueError:
        return {}
    return doc


def wait_engine(d: Daemon, name: str, state: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        assert d.proc is not None and d.proc.poll() is None, f"daemon exited:\n{d.log()[-4000:]}"
        engine: dict[str, Any] = status(d).get("engines", {}).get(name, {})
        return engine if engine.get("state") == state else None

    found: dict[str, Any] = wait_for(check, timeout_s=timeout_s, what=f"{name} {state}", poll_s=0.3)
    return found


def unsaved_metric(d: Daemon) -> float | None:
    for line in httpx.get(d.http_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("llmsupervisor_state_files_unsaved "):
            return float(line.split()[1])
    return None


def test_a_daemon_started_on_a_full_disk_supervises_and_writes_once_there_is_room(
    small_disk: SmallDisk, daemon_factory: Any
) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port())]})
    small_disk.fill()
    d.start()
    a = wait_engine(d, "a", "ready")
    assert a["pid"] is not None
    doc = status(d)
    unsaved = {u["file"]: u["error"] for u in doc["state_files_unsaved"]}
    assert unsaved.get(str(d.state_dir.resolve() / "status.json")) == NO_SPACE, doc["state_files_unsaved"]
    assert (unsaved_metric(d) or 0) >= 1
    table = cli(d, "status").stdout
    assert "State files not saved yet (No space left on device)" in table, table
    assert "cannot write this daemon's pid (No space left on device); the lock is held" in d.log()
    assert not (d.state_dir / "status.json").exists()

    small_disk.free()
    wait_for(lambda: d.status().get("pid") == d.pid, timeout_s=ROOM_WITHIN_S, what="status.json written")
    wait_for(lambda: status(d).get("state_files_unsaved") == [], timeout_s=ROOM_WITHIN_S, what="all saved")
    assert unsaved_metric(d) == 0
    assert d.engine("a")["state"] == "ready"
    assert d.stop() == 0


def test_stop_and_drain_on_a_full_disk_act_and_hold_across_a_restart_once_there_is_room(
    small_disk: SmallDisk, daemon_factory: Any
) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    d.wait_state("a", "ready", timeout_s=60)
    d.wait_state("b", "ready", timeout_s=60)
    holds = d.state_dir / "holds"
    small_disk.fill()

    out = cli(d, "stop", "a")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"the hold is not saved yet ({NO_SPACE}): it holds now" in out.stdout, out.stdout
    out = cli(d, "drain", "b")
    assert out.returncode == 0 and "not saved yet" in out.stdout, out.stdout + out.stderr
    a = wait_engine(d, "a", "stopped")  # acted on at once, full disk or not
    b = wait_engine(d, "b", "draining")
    # a's stop removed its group record: that page freed, its hold may have landed at once (a
    # write that lands wakes the kept ones). b's drain freed nothing.
    assert a["hold"]["hold"] == "stop" and b["hold"]["hold"] == "drain"
    assert b["hold_unsaved"] == NO_SPACE
    table = cli(d, "status", "-o", "wide").stdout  # the hold in full
    assert "drain hold by root (uid 0) since" in table and f"not saved yet: {NO_SPACE}" in table, table
    assert not (holds / "b.json").exists()

    small_disk.free()
    wait_for(
        lambda: (holds / "a.json").exists() and (holds / "b.json").exists(),
        timeout_s=ROOM_WITHIN_S,
        what="the holds written once there is room",
    )
    wait_for(lambda: status(d)["engines"]["a"]["hold_unsaved"] is None, timeout_s=10, what="a saved")
    assert d.stop() == 0

    d.start()  # the same state dir: a new daemon
    d.wait_state("b", "draining", timeout_s=60)
    assert d.engine("a")["state"] == "stopped" and not d.engine("a")["wants_run"]
    assert d.engine("a")["hold"]["hold"] == "stop" and d.engine("b")["hold"]["hold"] == "drain"
    assert d.stop() == 0
