"""Exceptions of the daemon.

::

    SupervisorError
     ├── ConfigError          a config file that does not validate; carries every ConfigProblem
     ├── IllegalTransition    an engine state change the transition table does not allow (a bug)
     ├── PortHeld             an engine's port is held by a process that is not ours
     ├── AlreadyRunning       another daemon holds the state dir's lock (STATE_DIR/daemon.lock);
     │                        this one exits EX_ALREADY_RUNNING without touching anything
     ├── UnsafeStateDir       the state dir is another user's (or no directory): the daemon
     │                        exits EX_CONFIG without using it (daemon/state_dir.py)
     └── NvmlUnavailable      no GPU telemetry on this host: no driver, driver not loaded, a reboot
                              pending after a driver upgrade, or no permission; the daemon degrades
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmsupervisor.redact import redact

EX_CONFIG = 78  # os.EX_CONFIG; the unit lists it in RestartPreventExitStatus=
# os.EX_TEMPFAIL: another daemon runs on this state dir; try again once the running daemon is gone.
# The unit lists it in RestartPreventExitStatus= too: a restart every 10 s would not make it go.
EX_ALREADY_RUNNING = 75


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        # The message may quote a value; the field path is the config's own words.
        return f"{self.file}:{self.line}: {self.field}: {redact(self.message)}"


class SupervisorError(Exception):
    pass


class ConfigError(SupervisorError):
    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = sorted(problems, key=lambda p: p.line)
        super().__init__("\n".join(str(p) for p in self.problems))


class IllegalTransition(SupervisorError):
    def __init__(self, engine: str, from_state: object, to_state: object) -> None:
        super().__init__(f"engine {engine}: illegal transition {from_state} -> {to_state}")
        self.engine = engine
        self.from_state = from_state
        self.to_state = to_state


class PortHeld(SupervisorError):
    def __init__(self, port: int, pid: int | None, cmdline: str) -> None:
        # Another process's command line may carry its secrets (an --api-key): masked.
        who = f"pid {pid} ({redact(cmdline)})" if pid is not None else "a process this user cannot see"
        super().__init__(f"port {port} is held by {who}, which is not an engine of this supervisor")
        self.port = port
        self.pid = pid
        self.cmdline = cmdline


class AlreadyRunning(SupervisorError):
    """The state dir's lock is held: a daemon already runs on it. ``pid`` is the one the lock
    file names (None if it names none yet); ``path`` the lock file."""

    def __init__(self, pid: int | None, path: Path) -> None:
        who = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(f"another daemon ({who}) holds {path}")
        self.pid = pid
        self.path = path


class UnsafeStateDir(SupervisorError):
    """The state dir must not be used: ``reason`` says why (another user owns it)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"state dir {path} is {reason}")
        self.path = path
        self.reason = reason


class NvmlUnavailable(SupervisorError):
    """NVML cannot be used here; engines still run, without GPU telemetry (docs/host-notes.md §1.2).

    ``reason`` is one of ``library_not_found``, ``driver_not_loaded``, ``reboot_pending``,
    ``no_permission``, ``import_failed``, ``init_failed`` or ``init_timeout``.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"NVML unavailable ({reason}): {detail}")
        self.reason = reason
        self.detail = detail
