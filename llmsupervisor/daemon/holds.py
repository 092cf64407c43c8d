"""Operator holds: an operator's `stop` or `drain` is intent, and it outlives the daemon.

One small file per held engine, ``STATE_DIR/holds/NAME.json`` (written atomically, files.py)::

    {"hold": "stop", "by": "alice (uid 1000)", "since": 1764147600.5}

    command accepted        the hold afterwards
    ──────────────────────────────────────────────────────────────────────────────────────
    stop                    stop (who and when: this command)
    drain                   drain; an engine held stopped stays held stopped
    start                   none (the file goes)
    restart                 unchanged when the engine runs (a restart keeps a drain: the new
                            incarnation comes up out of rotation); a stopped or FATAL engine is
                            started by it, like `start`, so its hold goes too

The file is written before the operator hears "accepted" (at most ``HOLD_WRITE_TIMEOUT_S``; a
disk that cannot take it is logged, the command still acts). When the daemon starts, a held
engine's runner begins with the hold in its desired state: a stopped one stays STOPPED, a drained
one starts and stays out of rotation (DRAINING) until `start`.

``enabled: false`` is the config's own word, apart from holds: a disabled engine does not start
at a daemon start whether or not it is held, and a hold file on it is kept and shown. `start`
clears the hold and starts the engine for this run of the daemon (an explicit command, as
before); after a daemon restart the config's `enabled: false` applies again. Removing a hold
file by hand therefore never starts a disabled engine.

Who: the uid of the process on the other end of the control socket (SO_PEERCRED, control.py),
with its user name where the password database has one; "operator" when it cannot be known.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pwd
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from llmsupervisor.config import EngineSpec
from llmsupervisor.engine.commands import Command, Desired, Hold, Start, Stop
from llmsupervisor.files import read_json, write_json_atomic

log = logging.getLogger("llmsupervisor")

HOLD_KINDS: Final = ("stop", "drain")
HOLD_WRITE_TIMEOUT_S: Final = 5.0  # a stuck disk must not keep the operator's answer forever
NAME_LOOKUP_TIMEOUT_S: Final = 2.0  # the password database may be remote (NSS, LDAP)
UNKNOWN_OPERATOR: Final = "operator"


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorHold:
    kind: str  # "stop" or "drain"
    by: str  # "alice (uid 1000)", or "operator"
    since: float  # wall clock (epoch seconds): when the command was accepted

    def as_json(self) -> dict[str, Any]:
        return {"hold": self.kind, "by": self.by, "since": self.since}

    @classmethod
    def from_json(cls, data: Any) -> OperatorHold | None:
        if not isinstance(data, dict) or data.get("hold") not in HOLD_KINDS:
            return None
        since = data.get("since")
        return cls(
            kind=data["hold"],
            by=str(data.get("by") or UNKNOWN_OPERATOR),
            since=float(since) if isinstance(since, int | float) else 0.0,
        )


def after(
    hold: OperatorHold | None, commands: Sequence[Command], *, by: str, now: float
) -> OperatorHold | None:
    """The hold once ``commands`` (an operator's, daemon/requests.py) are taken. Pure."""
    for cmd in commands:
        if isinstance(cmd, Start):
            hold = None
        elif isinstance(cmd, Stop) and not cmd.final:
            hold = (
                hold
                if hold is not None and hold.kind == "stop"
                else OperatorHold(kind="stop", by=by, since=now)
            )
        elif isinstance(cmd, Hold):
            if not cmd.on:
                hold = None if hold is not None and hold.kind == "drain" else hold
            elif hold is None:
                hold = OperatorHold(kind="drain", by=by, since=now)
    return hold


def desired_for(spec: EngineSpec, hold: OperatorHold | None) -> Desired | None:
    """What a runner begins with at a daemon start; None: what the config says."""
    if hold is None:
        return None
    if hold.kind == "stop":
        return Desired(run=False)
    return Desired(run=spec.enabled, held=True)


def desired_at_start(spec: EngineSpec, hold: OperatorHold | None, *, blocked: bool) -> Desired | None:
    """``desired_for``, and never a start when ``blocked``: a GPU condition from earlier in this
    boot means the GPU was not reset (or nobody said so), so the engine stays STOPPED (docs/gpu.md)."""
    desired = desired_for(spec, hold)
    if not blocked:
        return desired
    return replace(desired or Desired(run=True), run=False)


async def operator_name(uid: int | None) -> str:
    """``alice (uid 1000)`` for the control socket's peer; ``uid 1000`` without a name."""
    if uid is None:
        return UNKNOWN_OPERATOR
    try:
        async with asyncio.timeout(NAME_LOOKUP_TIMEOUT_S):
            entry = await asyncio.to_thread(pwd.getpwuid, uid)
    except (KeyError, TimeoutError, OSError):
        return f"uid {uid}"
    return f"{entry.pw_name} (uid {uid})"


class Holds:
    """The holds of every engine: in memory for the loop, on disk for the next daemon."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._holds: dict[str, OperatorHold] = {}
        self._on_disk: dict[str, OperatorHold | None] = {}
        self._writing = asyncio.Lock()

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def load(self, names: Iterable[str]) -> None:
        """At startup, before the runners: the holds an earlier daemon kept (small local files)."""
        for name in names:
            hold = OperatorHold.from_json(read_json(self._path(name)))
            self._on_disk[name] = hold
            if hold is not None:
                self._holds[name] = hold
                log.info(
                    "operator hold kept from before the daemon started: %s by %s since %s",
                    hold.kind,
                    hold.by,
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(hold.since)),
                    extra={"engine": name},
                )

    def get(self, name: str) -> OperatorHold | None:
        return self._holds.get(name)

    def note(self, name: str, commands: Sequence[Command], *, by: str, now: float) -> OperatorHold | None:
        """Take an accepted operator command (on the loop); ``persist`` writes it."""
        hold = after(self._holds.get(name), commands, by=by, now=now)
        if hold is None:
            self._holds.pop(name, None)
        else:
            self._holds[name] = hold
        return hold

    def forget(self, name: str) -> None:
        """An engine removed from the config: its hold goes with it (``persist`` removes the file)."""
        self._holds.pop(name, None)

    async def persist(self, name: str) -> None:
        """Bring ``holds/NAME.json`` to the hold in memory now, in a thread, one write at a time
        (so the last command's hold is the one on disk)."""
        async with self._writing:
            hold = self._holds.get(name)
            if name in self._on_disk and self._on_disk[name] == hold:
                return
            path = self._path(name)
            try:
                async with asyncio.timeout(HOLD_WRITE_TIMEOUT_S):
                    if hold is None:
                        await asyncio.to_thread(_remove, path)
                    else:
                        await asyncio.to_thread(write_json_atomic, path, hold.as_json())
            except (OSError, TimeoutError) as exc:
                log.warning(
                    "cannot keep the operator's hold in %s: %s; it will not outlive this daemon",
                    path,
                    getattr(exc, "strerror", None) or exc or "timed out",
                    extra={"engine": name},
                )
                self._on_disk.pop(name, None)
                return
            self._on_disk[name] = hold


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
