"""`llm-supervisor gpu release|take-back` on the CLI's side (cli/gpu.py, cli/render.py): what it
asks, how it follows the release in `status`, what it prints and its exit code; and what `status`
and `describe` say of a release. The daemon's side: tests/unit/daemon/test_one_gpu_reset.py."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from llmsupervisor.cli import render
from llmsupervisor.cli.client import Client, Refused
from llmsupervisor.cli.engine_view import format_describe
from llmsupervisor.cli.gpu import gpu_command
from llmsupervisor.cli.main import main


def release(phase: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": 3,
        "gpu": 1,
        "uuid": "GPU-b",
        "pci_bus_id": "00000000:19:00.0",
        "phase": phase,
        "active": phase in ("stopping", "released", "taking_back"),
        "by": "alice (uid 1000)",
        "for_s": 5.0,
        "ends_in_s": 595.0,
        "window_s": 600.0,
        "engines": ["gpu1"],
        "kept_stopped": [],
        "nvml_closed": phase == "released",
        "outcome": "stopping gpu1, then closing NVML",
        "reset_command": "nvidia-smi -r -i GPU-b",
        "take_back_command": "llm-supervisor gpu take-back 1",
        **fields,
    }


class Scripted(Client):
    """The reply to the command, then one `status` per poll, each with the release as given."""

    def __init__(self, reply: dict[str, Any], *polls: dict[str, Any] | None) -> None:
        super().__init__(path=Path("/nonexistent"))
        self.reply, self.polls = reply, list(polls)
        self.asked: list[dict[str, Any]] = []

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        self.asked.append(payload)
        if payload["command"] != "status":
            return self.reply
        return {"engines": {}, "gpu_release": self.polls.pop(0)}


def run(client: Client, command: str, **kwargs: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = gpu_command(client, command, 1, as_json=False, out=out, err=err, sleep=lambda s: None, **kwargs)
    return code, out.getvalue(), err.getvalue()


def test_release_waits_for_nvml_to_close_then_prints_the_reset() -> None:
    client = Scripted(
        {"release": release("stopping"), "engines": ["gpu1"]},
        release("stopping", outcome="closing NVML"),
        release("released", outcome="gpu1 stopped and held; NVML closed"),
    )
    code, out, err = run(client, "release", window_s=300.0)
    assert code == 0 and err == ""
    assert client.asked[0] == {"command": "gpu_release", "gpu": 1, "window_s": 300.0}
    lines = out.splitlines()
    assert lines[0] == "GPU 1 (GPU-b): release accepted; stopping gpu1, then closing NVML"
    assert lines[1] == "GPU 1: closing NVML"
    assert "GPU 1 released (GPU-b, PCI 00000000:19:00.0): gpu1 stopped and held" in out
    assert "  nvidia-smi -r -i GPU-b" in lines and "  llm-supervisor gpu take-back 1" in lines
    assert "-i 00000000:19:00.0, or -i 1" in out


def test_a_release_that_fails_exits_1_with_why() -> None:
    client = Scripted(
        {"release": release("stopping")},
        release("failed", outcome="gpu1 did not stop within 1m35s: NVML not closed"),
    )
    code, _, err = run(client, "release")
    assert code == 1 and "GPU 1: gpu1 did not stop within 1m35s" in err


def test_take_back_waits_until_the_gpu_was_judged() -> None:
    done = "taken back: it answers NVML (recovery action none); gpu_unrecoverable cleared; started gpu1"
    client = Scripted(
        {"release": release("taking_back", outcome="opening NVML again")},
        release("taking_back", outcome="opening NVML again"),
        release("done", outcome=done),
    )
    code, out, _ = run(client, "take-back")
    assert code == 0 and client.asked[0] == {"command": "gpu_take_back", "gpu": 1}
    assert out.splitlines() == ["GPU 1 (GPU-b): take-back accepted; opening NVML again", f"GPU 1 {done}"]


def test_a_refused_command_and_a_release_gone_from_the_daemon_exit_1() -> None:
    class No(Client):
        def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
            raise Refused("GPU 0 is the one released, not GPU 1")

    code, _, err = run(No(path=Path("/nonexistent")), "take-back")
    assert code == 1 and "GPU 0 is the one released" in err
    code, _, err = run(Scripted({"release": release("stopping")}, None), "release")
    assert code == 1 and "gone from the daemon" in err


def test_status_says_where_a_release_stands() -> None:
    assert render.gpu_release_lines(release("stopping")) == [
        "GPU 1 release (by alice (uid 1000)): stopping gpu1, then closing NVML"
    ]
    (line,) = render.gpu_release_lines(release("released"))
    assert line.startswith("GPU 1 released for its reset 5s ago by alice (uid 1000): NVML closed on purpose")
    assert "reset it: nvidia-smi -r -i GPU-b, then `llm-supervisor gpu take-back 1`" in line
    assert line.endswith("taken back by itself in 9m55s")
    assert render.gpu_release_lines(release("failed", outcome="x")) == ["GPU 1 release failed 5s ago: x"]
    assert render.gpu_release_lines(release("done", outcome="taken back: y", for_s=3600.0)) == []
    assert render.gpu_release_lines(release("done", outcome="taken back: y")) == [
        "GPU 1 taken back 5s ago: y"
    ]
    status = {
        "engines": {},
        "gpu_release": release("released"),
        "nvml": {"up": False, "reason": "released", "detail": "released by alice", "needed": True},
    }
    shown = render.format_status(status)
    assert "GPU 1 released for its reset" in shown and "NVML unavailable" not in shown


def test_a_hold_for_a_gpu_reset_says_so_and_describe_shows_the_release() -> None:
    hold = {
        "hold": "stop",
        "by": "alice (uid 1000)",
        "since": 100.0,
        "gpu_reset": {"gpu": 1, "uuid": "GPU-b"},
    }
    engine = {"state": "stopped", "reason": "stop requested: stopped", "gpus": [1], "hold": hold}
    assert render.short_hold(engine, now=160.0) == "held: stop for GPU 1 reset (alice, 1m)"
    assert "for the reset of GPU 1 (GPU-b): `llm-supervisor gpu take-back 1` starts it" in str(
        render.hold_text(engine)
    )
    text = format_describe("gpu1", engine, [], {}, release=release("released"))
    assert "GPU release:" in text and "nvidia-smi -r -i GPU-b" in text
    assert "GPU release:" not in format_describe("gpu1", engine, [], {}, release=release("done"))


def test_the_parser_takes_the_gpu_commands(capsys: Any, tmp_path: Path) -> None:
    """A bad window is refused before the daemon is asked; no daemon is 69."""
    config = tmp_path / "none.yaml"
    assert main(["gpu", "release", "1", "--window", "0", "--config", str(config)]) == 2
    assert "--window must be above 0" in capsys.readouterr().err
    sock = tmp_path / "no.sock"
    assert main(["gpu", "take-back", "1", "--config", str(config), "--socket", str(sock)]) == 69
