"""Issue 38, points 2, 3 and 4, on virtual time: a full state disk loses nothing. An operator's
stop acts at once, is shown as not saved yet, and is on disk once the disk has room; a ladder
step and a GPU mark likewise; every kept write is tried again on a bounded backoff (no busy
loop), and at once when another state file lands; a daemon starts on a full disk. The real
daemon over a real full tmpfs, across a restart: tests/system/test_full_disk_system.py."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmsupervisor import aio, logs
from llmsupervisor.cli import main as cli
from llmsupervisor.config import EngineSpec, SupervisorConfig, SupervisorSettings
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon import lock
from llmsupervisor.daemon.actions import GpuMarks
from llmsupervisor.daemon.holds import Holds
from llmsupervisor.daemon.requests import Request
from llmsupervisor.daemon.supervisor import Supervisor
from llmsupervisor.engine.ladder import LadderStore
from llmsupervisor.files import JsonFileWriter, flush_all
from llmsupervisor.notify import Notifier
from llmsupervisor.probes.fake_gpu import FakeGpu
from tests.lib.engine_fakes import FakeProcesses, FakeSweeper, ServerScript
from tests.lib.full_disk import FullDisk
from tests.lib.runner_harness import spec
from tests.lib.virtual_time import run_virtual

FULL_FOR_S = 600.0  # ten minutes of a full disk
NO_SPACE = os.strerror(errno.ENOSPC)
ROOM_WITHIN_S = 60.0  # RETRY_MAX_S (30 s) and then some: a kept write lands within it


def test_a_ladder_step_taken_on_a_full_disk_lands_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A step lost to a restart starts the engine again at the batch that ran it out of memory."""
    state = tmp_path / "state"
    ladder = spec(name="a", ladder=({"max-num-seqs": 16},))

    async def scenario() -> int:
        disk = FullDisk(monkeypatch)
        store = LadderStore(state, ladder)
        store.set(1, "out of memory at start")
        assert store.step == 1  # the next spawn runs at it, written or not
        await asyncio.sleep(FULL_FOR_S)
        assert not store.path.exists()
        # No busy loop: a bounded backoff (1 s doubling to 30 s), not an attempt per turn.
        assert 1 < disk.refused <= FULL_FOR_S / 30 + 6
        disk.free()
        await asyncio.sleep(ROOM_WITHIN_S)
        return LadderStore(state, ladder).step  # what the next daemon finds

    with caplog.at_level(logging.INFO, logger="llmsupervisor.files"):
        assert run_virtual(scenario()) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "llmsupervisor.files"]
    assert len(warnings) == 1 and "tried again until written" in warnings[0].getMessage()  # once, not per try
    assert "saved the ladder step to" in caplog.text


def test_a_gpu_mark_on_a_full_disk_lands_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpu-faults.json"
    uuids = {0: "GPU-aaaa"}

    async def scenario() -> dict[int, int]:
        disk = FullDisk(monkeypatch)
        marks = GpuMarks(path, gpus=lambda: uuids, boot="boot-1", node="n1")
        marks.mark((0,), "Xid 79: fallen off the bus", reason="xid")
        await asyncio.sleep(FULL_FOR_S)
        assert not path.exists()
        disk.free()
        await asyncio.sleep(ROOM_WITHIN_S)
        return GpuMarks(path, gpus=lambda: uuids, boot="boot-1", node="n1").counts

    assert run_virtual(scenario()) == {0: 1}


