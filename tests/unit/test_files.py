"""State files (status.json, ladder.json, GPU marks, recorded groups): written durably (fsync of
the file, then of the directory after the rename), created 0640 whatever the umask; a corrupt
one is logged, kept aside as NAME.corrupt-TIMESTAMP (a few at most) and the default used."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsupervisor.daemon.status import StatusFile
from llmsupervisor.files import (
    MAX_CORRUPT_KEPT,
    JsonFileWriter,
    flush_all,
    read_json,
    remove_stale_temporaries,
    write_json_atomic,
)
from tests.lib.held_disk import HeldDisk


@pytest.fixture
def umask() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_write_fsyncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state" / "ladder.json"
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        events.append("fsync dir" if stat.S_ISDIR(mode) else "fsync file")
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path, **dir_fds: int) -> None:
        events.append("rename")
        real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_json_atomic(path, {"step": 2})
    assert events == ["fsync file", "rename", "fsync dir"]
    assert json.loads(path.read_text()) == {"step": 2}
    assert [p.name for p in path.parent.iterdir()] == ["ladder.json"]  # no temporary left


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o000])
def test_files_are_created_0640_whatever_the_umask(tmp_path: Path, umask: None, mask: int) -> None:
    os.umask(mask)
    path = tmp_path / "status.json"
    write_json_atomic(path, {"a": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    write_json_atomic(path, {"a": 2})  # a rewrite too
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_secret_is_created_0600(tmp_path: Path, umask: None) -> None:
    path = tmp_path / "token.json"
    write_json_atomic(path, {"token": "x"}, mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ladder.json"
    write_json_atomic(path, {"step": 1})

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        write_json_atomic(path, {"step": 2})
    assert json.loads(path.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ladder.json"]


def test_a_missing_file_is_the_default_without_a_word(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        assert read_json(tmp_path / "absent.json", {"d": 1}) == {"d": 1}
    assert not caplog.records


@pytest.mark.parametrize("content", [b"", b'{"step": 2', b"\xff\xfe garbage", b"\0\0\0\0"])
def test_a_corrupt_file_is_logged_and_kept_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    path = tmp_path / "ladder.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="llmsupervisor.files"):
        assert read_json(path, {"safe": True}) == {"safe": True}
    assert not path.exists()
    [kept] = list(tmp_path.glob("ladder.json.corrupt-*"))
    assert kept.read_bytes() == content
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert str(path) in record.getMessage() and kept.name in record.getMessage()


def test_corrupt_copies_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "gpu-faults.json"
    for i in range(MAX_CORRUPT_KEPT + 3):
        path.write_text(f"not json {i}")
        assert read_json(path, {}) == {}
    kept = sorted(tmp_path.glob("gpu-faults.json.corrupt-*"))
    assert len(kept) == MAX_CORRUPT_KEPT
    # The newest are kept: the last corruption is the one to look at.
    assert {p.read_text() for p in kept} == {f"not json {i}" for i in range(3, MAX_CORRUPT_KEPT + 3)}


def test_an_unreadable_path_is_logged_and_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "status.json"
    path.mkdir()  # cannot be read as a file; not corrupt content, so not moved
    with caplog.at_level(logging.WARNING, logger="llmsupervisor.files"):
        assert read_json(path, 7) == 7
    assert path.is_dir()
    assert any("cannot read" in r.getMessage() for r in caplog.records)


def test_the_control_socket_is_0660_under_the_units_umask(tmp_path: Path, umask: None) -> None:
    # The unit sets UMask=0077; the CLI's users in the daemon's group must still connect.
    import asyncio

    from llmsupervisor import control

    async def scenario() -> int:
        async def handler(request: dict[str, object]) -> object:
            return None

        server = control.ControlServer(tmp_path / "control.sock", handler)
        await server.start()
        try:
            return stat.S_IMODE((tmp_path / "control.sock").stat().st_mode)
        finally:
            await server.close()

    os.umask(0o077)
    assert asyncio.run(scenario()) == 0o660
    write_json_atomic(tmp_path / "status.json", {})
    assert stat.S_IMODE((tmp_path / "status.json").stat().st_mode) == 0o640


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped (not reused within a test)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporaries_of_dead_writers_are_removed_and_others_kept(tmp_path: Path) -> None:
    """A SIGKILL during a write leaves .NAME.PID.tmp behind; it was never removed (issue 28)."""
    path = tmp_path / "status.json"
    dead = tmp_path / f".status.json.{_dead_pid()}.tmp"
    alive = tmp_path / f".status.json.{os.getppid()}.tmp"  # a running writer's: not ours to remove
    unrelated = [tmp_path / ".status.json.abc.tmp", tmp_path / f".ladder.json.{_dead_pid()}.tmp"]
    for file in (dead, alive, *unrelated):
        file.write_text("{")
    assert remove_stale_temporaries(path) == [dead]
    assert not dead.exists()
    assert alive.exists() and all(f.exists() for f in unrelated)
    assert remove_stale_temporaries(tmp_path / "missing" / "status.json") == []


def test_the_status_file_removes_a_temporary_left_by_a_killed_daemon(tmp_path: Path) -> None:
    stale = tmp_path / f".status.json.{_dead_pid()}.tmp"
    stale.write_text('{"half": ')
    StatusFile(tmp_path / "status.json")
    assert not stale.exists()


def test_a_save_on_the_loop_returns_while_the_disk_holds_the_write_and_the_newest_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ladder.json"

    async def scenario() -> None:
        disk = HeldDisk(monkeypatch)
        writer = JsonFileWriter(path, what="the ladder step")
        writer.save({"step": 1})
        assert await asyncio.to_thread(disk.entered.wait, 30)  # the write waits, in its thread
        writer.save({"step": 2})
        writer.save({"step": 3})  # the loop went on: these coalesce behind the held write
        assert not path.exists()
        disk.release()
        assert await flush_all(30) == []
        assert json.loads(path.read_text()) == {"step": 3}
        assert writer.failed is None

    asyncio.run(scenario())


def test_a_failed_background_save_is_logged_and_kept_for_the_caller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")

    async def scenario() -> JsonFileWriter:
        writer = JsonFileWriter(blocked / "status.json", what="the status")
        writer.save({"a": 1})
        assert await flush_all(30) == [writer.path]  # not on disk: kept, and tried again
        return writer

    with caplog.at_level(logging.WARNING, logger="llmsupervisor.files"):
        writer = asyncio.run(scenario())
    assert isinstance(writer.failed, OSError)
    assert "cannot save the status to" in caplog.text


def test_a_flush_on_a_disk_that_does_not_answer_ends_at_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        disk = HeldDisk(monkeypatch)
        writer = JsonFileWriter(tmp_path / "status.json", what="the status")
        writer.save({"a": 1})
        assert await asyncio.to_thread(disk.entered.wait, 30)
        assert await flush_all(0.05) == [writer.path]
        disk.release()
        assert await flush_all(30) == []

    asyncio.run(scenario())


def test_without_a_loop_a_save_writes_at_once(tmp_path: Path) -> None:
    writer = JsonFileWriter(tmp_path / "marks.json", what="the GPU marks")
    writer.save({"gpus": {}})
    assert json.loads((tmp_path / "marks.json").read_text()) == {"gpus": {}}


def test_at_shutdown_every_writer_is_waited_for_and_a_stuck_disk_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ladder step or a GPU mark saved just before a stop must not be lost with the loop."""

    async def scenario() -> None:
        disk = HeldDisk(monkeypatch)
        ladder = JsonFileWriter(tmp_path / "ladder.json", what="the ladder step")
        marks = JsonFileWriter(tmp_path / "gpu-marks.json", what="the GPU marks")
        ladder.save({"step": 1})
        marks.save({"gpus": {}})
        assert await asyncio.to_thread(disk.entered.wait, 30)
        assert sorted(p.name for p in await flush_all(0.05)) == ["gpu-marks.json", "ladder.json"]
        disk.release()
        ladder.save({"step": 2})
        assert await flush_all(30) == []
        assert json.loads((tmp_path / "ladder.json").read_text()) == {"step": 2}
        assert (tmp_path / "gpu-marks.json").exists()

    asyncio.run(scenario())
