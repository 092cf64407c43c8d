"""Operator holds: the table of what each command leaves, the files, and who asked."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from llmsupervisor import control
from llmsupervisor.daemon.holds import GpuReset, Holds, OperatorHold, after, desired_for, operator_name
from llmsupervisor.engine.commands import Command, Desired, Hold, Restart, Start, Stop
from tests.lib.runner_harness import spec

STOP = OperatorHold(kind="stop", by="alice (uid 1000)", since=1.0)
DRAIN = OperatorHold(kind="drain", by="alice (uid 1000)", since=1.0)
RESTART = Restart(cause="operator", reason="restart requested by operator")


@pytest.mark.parametrize(
    ("before", "commands", "kind"),
    [
        (None, [Stop()], "stop"),
        (None, [Hold(True)], "drain"),
        (DRAIN, [Stop()], "stop"),
        (STOP, [Hold(True)], "stop"),  # a stopped engine held out of rotation is still stopped
        (STOP, [Start()], None),
        (DRAIN, [Start()], None),
        (DRAIN, [RESTART], "drain"),  # a restart keeps the drain (docs/cli.md)
        (None, [RESTART], None),
        (None, [Stop(final=True)], None),  # the daemon's own shutdown is no hold
    ],
)
def test_what_each_command_leaves(
    before: OperatorHold | None, commands: list[Command], kind: str | None
) -> None:
    hold = after(before, commands, by="bob (uid 1001)", now=9.0)
    assert (hold.kind if hold is not None else None) == kind
    if hold is not None and before is not None and hold.kind == before.kind:
        assert hold == before  # who and since: the first command that held it


def test_a_held_engine_begins_with_the_hold() -> None:
    assert desired_for(spec(), None) is None
    assert desired_for(spec(), STOP) == Desired(run=False)
    assert desired_for(spec(), DRAIN) == Desired(run=True, held=True)
    # enabled: false is the config's word: a drain hold does not start a disabled engine.
    assert desired_for(spec(enabled=False), DRAIN) == Desired(run=False, held=True)


def test_holds_are_written_and_read_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        holds = Holds(tmp_path / "holds")
        holds.note("a", [Stop()], by="alice (uid 1000)", now=5.0)
        holds.note("b", [Hold(True)], by="operator", now=6.0)
        await holds.persist("a")
        await holds.persist("b")
        assert json.loads((tmp_path / "holds" / "a.json").read_text()) == {
            "hold": "stop",
            "by": "alice (uid 1000)",
            "since": 5.0,
        }
        again = Holds(tmp_path / "holds")
        again.load(["a", "b", "c"])
        assert again.get("a") == OperatorHold(kind="stop", by="alice (uid 1000)", since=5.0)
        assert again.get("b") == OperatorHold(kind="drain", by="operator", since=6.0)
        assert again.get("c") is None
        again.note("a", [Start()], by="alice (uid 1000)", now=7.0)
        await again.persist("a")
        assert not (tmp_path / "holds" / "a.json").exists()

    asyncio.run(scenario())


def test_a_stop_for_a_gpu_reset_names_the_gpu_and_an_operators_stop_stays_theirs(tmp_path: Path) -> None:
    """`gpu release`'s stop names the GPU (``gpu_reset``), on disk too, so that `gpu take-back`
    finds its engines after a daemon restart; a stop an operator took before stays untagged."""
    reset = GpuReset(1, "GPU-b")

    async def scenario() -> None:
        holds = Holds(tmp_path / "holds")
        holds.note("a", [Stop()], by="alice (uid 1000)", now=5.0, gpu_reset=reset)
        holds.note("b", [Stop()], by="bob (uid 1001)", now=4.0)
        holds.note("b", [Stop()], by="alice (uid 1000)", now=5.0, gpu_reset=reset)
        holds.note("c", [Hold(True)], by="carol", now=3.0)
        holds.note("c", [Stop()], by="alice (uid 1000)", now=5.0, gpu_reset=reset)
        for name in "abc":
            await holds.persist(name)
        assert json.loads((tmp_path / "holds" / "a.json").read_text())["gpu_reset"] == {
            "gpu": 1,
            "uuid": "GPU-b",
        }
        again = Holds(tmp_path / "holds")
        again.load(["a", "b", "c"])
        assert again.get("a") == OperatorHold(kind="stop", by="alice (uid 1000)", since=5.0, gpu_reset=reset)
        assert again.get("b") == OperatorHold(kind="stop", by="bob (uid 1001)", since=4.0)
        assert sorted(again.for_gpu_reset("GPU-b")) == ["a", "c"] and again.for_gpu_reset("GPU-x") == []

    asyncio.run(scenario())
    assert GpuReset.from_json({"gpu": True, "uuid": "GPU-b"}) is None
    assert GpuReset.from_json({"gpu": 1}) is None


def test_a_corrupt_hold_file_is_no_hold(tmp_path: Path) -> None:
    (tmp_path / "holds").mkdir()
    (tmp_path / "holds" / "a.json").write_text('{"hold": "pause"}')
    (tmp_path / "holds" / "b.json").write_text("{not json")
    holds = Holds(tmp_path / "holds")
    holds.load(["a", "b"])
    assert holds.get("a") is None and holds.get("b") is None


def test_the_control_socket_tells_who_is_asking(tmp_path: Path) -> None:
    """SO_PEERCRED: the kernel's word, not the client's ("peer_uid" in a request is replaced)."""

    async def scenario() -> object:
        seen: list[object] = []

        async def handler(request: dict[str, object]) -> object:
            seen.append(request.get("peer_uid"))
            return None

        server = control.ControlServer(tmp_path / "c.sock", handler)
        await server.start()
        try:
            await asyncio.to_thread(
                control.request, tmp_path / "c.sock", {"command": "status", "peer_uid": -5}
            )
        finally:
            await server.close()
        return seen[0]

    assert asyncio.run(scenario()) == os.getuid()
    name = asyncio.run(operator_name(os.getuid()))
    assert name.endswith(f"(uid {os.getuid()})") or name == f"uid {os.getuid()}"
    assert asyncio.run(operator_name(None)) == "operator"
