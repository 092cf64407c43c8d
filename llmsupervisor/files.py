"""Small state files (status.json, ladder.json, GPU marks, holds, recorded process groups):
written atomically and durably (a reader never sees half a file, and a power cut never leaves an
empty one: a lost ladder.json would put a throttled engine back at full batch), written again
until they land (a full disk delays a file, it does not lose it), read forgivingly but not
silently (a corrupt file is logged and kept aside for inspection), and never through a link
someone else planted.

The state dir trusts no one (issue 38). Below the state dir (``root``), every directory is
opened one component at a time under its parent's descriptor with ``O_DIRECTORY|O_NOFOLLOW``
and must belong to the daemon's user, and every file is opened with ``O_NOFOLLOW``: a symbolic
link planted at ``engines/b`` or at ``ladder.json`` is refused (logged), never followed, so the
daemon (root, often) creates nothing elsewhere and reads nothing from elsewhere. Directories it
creates are mode 0750 exactly.

A read is bounded and cannot block: the file is opened ``O_NONBLOCK`` (a FIFO planted at
``holds/a.json`` does not wait for a writer), must be a regular file (``fstat``: not a FIFO, not
a device such as ``/dev/zero``), and at most ``MAX_STATE_FILE_BYTES`` is read. That is one small
read of the local disk, which is why ``read_json`` may run on the loop (at startup, and for a
GPU mark's load) instead of in a thread.

A write that fails (``ENOSPC`` on a full disk, above all) is not dropped: ``JsonFileWriter``
keeps the newest content and writes it again on a bounded backoff on the daemon's clock
(``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``), and at once when any other state file lands
(the disk has room again). ``unsaved_files`` says what is waiting, for `status`, the STATUS=
line and ``llmsupervisor_state_files_unsaved``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import stat
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from llmsupervisor import aio

log = logging.getLogger(__name__)

# Group-readable, whatever the umask (the unit sets UMask=0077): the operators' group reads
# status.json. Anything secret is written with mode=0o600.
STATE_FILE_MODE: Final = 0o640
# Directories the daemon makes in the state dir: the operators' group may look, nobody else.
DIRECTORY_MODE: Final = 0o750
# Corrupt copies kept per file (NAME.corrupt-TIMESTAMP); older ones are removed.
MAX_CORRUPT_KEPT: Final = 3
# A background write slower than this is logged when it ends: the disk stalled the writer (not
# the loop), and an operator reading a "cannot keep up" report wants to know by how much.
SLOW_WRITE_S: Final = 1.0
# The largest state file read: the GPU marks of 8 GPUs over a day are a few tens of KB. A larger
# file is not ours (``ladder.json`` -> ``/dev/zero`` grew the daemon past 1 GB in seconds).
MAX_STATE_FILE_BYTES: Final = 4 * 1024 * 1024
# A failed write is tried again after this, doubling up to RETRY_MAX_S: a full disk costs one
# attempt per file per RETRY_MAX_S, and a file lands at most RETRY_MAX_S after the disk has room.
RETRY_FIRST_S: Final = 1.0
RETRY_MAX_S: Final = 30.0
# Errors that mean "no room now", which time (an operator, a log rotation) takes away.
DISK_FULL_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


def open_directory(directory: Path, *, root: Path | None = None, create: bool = False) -> int:
    """A descriptor of ``directory`` (the caller closes it).

    ``root`` (None: ``directory`` itself) is trusted as the configuration names it; each
    component below it is opened under its parent's descriptor with ``O_DIRECTORY|O_NOFOLLOW``
    and must belong to this process's user: a symbolic link is refused (ELOOP), as is a directory
    of another user's (EPERM), either one planted while the state dir was open to others.
    ``create``: ``root`` is made with its parents where missing, and each missing component below
    it with mode DIRECTORY_MODE exactly. Raises OSError (FileNotFoundError without ``create``)."""
    root = directory if root is None else root
    parts = directory.relative_to(root).parts
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        where = root
        for part in parts:
            where = where / part
            made = False
            if create:
                try:
                    os.mkdir(part, DIRECTORY_MODE, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                    raise OSError(
                        errno.ELOOP, "a symbolic link in the state dir: not followed", str(where)
                    ) from None
                raise
            os.close(fd)
            fd = child
            if made:
                os.fchmod(fd, DIRECTORY_MODE)  # exactly, whatever the umask
            owner = os.fstat(fd).st_uid
            if owner != os.geteuid():
                raise OSError(
                    errno.EPERM,
                    f"owned by uid {owner}, not by the daemon's user (uid {os.geteuid()}): not used",
                    str(where),
                )
        return fd
    except BaseException:
        os.close(fd)
        raise


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def write_atomic(path: Path, data: bytes, *, root: Path | None = None, mode: int = STATE_FILE_MODE) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``,
    then fsync the directory so the rename itself survives a crash. The file gets ``mode``
    exactly (not reduced by the umask). Everything happens under the directory's descriptor
    (``open_directory``: no link below ``root`` is followed), and the temporary file is created
    ``O_EXCL|O_NOFOLLOW``. Raises OSError (a full or read-only disk, a planted link): the caller
    decides whether that matters."""
    dir_fd = open_directory(path.parent, root=root, create=True)
    tmp = f".{path.name}.{os.getpid()}.tmp"
    try:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)  # our own leftover of a failed attempt
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                mode,
                dir_fd=dir_fd,
            )
            try:
                os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        _fsync_directory(dir_fd)
    finally:
        os.close(dir_fd)


