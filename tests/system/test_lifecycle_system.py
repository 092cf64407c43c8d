"""Lifecycle regressions through the real daemon and real processes (tests/lib/fake_vllm.py), each
one a defect that operators hit with the old lifecycle core."""

from __future__ import annotations

import time

import pytest

from llmsupervisor.control import default_socket_path, request
from tests.lib.daemon import fake_engine, free_port, wait_for

pytestmark = pytest.mark.system


def test_restart_of_a_starting_engine_abandons_the_start(daemon_factory):
    """`restart` of an engine still loading used to wait for the whole load and then restart
    it: two full model loads (20 minutes for a 70B model) for one command."""
    d = daemon_factory(
        {
            "engines": [
                fake_engine("a", free_port(), fake_startup_delay_s=25, start_timeout_s=60, stop_timeout_s=2)
            ]
        }
    ).start()
    d.wait_state("a", "starting", timeout_s=15)
    wait_for(lambda: len(d.spawned_sessions()) == 1, timeout_s=10, what="the first spawn")
    asked = time.monotonic()
    reply = request(default_socket_path(d.state_dir.resolve()), {"command": "restart", "engine": "a"})
    assert reply["ok"] and reply["result"]["accepted"] == "restart"
    wait_for(
        lambda: len(d.spawned_sessions()) == 2, timeout_s=15, what="a second spawn, well before the load ends"
    )
    assert time.monotonic() - asked < 15
    engine = d.wait_state("a", "ready", timeout_s=60)
    assert engine["restarts_by_reason"].get("operator") == 1
    assert len(d.spawned_sessions()) == 2  # one restart, not a restart after a finished start
    assert d.stop() == 0
