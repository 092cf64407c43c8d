"""`reload` and `reload --dry-run` as the operator reads them (cli/render.py ``reload_lines``)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from llmsupervisor.cli import control as cli_control
from llmsupervisor.cli import render
from llmsupervisor.cli.client import Client

REPLY: dict[str, Any] = {
    "reloaded": True,
    "added": ["gpu3"],
    "removed": [],
    "changed": ["gpu1", "gpu2"],
    "rolling": ["gpu1"],
    "max_unavailable": 1,
    "next_start_only": ["supervisor.tick_interval_s"],
    "engines": [
        {"engine": "gpu0", "action": "nothing", "why": "unchanged", "model_reload": False, "changes": []},
        {"engine": "gpu1", "action": "restart", "why": "changed", "model_reload": True, "changes": [{}]},
        {"engine": "gpu2", "action": "stop", "why": "disabled", "model_reload": False, "changes": [{}]},
        {"engine": "gpu3", "action": "start", "why": "added", "model_reload": False, "changes": []},
    ],
    "settings": [
        {"field": "supervisor.tick_interval_s", "old": "1", "new": "2", "when": "next daemon start"}
    ],
    "lines": [
        "gpu0: nothing (unchanged)",
        "gpu1: restart (model reload): model: a -> b",
        "gpu2: stop (disabled): enabled: true -> false",
        "gpu3: start (added)",
        "supervisor.tick_interval_s: 1 -> 2 (at the next daemon start)",
    ],
}


def test_reload_says_per_engine_why() -> None:
    assert render.reload_lines(REPLY) == [
        "reload accepted; restarting gpu1 (rolled within max_unavailable=1); stopping gpu2; starting gpu3;"
        " supervisor.tick_interval_s at the next daemon start",
        "  gpu1: restart (model reload): model: a -> b",
        "  gpu2: stop (disabled): enabled: true -> false",
        "  gpu3: start (added)",
        "  supervisor.tick_interval_s: 1 -> 2 (at the next daemon start)",
        "  unchanged: gpu0",
    ]
    dry = render.reload_lines({**REPLY, "reloaded": False, "dry_run": True}, dry_run=True)
    assert dry[0].startswith("dry run, nothing applied; a reload would be: restarting gpu1")
    assert dry[1:] == render.reload_lines(REPLY)[1:]


def test_a_reply_without_the_table_keeps_the_one_line() -> None:
    old = {"reloaded": True, "added": [], "changed": ["b"], "removed": []}
    assert render.reload_lines(old) == ["reload accepted; restarting b"]


class Daemon(Client):
    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(Path("/nonexistent"))
        self.reply = reply
        self.asked: list[dict[str, Any]] = []

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        self.asked.append(payload)
        return self.reply


def test_dry_run_asks_for_it_and_exits_0_or_78() -> None:
    out, err = io.StringIO(), io.StringIO()
    daemon = Daemon({**REPLY, "reloaded": False, "dry_run": True})
    code = cli_control.reload(
        daemon, wait_for=False, timeout_s=None, as_json=False, out=out, err=err, dry_run=True
    )
    assert code == 0 and daemon.asked == [{"command": "reload", "dry_run": True}]
    assert out.getvalue().startswith("dry run, nothing applied") and err.getvalue() == ""
    bad = Daemon({"reloaded": False, "dry_run": True, "problems": ["c.yaml:3: engines[0].port: bad"]})
    code = cli_control.reload(
        bad, wait_for=False, timeout_s=None, as_json=False, out=out, err=err, dry_run=True
    )
    assert code == 78
    assert err.getvalue() == (
        "c.yaml:3: engines[0].port: bad\n"
        "llm-supervisor: a reload would be rejected; the daemon keeps its config\n"
    )
