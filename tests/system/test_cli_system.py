"""The operator's CLI against the real daemon and fake vLLM engines: the one-line answers,
`--wait` with its progress line and exit codes 0/1/69/78, `status NAME...` and its exit code,
`status --watch`, `events` and `events --follow`, the start phase read from the engine's log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.lib.daemon import Daemon, cli, fake_engine, free_port, wait_for

pytestmark = pytest.mark.system


def _interruptible() -> None:
    # Ctrl-C as at a terminal, whatever this run inherited: a test run started in the background
    # by a shell without job control (`cmd &`, nohup) ignores SIGINT, every child keeps ignoring
    # it, and the CLI's Ctrl-C tests below would wait out their timeouts.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_cli(d: Daemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmsupervisor", "--config", str(d.config_path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
    )


def slow_engine(name: str, port: int, **fields: Any) -> dict[str, Any]:
    """A fake engine that spends a few seconds "loading weights" on every start."""
    return fake_engine(name, port, fake_load_s=3.0, fake_compile_s=1.0, **fields)


def test_restart_wait_shows_phases_and_exits_0(daemon_factory) -> None:
    d = daemon_factory({"engines": [slow_engine("a", free_port())]})
    d.start()
    first = d.wait_state("a", "ready", timeout_s=60)

    out = cli(d, "restart", "a", "--wait", "--timeout", "120")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "a: restart accepted; draining, then restarting"
    # Not a TTY: plain lines, one per change of state or phase (no carriage returns).
    assert "\r" not in out.stdout
    progress = [line for line in lines[1:-1] if line.startswith("a ")]
    assert any(line.startswith("a STARTING ") and ": loading weights" in line for line in progress), lines
    assert any(" / 20s" in line for line in progress), lines  # the start budget: start_timeout_s
    assert lines[-1] == "a: READY (restart done)"
    again = d.engine("a")
    assert again["pid"] != first["pid"] and again["state"] == "ready"
    assert again["incarnation"] == first["incarnation"] + 1

    # --json: the reply for scripts, whose "state" is said to be the state when taken.
    out = cli(d, "drain", "a", "--json")
    reply = json.loads(out.stdout)
    assert reply["accepted"] == "drain" and reply["engine"] == "a" and reply["state"] == "ready"
    out = cli(d, "start", "a", "--wait")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "a: READY (start done)", out
    out = cli(d, "stop", "a", "--wait")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "a: STOPPED (stop done)", out
    assert d.stop() == 0


def test_wait_on_a_start_that_fails_exits_1(daemon_factory) -> None:
    d = daemon_factory(
        {"engines": [fake_engine("bad", free_port(), fake_refuse_canary=True, max_failures=2, enabled=False)]}
    )
    d.start()
    d.wait_state("bad", "stopped")
    out = cli(d, "start", "bad", "--wait", "--timeout", "60")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines()[0] == "bad: start accepted; starting"
    assert "bad: start failed (BACKOFF): canary failed" in out.stderr
    assert d.stop() == 0


def test_wait_timeout_exits_1_and_the_command_goes_on(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port(), fake_load_s=30.0, enabled=False)]})
    d.start()
    d.wait_state("a", "stopped")
    out = cli(d, "start", "a", "--wait", "--timeout", "2")
    assert out.returncode == 1
    assert "a: gave up waiting after" in out.stderr and "still STARTING (the command goes on)" in out.stderr
    assert d.engine("a")["state"] == "starting"
    assert d.engine("a")["phase"] == "loading weights"
    status = cli(d, "status", "a")
    assert "STARTING (loading weights)" in status.stdout
    assert status.returncode == 0  # starting is not down
    assert d.stop() == 0


def test_daemon_gone_while_waiting_exits_69(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port(), fake_load_s=60.0, enabled=False)]})
    d.start()
    d.wait_state("a", "stopped")
    waiting = popen_cli(d, "start", "a", "--wait")
    d.wait_state("a", "starting", phase="loading weights")
    time.sleep(1.5)  # the CLI has polled at least once
    d.signal(signal.SIGKILL)
    _out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 69, err
    assert "lost the daemon while waiting" in err


def test_no_daemon_69_and_broken_config_78(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    engines = "engines:\n  - {name: a, model: tiny, port: 8000, command: [/bin/true]}\n"
    config.write_text(f"supervisor:\n  state_dir: {tmp_path / 'state'}\n{engines}")
    out = cli(None, "restart", "a", "--wait", config=config)
    assert out.returncode == 69 and "the daemon is not running" in out.stderr
    config.write_text(f"supervisor:\n  state_dir: {tmp_path / 'state'}\n  tick_interval_s: soon\n{engines}")
    for args in (("restart", "a", "--wait"), ("status",), ("events",)):
        out = cli(None, *args, config=config)
        assert out.returncode == 78, out
        assert (
            out.stderr.startswith("llm-supervisor: the config is broken: ")
            and "tick_interval_s" in out.stderr
        )


def test_status_names_exit_codes_and_last_exit(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    a = d.wait_state("a", "ready")
    d.wait_state("b", "ready")
    assert cli(d, "status").returncode == 0
    assert cli(d, "stop", "b", "--wait").returncode == 0
    out = cli(d, "status", "a")
    assert out.returncode == 0 and [line.split()[0] for line in out.stdout.splitlines()] == ["ENGINE", "a"]
    out = cli(d, "status", "b")  # stopped on purpose: where the operator put it (issue 39)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert cli(d, "status").returncode == 0
    out = cli(d, "status", "nope")
    assert out.returncode == 1 and "no engine named 'nope'" in out.stderr
    only_a = json.loads(cli(d, "status", "a", "--json").stdout)
    assert list(only_a["engines"]) == ["a"] and only_a["engines"]["a"]["model"] == "tiny"

    # A crash shows as one, not only as RESTARTS+1.
    os.kill(a["pid"], signal.SIGKILL)
    d.wait_state("a", "ready", restarts=1)
    out = cli(d, "status", "a")
    assert "crashed (SIGKILL)" in out.stdout and " ago" in out.stdout, out.stdout
    assert d.stop() == 0


def test_events_and_follow(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    d.wait_state("a", "ready")
    d.wait_state("b", "ready")
    out = cli(d, "events", "a", "--since", "10m")
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert any(" a transition STOPPED -> STARTING: start" in line for line in lines), lines
    assert all(" a " in line for line in lines)

    follower = popen_cli(d, "events", "--follow", "--json")
    assert cli(d, "drain", "b").returncode == 0
    seen: list[dict[str, Any]] = []
    assert follower.stdout is not None
    while not any(e.get("to_state") == "draining" for e in seen):
        seen.append(json.loads(follower.stdout.readline()))
    assert any(e["kind"] == "operator" and e["engine"] == "b" for e in seen)
    follower.send_signal(signal.SIGINT)
    _out, err = follower.communicate(timeout=30)
    assert follower.returncode == 0 and "Traceback" not in err
    assert d.stop() == 0


def test_status_watch_ends_cleanly_on_ctrl_c(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port())]})
    d.start()
    d.wait_state("a", "ready")
    watcher = popen_cli(d, "status", "--watch", "--interval", "0.3")
    assert watcher.stdout is not None
    stdout = watcher.stdout
    wait_for(lambda: "READY" in stdout.readline(), timeout_s=30, what="a redraw")
    watcher.send_signal(signal.SIGINT)
    _out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0 and "Traceback" not in err
    assert d.stop() == 0


def test_reload_wait_until_changed_engine_is_ready(daemon_factory) -> None:
    import yaml

    d = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    d.wait_state("a", "ready")
    b = d.wait_state("b", "ready")
    new = yaml.safe_load(d.config_path.read_text())
    new["engines"][1]["args"]["fake-completion-delay-s"] = 0.01
    d.config_path.write_text(yaml.safe_dump(new, sort_keys=False))
    out = cli(d, "reload", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[0] == "reload accepted; restarting b (rolled within max_unavailable=1)"
    assert "  b: restart: args.fake-completion-delay-s: - -> 0.01" in out.stdout.splitlines()
    assert out.stdout.splitlines()[-1] == "b: READY (reload done)"
    # Issue 26 (11): operator commands are logged with the caller (the socket peer's uid).
    assert f"operator: reload (by {_me()})" in d.log()
    assert d.engine("b")["pid"] != b["pid"]
    assert d.stop() == 0


def test_findings_of_an_old_incarnation_do_not_stay_on_the_new_one(daemon_factory) -> None:
    import httpx

    port = free_port()
    # Report-only, so that the hang stays until the operator restarts.
    engine = fake_engine("a", port, canary_interval_s=0.5, live_canary_timeout_s=1, automatic_actions=False)
    d = daemon_factory({"engines": [engine]})
    d.start()
    d.wait_state("a", "ready")
    httpx.post(f"http://127.0.0.1:{port}/fake/hang", timeout=5)
    wait_for(lambda: [f["kind"] for f in d.engine("a")["findings"]] == ["hang"], timeout_s=40, what="hang")
    assert "hang (critical)" in cli(d, "status", "a").stdout
    # Issue 39 (5): the finding reads for a person in `events` and `describe`: no "hang: hung",
    # "1 deadline misses" or raw floats; the values as measured stay in `events --json`.
    text = cli(d, "events", "a").stdout + cli(d, "describe", "a").stdout
    found = [line for line in text.splitlines() if "finding hang" in line or "Finding:" in line]
    assert any("finding hang (critical): " in line for line in found), text
    for debug in ("hang: hung", "hung: ", "1 deadline misses", "="):
        assert all(debug not in line for line in found), (debug, found)
    assert re.search(r"\d\.\d{4,}", "\n".join(found)) is None, found
    found_json = [json.loads(x) for x in cli(d, "events", "a", "--json").stdout.splitlines() if x.strip()]
    assert any("rule" in (e.get("evidence") or {}) for e in found_json if e["kind"] == "finding"), found_json
    out = cli(d, "restart", "a", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert d.engine("a")["findings"] == []
    assert "hang" not in cli(d, "status", "a").stdout
    events = cli(d, "events", "a").stdout
    assert " a finding hang (critical)" in events and " a operator: restart" in events
    assert " a transition READY -> DRAINING: draining: restart requested by operator" in events
    assert d.stop() == 0


def _me() -> str:
    """How the daemon names this test's user (daemon/holds.py operator_name)."""
    import pwd

    uid = os.getuid()
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