def write_json_atomic(
    path: Path, obj: Any, *, indent: int | None = 2, mode: int = STATE_FILE_MODE, root: Path | None = None
) -> None:
    """``obj`` as JSON, by ``write_atomic``."""
    write_atomic(path, (json.dumps(obj, indent=indent) + "\n").encode(), root=root, mode=mode)


def remove_file(path: Path, *, root: Path | None = None, durable: bool = True) -> None:
    """Remove ``path`` (nothing when it or its directory is missing), under its directory's
    descriptor as ``write_atomic`` writes, and with ``durable`` make the removal survive a power
    cut (an fsync of the directory: not on the loop)."""
    try:
        dir_fd = open_directory(path.parent, root=root)
    except FileNotFoundError:
        return
    try:
        try:
            os.unlink(path.name, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        if durable:
            _fsync_directory(dir_fd)
    finally:
        os.close(dir_fd)


def read_bounded(path: Path, *, root: Path | None = None, max_bytes: int = MAX_STATE_FILE_BYTES) -> bytes:
    """The file's bytes. Never follows a link below ``root`` nor at ``path``, never blocks on a
    FIFO (``O_NONBLOCK``), reads regular files only and at most ``max_bytes``. Raises
    FileNotFoundError when it is missing, and OSError otherwise: ELOOP (a link), EINVAL (not a
    regular file), EFBIG (larger than ``max_bytes``)."""
    dir_fd = open_directory(path.parent, root=root)
    try:
        try:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "a symbolic link: not followed", str(path)) from None
            raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)}): not read", str(path))
        too_large = OSError(errno.EFBIG, f"larger than {max_bytes} bytes: not read", str(path))
        if st.st_size > max_bytes:
            raise too_large
        chunks: list[bytes] = []
        left = max_bytes + 1  # one byte more tells a file that grew past the bound
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise too_large
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a file"


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


