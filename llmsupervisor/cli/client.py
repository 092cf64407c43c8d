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

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        try:
            reply = control.request(self.path, payload, timeout_s=timeout_s)
        except control.ControlError as exc:
            raise Unreachable(str(exc)) from None
        if not reply.get("ok"):
            raise Refused(str(reply.get("error")))
        return reply.get("result")


def unreachable(client: Client, exc: Unreachable, err: TextIO) -> int:
    if client.config_problem is not None:
        print(f"llm-supervisor: the config is broken: {client.config_problem}", file=err)
        return EX_CONFIG
    print(f"llm-supervisor: {exc}", file=err)
    return EX_UNAVAILABLE
