"""`restart|drain|stop|start NAME... | --all` and `wait NAME... --for` (issue 26: one engine per
command), against a scripted daemon."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor.cli import control as cli_control
from llmsupervisor.cli import main as cli
from llmsupervisor.cli.client import Client


class Daemon(Client):
    """Engines that reach READY (a new incarnation) one status look after a restart or start,
    and STOPPED after a stop."""

    def __init__(self, **engines: dict[str, Any]) -> None:
        super().__init__(Path("/nonexistent"))
        self.engines = {
            n: {"state": "ready", "incarnation": 1, "pid": 10, "enabled": True, "wants_run": True, **e}
            for n, e in engines.items()
        }
        self.sent: list[str] = []  # "restart a", ... in order
        self.pending: dict[str, dict[str, Any]] = {}

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        command = payload["command"]
        if command == "status":
            for name, change in self.pending.items():
                self.engines[name].update(change)
            self.pending.clear()
            return {"engines": {n: dict(e) for n, e in self.engines.items()}}
        if command == "events":
            return {"events": [], "last_seq": 0}
        name = payload["engine"]
        self.sent.append(f"{command} {name}")
        engine = self.engines[name]
        reply = {"engine": name, "accepted": command, "state": engine["state"], "doing": "x"}
        reply |= {"incarnation": engine["incarnation"], "state_changes": 0, "events_seq": 0}
        if command in ("restart", "start"):
            self.pending[name] = {"state": "ready", "incarnation": engine["incarnation"] + 1, "pid": 11}
        elif command == "stop":
            self.pending[name] = {"state": "stopped", "pid": None, "wants_run": False}
        elif command == "drain":
            self.pending[name] = {"state": "draining", "requests_running": 0}
        return reply


def run(daemon: Daemon, command: str, names: list[str], **kwargs: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    options: dict[str, Any] = {"every": False, "wait_for": False, "timeout_s": None, "as_json": False}
    code = cli_control.engine_commands(daemon, command, names, **{**options, **kwargs}, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_a_restart_of_several_is_rolled_one_at_a_time() -> None:
    daemon = Daemon(a={}, b={}, c={})
    seen_when_b_sent: dict[str, Any] = {}
    original = daemon.call

    def call(payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        if payload.get("command") == "restart" and payload.get("engine") == "b":
            seen_when_b_sent.update(daemon.engines["a"])
        return original(payload, timeout_s=timeout_s)

    daemon.call = call  # type: ignore[method-assign]
    code, out, _ = run(daemon, "restart", ["a", "b"])
    assert code == 0, out
    assert daemon.sent == ["restart a", "restart b"]
    assert seen_when_b_sent["incarnation"] == 2  # a was READY again before b was sent
    assert out.splitlines()[0].startswith("restarting a, b one at a time, each READY before the next")
    assert "a: READY (restart done)" in out and "b: READY (restart done)" in out


def test_a_failed_engine_stops_the_roll_and_names_the_rest() -> None:
    daemon = Daemon(a={}, b={}, c={})
    original = daemon.call

    def call(payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        reply = original(payload, timeout_s=timeout_s)
        if payload.get("command") == "restart" and payload["engine"] == "b":
            daemon.pending["b"] = {"state": "fatal", "reason": "crashed", "state_changes": 3, "pid": None}
        return reply

    daemon.call = call  # type: ignore[method-assign]
    code, _, err = run(daemon, "restart", ["a", "b", "c"])
    assert code == 1 and daemon.sent == ["restart a", "restart b"]
    assert "roll stopped at b; not restarted: c" in err


def test_a_typo_among_several_names_does_nothing() -> None:
    daemon = Daemon(a={}, b={})
    code, out, err = run(daemon, "stop", ["a", "nosuch"])
    assert (code, out, daemon.sent) == (1, "", [])
    assert err == "llm-supervisor: no engine named 'nosuch'; engines: a, b\n"


def test_stop_all_sends_every_enabled_engine_at_once_and_waits_for_them() -> None:
    daemon = Daemon(a={}, b={}, off={"enabled": False, "state": "stopped", "pid": None})
    code, out, _ = run(daemon, "stop", [], every=True, wait_for=True)
    assert code == 0 and daemon.sent == ["stop a", "stop b"]
    assert "a: STOPPED (stop done)" in out and "b: STOPPED (stop done)" in out


def test_drain_all_takes_a_disabled_engine_started_by_hand_and_leaves_one_not_started() -> None:
    """Issue 35: `--all` was every engine `enabled` in the config, so `drain --all` left a
    disabled engine that `start` put in service in rotation, and said nothing. The daemon says
    which engines are meant to serve (a daemon that does not: `enabled`)."""
    daemon = Daemon(
        a={"meant_to_serve": True},
        by_hand={"enabled": False, "meant_to_serve": True},
        off={"enabled": False, "meant_to_serve": False, "wants_run": False, "state": "stopped", "pid": None},
    )
    code, out, _ = run(daemon, "drain", [], every=True, wait_for=True)
    assert code == 0 and daemon.sent == ["drain a", "drain by_hand"]
    assert "by_hand: DRAINING, no requests in flight (drain done)" in out


def test_restart_all_leaves_an_engine_an_operator_stopped() -> None:
    daemon = Daemon(a={}, b={"state": "stopped", "wants_run": False, "pid": None}, c={})
    code, _, err = run(daemon, "restart", [], every=True)
    assert code == 0 and daemon.sent == ["restart a", "restart c"]
    assert "not restarting b: stopped by an operator" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["restart"], "restart: name one or more engines, or --all"),
        # Issue 39: both is its own mistake, not "name one or more".
        (
            ["restart", "--all", "gpu0"],
            "restart: --all or engine names, not both: `restart --all` or `restart gpu0`",
        ),
    ],
)
def test_names_or_all_not_neither_nor_both(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*argv, "--socket", "/nonexistent.sock"]) == 2
    assert capsys.readouterr().err == f"llm-supervisor: {said}\n"


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


def wait(
    daemon: Client, names: list[str], target: str, timeout_s: float | None = None
) -> tuple[int, str, str]:
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    code = cli_control.wait_for_state(
        daemon, names, target, timeout_s=timeout_s, out=out, err=err, clock=clock, sleep=clock.sleep
    )
    return code, out.getvalue(), err.getvalue()


class Starting(Client):
    """STARTING for ``looks`` status calls, then READY; ``b`` is STOPPED throughout."""

    def __init__(self, looks: int, *, then: str = "ready") -> None:
        super().__init__(Path("/nonexistent"))
        self.looks, self.then, self.calls = looks, then, 0

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        self.calls += 1
        state = "starting" if self.calls <= self.looks else self.then
        a = {"state": state, "pid": 5, "for_s": 1.0, "reason": "boom"}
        return {"engines": {"a": a, "b": {"state": "stopped", "pid": None}}}


def test_wait_for_ready_acts_on_nothing_and_ends_when_there() -> None:
    daemon = Starting(looks=3)
    code, out, err = wait(daemon, ["a", "b"], "stopped", timeout_s=1)  # a is not stopped
    assert code == 1 and "not stopped after" in err and "a STARTING" in err
    code, out, _ = wait(Starting(looks=3), ["a"], "ready")
    assert code == 0 and out.splitlines()[-1] == "a: READY"
    code, out, _ = wait(Starting(looks=0), ["b"], "stopped")
    assert code == 0 and out == "b: STOPPED\n"


def test_wait_gives_up_at_its_timeout_or_on_fatal() -> None:
    code, _, err = wait(Starting(looks=100), ["a"], "ready", timeout_s=5)
    assert code == 1 and "not ready after 5s: a STARTING" in err
    code, _, err = wait(Starting(looks=1, then="fatal"), ["a"], "ready")
    assert code == 1 and "a: FATAL, it will not be ready by itself: boom" in err


def test_wait_for_a_typo_is_exit_1_with_the_engines() -> None:
    code, _, err = wait(Starting(looks=0), ["a", "nosuch"], "ready")
    assert code == 1 and err == "llm-supervisor: no engine named 'nosuch'; engines: a, b\n"
