"""Issue 39 (3): the CLI agrees with what the operator asked, without a daemon: a held engine ends
`wait --for ready` at once, `reload --wait` counts an engine done only once it serves its new
spec, a drain held by an operator shows no drain budget, `status gpu9` prints no table, and
`logs --previous` says how that incarnation ended. A dry run: tests/unit/config/test_reload_diff.py;
through the real CLI against a daemon: tests/system/test_cli_intent.py."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

from llmsupervisor.cli import control as cli_control
from llmsupervisor.cli import engine_view, render
from llmsupervisor.cli.client import Client
from llmsupervisor.cli.wait import Baseline, judge

DRAIN = {"hold": "drain", "by": "alice (uid 1000)", "since": 1_795_000_000.0}


class Engines(Client):
    """A daemon whose status is ``engines``, always."""

    def __init__(self, **engines: dict[str, Any]) -> None:
        super().__init__(Path("/nonexistent"))
        self.engines = engines
        self.looks = 0

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        self.looks += 1
        return {"engines": self.engines}


def test_wait_for_ready_on_a_held_engine_ends_at_once_saying_how_to_release_it() -> None:
    daemon = Engines(
        d={"state": "draining", "pid": 7, "held_by_operator": True, "wants_run": True, "hold": DRAIN},
        s={"state": "stopped", "pid": None, "held_by_operator": True, "wants_run": False},
        off={"state": "stopped", "pid": None, "held_by_operator": True, "wants_run": False, "enabled": False},
    )
    for name, said in (
        (
            "d",
            "d: held by the operator since {} (drain by alice (uid 1000));"
            " `llm-supervisor start d` to release",
        ),
        ("s", "s: held by the operator; `llm-supervisor start s` to release"),
        ("off", "off: disabled in the config (enabled: false); `llm-supervisor start off` starts it"),
    ):
        out, err = io.StringIO(), io.StringIO()
        code = cli_control.wait_for_state(daemon, [name], "ready", timeout_s=None, out=out, err=err)
        assert code == 1  # not forever, not --timeout: at once
        assert err.getvalue() == said.format(render.hold_since(DRAIN)) + "\n"
    assert daemon.looks == 3  # one look each


def test_a_drain_held_by_an_operator_has_no_budget_in_the_progress_line() -> None:
    held = {"state": "draining", "for_s": 5.0, "drain_timeout_s": 120.0, "hold": DRAIN, "reason": "x"}
    line = render.progress_line("gpu1", held, waited_s=5.0)
    assert line.startswith("gpu1 DRAINING 5s: held: drain (alice, ") and " / 2m" not in line
    draining = {**held, "hold": None}
    assert render.progress_line("gpu1", draining, waited_s=5.0) == "gpu1 DRAINING 5s / 2m: x (waited 5s)"


def test_reload_wait_counts_an_engine_done_only_once_it_serves_its_new_spec() -> None:
    """A READY of the old spec (a start that ends after the reload, an engine whose turn in the
    roll is still to come) was counted done before its restart."""
    base = Baseline("reload", incarnation=3)
    became_ready = [{"kind": "transition", "to_state": "ready", "message": "STARTING -> READY: ready"}]
    pending = {"name": "b", "state": "ready", "incarnation": 3, "config_roll": "pending"}
    assert judge(base, pending, became_ready) is None
    assert judge(base, {**pending, "state": "starting", "config_roll": None}, []) is None
    done = judge(base, {**pending, "incarnation": 4, "config_roll": None}, [])
    assert done is not None and done.reached and done.line == "b: READY (reload done)"
    # An added engine (no incarnation to compare) is done once READY.
    added = judge(
        Baseline("reload"), {"name": "c", "state": "ready", "incarnation": 1, "config_roll": None}, []
    )
    assert added is not None and added.reached
    # Waiting for its turn, the progress line says so, not the old incarnation's "ready".
    line = render.progress_line("b", {**pending, "for_s": 600.0}, waited_s=3.0)
    assert line == "b READY 10m: new config pending: rolls within max_unavailable (waited 3s)"


def test_status_of_a_typo_prints_no_table_before_its_error() -> None:
    out, err = io.StringIO(), io.StringIO()
    code = cli_control.status(Engines(gpu0={"state": "ready"}), ["gpu9"], as_json=False, out=out, err=err)
    assert code == 1 and out.getvalue() == ""
    assert err.getvalue() == "llm-supervisor: no engine named 'gpu9'; engines: gpu0\n"


def test_logs_previous_says_how_that_incarnation_ended() -> None:
    t0 = 1_795_000_000.0
    lines: list[dict[str, Any]] = [
        {"seq": 1, "time": t0, "pid": 48213, "text": "x"},
        {"seq": 2, "time": t0 + 5, "pid": 48213},
    ]
    events = [
        {"time": t0 - 60, "kind": "transition", "to_state": "backoff", "message": "READY -> BACKOFF: older"},
        {"time": t0 + 1, "kind": "finding", "message": "finding hang (critical): x"},
        {"time": t0 + 6, "kind": "transition", "to_state": "stopping", "message": "READY -> STOPPING: hang"},
        {
            "time": t0 + 7,
            "kind": "transition",
            "to_state": "backoff",
            "message": "STOPPING -> BACKOFF: later",
        },
    ]
    stamp = time.strftime("%H:%M:%S", time.localtime(t0 + 6))
    assert engine_view.how_it_ended(lines, events) == f"pid 48213 ended {stamp}: READY -> STOPPING: hang"
    assert engine_view.how_it_ended(lines, events[:2]) == (
        "pid 48213: how it ended is no longer in the daemon's event ring"
    )
