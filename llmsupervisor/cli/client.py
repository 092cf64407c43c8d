"""The CLI's client of the control socket (control.py): one request, one reply, and the exit codes.

Exit codes, for scripts (``EXIT_STATUS``, which docs/cli.md's table is generated from): 0 done
(for `status`, every engine asked about is where the operator put it); 1 failed (a refused
command, an engine down or FATAL that nobody asked to be, a `--wait` that ended in BACKOFF or
FATAL or ran past ``--timeout``); 2 bad arguments; 69 the daemon is not reachable; 78 the config
is broken (and no daemon answered) or a reload was rejected; 130 interrupted while waiting (the
command itself goes on).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

from llmsupervisor import control
from llmsupervisor.daemon import lock

EX_OK: Final = 0
EX_FAILED: Final = 1
EX_USAGE: Final = 2  # argparse's
EX_UNAVAILABLE: Final = 69  # the daemon is not running or not reachable
EX_CONFIG: Final = 78
EX_INTERRUPTED: Final = 130

# What each exit code means, the same for every command that talks to the daemon: docs/cli.md's
# table is generated from this (tests/unit/cli/test_docs_cli.py), and the system tests reach
# each one through the real CLI.
EXIT_STATUS: Final = (
    (
        EX_OK,
        "done: the command was accepted (and, with `--wait`, the engine reached the state asked for);"
        " for `status`, every engine asked about is where the operator put it: serving or on its"
        " way, or stopped, drained or disabled on purpose; `--follow` and `--watch` ended with Ctrl-C",
    ),
    (
        EX_FAILED,
        "failed: the daemon refused the command (no such engine, shutting down); `wait` ran past"
        " `--timeout`, or an engine waited for to be ready is FATAL or held by an operator; with"
        " `--wait`, the engine went to BACKOFF or FATAL (a failed start, a start timeout), was"
        " stopped meanwhile, or `--timeout` passed; for `status`, an engine asked about is down,"
        " FATAL or not ready when it should be (nobody stopped or drained it), or does not exist",
    ),
    (EX_USAGE, "bad arguments (argparse; engine names and `--all` together), or an unreadable `--since`"),
    (
        EX_UNAVAILABLE,
        "the daemon is not reachable: not running, a stale socket, permission denied, no answer"
        " within 10 s, or it went away during `--wait`",
    ),
    (
        EX_CONFIG,
        "the config is broken (and no daemon answered at the socket it names), or `reload` was rejected",
    ),
    (
        EX_INTERRUPTED,
        "`--wait`, `wait` or a rolled restart interrupted with Ctrl-C; the command itself goes on",
    ),
)


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
