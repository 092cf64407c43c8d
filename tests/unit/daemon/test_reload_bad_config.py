"""A bad file on reload or at startup (issue 17): the reload answers with the problems, keeps
the old config and sends READY=1 after RELOADING=1; startup exits 78 without a traceback, so
systemd does not restart it (the daemon started as a process on such a file:
tests/system/test_bad_config_startup.py). Even a loader bug reads as a problem of the file, never as an
"internal error" that leaves systemd waiting in "reloading"."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest

from llmsupervisor.cli import main as cli
from llmsupervisor.config import load as config_load
from llmsupervisor.config import load_config, state_dir_named_in
from llmsupervisor.daemon.reload import Reloader
from llmsupervisor.errors import EX_CONFIG, ConfigError
from llmsupervisor.notify import Notifier

GOOD = """
supervisor:
  state_dir: {state}
engines:
  - name: a
    model: org/m
    port: 8000
    command: [python3]
"""


class Recorder:
    """The notify socket: every datagram the Notifier sends."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def __call__(self, address: str) -> Recorder:
        return self

    def notify(self, message: str) -> None:
        self.sent.append(message.split("\n")[0])

    def close(self) -> None:
        pass


def reloader(recorder: Recorder) -> Reloader:
    notifier = Notifier({"NOTIFY_SOCKET": "/run/fake-notify"}, factory=recorder)
    # A rejected file never reaches the fleet.
    return Reloader(
        cast(Any, None),
        notifier,
        summary=lambda: "1/1 engines ready",
        stopping=lambda: False,
    )


def loaded(tmp_path: Path) -> tuple[Path, Any]:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(GOOD.format(state=tmp_path / "state")).lstrip())
    return path, load_config(path, check_paths=False)


@pytest.mark.parametrize(
    "bad",
    [
        "a: &a [*a]\n",
        "engines: " + "[" * 500 + "]" * 500 + "\n",
        GOOD.format(state="/tmp/x").replace("port: 8000", "port: " + "9" * 400),
        GOOD.format(state="/tmp/x").replace("[python3]", '"python3 \'x"'),
    ],
)
def test_a_bad_file_on_reload_answers_the_problems_and_sends_ready(tmp_path: Path, bad: str) -> None:
    path, current = loaded(tmp_path)
    path.write_text(bad)
    recorder = Recorder()
    r = reloader(recorder)
    new, reply = asyncio.run(r.reload(current))
    assert new is None
    assert reply["reloaded"] is False
    assert reply["problems"] and all(p.startswith(f"{path}:") for p in reply["problems"]), reply
    assert recorder.sent == ["RELOADING=1", "READY=1"]
    assert r.totals == {"ok": 0, "invalid": 1}
    assert r.problem is not None and "old config kept" in r.problem


def test_a_loader_bug_on_reload_is_a_problem_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, current = loaded(tmp_path)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in a check")

    monkeypatch.setattr(config_load, "_validate", broken)
    recorder = Recorder()
    new, reply = asyncio.run(reloader(recorder).reload(current))
    assert new is None
    assert reply["reloaded"] is False
    [problem] = reply["problems"]
    assert problem.startswith(f"{path}:1: ")
    assert "RuntimeError: a bug in a check" in problem
    assert recorder.sent == ["RELOADING=1", "READY=1"]


def test_a_loader_bug_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = loaded(tmp_path)
    monkeypatch.setattr(config_load, "_validate", lambda *a, **k: 1 / 0)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:1: (top level): ")
    assert "ZeroDivisionError" in str(info.value)
    assert config_load.INTERNAL_PROBLEM in str(info.value)


def test_check_config_exits_78_on_a_loader_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = loaded(tmp_path)
    monkeypatch.setattr(config_load, "_validate", lambda *a, **k: 1 / 0)
    assert cli.main(["check-config", str(path)]) == EX_CONFIG
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:1: ") and "Traceback" not in err


@pytest.mark.parametrize(
    "bad",
    [
        "a: &a [*a]\n",
        "engines: " + "[" * 5000 + "]" * 5000 + "\n",
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{n}: &{n} [" + ", ".join([f"*{p}"] * 9) + "]\n"
            for n, p in zip("bcdefghi", "abcdefgh", strict=True)
        ),
    ],
    ids=["self-alias", "deep", "laughs"],
)
def test_the_cli_finds_its_socket_beside_a_bad_file(tmp_path: Path, bad: str) -> None:
    # `llm-supervisor reload` reads the file only for the state dir; it used yaml.safe_load,
    # which recursed past the stack on 5,000 brackets and expanded the laughs without end.
    path = tmp_path / "config.yaml"
    path.write_text(bad)
    assert state_dir_named_in(path) is None
    path.write_text(GOOD.format(state=tmp_path / "state"))
    assert state_dir_named_in(path) == tmp_path / "state"
