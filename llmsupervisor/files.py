"""Small state files (status.json, ladder.json, GPU marks, recorded process groups): written
atomically and durably (a reader never sees half a file, and a power cut never leaves an
empty one: a lost ladder.json would put a throttled engine back at full batch), read
forgivingly but not silently (a corrupt file is logged and kept aside for inspection).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(__name__)

# Group-readable, whatever the umask (the unit sets UMask=0077): the operators' group reads
# status.json. Anything secret is written with mode=0o600.
STATE_FILE_MODE: Final = 0o640
# Corrupt copies kept per file (NAME.corrupt-TIMESTAMP); older ones are removed.
MAX_CORRUPT_KEPT: Final = 3
# A background write slower than this is logged when it ends: the disk stalled the writer (not
# the loop), and an operator reading a "cannot keep up" report wants to know by how much.
SLOW_WRITE_S: Final = 1.0


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = 2, mode: int = STATE_FILE_MODE) -> None:
    """Write ``obj`` as JSON to a temporary file beside ``path``, fsync it, rename it over
    ``path``, then fsync the directory so the rename itself survives a crash. The file gets
    ``mode`` exactly (not reduced by the umask). Raises OSError (a full or read-only disk):
    the caller decides whether that matters."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(obj, indent=indent) + "\n").encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove ``.NAME.PID.tmp`` files that ``write_json_atomic`` left beside ``path`` when its
    process was killed mid-write (SIGKILL, a power cut) and that process is gone; a running
    writer's file is left alone. Returns what was removed. Never raises: a leftover only costs
    space. Call it at start, before the first write."""
    removed: list[Path] = []
    prefix, suffix = f".{path.name}.", ".tmp"
    try:
        candidates = [
            p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(suffix)
        ]
    except OSError:  # no directory yet, or not readable: nothing of ours is there
        return removed
    for candidate in sorted(candidates):
        pid_text = candidate.name[len(prefix) : -len(suffix)]
        if not (pid_text.isascii() and pid_text.isdigit()) or _running(int(pid_text)):
            continue
        try:
            candidate.unlink()
        except OSError as exc:
            log.warning("cannot remove %s, left by a killed writer: %s", candidate, exc.strerror or exc)
            continue
        removed.append(candidate)
    if removed:
        log.info("removed %s, left by a writer that was killed mid-write", ", ".join(p.name for p in removed))
    return removed


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except PermissionError:
        return True  # another user's process
    except (ProcessLookupError, OverflowError):  # gone; or a pid no process can have
        return False
    return True


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # filesystems that cannot, by design
            raise
    finally:
        os.close(fd)


def read_json(path: Path, default: Any = None) -> Any:
    """The file's JSON, or ``default`` when it is missing (silently), cannot be read (logged),
    or is not JSON (logged, and the file moved aside as NAME.corrupt-TIMESTAMP)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return default
    except OSError as exc:
        log.warning("cannot read %s: %s; using the default", path, exc.strerror or exc)
        return default
    try:
        return json.loads(data)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        kept = _keep_aside(path)
        where = f"kept as {kept.name}" if kept is not None else "could not be moved aside"
        log.warning("%s is corrupt (%s); %s; using the default", path, exc, where)
        return default


def _keep_aside(path: Path) -> Path | None:
    now_ns = time.time_ns()
    # Fixed width to the microsecond, so names sort by time.
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_ns // 10**9)) + f".{now_ns // 1000 % 10**6:06d}Z"
    kept = path.with_name(f"{path.name}.corrupt-{stamp}")
    if kept.exists():
        return None  # the same microsecond: leave it where it is, it is read again next time
    try:
        os.replace(path, kept)
    except OSError:
        return None
    for stale in sorted(path.parent.glob(f"{path.name}.corrupt-*"))[:-MAX_CORRUPT_KEPT]:
        with contextlib.suppress(OSError):
            stale.unlink()
    return kept


class JsonFileWriter:
    """One JSON file kept at the newest content given to ``save``, written by
    ``write_json_atomic`` in a thread, one write at a time.

    Two fsyncs wait for the disk, and a busy disk holds them for seconds: the kernel throttles
    writers while a vLLM engine saves its compile cache, and an ext4 journal commit flushes
    every file's dirty data before it. On the event loop such a write stopped the daemon for
    about 7 s on CI (a ladder step down): every load balancer check timed out, HAProxy marked
    both engines down and 1,894 requests got 503. So the loop only hands the content over.
    Contents given while a write is under way coalesce: the newest is written next, the ones
    between are skipped (each is a whole file, so nothing is lost but history).

    Without a running loop (the CLI, a unit test) ``save`` writes at once, as before."""

    def __init__(
        self,
        path: Path,
        *,
        what: str,
        engine: str | None = None,
        indent: int | None = 2,
        mode: int = STATE_FILE_MODE,
    ) -> None:
        self.path = path
        self._what = what
        self._log_extra = {"engine": engine} if engine is not None else None
        self._indent = indent
        self._mode = mode
        self._pending: Any = None
        self._has_pending = False
        self._writer: asyncio.Task[None] | None = None
        self.failed: OSError | None = None  # the last write's error, None once one succeeds

    def save(self, obj: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write(obj, blocking=True)
            return
        self._pending, self._has_pending = obj, True
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write_pending(), name=f"write {self.path.name}")
            _WRITING.add(self)

    async def _write_pending(self) -> None:
        while self._has_pending:
            obj, self._pending, self._has_pending = self._pending, None, False
            await asyncio.to_thread(self._write, obj, blocking=False)

    def _write(self, obj: Any, *, blocking: bool) -> None:
        started_s = time.monotonic()
        try:
            write_json_atomic(self.path, obj, indent=self._indent, mode=self._mode)
        except OSError as exc:
            self.failed = exc
            log.warning(
                "cannot save %s to %s: %s", self._what, self.path, exc.strerror or exc, extra=self._log_extra
            )
            return
        self.failed = None
        took_s = time.monotonic() - started_s
        if not blocking and took_s >= SLOW_WRITE_S:
            log.info(
                "saving %s to %s took %.1f s (a busy disk; the loop did not wait)",
                self._what,
                self.path,
                took_s,
                extra=self._log_extra,
            )


# Every writer that has written from the loop (weakly: one per state file, so few), for
# ``flush_all`` at shutdown.
_WRITING: weakref.WeakSet[JsonFileWriter] = weakref.WeakSet()


async def flush_all(timeout_s: float) -> list[Path]:
    """Wait until every writer's newest content is on disk (at shutdown: a ladder step or a GPU
    mark saved just before must not be lost with the loop). Returns the files still being
    written at the deadline (a disk that does not answer)."""
    writing = {w._writer: w.path for w in list(_WRITING) if w._writer is not None and not w._writer.done()}
    if not writing:
        return []
    _, late = await asyncio.wait(set(writing), timeout=timeout_s)
    return [writing[t] for t in late]
