"""A step heartbeat from inside vLLM: the scheduler counts its steps into a small mmap'd file.

vLLM's ``/metrics`` cannot tell a hang from a pause: its counters move only on steps that emit
output (a long chunked prefill freezes them), and an idle engine publishes nothing (issue 25,
shared/docs/hang-detection.md §2). This module is loaded by vLLM's own ``--scheduler-cls`` hook
(0.32: ``SchedulerConfig.get_scheduler_cls`` resolves the dotted name and calls it with the
scheduler's keyword arguments), which is also how Dynamo injects its per-step emitter.
``scheduler`` is a factory, not a class: it subclasses the class vLLM would have used
(``AsyncScheduler`` when async scheduling is on, else ``Scheduler``) so async scheduling stays as
it was, and returns an instance of it.

Each step writes a few numbers into the file named by ``LLMSUPERVISOR_STEP_HEARTBEAT`` (the
daemon removes it before each spawn): when a step was scheduled, when one completed, the
requests the scheduler holds, the longest recent step, the tokens of the steps under way and
the slowest recent time per scheduled token (what bounds a step's time by its size), and how
many requests the API server has handed the scheduler (its sign of life), with a sequence
counter around each write so that a reader never takes a torn record (``read``). About a microsecond a step
(docs/benchmarks.md, "Step heartbeat"). Nothing here may raise into vLLM: a file that cannot be
made leaves the scheduler running without a heartbeat, and the daemon with today's rules.

Runs in the engine's Python: the standard library and vLLM only (no ``llmsupervisor`` import).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import importlib
import mmap
import os
import stat
import struct
import time
from typing import Any, Final

ENV: Final = "LLMSUPERVISOR_STEP_HEARTBEAT"
# The dotted name the daemon passes as --scheduler-cls.
QUALNAME: Final = "llmsupervisor_step_heartbeat.scheduler"
MAGIC: Final = 0x4C534842  # "LSHB"
VERSION: Final = 2
# magic, version, pid, (pad), seq, steps scheduled, steps done, last scheduled (monotonic s),
# last done, requests held after the last step, tokens of the steps under way, longest recent
# step (s), requests added since the start, slowest recent step time per scheduled token (s).
LAYOUT: Final = struct.Struct("<IIIIQQQddIIdQd")
SIZE: Final = 4096  # one page; the record is the first LAYOUT.size bytes
# The longest recent step decays by this factor a step: a long prefill is remembered for a few
# hundred steps (a few seconds of decode), not forever.
LONGEST_DECAY: Final = 0.995
# And it halves every this many seconds the engine held no step: an idle engine takes no steps to
# decay by, so without it the last long prefill before a pause stayed the bound of the first
# small step after it (a canary's, 4x that long before a Worker spinning on it was overdue).
# The time per token does not decay with idleness: it bounds a step by its own size, so a long
# prefill after a pause still gets a long bound (detectors/hang/steps.py).
LONGEST_IDLE_HALF_LIFE_S: Final = 2.0

_SEQ_AT: Final = 16  # offset of seq in LAYOUT

# What this module relies on in vLLM, in one place (tests/lib/vllm_surface.py checks every release
# of the support matrix for it, reading the release's source; tests/unit/probes/test_step_heartbeat.py
# that the code here uses nothing else): the scheduler class vLLM would have used, by whether async
# scheduling is on (``SchedulerConfig.get_scheduler_cls``), the config field that says so, the
# keyword (or first positional argument) the scheduler is built with,
BASES: Final = {
    False: ("vllm.v1.core.sched.scheduler", "Scheduler"),
    True: ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
}
ASYNC_FIELD: Final = "async_scheduling"
CONFIG_ARG: Final = "vllm_config"
# the methods wrapped with a beat (EngineCore calls each on its scheduler), the one that counts
# the requests held, and the field of a step's ``SchedulerOutput`` with its tokens.
WRAPPED: Final = ("add_request", "schedule", "update_from_output")
HELD_COUNT: Final = "get_num_unfinished_requests"
STEP_TOKENS: Final = "total_num_scheduled_tokens"


def open_beat_file(path: str) -> int:
    """The heartbeat file, made by this process, or one it made before; never someone else's.

    The daemon removes the file before the spawn, and the engine makes it seconds later: time
    enough for a local user who can write in the engine's directory to plant a link there (to
    ``/etc/shadow``, say: the engine runs as the daemon's user, root often) or a hard link. So
    the file is made ``O_CREAT|O_EXCL|O_NOFOLLOW`` (a link of any kind, or anything already
    there, fails it); a file that already exists is taken only if it is a regular file of this
    user with one name, and it is truncated only then. Raises OSError otherwise (no heartbeat)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass  # a second scheduler of this engine, or a file left behind: looked at first
    fd = os.open(path, flags | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise OSError(errno.EPERM, "not a heartbeat file of this engine's", path)
    os.ftruncate(fd, 0)
    return fd


class Heartbeat:
    """The writer: one per scheduler, in the EngineCore process."""

    def __init__(self, path: str) -> None:
        fd = open_beat_file(path)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._pid = os.getpid()
        self._seq = 0
        self.scheduled = 0
        self.done = 0
        self.scheduled_s = time.monotonic()
        self.done_s = self.scheduled_s
        self.work = 0
        self.longest_s = 0.0
        self.added = 0
        self.per_token_s = 0.0
        # (when scheduled, tokens) of each step not back yet: async scheduling schedules the next
        # step while one runs.
        self._pending: collections.deque[tuple[float, int]] = collections.deque(maxlen=8)
        self._write()

    def _write(self) -> None:
        # Seqlock: odd while writing. The reader retries on an odd or changed seq.
        self._seq += 1
        struct.pack_into("<Q", self._map, _SEQ_AT, self._seq)
        self._seq += 1
        LAYOUT.pack_into(
            self._map,
            0,
            MAGIC,
            VERSION,
            self._pid,
            0,
            self._seq,
            self.scheduled,
            self.done,
            self.scheduled_s,
            self.done_s,
            self.work,
            sum(tokens for _, tokens in self._pending),
            self.longest_s,
            self.added,
            self.per_token_s,
        )

    def on_add(self) -> None:
        """A request handed to the scheduler: counted, written with the next step."""
        self.added += 1

    def on_schedule(self, work: int, tokens: int = 0) -> None:
        now = time.monotonic()
        if not self._pending:  # nothing under way since the last step came back: idle until now
            self.longest_s *= 0.5 ** (max(0.0, now - self.done_s) / LONGEST_IDLE_HALF_LIFE_S)
        self.scheduled += 1
        self.scheduled_s = now
        self.work = work
        self._pending.append((now, tokens))
        self._write()

    def on_done(self, work: int) -> None:
        now = time.monotonic()
        started_s, tokens = self._pending.popleft() if self._pending else (now, 0)
        # A step's time: from when it was scheduled, or the previous one was done if later
        # (async scheduling schedules the next step while this one runs).
        step_s = now - max(started_s, self.done_s)
        self.longest_s = max(step_s, self.longest_s * LONGEST_DECAY)
        if tokens > 0:
            # A step takes about a + b x its tokens; the slowest time per token seen (a small
            # step's) times a step's tokens bounds that step from above (detectors/hang/steps.py).
            self.per_token_s = max(step_s / tokens, self.per_token_s * LONGEST_DECAY)
        self.done += 1
        self.done_s = now
        self.work = work
        self._write()


def _tokens(out: Any) -> int:
    """The tokens a ``SchedulerOutput`` schedules (0.32: ``total_num_scheduled_tokens``)."""
    try:
        return max(0, int(out.total_num_scheduled_tokens))
    except Exception:
        return 0


def _held(sched: Any) -> int:
    """The requests the scheduler means to step: vLLM's own count, which leaves out what a pause
    (``/pause``, sleep mode) holds back, so that a paused engine does not read as stuck."""
    try:
        return int(sched.get_num_unfinished_requests())
    except Exception:
        return 0


_classes: dict[type, type] = {}


def _with_heartbeat(base: type) -> type:
    """``base`` with a heartbeat at each ``schedule`` and ``update_from_output``."""
    cls = _classes.get(base)
    if cls is not None:
        return cls

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)  # type: ignore[misc]
        self._llmsup_beat = None
        path = os.environ.get(ENV)
        if path:
            # No heartbeat if the file cannot be made: the daemon keeps its rules without one.
            with contextlib.suppress(OSError):
                self._llmsup_beat = Heartbeat(path)

    def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = base.add_request(self, *args, **kwargs)  # type: ignore[attr-defined]
        beat = self._llmsup_beat
        if beat is not None:
            beat.on_add()
        return out

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = base.schedule(self, *args, **kwargs)  # type: ignore[attr-defined]
        beat = self._llmsup_beat
        if beat is not None:
            beat.on_schedule(_held(self), _tokens(out))
        return out

    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = base.update_from_output(self, *args, **kwargs)  # type: ignore[attr-defined]
        beat = self._llmsup_beat
        if beat is not None:
            beat.on_done(_held(self))
        return out

    cls = type(
        f"Heartbeat{base.__name__}",
        (base,),
        {
            "__init__": __init__,
            "add_request": add_request,
            "schedule": schedule,
            "update_from_output": update_from_output,
        },
    )
    _classes[base] = cls
    return cls


def base_scheduler(vllm_config: Any) -> type:
    """The class vLLM would have used without ``--scheduler-cls`` (SchedulerConfig, 0.32)."""
    module, name = BASES[bool(getattr(vllm_config.scheduler_config, ASYNC_FIELD, False))]
    found: type = getattr(importlib.import_module(module), name)
    return found


def scheduler(*args: Any, **kwargs: Any) -> Any:
    """What ``--scheduler-cls llmsupervisor_step_heartbeat.scheduler`` resolves to: vLLM calls
    it as it would call the scheduler class."""
    vllm_config = kwargs[CONFIG_ARG] if CONFIG_ARG in kwargs else args[0]
    return _with_heartbeat(base_scheduler(vllm_config))(*args, **kwargs)


__all__ = [
    "ASYNC_FIELD",
    "BASES",
    "CONFIG_ARG",
    "ENV",
    "HELD_COUNT",
    "LAYOUT",
    "MAGIC",
    "QUALNAME",
    "SIZE",
    "STEP_TOKENS",
    "VERSION",
    "WRAPPED",
    "Heartbeat",
    "scheduler",
]
