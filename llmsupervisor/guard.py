"""The guard: makes engines die with the daemon, even when the daemon is SIGKILLed.

The daemon starts one guard per run, in its own session, with the read end of a pipe as its
stdin; the daemon holds the only write end. When the daemon dies, however it dies, the kernel
closes that end and the guard's read returns EOF. The guard then kills every process that
carries this daemon's markers (state dir and daemon PID) in its environment, whole process
groups first, and exits. After a clean shutdown there is nothing left for it to kill.

Under systemd the unit's cgroup does the same job (KillMode=mixed); the guard covers runs
outside systemd, such as a terminal or a container without an init that reaps.

Kept free of the daemon's other modules, so it starts fast and cannot fail on their imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time


def _marked(state_dir: str, daemon_pid: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if (
            f"LLMSUPERVISOR_STATE_DIR={state_dir}".encode() in env
            and f"LLMSUPERVISOR_DAEMON_PID={daemon_pid}".encode() in env
        ):
            found.append(int(entry))
    return found


def sweep(state_dir: str, daemon_pid: str, *, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    killed = 0
    while time.monotonic() < deadline:
        pids = _marked(state_dir, daemon_pid)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
    return killed


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
