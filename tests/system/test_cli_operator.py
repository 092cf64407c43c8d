"""The operator's CLI against the real daemon over fake engines, issue 26: a name that is no
engine (every command, and the HTTP listener), several engines per command and `--all`,
`wait NAME... --for`, and `reload --dry-run`."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import yaml

from tests.lib.daemon import Daemon, fake_engine, free_port

pytestmark = pytest.mark.system


def cli(d: Daemon, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmsupervisor", *args, "--config", str(d.config_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s,
    )


def test_a_name_that_is_no_engine_is_an_error_everywhere(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    d.wait_state("a", "ready")
    known = "no engine named 'nosuch'; engines: a, b"
    for args in (
        ("events", "nosuch"),
        ("events", "-f", "nosuch"),  # waited forever before
        ("status", "nosuch"),
        ("status", "--watch", "nosuch"),
        ("restart", "nosuch"),
        ("stop", "a", "nosuch"),  # nothing is done when one name is wrong
        ("wait", "nosuch", "--for", "ready"),
    ):
        out = cli(d, *args, timeout_s=30)
        assert out.returncode == 1, (args, out)
        assert known in out.stderr, (args, out.stderr)
    assert d.engine("a")["state"] == "ready" and d.engine("a")["wants_run"]
    r = httpx.get(d.http_url + "/engines/nosuch/ready", timeout=5)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": known, "status": 404, "engines": ["a", "b"]}
    r = httpx.get(d.http_url + "/nope", timeout=5)
    assert r.status_code == 404 and r.json()["error"] == "no such endpoint: /nope"
    assert d.stop() == 0


def test_reload_dry_run_says_why_and_applies_nothing(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine(n, free_port()) for n in ("a", "b", "c")]})
    d.start()
    before = {n: d.wait_state(n, "ready")["pid"] for n in ("a", "b", "c")}
    new = yaml.safe_load(d.config_path.read_text())
    old_port, new_port = new["engines"][0]["port"], free_port()
    new["engines"][0]["port"] = new_port
    new["engines"][1]["enabled"] = False
    new["engines"][2]["env"] = {"HF_TOKEN": "hf_not_for_the_screen"}
    d.config_path.write_text(yaml.safe_dump(new, sort_keys=False))

    dry = cli(d, "reload", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0] == (
        "dry run, nothing applied; a reload would be: restarting a, c (rolled within max_unavailable=1);"
        " stopping b"
    )
    assert f"  a: restart: port: {old_port} -> {new_port}" in lines
    assert "  b: stop (disabled): enabled: true -> false" in lines
    assert "  c: restart: env.HF_TOKEN: - -> ***" in lines
    assert "hf_not_for_the_screen" not in dry.stdout + d.log()
    assert {n: d.engine(n)["pid"] for n in before} == before  # nothing applied
    assert d.engine("b")["state"] == "ready"

    real = cli(d, "reload")
    assert real.returncode == 0, real.stdout + real.stderr
    assert real.stdout.splitlines()[1:] == lines[1:]  # the same table as the dry run
    assert real.stdout.splitlines()[0].startswith("reload accepted; restarting a, c")
    d.wait_state("b", "stopped")
    d.wait_state("a", "ready", port=new_port)
    assert f"reload: a: restart: port: {old_port} -> {new_port}" in d.log()
    assert d.stop() == 0


def test_several_engines_per_command_and_wait(daemon_factory) -> None:
    d = daemon_factory({"engines": [fake_engine("a", free_port()), fake_engine("b", free_port())]})
    d.start()
    before = {n: d.wait_state(n, "ready")["pid"] for n in ("a", "b")}
    out = cli(d, "restart", "a", "b", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("restarting a, b one at a time, each READY before the next")
    # b is sent only once a is READY again: a's result line comes before b's accepted line.
    assert lines.index("a: READY (restart done)") < next(
        i for i, x in enumerate(lines) if x.startswith("b: restart")
    )
    assert lines[-1] == "b: READY (restart done)"
    assert all(d.engine(n)["pid"] != before[n] for n in before)

    assert cli(d, "stop", "--all").returncode == 0
    out = cli(d, "wait", "a", "b", "--for", "stopped", "--timeout", "30")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-2:] == ["a: STOPPED", "b: STOPPED"]
    out = cli(d, "wait", "a", "--for", "ready")  # does not start it, and ends at once: it is held
    assert out.returncode == 1 and "a: held by the operator since " in out.stderr, out.stderr
    assert d.engine("a")["state"] == "stopped"
    assert cli(d, "start", "a", "b").returncode == 0
    assert cli(d, "wait", "a", "b", "--for", "ready", "--timeout", "60").returncode == 0
    assert d.stop() == 0
