"""A name that is no engine is told as one, with the engines there are (issue 26)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from llmsupervisor.cli import control as cli_control
from llmsupervisor.cli import render
from llmsupervisor.cli.client import Client


class Status(Client):
    def __init__(self) -> None:
        super().__init__(Path("/nonexistent"))
        self.calls = 0

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        self.calls += 1
        return {"engines": {"gpu0": {"state": "ready"}, "gpu1": {"state": "ready"}}}


def test_unknown_engines_lists_the_known_ones() -> None:
    assert render.unknown_engines(["a", "b"], ["a", "x", "y"]) == [
        "no engine named 'x'; engines: a, b",
        "no engine named 'y'; engines: a, b",
    ]
    assert render.unknown_engines([], ["x"]) == ["no engine named 'x'; engines: none"]


def test_watch_of_a_typo_ends_at_once_with_exit_1() -> None:
    out, err = io.StringIO(), io.StringIO()
    client = Status()

    def sleep(_: float) -> None:
        raise AssertionError("a typo must not be watched")

    assert cli_control.watch(client, ["gpu9"], interval_s=1.0, out=out, err=err, sleep=sleep) == 1
    assert err.getvalue() == "llm-supervisor: no engine named 'gpu9'; engines: gpu0, gpu1\n"
    assert out.getvalue() == ""
