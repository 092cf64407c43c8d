"""Issue 38, points 6 and 7: the state dir trusts no one. A link planted in it is refused, never
followed (root created files through ``engines/b`` -> elsewhere); the engine's heartbeat file is
never someone else's; the state dir is created 0750, tightened when the daemon owns it, refused
when another user does. State files are read as regular files only, bounded, without blocking:
a FIFO at ``holds/a.json`` hung the daemon, ``ladder.json`` -> ``/dev/zero`` grew it past 1 GB."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmsupervisor import logs, process
from llmsupervisor.cli import main as cli
from llmsupervisor.daemon.holds import Holds
from llmsupervisor.engine.commands import Stop
from llmsupervisor.engine.evidence import incident_dir, write_incident
from llmsupervisor.engine.ladder import LadderStore
from llmsupervisor.engine.launch import launch
from llmsupervisor.errors import EX_CONFIG
from llmsupervisor.files import read_json
from llmsupervisor.probes.heartbeat import StepBeat, read_heartbeat
from llmsupervisor.probes.vllm_plugin.llmsupervisor_step_heartbeat import Heartbeat
from llmsupervisor.stacks import StackDump
from tests.lib.engine_fakes import FakeProcesses
from tests.lib.paths import REPO
from tests.lib.runner_harness import spec

LADDER = ({"max-num-seqs": 16},)
HANG_S = 10.0  # a read still running after this is hung (it takes microseconds)


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """(state dir, elsewhere): ``engines/b`` and ``holds`` are links to elsewhere."""
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    (state / "engines").mkdir(parents=True)
    elsewhere.mkdir()
    (state / "engines" / "b").symlink_to(elsewhere)
    (state / "holds").symlink_to(elsewhere)
    return state, elsewhere


# ---- point 6: nothing is written through a planted link ----


def test_a_ladder_step_is_not_written_through_a_planted_engine_directory(
    planted: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    state, elsewhere = planted
    store = LadderStore(state, spec(name="b", ladder=LADDER))
    with caplog.at_level(logging.WARNING, logger="llmsupervisor.files"):
        store.set(1, "out of memory")
    assert list(elsewhere.iterdir()) == []
    assert "symbolic link" in caplog.text


def test_a_process_group_record_is_not_written_through_a_planted_engine_directory(
    planted: tuple[Path, Path],
) -> None:
    state, elsewhere = planted
    with pytest.raises(OSError) as info:
        process.record_group(state, "b", os.getpid(), os.getpid())
    assert info.value.errno == errno.ELOOP
    assert list(elsewhere.iterdir()) == []


def test_an_operators_hold_is_not_written_through_a_planted_holds_directory(
    planted: tuple[Path, Path],
) -> None:
    state, elsewhere = planted

    async def scenario() -> None:
        holds = Holds(state / "holds")
        holds.note("a", [Stop()], by="alice", now=1.0)
        await holds.persist("a")

    asyncio.run(scenario())
    assert list(elsewhere.iterdir()) == []


def test_an_incident_is_not_written_through_a_planted_engine_directory(planted: tuple[Path, Path]) -> None:
    state, elsewhere = planted
    dump = StackDump(1, "VLLM::EngineCore", "S", True, "stack")
    with pytest.raises(OSError):
        write_incident(
            incident_dir(state, "b"), engine="b", cause="hang", reason="r", dumps=[dump], root=state
        )
    assert list(elsewhere.iterdir()) == []


def test_an_engine_whose_directory_is_a_planted_link_does_not_start(planted: tuple[Path, Path]) -> None:
    """Its heartbeat, and vLLM its compile cache, would be made wherever the link points; the
    daemon makes nothing there either (not even the cache's empty directory)."""
    state, elsewhere = planted
    procs = FakeProcesses(state_dir=state)
    launched = asyncio.run(launch(spec(name="b"), 0, procs))
    assert launched.proc is None and procs.spawned == []
    assert "symbolic link" in launched.failure
    assert list(elsewhere.iterdir()) == []


def test_a_directory_of_another_user_in_the_state_dir_is_not_used(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    state = tmp_path / "state"
    (state / "engines" / "b").mkdir(parents=True)
    os.chown(state / "engines" / "b", 65534, 65534)
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        process.record_group(state, "b", os.getpid(), os.getpid())
    assert list((state / "engines" / "b").iterdir()) == []


# ---- point 6: the heartbeat file is the engine's own ----


def test_the_heartbeat_does_not_follow_a_link_planted_before_the_engine_opens_it(tmp_path: Path) -> None:
    """The daemon removes it before the spawn; the engine opens it seconds later."""
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    beat = tmp_path / "step-heartbeat"
    beat.symlink_to(victim)
    with pytest.raises(OSError):
        Heartbeat(str(beat))
    assert victim.read_text() == "root:secret\n"  # neither truncated nor mapped


def test_the_heartbeat_does_not_take_a_planted_hard_link(tmp_path: Path) -> None:
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    beat = tmp_path / "step-heartbeat"
    os.link(victim, beat)
    with pytest.raises(OSError):
        Heartbeat(str(beat))
    assert victim.read_text() == "root:secret\n"


def test_the_heartbeat_takes_its_own_file_again(tmp_path: Path) -> None:
    """A second scheduler of the engine (or one left behind) is a regular file of this user."""
    beat = tmp_path / "step-heartbeat"
    Heartbeat(str(beat))
    Heartbeat(str(beat)).on_schedule(1, 8)
    found = read_heartbeat(beat)
    assert isinstance(found, StepBeat) and found.scheduled == 1


def test_the_heartbeat_reader_does_not_wait_on_a_fifo(tmp_path: Path) -> None:
    beat = tmp_path / "step-heartbeat"
    os.mkfifo(beat)
    result = within(lambda: read_heartbeat(beat), unblock=beat)
    assert result is not None and "not a regular file" in str(getattr(result, "detail", ""))


# ---- point 6: whom the state dir itself lets in ----


class Started:
    """Stands for the Supervisor: what `run` does before it is what is tested."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def run(self) -> int:
        return 0


@pytest.fixture
def run_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[Path], int]:
    import llmsupervisor.daemon.supervisor

    monkeypatch.setattr(logs, "setup", lambda *args, **kwargs: None)
    monkeypatch.setattr(llmsupervisor.daemon.supervisor, "Supervisor", Started)

    def run(state: Path) -> int:
        path = tmp_path / "config.yaml"
        engine = {"name": "a", "model": "tiny", "port": 8001, "command": ["/bin/true"]}
        path.write_text(yaml.safe_dump({"supervisor": {"state_dir": str(state)}, "engines": [engine]}))
        return cli.main(["--config", str(path)])

    return run


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_a_new_state_dir_is_created_0750(
    tmp_path: Path, run_daemon: Callable[[Path], int], umask_022: None
) -> None:
    assert run_daemon(tmp_path / "state") == 0
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o750


def test_a_state_dir_of_the_daemons_own_that_others_may_write_in_is_closed(
    tmp_path: Path, run_daemon: Callable[[Path], int], caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    assert run_daemon(state) == 0
    assert stat.S_IMODE(state.stat().st_mode) == 0o755
    assert "was writable by its group and others (mode 0777); now 0755" in caplog.text


def test_a_state_dir_of_another_user_is_refused(
    tmp_path: Path, run_daemon: Callable[[Path], int], capsys: pytest.CaptureFixture[str]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 65534, 65534)
    assert run_daemon(state) == EX_CONFIG
    err = capsys.readouterr().err
    assert (
        f"state dir {state} is owned by" in err and "(uid 65534)" in err and "not starting (exit 78)" in err
    )
    assert list(state.iterdir()) == []  # not even the lock


# ---- point 7: regular files only, bounded, never blocking ----


def within(call: Callable[[], Any], *, unblock: Path) -> Any:
    """``call()`` in a thread; a test failure (not a hung test) when it is still running after
    HANG_S: the FIFO ``unblock`` is then opened for writing, which lets a reader stuck on it go."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(HANG_S)
    hung = thread.is_alive()
    if hung:
        fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(HANG_S)
    assert not hung, f"reading {unblock} hung (a FIFO planted there)"
    return out[0] if out else None


def test_a_fifo_planted_as_a_hold_does_not_hang_the_daemons_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = tmp_path / "holds" / "a.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    holds = Holds(tmp_path / "holds")
    with caplog.at_level(logging.WARNING, logger="llmsupervisor.files"):
        within(lambda: holds.load(["a"]), unblock=fifo)
    assert holds.get("a") is None
    assert "not a regular file (a FIFO)" in caplog.text


def test_a_fifo_planted_as_a_group_record_does_not_hang_the_leftover_sweep(tmp_path: Path) -> None:
    fifo = tmp_path / "engines" / "a" / "group.json"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    assert within(lambda: process.recorded_groups(tmp_path), unblock=fifo) == []


def test_a_ladder_linked_to_dev_zero_is_not_read(tmp_path: Path) -> None:
    """It grew the daemon past 1 GB in seconds: here under a 2 GiB address-space limit, in a
    child, so that the test fails instead of taking the machine's memory."""
    state = tmp_path / "state"
    (state / "engines" / "a").mkdir(parents=True)
    (state / "engines" / "a" / "ladder.json").symlink_to("/dev/zero")
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from pathlib import Path\n"
        "from llmsupervisor.engine.ladder import LadderStore\n"
        "from tests.lib.runner_harness import spec\n"
        f"print(LadderStore(Path({str(state)!r}), spec(name='a', ladder=({{'max-num-seqs': 16}},))).step)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]
    assert "symbolic link: not followed" in done.stderr


def test_a_state_file_over_the_bound_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gpu-faults.json"
    with open(path, "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: 64 MiB of nothing, on no disk
    with caplog.at_level(logging.WARNING, logger="llmsupervisor.files"):
        assert read_json(path, {"safe": True}) == {"safe": True}
    assert "larger than 4194304 bytes: not read" in caplog.text
    assert not path.exists() and len(list(tmp_path.glob("gpu-faults.json.corrupt-*"))) == 1