def test_a_kept_write_lands_at_once_when_another_state_file_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk has room again: a writer waiting out a 30 s backoff need not wait it out."""

    async def scenario() -> bool:
        disk = FullDisk(monkeypatch)
        ladder = JsonFileWriter(tmp_path / "ladder.json", what="the ladder step")
        ladder.save({"step": 1})
        await asyncio.sleep(FULL_FOR_S + 10)  # its backoff is at its longest now, 20 s to go
        disk.free()
        status = JsonFileWriter(tmp_path / "status.json", what="the status")
        status.save({"engines": {}})
        await asyncio.sleep(1.0)  # not the up to 30 s left of its backoff
        return (tmp_path / "ladder.json").exists()

    assert run_virtual(scenario())


def test_at_shutdown_a_kept_write_gets_one_more_try(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> list[Path]:
        disk = FullDisk(monkeypatch)
        ladder = JsonFileWriter(tmp_path / "ladder.json", what="the ladder step")
        ladder.save({"step": 2})
        await asyncio.sleep(FULL_FOR_S)
        assert await flush_all(5.0) == [ladder.path]  # still full: named, not waited on for long
        disk.free()
        return await flush_all(5.0)  # well inside the 30 s backoff: tried because of the flush

    assert run_virtual(scenario()) == []
    assert json.loads((tmp_path / "ladder.json").read_text()) == {"step": 2}


# ---- the operator's hold, through the daemon's loop ----


def two_engines(tmp_path: Path) -> SupervisorConfig:
    engines = tuple(
        EngineSpec(
            name=name,
            model="m",
            port=port,
            gpus=(),
            command=("vllm-fake",),
            start_timeout_s=60.0,
            gpu_release_timeout_s=0.0,
        )
        for name, port in (("a", 8001), ("b", 8002))
    )
    settings = SupervisorSettings(state_dir=tmp_path / "state", tick_interval_s=2.0)
    return SupervisorConfig(path=tmp_path / "config.yaml", supervisor=settings, engines=engines)


async def wait_state(sup: Supervisor, name: str, state: EngineState) -> None:
    while (status := sup.fleet.status(name)) is None or status.state is not state:
        seen = sup.fleet.changes.version
        await aio.wait_any(sup.fleet.changes.wait(seen), timeout_s=600)


def test_an_operators_stop_on_a_full_disk_acts_says_so_and_is_kept_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepted and acted on at once (an operator stopping an engine on a full disk wants it
    stopped), the reply and `status` say it is not saved yet, and it is on disk once the disk
    has room, for the next daemon."""
    holds_dir = tmp_path / "state" / "holds"

    async def scenario() -> dict[str, Any]:
        procs = FakeProcesses(state_dir=tmp_path / "state")
        sup = Supervisor(
            two_engines(tmp_path),
            notifier=Notifier(environ={}),
            gpu_reader=FakeGpu(),
            procs=procs,
            http_for=ServerScript(procs).http_for,
            sweeper=FakeSweeper(),
        )
        for engine in sup.config.engines:
            sup.fleet.add(engine)
        loop = asyncio.create_task(sup._loop())
        await wait_state(sup, "a", EngineState.READY)
        await wait_state(sup, "b", EngineState.READY)
        disk = FullDisk(monkeypatch)

        reply = await sup.intake.on_control({"command": "stop", "engine": "a"})
        assert reply["accepted"] == "stop" and reply["hold"]["hold"] == "stop"
        assert reply["hold_unsaved"] == os.strerror(errno.ENOSPC)
        await wait_state(sup, "a", EngineState.STOPPED)  # it acted
        await asyncio.sleep(FULL_FOR_S)
        shown = sup.status()
        assert shown["engines"]["a"]["hold"]["hold"] == "stop"
        assert shown["engines"]["a"]["hold_unsaved"] == os.strerror(errno.ENOSPC)
        assert shown["engines"]["b"]["hold_unsaved"] is None
        unsaved = {u["file"] for u in shown["state_files_unsaved"]}
        assert str(holds_dir / "a.json") in unsaved
        assert sup.summary().startswith("state dir full: ")
        assert not (holds_dir / "a.json").exists()

        disk.free()
        await asyncio.sleep(ROOM_WITHIN_S)
        after = sup.status()
        sup.submit(Request.SHUTDOWN)
        await loop
        sup.fleet.stop_all()
        await asyncio.wait_for(asyncio.gather(*sup.fleet.all_tasks()), 600)
        return after

    after = run_virtual(scenario())
    assert after["engines"]["a"]["hold_unsaved"] is None and after["state_files_unsaved"] == []
    again = Holds(holds_dir)  # the next daemon
    again.load(["a", "b"])
    kept = again.get("a")
    assert kept is not None and kept.kind == "stop"
    assert again.get("b") is None


# ---- a daemon started on a full disk ----


def test_the_lock_is_taken_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pid in the lock file is for messages; the lock is the kernel's."""

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    held = lock.acquire(tmp_path)
    try:
        assert held.held
        assert held.pid_unwritten is not None and held.pid_unwritten.errno == errno.ENOSPC
    finally:
        held.release()


def test_run_starts_the_daemon_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It exited 1: under systemd, five tries, then every engine stayed down."""
    import llmsupervisor.daemon.supervisor

    path = tmp_path / "config.yaml"
    engine = {"name": "a", "model": "tiny", "port": 8001, "command": ["/bin/true"]}
    path.write_text(
        yaml.safe_dump({"supervisor": {"state_dir": str(tmp_path / "state")}, "engines": [engine]})
    )
    ran: list[bool] = []

    class Started:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        async def run(self) -> int:
            ran.append(True)
            return 0

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(logs, "setup", lambda *args, **kwargs: None)
    monkeypatch.setattr(llmsupervisor.daemon.supervisor, "Supervisor", Started)
    monkeypatch.setattr(os, "pwrite", full)
    assert cli.main(["--config", str(path)]) == 0
    assert ran == [True]
    assert "cannot write this daemon's pid (No space left on device)" in caplog.text


# ---- how it is shown ----


def test_the_reply_status_table_and_metric_say_what_is_not_saved_yet(tmp_path: Path) -> None:
    from llmsupervisor.cli import render
    from llmsupervisor.daemon.exporter import Exporter
    from llmsupervisor.daemon.status import Snapshot, unsaved_text
    from llmsupervisor.files import UnsavedFile

    reply = {"engine": "a", "accepted": "stop", "doing": "draining, then stopping", "hold_unsaved": NO_SPACE}
    assert render.accepted_line(reply) == (
        f"a: stop accepted; draining, then stopping; the hold is not saved yet ({NO_SPACE}): it holds"
        " now, is written once the disk has room, and a daemon restart before then would forget it"
    )
    held = {"hold": {"hold": "stop", "by": "alice (uid 1000)", "since": 0.0}, "hold_unsaved": NO_SPACE}
    assert (render.hold_text(held) or "").endswith(f", not saved yet: {NO_SPACE}")
    assert (
        render.hold_text({"hold": None, "hold_unsaved": NO_SPACE})
        == f"hold removed, not saved yet: {NO_SPACE}"
    )
    assert render.hold_text({"hold": None, "hold_unsaved": None}) is None

    unsaved = UnsavedFile(tmp_path / "holds" / "a.json", "the operator's hold", NO_SPACE, 1.0, True)
    table = render.format_status({"engines": {}, "state_files_unsaved": [unsaved.as_json()]})
    assert f"State files not saved yet ({NO_SPACE}): {tmp_path / 'holds' / 'a.json'}" in table
    assert unsaved_text([unsaved]) == f"state dir full: 1 state file(s) not saved yet ({NO_SPACE})"
    registry = Exporter(lambda: Snapshot(engines=(), unsaved_files=(unsaved,))).registry
    assert registry.get_sample_value("llmsupervisor_state_files_unsaved") == 1.0
