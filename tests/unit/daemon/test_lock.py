"""One daemon per state dir: ``llmsupervisor.daemon.lock`` and how ``llm-supervisor run`` uses it
(the two-daemon system test is in test_system_fake.py)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmsupervisor import logs
from llmsupervisor.cli import main as cli
from llmsupervisor.daemon import lock
from llmsupervisor.errors import EX_ALREADY_RUNNING, EX_CONFIG, AlreadyRunning, SupervisorError
from tests.lib.daemon import FAKE_VLLM, free_port


def test_second_acquire_in_one_process_names_the_holder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    held = lock.acquire(state)  # flock locks belong to the open file: a second fd conflicts
    try:
        assert held.held and held.path == state / "daemon.lock"
        assert held.path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(AlreadyRunning) as info:
            lock.acquire(state)
        assert isinstance(info.value, SupervisorError)
        assert info.value.pid == os.getpid()
        assert info.value.path == state / "daemon.lock"
        assert str(info.value) == f"another daemon (pid {os.getpid()}) holds {state / 'daemon.lock'}"
        assert held.path.read_text() == f"{os.getpid()}\n"  # the loser wrote nothing
    finally:
        held.release()


def test_release_then_acquire_again(tmp_path: Path) -> None:
    first = lock.acquire(tmp_path)
    first.release()
    assert not first.held
    assert first.path.read_text() == ""  # a released lock names nobody
    first.release()  # idempotent
    with lock.acquire(tmp_path) as second:
        assert second.held
        assert second.path.read_text() == f"{os.getpid()}\n"
    assert not second.held
    lock.acquire(tmp_path).release()


def test_a_holder_that_has_not_written_its_pid_yet(tmp_path: Path) -> None:
    path = tmp_path / "daemon.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(AlreadyRunning) as info:
            lock.acquire(tmp_path)
        assert info.value.pid is None
        assert "pid unknown" in str(info.value)
    finally:
        os.close(fd)


def test_the_lock_fd_is_close_on_exec(tmp_path: Path) -> None:
    with lock.acquire(tmp_path) as held:
        assert held._fd is not None
        assert not os.get_inheritable(held._fd)
        assert fcntl.fcntl(held._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC


HOLDER = """
import os, signal, subprocess, sys
from pathlib import Path
from llmsupervisor.daemon import lock
held = lock.acquire(Path(sys.argv[1]))
# An engine started with every descriptor passed on: it must not inherit the lock.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
print(child.pid, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_holder_releases_the_lock_even_if_its_children_live(tmp_path: Path) -> None:
    """No stale-lock handling is needed: the kernel drops the lock with the holder."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(AlreadyRunning) as info:
            lock.acquire(tmp_path)
        assert info.value.pid == holder.pid
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.wait(timeout=30) == -9
        os.kill(child, 0)  # the child still runs
        with lock.acquire(tmp_path) as held:
            assert held.path.read_text() == f"{os.getpid()}\n"
    finally:
        os.kill(child, 9)  # not our child: init (or a subreaper) reaps it
        holder.stdin.close()
        holder.stdout.close()


def test_nonexistent_state_dir_is_created(tmp_path: Path) -> None:
    with lock.acquire(tmp_path / "a" / "b") as held:
        assert held.path == tmp_path / "a" / "b" / "daemon.lock"
        assert held.path.is_file()


def test_state_dir_under_a_file_is_a_clear_oserror(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    state = tmp_path / "file" / "state"
    with pytest.raises(OSError) as info:
        lock.acquire(state)
    assert not isinstance(info.value, AlreadyRunning)
    assert f"cannot open the daemon lock {state / 'daemon.lock'}: Not a directory" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_read_only_parent_is_a_clear_permission_error(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(PermissionError) as info:
            lock.acquire(parent / "state")
        assert f"cannot open the daemon lock {parent / 'state' / 'daemon.lock'}: Permission denied" in str(
            info.value
        )
        with pytest.raises(PermissionError, match="cannot open the daemon lock"):
            lock.acquire(parent)  # the dir exists, the file cannot be created in it
    finally:
        parent.chmod(0o755)


# ---- the CLI ----


def config_file(tmp_path: Path, engines: list[dict[str, object]] | None = None) -> Path:
    engine = {"name": "a", "model": "tiny", "port": free_port(), "command": [sys.executable, str(FAKE_VLLM)]}
    path = tmp_path / "config.yaml"
    config = {"supervisor": {"state_dir": str(tmp_path / "state")}, "engines": engines or [engine]}
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the root logger as pytest set it up, and fail if the daemon proper were started."""
    import llmsupervisor.daemon.supervisor

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Supervisor was constructed")

    monkeypatch.setattr(logs, "setup", lambda *args, **kwargs: None)
    monkeypatch.setattr(llmsupervisor.daemon.supervisor, "Supervisor", refuse)


def test_run_exits_75_while_the_lock_is_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_supervisor: None
) -> None:
    path = config_file(tmp_path)
    state = (tmp_path / "state").resolve()
    with lock.acquire(state):
        assert cli.main(["--config", str(path)]) == EX_ALREADY_RUNNING
        assert cli.main(["--config", str(path), "run"]) == EX_ALREADY_RUNNING
    err = capsys.readouterr().err
    assert (
        f"llm-supervisor: another daemon (pid {os.getpid()}) is running on state dir {state};"
        " not starting (exit 75)\n"
    ) in err
    assert sorted(p.name for p in state.iterdir()) == ["daemon.lock"]  # nothing else touched


