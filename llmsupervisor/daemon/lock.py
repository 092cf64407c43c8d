"""One daemon per state dir: an exclusive ``flock`` on ``STATE_DIR/daemon.lock``, held for life.

A second daemon on the same state dir (an operator typing plain ``llm-supervisor`` while the
service runs) would take the running daemon's engines for leftovers of an earlier run and kill
them, bind its own control socket over the running one's, and remove it when it exits. So the
daemon takes this lock before it touches anything in the state dir, and a daemon that cannot get
it exits at once with ``EX_ALREADY_RUNNING`` (75), naming the holder's pid, which the holder
writes into the file once it holds the lock.

There is no stale-lock handling, and none is needed: the lock belongs to the open file
description, which only the daemon holds (the descriptor is close-on-exec, so neither the guard
nor any engine inherits it), and the kernel releases it when the daemon exits, however it exits
(SIGKILL and OOM kills included). A pid left in the file by a dead daemon means nothing; the
next holder overwrites it. The file itself is never removed: unlinking a lock file lets two
daemons hold locks on two different inodes of the same name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Final

from llmsupervisor.errors import AlreadyRunning
from llmsupervisor.files import DISK_FULL_ERRNOS

LOCK_NAME: Final = "daemon.lock"
PID_READ_ATTEMPTS: Final = 5
PID_READ_PAUSE_S: Final = 0.02


def lock_path(state_dir: Path) -> Path:
    return state_dir / LOCK_NAME


class StateDirLock:
    """The held lock; ``release()`` (or leaving the ``with`` block) gives it up. ``pid_unwritten``:
    why the file does not name this daemon (a full disk), or None."""

    def __init__(self, path: Path, fd: int, *, pid_unwritten: OSError | None = None) -> None:
        self.path = path
        self._fd: int | None = fd
        self.pid_unwritten = pid_unwritten

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empty the file (it would name a process that no longer holds it), unlock, close.
        Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # before the unlock: afterwards it may be the next holder's
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> StateDirLock:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"StateDirLock({str(self.path)!r}, held={self.held})"


def _read_pid(fd: int) -> int | None:
    """The holder's pid; it writes it just after it takes the lock, so an empty file is retried
    for a moment (a holder that died in between leaves it empty: None)."""
    for attempt in range(PID_READ_ATTEMPTS):
        if attempt:
            time.sleep(PID_READ_PAUSE_S)
        try:
            text = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip()
        except OSError:
            return None
        if text.isdigit():
            return int(text)
    return None


def holder(state_dir: Path, *, proc: Path = Path("/proc")) -> int | None:
    """The pid of the daemon that holds ``state_dir``'s lock now, or None (no daemon, or one this
    user cannot see). Read from the kernel's lock table (``/proc/locks``), never by taking the
    lock: a probe that held it for a moment could make a daemon starting just then exit 75.

    This is how `doctor` tells the running daemon's own ports from a stranger's, by the state
    dir and not by a process name (the console script is ``llm-supervisor``, the module
    ``llmsupervisor``: a name test missed one of them, issue 26)."""
    try:
        st = lock_path(state_dir).stat()
        table = (proc / "locks").read_text()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 13412 fe:00:2485311 0 EOF"; "1: -> FLOCK ..." is a waiter.
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
            return int(fields[4])
    return None


def acquire(state_dir: Path) -> StateDirLock:
    """Take the state dir's lock without waiting and write this process's pid into it.

    Creates the state dir (and parents) if needed. Raises ``AlreadyRunning`` (with the holder's
    pid, or None if the file does not name one yet) if another process holds it, and ``OSError``
    with the lock file's path in it if the dir or the file cannot be created or opened. A pid that
    cannot be written for a full disk is no failure (``StateDirLock.pid_unwritten`` says so).
    """
    path = lock_path(state_dir)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        # OSError(errno, ...) is PermissionError, FileNotFoundError, ... as the errno says.
        raise OSError(exc.errno, f"cannot open the daemon lock {path}: {exc.strerror}{where}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AlreadyRunning(_read_pid(fd), path) from None
        # Ours now: the holder's pid, for the next daemon's message and for operators.
        os.ftruncate(fd, 0)
        try:
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            if exc.errno not in DISK_FULL_ERRNOS:
                raise
            # The lock is the kernel's, held whatever the file says: a full disk must not keep
            # the engines from being supervised (under systemd, every engine stayed down). A
            # second daemon then says "pid unknown".
            return StateDirLock(path, fd, pid_unwritten=exc)
    except BaseException:
        os.close(fd)
        raise
    return StateDirLock(path, fd)


__all__ = ["LOCK_NAME", "AlreadyRunning", "StateDirLock", "acquire", "holder", "lock_path"]
