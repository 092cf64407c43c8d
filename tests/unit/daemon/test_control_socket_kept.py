"""Issue 38, point 8: the control socket is the daemon's own, kept while it runs and removed only
if it is still its own.

Before: a deleted socket was never re-created (every CLI command said "the daemon is not
running" while it ran), and at exit the daemon unlinked whatever socket sat at the path, an
impostor's included. Real Unix sockets in a temporary directory; the server's check is called
directly (the daemon calls it every few seconds and on SIGHUP).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import control
from llmsupervisor.cli.client import Client, Unreachable
from llmsupervisor.daemon import lock


async def handler(request: dict[str, Any]) -> Any:
    return {"pong": request["command"]}


def ask(path: Path) -> dict[str, Any]:
    return control.request(path, {"command": "status"}, timeout_s=5.0)


def test_a_deleted_socket_is_made_again_and_answers(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"

    async def scenario() -> None:
        server = control.ControlServer(path, handler)
        await server.start()
        try:
            assert (await asyncio.to_thread(ask, path))["ok"]
            path.unlink()
            with pytest.raises(control.ControlError, match="no control socket"):
                await asyncio.to_thread(ask, path)
            assert await server.keep() is True  # noticed, and made again
            reply = await asyncio.to_thread(ask, path)
            assert reply == {"ok": True, "result": {"pong": "status"}}
            assert oct(path.stat().st_mode & 0o777) == "0o660"
            assert await server.keep() is False  # its own: nothing to do
        finally:
            await server.close()
        assert not path.exists()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_the_daemon_notices_a_deleted_socket_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "control.sock"
    monkeypatch.setattr(control, "SOCKET_CHECK_S", 0.05, raising=False)

    async def scenario() -> None:
        server = control.ControlServer(path, handler)
        await server.start()
        try:
            path.unlink()
            for _ in range(200):  # 10 s at most
                if path.exists():
                    break
                await asyncio.sleep(0.05)
            assert (await asyncio.to_thread(ask, path))["ok"]
        finally:
            await server.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def with_an_impostor(path: Path, while_running: Callable[[control.ControlServer], Awaitable[None]]) -> None:
    """A server at ``path`` whose socket someone removes and replaces with their own;
    ``while_running`` runs then, the server closes, and the impostor's socket must be there."""
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    async def scenario() -> int:
        server = control.ControlServer(path, handler)
        await server.start()
        try:
            os.unlink(path)
            impostor.bind(str(path))  # someone else's socket now sits at the path
            impostor.listen()
            inode = os.stat(path).st_ino
            await while_running(server)
        finally:
            await server.close()
        return inode

    try:
        inode = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert path.exists() and path.stat().st_ino == inode
    finally:
        impostor.close()


def test_at_exit_an_impostors_socket_is_left_where_it_is(tmp_path: Path) -> None:
    async def nothing(_: control.ControlServer) -> None:
        pass

    with_an_impostor(tmp_path / "control.sock", nothing)


def test_someone_elses_socket_is_not_replaced_while_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def look_twice(server: control.ControlServer) -> None:
        assert await server.keep() is False
        assert await server.keep() is False

    with_an_impostor(tmp_path / "control.sock", look_twice)
    said = [r.getMessage() for r in caplog.records if "not this daemon's" in r.getMessage()]
    assert len(said) == 1, said  # said once, not at every look


def test_the_cli_says_the_daemon_runs_but_its_socket_is_gone(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    held = lock.acquire(state_dir)  # this process plays the daemon: it holds the lock
    try:
        client = Client(state_dir / "control.sock", state_dir=state_dir)
        with pytest.raises(Unreachable) as caught:
            client.call({"command": "status"})
        text = str(caught.value)
        assert f"the daemon runs (pid {os.getpid()}, lock held)" in text
        assert "its control socket" in text and "is gone" in text
        assert "not running" not in text
    finally:
        held.release()
    # No lock held: it is not running, as before.
    with pytest.raises(Unreachable, match="the daemon is not running"):
        Client(state_dir / "control.sock", state_dir=state_dir).call({"command": "status"})