def test_a_bad_config_still_exits_78_first(tmp_path: Path, no_supervisor: None) -> None:
    path = config_file(tmp_path, engines=[{"name": "a", "model": "tiny", "port": "nope"}])
    with lock.acquire(tmp_path / "state"):
        assert cli.main(["--config", str(path)]) == EX_CONFIG


def test_run_with_an_unusable_state_dir_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, no_supervisor: None
) -> None:
    path = config_file(tmp_path)
    (tmp_path / "state").write_text("")  # a file where the state dir should be
    # A config problem (issue 38: the state dir is judged before the lock): systemd stops there.
    assert cli.main(["--config", str(path)]) == EX_CONFIG
    assert f"state dir {(tmp_path / 'state').resolve()} is not a directory; not starting" in caplog.text


def test_check_config_does_not_take_the_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_file(tmp_path)
    with lock.acquire(tmp_path / "state"):
        assert cli.main(["check-config", str(path)]) == 0
        assert cli.main(["--config", str(path), "check-config"]) == 0
    assert f"{path}: OK, 1 engine(s): a" in capsys.readouterr().out


def test_holder_is_read_from_the_kernel_lock_table(tmp_path: Path) -> None:
    assert lock.holder(tmp_path) is None  # no lock file yet
    with lock.acquire(tmp_path):
        assert lock.holder(tmp_path) == os.getpid()
        assert lock.holder(tmp_path / "elsewhere") is None
    assert lock.holder(tmp_path) is None  # released: the file is still there, nobody holds it


def test_holder_skips_waiters_and_other_files(tmp_path: Path) -> None:
    (tmp_path / "daemon.lock").write_text("")
    st = (tmp_path / "daemon.lock").stat()
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "locks").write_text(
        f"1: FLOCK  ADVISORY  WRITE 11 00:00:{st.st_ino + 1} 0 EOF\n"
        f"2: POSIX  ADVISORY  WRITE 12 {inode} 0 EOF\n"
        f"3: -> FLOCK  ADVISORY  WRITE 13 {inode} 0 EOF\n"
        f"3: FLOCK  ADVISORY  WRITE 14 {inode} 0 EOF\n"
    )
    assert lock.holder(tmp_path, proc=proc) == 14
