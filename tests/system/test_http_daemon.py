"""The daemon's HTTP listener, live: readiness for load balancers and its own /metrics."""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest

from tests.lib.daemon import fake_engine, free_port, wait_for

pytestmark = pytest.mark.system


def test_readiness_endpoints_follow_rotation_and_metrics_lint_clean(daemon_factory) -> None:
    p1, p2 = free_port(), free_port()
    d = daemon_factory({"engines": [fake_engine("a", p1), fake_engine("b", p2, fake_startup_delay_s=60)]})
    d.start()
    d.wait_state("a", "ready")
    wait_for(lambda: _get(d.http_url + "/healthz") == 200, timeout_s=10, what="/healthz")
    # readyz_requires: all (the default): b, meant to serve and still loading, keeps /readyz 503.
    readyz = httpx.get(d.http_url + "/readyz", timeout=5)
    assert readyz.status_code == 503
    assert readyz.json()["engines_in_rotation"] == ["a"]
    assert readyz.json()["engines_out_of_rotation"] == ["b"]
    assert _get(d.http_url + "/engines/a/ready") == 200
    b = httpx.get(d.http_url + "/engines/b/ready", timeout=5)
    assert b.status_code == 503
    assert b.json()["state"] == "starting"
    assert _get(d.http_url + "/engines/nope/ready") == 404

    # Engine rounds are timed from the first tick in READY on; b, still starting, has none.
    rounds_a = 'llmsupervisor_engine_observation_seconds_count{engine="a"}'
    wait_for(lambda: rounds_a in _metrics(d), timeout_s=15, what="a's first observation round")
    metrics = _metrics(d)
    assert 'llmsupervisor_engine_state{engine="a",state="ready"} 1.0' in metrics
    assert 'llmsupervisor_engine_state{engine="b",state="starting"} 1.0' in metrics
    assert "llmsupervisor_tick_duration_seconds_count" in metrics
    assert 'llmsupervisor_engine_observation_seconds_count{engine="b"}' not in metrics
    promtool = shutil.which("promtool")
    if promtool:
        lint = subprocess.run(
            [promtool, "check", "metrics"], input=metrics, capture_output=True, text=True, check=False
        )
        assert lint.returncode == 0 and lint.stdout == "" and lint.stderr == "", lint.stdout + lint.stderr

    # A drained engine leaves rotation at once; with no engine in rotation /readyz says 503.
    drain = subprocess.run(
        [sys.executable, "-m", "llmsupervisor", "--config", str(d.config_path), "drain", "a"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert drain.returncode == 0, drain.stderr
    wait_for(lambda: _get(d.http_url + "/engines/a/ready") == 503, timeout_s=10, what="a out of rotation")
    assert _get(d.http_url + "/readyz") == 503
    assert d.stop() == 0


def _metrics(d) -> str:
    return httpx.get(d.http_url + "/metrics", timeout=5).text


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0
