"""An engine `enabled: false` in the config, started by hand (`start NAME`: "for this run of the
daemon"), is meant to serve like any other (issue 35): the policy repairs it when it hangs, and
`drain --all` drains it. The real daemon over fake engines, driven with the CLI."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.lib.daemon import FAST_DETECTORS, Daemon, cli, fake_engine, free_port

pytestmark = pytest.mark.system


def started_by_hand(daemon_factory: Any, **fields: Any) -> tuple[Daemon, int]:
    """A daemon with `a` enabled and `off` disabled, `off` then started by hand and READY."""
    port = free_port()
    off = fake_engine("off", port, enabled=False, **fields)
    d = daemon_factory({"engines": [fake_engine("a", free_port()), off]})
    d.start()
    d.wait_state("a", "ready", timeout_s=60)
    assert d.engine("off")["state"] == "stopped"
    out = cli(d, "start", "off", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    off_now = d.wait_state("off", "ready", timeout_s=60)
    assert not off_now["enabled"] and off_now["in_rotation"]
    return d, port


def test_a_hung_disabled_engine_started_by_hand_is_restarted(daemon_factory: Any) -> None:
    """It used to stay READY and out of rotation for good (32 deadline misses over 1 min 40 s),
    while the same hang on an enabled engine was READY again in 10 s."""
    d, port = started_by_hand(daemon_factory, detectors=FAST_DETECTORS, live_canary_timeout_s=0.5)
    first = d.engine("off")
    httpx.post(f"http://127.0.0.1:{port}/fake/hang", timeout=5)
    d.wait_log("[off] action restart (hang)", timeout_s=30)
    again = d.wait_state("off", "ready", timeout_s=30, restarts_by_reason={"hang": 1})
    assert again["pid"] != first["pid"] and again["in_rotation"] and again["meant_to_serve"]
    assert d.engine("a")["restarts"] == 0
    assert d.stop() == 0


def test_drain_all_drains_a_disabled_engine_started_by_hand(daemon_factory: Any) -> None:
    """`--all` used to be every engine `enabled` in the config: `drain --all` left this one in
    rotation and said nothing."""
    d, _ = started_by_hand(daemon_factory)
    out = cli(d, "drain", "--all", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "off: drain accepted" in out.stdout, out.stdout
    for name in ("a", "off"):
        engine = d.wait_state(name, "draining", timeout_s=30)
        assert not engine["in_rotation"] and engine["held_by_operator"]
    ready = httpx.get(f"{d.http_url}/readyz", timeout=5).json()
    assert ready["engines_in_rotation"] == [] and sorted(ready["engines_held"]) == ["a", "off"]
    assert d.stop() == 0
