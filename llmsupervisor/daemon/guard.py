"""The guard: makes engines die with the daemon, even when the daemon is SIGKILLed.

The daemon starts one guard per run, in its own session, with the read end of a pipe as its
stdin; the daemon holds the only write end. When the daemon dies, however it dies, the kernel
closes that end and the guard's read returns EOF. The guard then kills every process that
carries this daemon's markers (state dir and daemon PID) in its environment, whole process
groups first, and exits. After a clean shutdown there is nothing left for it to kill.

Under systemd the unit's cgroup does the same job (KillMode=mixed); the guard covers runs
outside systemd, such as a terminal or a container without an init that reaps.

It finds the engines two ways (see process.py): the marker variables in the environment, and
the process groups the daemon recorded in the state dir (EngineCore and workers rename
themselves, which hides their environment). It imports only ``process`` and psutil.

``GuardProcess`` is the daemon's side: it starts the guard and, at a clean exit, closes the
pipe and reaps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

from llmsupervisor import process

GUARD_EXIT_TIMEOUT_S = 15.0


class GuardProcess:
    def __init__(self, state_dir: Path) -> None:
        self._state_dir = state_dir
        self.pid: int | None = None
        self._fd: int | None = None

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-m", "llmsupervisor.daemon.guard", str(self._state_dir), str(os.getpid())],
                dict(os.environ),
                file_actions=[(os.POSIX_SPAWN_DUP2, read_fd, 0)],
                setsid=True,
            )
        except OSError as exc:
            os.close(write_fd)
            logging.getLogger("llmsupervisor").warning(
                "cannot start the guard process (%s): engines would outlive a SIGKILLed daemon "
                "until its next start",
                exc,
            )
            return
        finally:
            os.close(read_fd)
        os.set_inheritable(write_fd, False)
        self._fd = write_fd

    def stop(self) -> None:
        """Close our end (the guard finds nothing left to kill) and reap it, bounded."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.pid is not None:
            deadline = time.monotonic() + GUARD_EXIT_TIMEOUT_S
            while time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    pid, _ = os.waitpid(self.pid, os.WNOHANG)
                    if pid == 0:
                        time.sleep(0.05)
                        continue
                break
            self.pid = None


def _ours(state_dir: str, daemon_pid: str) -> list[int]:
    pids = process.marker_processes(Path(state_dir), only_daemon_pid=int(daemon_pid))
    for group in process.recorded_groups(Path(state_dir)):
        if str(group.daemon_pid) == daemon_pid:
            pids += process.recorded_group_members(group)
    return pids


def sweep(state_dir: str, daemon_pid: str, *, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    killed: set[int] = set()
    while time.monotonic() < deadline:
        pids = _ours(state_dir, daemon_pid)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.2)
    return len(killed)


def main(argv: list[str]) -> int:
    state_dir, daemon_pid = argv[1], argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the daemon
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.read(0, 4096):
        pass
    killed = sweep(state_dir, daemon_pid)
    if killed:
        print(
            f"llm-supervisor guard: daemon {daemon_pid} is gone; killed {killed} engine process(es)",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