def _fsync_directory(dir_fd: int) -> None:
    try:
        os.fsync(dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # filesystems that cannot, by design
            raise


def read_json(path: Path, default: Any = None, *, root: Path | None = None) -> Any:
    """The file's JSON, or ``default`` when it is missing (silently), cannot be read (logged: a
    link, a FIFO or device, a file over MAX_STATE_FILE_BYTES, no permission), or is not JSON
    (logged, and the file moved aside as NAME.corrupt-TIMESTAMP; so is a file too large).
    ``read_bounded`` makes it one bounded, non-blocking read."""
    try:
        data = read_bounded(path, root=root)
    except FileNotFoundError:
        return default
    except OSError as exc:
        kept = _keep_aside(path, root) if exc.errno == errno.EFBIG else None
        where = f"; kept as {kept.name}" if kept is not None else ""
        log.warning("cannot read %s: %s%s; using the default", path, exc.strerror or exc, where)
        return default
    try:
        return json.loads(data)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        kept = _keep_aside(path, root)
        where = f"kept as {kept.name}" if kept is not None else "could not be moved aside"
        log.warning("%s is corrupt (%s); %s; using the default", path, exc, where)
        return default


def _keep_aside(path: Path, root: Path | None) -> Path | None:
    now_ns = time.time_ns()
    # Fixed width to the microsecond, so names sort by time.
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_ns // 10**9)) + f".{now_ns // 1000 % 10**6:06d}Z"
    kept = path.with_name(f"{path.name}.corrupt-{stamp}")
    try:
        dir_fd = open_directory(path.parent, root=root)
    except OSError:
        return None
    try:
        try:
            os.stat(kept.name, dir_fd=dir_fd, follow_symlinks=False)
            return None  # the same microsecond: leave it where it is, it is read again next time
        except FileNotFoundError:
            pass
        except OSError:
            return None
        try:
            os.replace(path.name, kept.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            return None
        with contextlib.suppress(OSError):
            corrupt = sorted(n for n in os.listdir(dir_fd) if n.startswith(f"{path.name}.corrupt-"))
            for stale in corrupt[:-MAX_CORRUPT_KEPT]:
                with contextlib.suppress(OSError):
                    os.unlink(stale, dir_fd=dir_fd)
        return kept
    finally:
        os.close(dir_fd)


@dataclass(frozen=True, slots=True)
class UnsavedFile:
    """A state file whose newest content is not on disk: its last write failed, and it is tried
    again (``JsonFileWriter``)."""

    path: Path
    what: str  # "the ladder step"
    error: str  # "No space left on device"
    since: float  # wall clock (epoch seconds) of the first failed write: shown to people
    disk_full: bool  # ENOSPC or EDQUOT: it lands once the disk has room

    def as_json(self) -> dict[str, Any]:
        return {"file": str(self.path), "what": self.what, "error": self.error, "since": self.since}


_REMOVE: Final = object()  # ``save``'s content that means "the file goes"


class JsonFileWriter:
    """One JSON file kept at the newest content given to ``save`` (or gone after ``remove``),
    written by ``write_json_atomic`` in a thread, one write at a time, and again until it lands.

    Two fsyncs wait for the disk, and a busy disk holds them for seconds: the kernel throttles
    writers while a vLLM engine saves its compile cache, and an ext4 journal commit flushes
    every file's dirty data before it. On the event loop such a write stopped the daemon for
    about 7 s on CI (a ladder step down): every load balancer check timed out, HAProxy marked
    both engines down and 1,894 requests got 503. So the loop only hands the content over.
    Contents given while a write is under way coalesce: the newest is written next, the ones
    between are skipped (each is a whole file, so nothing is lost but history).

    A write that fails is kept, not dropped (a ladder step taken on a full disk was gone after a
    restart, and the engine's next start ran out of memory again): it is tried again after
    RETRY_FIRST_S, doubling to RETRY_MAX_S, on the daemon's clock; at once when another state
    file lands (the disk has room again), or when content is given with ``promptly`` (an
    operator waits for it). Newer content replaces it. The first failure of a kind is logged as
    a warning, the landing after failures as info; the attempts between are not.

    Without a running loop (the CLI, a unit test) ``save`` writes at once, once, as before."""

    def __init__(
        self,
        path: Path,
        *,
        what: str,
        engine: str | None = None,
        indent: int | None = 2,
        mode: int = STATE_FILE_MODE,
        root: Path | None = None,
    ) -> None:
        self.path = path
        self.what = what
        self._log_extra = {"engine": engine} if engine is not None else None
        self._indent = indent
        self._mode = mode
        self._root = root
        self._pending: Any = None
        self._has_pending = False
        self._writer: asyncio.Task[None] | None = None
        self._wake = aio.Flag()  # ends a backoff early
        self._given = 0  # contents handed over so far
        self._tried = 0  # the newest of them that a write was attempted with
        self._attempts = aio.Changes()  # one change per attempt, for ``settled``
        self.failed: OSError | None = None  # the last write's error, None once one succeeds
        self.failed_since: float | None = None  # wall clock of the first failure since the last success
        self._failures = 0  # attempts failed since the last success

    def save(self, obj: Any, *, promptly: bool = False) -> None:
        """``obj`` is the file's content from now on. ``promptly``: a write waiting out a backoff
        is tried now (an operator waits for the answer)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._attempt(obj, blocking=True)
            return
        self._given += 1
        self._pending, self._has_pending = obj, True
        if promptly:
            self._wake.set()
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write_pending(), name=f"write {self.path.name}")
            _WRITING.add(self)

    def remove(self, *, promptly: bool = False) -> None:
        """The file goes (after any content given before, in order)."""
        self.save(_REMOVE, promptly=promptly)

    @property
    def unsaved(self) -> UnsavedFile | None:
        """What is not on disk after a failed write, or None."""
        failed = self.failed
        if failed is None:
            return None
        return UnsavedFile(
            self.path,
            self.what,
            failed.strerror or str(failed),
            self.failed_since if self.failed_since is not None else time.time(),
            failed.errno in DISK_FULL_ERRNOS,
        )

    async def settled(self, timeout_s: float) -> bool:
        """Wait until a write was attempted with the newest content given so far (it landed, or
        ``failed`` says why not and it is tried again later); False at ``timeout_s`` (the disk
        does not answer)."""
        return await self._settled(self._given, None, timeout_s)

    async def _settled(self, target: int, after: int | None, timeout_s: float) -> bool:
        """``settled`` for the content numbered ``target``, and with ``after`` (an attempts
        version) once an attempt ended after it too."""

        def done() -> bool:
            return self._tried >= target and (after is None or self._attempts.version > after)

        deadline_s = aio.now() + timeout_s
        while not done():
            left_s = deadline_s - aio.now()
            if left_s <= 0:
                return False
            await aio.wait_any(self._attempts.future(self._attempts.version), timeout_s=left_s)
        return True

    def retry_now(self) -> None:
        """End a backoff: try the kept content now (the disk has room, or the daemon stops)."""
        self._wake.set()

    async def _write_pending(self) -> None:
        delay_s = RETRY_FIRST_S
        while self._has_pending:
            obj, version = self._pending, self._given
            self._pending, self._has_pending = None, False
            self._wake.clear()
            landed = await asyncio.to_thread(self._attempt, obj, blocking=False)
            self._tried = max(self._tried, version)
            self._attempts.set()
            if landed:
                delay_s = RETRY_FIRST_S
                _room_again(self)
                continue
            if self.failed_since is None:
                self.failed_since = time.time()
            if not self._has_pending:  # nothing newer: this content again, after the backoff
                self._pending, self._has_pending = obj, True
            if not self._wake.is_set():
                await aio.wait_any(self._wake.future(), timeout_s=delay_s)
            delay_s = min(2 * delay_s, RETRY_MAX_S)

    def _attempt(self, obj: Any, *, blocking: bool) -> bool:
        started_s = time.monotonic()
        try:
            if obj is _REMOVE:
                remove_file(self.path, root=self._root)
            else:
                write_json_atomic(self.path, obj, indent=self._indent, mode=self._mode, root=self._root)
        except OSError as exc:
            news = self.failed is None or self.failed.errno != exc.errno
            self.failed = exc
            self._failures += 1
            if news:
                log.warning(
                    "cannot save %s to %s: %s%s",
                    self.what,
                    self.path,
                    exc.strerror or exc,
                    ""
                    if blocking
                    else f"; kept, and tried again until written (every {RETRY_MAX_S:g} s at most)",
                    extra=self._log_extra,
                )
            return False
        if self._failures:
            log.info(
                "saved %s to %s, after %d failed attempt(s)",
                self.what,
                self.path,
                self._failures,
                extra=self._log_extra,
            )
        self.failed, self.failed_since, self._failures = None, None, 0
        took_s = time.monotonic() - started_s
        if not blocking and took_s >= SLOW_WRITE_S:
            log.info(
                "saving %s to %s took %.1f s (a busy disk; the loop did not wait)",
                self.what,
                self.path,
                took_s,
                extra=self._log_extra,
            )
        return True


# Every writer that has written from the loop (weakly: one per state file, so few), for
# ``flush_all`` at shutdown and ``unsaved_files`` in the status. A writer with a write under way
# or waiting out a backoff is kept alive by its task.
_WRITING: weakref.WeakSet[JsonFileWriter] = weakref.WeakSet()


def _room_again(landed: JsonFileWriter) -> None:
    """A state file landed: the others waiting out a backoff try now (they share its disk)."""
    for writer in list(_WRITING):
        if writer is not landed and writer.failed is not None and writer.failed.errno in DISK_FULL_ERRNOS:
            writer.retry_now()


def unsaved_files() -> list[UnsavedFile]:
    """Every state file of this process whose newest content is not on disk, oldest first."""
    found = [u for w in list(_WRITING) if (u := w.unsaved) is not None]
    return sorted(found, key=lambda u: (u.since, str(u.path)))


async def flush_all(timeout_s: float) -> list[Path]:
    """Wait until every writer's newest content is on disk or was tried once more now (at
    shutdown: a ladder step or a GPU mark saved just before must not be lost with the loop, and
    one kept from a full disk gets a last try). Returns the files not on disk at the end: a
    disk that does not answer, or is still full."""
    writers = [w for w in list(_WRITING) if w._writer is not None and not w._writer.done()]
    if not writers:
        return []
    # (content, attempt) each waits for: one kept from a failed write waits for one more try.
    marks = {w: (w._given, w._attempts.version if w.failed is not None else None) for w in writers}
    for writer in writers:
        writer.retry_now()
    deadline_s = aio.now() + timeout_s
    for writer, (target, after) in marks.items():
        await writer._settled(target, after, max(0.0, deadline_s - aio.now()))
    return [w.path for w in writers if w.failed is not None or w._tried < w._given]
