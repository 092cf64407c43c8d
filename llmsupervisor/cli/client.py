"""The CLI's client of the control socket (control.py): one request, one reply, and the exit codes.

Exit codes, for scripts: 0 done (or, for `status`, every engine asked about is up); 1 failed (a
refused command, an engine FATAL or down, a `--wait` that ended in BACKOFF or FATAL or ran past
``--timeout``); 69 the daemon is not reachable; 78 the config is broken (and no daemon answered)
or a reload was rejected; 130 interrupted while waiting (the command itself goes on).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

from llmsupervisor import control
from llmsupervisor.daemon import lock

EX_OK: Final = 0
EX_FAILED: Final = 1
EX_UNAVAILABLE: Final = 69  # the daemon is not running or not reachable
EX_CONFIG: Final = 78
EX_INTERRUPTED: Final = 130


class Unreachable(Exception):
    """The daemon did not answer (not running, stale socket, permission, timeout)."""


class Refused(Exception):
    """The daemon answered no."""


@dataclass(slots=True)
class Client:
    path: Path
    config_problem: str | None = None  # the config does not load: said instead of "not running"
    status_file: Path | None = None  # STATE_DIR/status.json: what a dead daemon last wrote
    state_dir: Path | None = None  # its lock tells a running daemon whose socket is gone

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        try:
            reply = control.request(self.path, payload, timeout_s=timeout_s)
        except control.SocketGone as exc:
            raise Unreachable(self._socket_gone() or str(exc)) from None
        except control.ControlError as exc:
            raise Unreachable(str(exc)) from None
        if not reply.get("ok"):
            raise Refused(str(reply.get("error")))
        return reply.get("result")

    def _socket_gone(self) -> str | None:
        """When nothing listens at the socket but a daemon holds the state dir's lock: say so,
        not "not running" (issue 38). None when no daemon holds it (or we cannot see it)."""
        if self.state_dir is None or (pid := lock.holder(self.state_dir)) is None:
            return None
        return (
            f"the daemon runs (pid {pid}, lock held) but its control socket {self.path} is gone;"
            f" it makes it again within {control.SOCKET_CHECK_S:g} s"
            f" (at once on `kill -HUP {pid}`)"
        )


def unreachable(client: Client, exc: Unreachable, err: TextIO) -> int:
    if client.config_problem is not None:
        print(f"llm-supervisor: the config is broken: {client.config_problem}", file=err)
        return EX_CONFIG
    print(f"llm-supervisor: {exc}", file=err)
    return EX_UNAVAILABLE
