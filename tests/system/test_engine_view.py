"""`logs NAME` and `describe NAME` over the real daemon and fake engines (issue 26, point 3): a
crashed engine's last lines are there with `--previous`, and `describe` says why it restarted.
The fake engine's canary lines are not in its output (point 1)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
import pytest

from tests.lib.daemon import Daemon, cli, fake_engine, free_port, wait_for

pytestmark = pytest.mark.system


def test_logs_previous_shows_the_crashed_incarnation_and_describe_says_why(
    daemon_factory: Any,
) -> None:
    port = free_port()
    d: Daemon = daemon_factory({"engines": [fake_engine("a", port), fake_engine("b", free_port())]})
    d.start()
    first = d.wait_state("a", "ready", timeout_s=60)
    d.wait_state("b", "ready", timeout_s=60)
    httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
    wait_for(lambda: '"POST /v1/completions' in cli(d, "logs", "a").stdout, timeout_s=20, what="user line")
    current = cli(d, "logs", "a")
    assert current.returncode == 0, current.stderr
    # The user's completion is there; the canary's (one every few seconds, from the daemon) are not.
    assert current.stdout.count('"POST /v1/completions') == 1, current.stdout
    assert "Application startup complete" in current.stdout

    with contextlib.suppress(httpx.HTTPError):  # it exits without an answer
        httpx.post(f"http://127.0.0.1:{port}/fake/crash?code=3", timeout=10)
    second = d.wait_state("a", "ready", timeout_s=60, incarnation=first["incarnation"] + 1)
    assert second["last_restart"]["cause"] == "crash"
    assert "fake crash requested, exit code 3" in second["last_failure"], second["last_failure"]

    previous = cli(d, "logs", "a", "--previous", "-n", "5")
    assert previous.returncode == 0, previous.stderr
    assert "fake crash requested, exit code 3" in previous.stdout
    assert f"[{first['pid']}]" in previous.stdout and len(previous.stdout.splitlines()) <= 5
    as_json = [json.loads(line) for line in cli(d, "logs", "a", "--json", "-n", "2").stdout.splitlines()]
    assert len(as_json) == 2 and all(line["pid"] == second["pid"] for line in as_json)

    described = cli(d, "describe", "a")
    assert described.returncode == 0, described.stderr
    text = described.stdout
    assert f"{second['pid']} (incarnation {second['incarnation']})" in text, text
    assert "fake_vllm.py" in text and f"--port {port}" in text  # the command line
    assert "Last restart:" in text and "crash, " in text
    assert "fake crash requested, exit code 3" in text
    assert "Last output" in text
    assert "crashed (exit 3)" in text

    unknown = cli(d, "logs", "nosuch")
    assert unknown.returncode == 1 and "engines: a, b" in unknown.stderr
    assert cli(d, "describe", "nosuch").returncode == 1
