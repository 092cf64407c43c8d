"""Small state files (status.json, ladder.json, GPU marks, recorded process groups): written
atomically and durably (a reader never sees half a file, and a power cut never leaves an
empty one: a lost ladder.json would put a throttled engine back at full batch), read
forgivingly but not silently (a corrupt file is logged and kept aside for inspection).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(__name__)

# Group-readable, whatever the umask (the unit sets UMask=0077): the operators' group reads
# status.json. Anything secret is written with mode=0o600.
STATE_FILE_MODE: Final = 0o640
# Corrupt copies kept per file (NAME.corrupt-TIMESTAMP); older ones are removed.
MAX_CORRUPT_KEPT: Final = 3


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
