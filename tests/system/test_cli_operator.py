"""The operator's CLI against the real daemon over fake engines, issue 26: a name that is no
engine (every command, and the HTTP listener), several engines per command and `--all`,
`wait NAME... --for`, and `reload --dry-run`."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.conftest import Daemon, fake_engine, free_port

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
