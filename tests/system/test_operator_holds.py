"""An operator's stop and drain outlive a daemon restart, and `restart --wait` on a drained
engine ends (issue 22): the real daemon over fake engines, driven with the CLI."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.lib.daemon import Daemon, cli, fake_engine, free_port

pytestmark = pytest.mark.system


def ready_code(d: Daemon, name: str) -> int:
    return httpx.get(f"{d.http_url}/engines/{name}/ready", timeout=5).status_code


def test_stop_and_drain_holds_survive_a_daemon_restart(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    d.wait_state("a", "ready", timeout_s=60)
    d.wait_state("b", "ready", timeout_s=60)
    before_s = time.time()
    out = cli(d, "stop", "a", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    out = cli(d, "drain", "b", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    holds = d.state_dir / "holds"
    assert json.loads((holds / "a.json").read_text())["hold"] == "stop"
    assert json.loads((holds / "b.json").read_text())["hold"] == "drain"

    assert d.stop() == 0  # SIGTERM: every engine stops
    d.start()  # the same config and state dir: a new daemon
    b = d.wait_state("b", "draining", timeout_s=60)
    assert b["incarnation"] == 1 and not b["in_rotation"]  # started anew, out of rotation
    assert ready_code(d, "b") != 200
    a = d.engine("a")
    assert a["state"] == "stopped" and a["pid"] is None and not a["wants_run"]
    assert "a: spawned" not in d.log().split("supervising 2 engine(s)")[-1]

    status = json.loads(cli(d, "status", "--json").stdout)
    me = f"(uid {os.getuid()})"
    for name, kind in (("a", "stop"), ("b", "drain")):
        hold = status["engines"][name]["hold"]
        assert hold["hold"] == kind and (hold["by"].endswith(me) or hold["by"] == f"uid {os.getuid()}")
        assert before_s - 1 <= hold["since"] <= time.time()
    table = cli(d, "status").stdout  # a hold in a few characters; in full with -o wide (issue 39)
    assert "held: stop (" in table and "held: drain (" in table, table
    table = cli(d, "status", "-o", "wide").stdout
    assert "stop hold by" in table and "drain hold by" in table, table

    out = cli(d, "start", "a", "--wait", "--timeout", "60")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "a: READY (start done)", out
    assert not (holds / "a.json").exists()
    assert json.loads(cli(d, "status", "--json").stdout)["engines"]["a"]["hold"] is None
    assert d.engine("b")["state"] == "draining"  # still held
    assert d.stop() == 0


def test_restart_wait_on_a_drained_engine_returns_once_it_is_up_and_held(daemon_factory) -> None:
    """Issue 22: `restart --wait` on a drained engine never returned (READY for an instant, then
    DRAINING by the operator's drain, which a restart keeps)."""
    d = daemon_factory({"engines": [fake_engine("b", free_port())]})
    d.start()
    first = d.wait_state("b", "ready", timeout_s=60)
    assert cli(d, "drain", "b").returncode == 0
    d.wait_state("b", "draining", timeout_s=60)
    out = cli(d, "restart", "b", "--wait", "--timeout", "60", timeout_s=90)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("b: restart accepted;") and "stays drained" in lines[0], lines
    assert lines[-1] == "b: READY and held out of rotation by a drain (restart done)", lines
    after = d.engine("b")
    assert after["incarnation"] == first["incarnation"] + 1 and after["state"] == "draining"
    assert ready_code(d, "b") != 200
    assert d.stop() == 0
