"""Operator holds: an operator's `stop` or `drain` is intent, and it outlives the daemon.

One small file per held engine, ``STATE_DIR/holds/NAME.json`` (written atomically, files.py)::

    {"hold": "stop", "by": "alice (uid 1000)", "since": 1764147600.5}

A stop taken for a GPU reset (`gpu release N`, daemon/gpu_release.py) names the GPU, so that
`gpu take-back N` finds the engines it started, even after a daemon restart::

    {"hold": "stop", "by": "alice (uid 1000)", "since": ..., "gpu_reset": {"gpu": 1, "uuid": "GPU-..."}}

    command accepted        the hold afterwards
    ──────────────────────────────────────────────────────────────────────────────────────
    stop                    stop (who and when: this command)
    drain                   drain; an engine held stopped stays held stopped
    start                   none (the file goes)
    restart                 unchanged when the engine runs (a restart keeps a drain: the new
                            incarnation comes up out of rotation); a stopped or FATAL engine is
                            started by it, like `start`, so its hold goes too

The file is written before the operator hears "accepted" (at most ``HOLD_WRITE_TIMEOUT_S``).
A disk that cannot take it (full, above all) does not lose it, and does not refuse the command:
an operator who stops an engine on a full disk wants it stopped now, and the disk is not the
engine's business. So the command acts at once, the hold is kept and written again until it
lands (files.JsonFileWriter: a bounded backoff, and at once when another state file lands), and
until then the reply, `status` ("not saved yet: No space left on device") and the log say so:
the operator knows that a daemon restart before the disk has room would forget it. When the
daemon starts, a held
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
import logging
import pwd
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from llmsupervisor.config import EngineSpec
from llmsupervisor.engine.commands import Command, Desired, Hold, Start, Stop
from llmsupervisor.files import JsonFileWriter, read_json

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
    gpu_reset: GpuReset | None = None  # a stop for this GPU's reset (`gpu release`)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hold": self.kind, "by": self.by, "since": self.since}
        if self.gpu_reset is not None:
            out["gpu_reset"] = {"gpu": self.gpu_reset.gpu, "uuid": self.gpu_reset.uuid}
        return out

    @classmethod
    def from_json(cls, data: Any) -> OperatorHold | None:
        if not isinstance(data, dict) or data.get("hold") not in HOLD_KINDS:
            return None
        since = data.get("since")
        return cls(
            kind=data["hold"],
            by=str(data.get("by") or UNKNOWN_OPERATOR),
            since=float(since) if isinstance(since, int | float) else 0.0,
            gpu_reset=GpuReset.from_json(data.get("gpu_reset")),
        )


@dataclass(frozen=True, slots=True)
class GpuReset:
    """The GPU a stop hold was taken for the reset of: its NVML index then, and its UUID."""

    gpu: int
    uuid: str

    @classmethod
    def from_json(cls, data: Any) -> GpuReset | None:
        if not isinstance(data, dict):
            return None
        gpu, uuid = data.get("gpu"), data.get("uuid")
        if isinstance(gpu, bool) or not isinstance(gpu, int) or not isinstance(uuid, str):
            return None
        return cls(gpu, uuid)


def after(
    hold: OperatorHold | None,
    commands: Sequence[Command],
    *,
    by: str,
    now: float,
    gpu_reset: GpuReset | None = None,
) -> OperatorHold | None:
    """The hold once ``commands`` (an operator's, daemon/requests.py) are taken. Pure.
    ``gpu_reset``: the commands are `gpu release`'s, for that GPU's reset (a stop hold an
    operator took before stays theirs, untagged)."""
    for cmd in commands:
        if isinstance(cmd, Start):
            hold = None
        elif isinstance(cmd, Stop) and not cmd.final:
            hold = (
                hold
                if hold is not None and hold.kind == "stop"
                else OperatorHold(kind="stop", by=by, since=now, gpu_reset=gpu_reset)
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

    def __init__(self, directory: Path, *, root: Path | None = None) -> None:
        self.directory = directory
        # The state dir: no link below it is followed (files.open_directory).
        self._root = directory.parent if root is None else root
        self._holds: dict[str, OperatorHold] = {}
        self._given: dict[str, OperatorHold | None] = {}  # what each file's writer was handed
        self._files: dict[str, JsonFileWriter] = {}

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def _file(self, name: str) -> JsonFileWriter:
        writer = self._files.get(name)
        if writer is None:
            writer = JsonFileWriter(
                self._path(name), what="the operator's hold", engine=name, root=self._root
            )
            self._files[name] = writer
        return writer

    def load(self, names: Iterable[str]) -> None:
        """At startup, before the runners: the holds an earlier daemon kept (small local files)."""
        for name in names:
            hold = OperatorHold.from_json(read_json(self._path(name), root=self._root))
            self._given[name] = hold
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

    def unsaved(self, name: str) -> str | None:
        """Why ``holds/NAME.json`` is not yet what the engine's hold is now (None: it is, or no
        write of it has failed): the error of its last write, which is being tried again."""
        writer = self._files.get(name)
        failed = writer.failed if writer is not None else None
        return (failed.strerror or str(failed)) if failed is not None else None

    def note(
        self,
        name: str,
        commands: Sequence[Command],
        *,
        by: str,
        now: float,
        gpu_reset: GpuReset | None = None,
    ) -> OperatorHold | None:
        """Take an accepted operator command (on the loop); ``persist`` writes it."""
        return self.put(name, after(self._holds.get(name), commands, by=by, now=now, gpu_reset=gpu_reset))

    def put(self, name: str, hold: OperatorHold | None) -> OperatorHold | None:
        """Set the engine's hold as it is (a take-back gives back the drain it found); ``persist``
        writes it."""
        if hold is None:
            self._holds.pop(name, None)
        else:
            self._holds[name] = hold
        return hold

    def for_gpu_reset(self, uuid: str) -> list[str]:
        """The engines held stopped for the reset of the GPU ``uuid`` (`gpu release`)."""
        return [n for n, h in self._holds.items() if h.gpu_reset is not None and h.gpu_reset.uuid == uuid]

    def forget(self, name: str) -> None:
        """An engine removed from the config: its hold goes with it (``persist`` removes the file)."""
        self._holds.pop(name, None)

    async def persist(self, name: str) -> str | None:
        """Bring ``holds/NAME.json`` to the hold in memory now: handed to the file's writer (in
        a thread, newest content last), and waited for at most HOLD_WRITE_TIMEOUT_S. Returns
        None once it is on disk, else why not yet; the writer keeps trying until it is."""
        hold = self._holds.get(name)
        writer = self._file(name)
        if name not in self._given or self._given[name] != hold:
            self._given[name] = hold
            if hold is None:
                writer.remove(promptly=True)
            else:
                writer.save(hold.as_json(), promptly=True)
        if not await writer.settled(HOLD_WRITE_TIMEOUT_S):
            return f"the disk did not answer within {HOLD_WRITE_TIMEOUT_S:g} s"
        return self.unsaved(name)
