"""An engine's stdout and stderr, line by line into the daemon's log, tagged with its name.

vLLM prefixes its lines with a level word (after an optional ``(EngineCore pid=12)``); the line
is logged at that level, and continuation lines (tracebacks) keep the level of the line that
began them. Access lines for the supervisor's own probes are dropped (``log_probe_requests``
keeps them): the GETs by path, the canary's POST by the client address the daemon sent it from
(probes/health.py ``OwnAddresses``), so a user's completion is always kept. Out-of-memory lines
are reported (``OutputSeen(oom=True)``): the policy starts the next spawn a batch step down when
a start ran out of memory.

A stop the daemon ordered (``planned_stop``: an operator's stop or restart, a planned or config
restart, the daemon's shutdown) makes vLLM print errors that are none: ``AsyncLLM output_handler
failed ... EngineDeadError`` at ERROR on a clean drain (docs/vllm-notes.md §6) and a screen of
nanobind "leaked instance" warnings. From that order on, the incarnation's lines are shutdown
output: marked ``engine_shutdown`` and logged at INFO at most (journal ``SHUTDOWN=1``, logs.py), so that
`journalctl -p warning` lists only what needs a look. A crash's output keeps its level.

vLLM's start-up milestones (docs/vllm-notes.md §5) are reported as a start phase
(``START_PHASES``), so that `llm-supervisor status` and `restart --wait` can show how far a
minutes-long load has come. Only a hint: a vLLM that logs none of them (another version,
``VLLM_CONFIGURE_LOGGING=0``) starts just the same, its phase staying at "spawned".

The readers run as their own tasks and never call the runner back: ``report`` only queues an
``OutputSeen`` for the runner, which takes it at its next wait and publishes from its own task.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from llmsupervisor.probes.health import OwnAddresses

engine_output_log = logging.getLogger("llmsupervisor.engine.output")

# vLLM/torch out-of-memory at start: CUDA OOM, the KV cache not fitting, CPU KV space too large.
OOM_RE: Final = re.compile(
    r"out of memory|OutOfMemoryError|No available memory for the cache blocks|"
    r"insufficient memory|is larger than the available KV cache memory",
    re.IGNORECASE,
)
# The phases of a start, in order. The runner sets "spawned" and "canary"; the others are read
# from the engine's log by ``start_phase``. A phase only ever moves forward.
START_PHASES: Final = ("spawned", "loading weights", "compiling", "capturing graphs", "listening", "canary")
# Milestone lines of vLLM 0.32 (CUDA and CPU builds) and the phase each one begins. "Loading
# weights took" ends the load: compiling (torch.compile, the CPU build's warm-up) comes next.
_PHASE_MARKERS: Final = (
    (
        re.compile(r"Starting to load model|Loading safetensors checkpoint shards|Loading weights"),
        "loading weights",
    ),
    (
        re.compile(
            r"Loading weights took|Model loading took|Warming up model for the compilation|"
            r"torch\.compile|Compiling a graph|Compiling model|Dynamo bytecode transform"
        ),
        "compiling",
    ),
    (
        re.compile(r"Capturing CUDA graph|Graph capturing|cudagraph capturing", re.IGNORECASE),
        "capturing graphs",
    ),
    (re.compile(r"Starting vLLM server on|Uvicorn running on|Application startup complete"), "listening"),
)


def start_phase(line: str) -> str | None:
    """The start phase a vLLM log line begins, or None. The later phase wins when one line names
    two ("Loading weights took" is a loading line that ends the load)."""
    found = None
    for pattern, phase in _PHASE_MARKERS:
        if pattern.search(line):
            found = phase
    return found


def later_phase(current: str | None, new: str) -> bool:
    """Whether ``new`` comes after ``current`` (phases never go back)."""
    if current not in START_PHASES:
        return True
    return START_PHASES.index(new) > START_PHASES.index(current)


# vLLM log lines: optional "(EngineCore pid=12) " prefix, then the level word.
_LEVEL_RE: Final = re.compile(r"^(?:(?:\x1b\[[\d;]*m)?\(.*?\)\S*\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_LEVELS: Final = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}
# The paths the supervisor itself polls every tick: their uvicorn access lines were 85 % of the
# journal. Where vLLM has --disable-access-log-for-endpoints (engine/access_log.py) it drops them
# itself; this catches them from versions without the flag. Every other access line stays.
PROBE_PATHS: Final = ("/health", "/metrics", "/v1/models")
_PROBE_PATHS_RE: Final = "|".join(re.escape(p) for p in PROBE_PATHS)
_PROBE_ACCESS_RE: Final = re.compile(rf'"(?:GET|HEAD) (?:{_PROBE_PATHS_RE})/?(?:\?[^ "]*)? HTTP/[\d.]+"')
# The canary's requests (probes/health.py): at steady state, 11-15 lines a minute per idle engine
# and all of the journal. Only an answered one (2xx) from one of the canary's own connections is
# dropped; a failed canary's line stays, as does every user's request to the same path.
CANARY_PATHS: Final = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
_CANARY_PATHS_RE: Final = "|".join(re.escape(p) for p in CANARY_PATHS)
_CANARY_ACCESS_RE: Final = re.compile(
    rf'(?P<ip>[^\s"]+):(?P<port>\d+) - "POST (?:{_CANARY_PATHS_RE}) HTTP/[\d.]+" 2\d\d\b'
)
# vLLM's stats line ("Engine 000: Avg prompt throughput: ... Running: 0 reqs, Waiting: 0 reqs")
# every 10 s drops to DEBUG when the engine is idle (vllm-notes §3.1), but the canary's tokens
# keep it from being idle: measured on the real engine, six lines a minute of nothing but the
# canary. With nothing running or waiting it is logged once per STATS_IDLE_EVERY_S; a busy
# engine's (a request running or waiting) every time. The same numbers are in /metrics.
_IDLE_STATS_RE: Final = re.compile(r"Engine \d+: Avg prompt throughput: .*Running: 0 reqs, Waiting: 0 reqs")
STATS_IDLE_EVERY_S: Final = 300.0
OUTPUT_LINE_LIMIT: Final = 64 * 1024
# The final line of an uncaught exception ("RuntimeError: ...", "torch.OutOfMemoryError: ...").
_EXCEPTION_LINE_RE: Final = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b")
# A line its runtime printed when the engine could not even start, as none of vLLM's: Python's own
# (`python3: can't open file '...': [Errno 2] ...`, `python3: No module named vllm`, `... Error while
# finding module specification ...`), argparse's (`vllm serve: error: unrecognized arguments: ...`)
# and a shell's (`sh: 1: vllm: not found`, `env: 'x': No such file or directory`). ``prog`` is the
# program as it named itself: a path is cut to its last part (the log line keeps all of it).
_RUNTIME_ERROR_RE: Final = re.compile(
    r"^(?P<prog>[^\s:][^:]*?): (?:can't open file |No module named |Error while finding module |error: )"
    r"|^(?P<shell>[^\s:]+): .*(?::| -) "
    r"(?:(?:command )?not found|No such file or directory|Permission denied)$"
)
# The process a vLLM line comes from, before it: "(EngineCore_DP0 pid=12) ", maybe coloured.
_PROCESS_PREFIX_RE: Final = re.compile(r"^(?:\x1b\[[\d;]*m)?\([^()]*pid=\d+\)(?:\x1b\[[\d;]*m)?\s")
# CUDA's cudaErrorSystemNotReady (802, CUDA_ERROR_SYSTEM_NOT_READY in the driver API), whose
# string is "system not yet initialized": "the system is not yet ready to start any CUDA work ...
# verify ... all required driver daemons are actively running" (the CUDA runtime API). On an
# NVSwitch box that daemon is Fabric Manager (docs/gpu.md, "The NVSwitch fabric"); torch prints
# "Error 802: system not yet initialized". A failure that printed it says so in its reason.
SYSTEM_NOT_READY_RE: Final = re.compile(
    r"system not yet initialized|cudaErrorSystemNotReady|CUDA_ERROR_SYSTEM_NOT_READY|\bError 802\b"
)
SYSTEM_NOT_READY_HINT: Final = (
    "CUDA error 802 (system not yet initialized): on an NVSwitch (HGX) box the GPU fabric is not"
    " ready; is Fabric Manager running? (systemctl status nvidia-fabricmanager; docs/gpu.md)"
)
ERROR_LINE_LIMIT: Final = 300  # characters of the last error line kept for a failure's reason
READERS_FLUSH_S: Final = 2.0  # after the group is gone, how long its pipes may still drain


def is_probe_access_line(line: str) -> bool:
    """A uvicorn access line for one of the supervisor's probe paths (``GET /health``, ...)."""
    return '"' in line and _PROBE_ACCESS_RE.search(line) is not None


def is_own_canary_line(line: str, own: OwnAddresses, now: float) -> bool:
    """A uvicorn access line for an answered canary sent from one of the daemon's own
    connections (``127.0.0.1:40312 - "POST /v1/completions HTTP/1.1" 200 OK``)."""
    if '"POST ' not in line:
        return False
    match = _CANARY_ACCESS_RE.search(line)
    if match is None:
        return False
    ip = match.group("ip").strip("[]")
    return own.holds(ip, int(match.group("port")), now)


def engine_log_level(line: str, previous: int) -> int:
    match = _LEVEL_RE.match(line)
    return _LEVELS[match.group(1)] if match else previous


def runtime_error(line: str) -> str | None:
    """``line`` as a failure's reason quotes it when its runtime printed it on the way out
    (``_RUNTIME_ERROR_RE``), the program cut to its name; else None."""
    match = _RUNTIME_ERROR_RE.match(line)
    if match is None:
        return None
    prog = match.group("prog") or match.group("shell")
    if "/" not in prog or " " in prog:
        return line
    return prog.rsplit("/", 1)[1] + line[len(prog) :]


def with_error_line(reason: str, line: str | None, *, system_not_ready: bool = False) -> str:
    """``reason`` (a process that exited by itself) ending with the last error line it printed:
    so a crash loop says what went wrong, not only "exited with code 1"; and, where it printed
    CUDA's error 802 anywhere (``system_not_ready``), what that means on an NVSwitch box."""
    said = f"{reason}: {line}" if line and line not in reason else reason
    if system_not_ready and SYSTEM_NOT_READY_HINT not in said:
        said += f"; {SYSTEM_NOT_READY_HINT}"
    return said


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputSeen:
    """What a line of the engine's output tells the runner (engine/status.py ``seen``)."""

    oom: bool = False  # an out-of-memory line
    phase: str | None = None  # the start phase the line begins


class OutputForwarder:
    """The two pipe readers of one incarnation."""

    def __init__(
        self,
        engine: str,
        pid: int,
        fds: tuple[int, int],
        report: Callable[[OutputSeen], None],
        *,
        drop_probe_access: bool = True,
        own: OwnAddresses | None = None,
    ) -> None:
        self._engine = engine
        self._pid = pid
        self._report = report
        self._drop_probe_access = drop_probe_access
        self._own = own  # the canary's local addresses (probes/health.py)
        self._planned_stop = False
        self._idle_stats_at_s: float | None = None  # when an idle stats line was last let through
        # What a crash-looping engine said last: its newest ERROR line or exception line, for
        # the failure's reason ("exited with code 1: ValueError: ...").
        self.last_error_line: str | None = None
        # Whether it printed CUDA's error 802 (``SYSTEM_NOT_READY_RE``), on any line: vLLM's last
        # words after a worker died of it are its own ("Engine core initialization failed").
        self.system_not_ready = False
        self.dropped_probe_lines = 0
        stdout_fd, stderr_fd = fds
        self._tasks = [
            asyncio.create_task(self._forward(stdout_fd, logging.INFO), name=f"stdout:{engine}"),
            asyncio.create_task(self._forward(stderr_fd, logging.WARNING), name=f"stderr:{engine}"),
        ]

    def planned_stop(self) -> None:
        """The daemon is stopping this incarnation on purpose: what it prints from now on is
        shutdown output, not a problem."""
        self._planned_stop = True

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until both pipes are read to their end: a process that
        exited may have left its last lines in them."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)

    async def explained(self, reason: str, *, settle_s: float) -> tuple[str, str | None]:
        """``reason`` (a process that exited by itself) ending with the last error line it printed
        (``with_error_line``, with what CUDA's error 802 means where it printed one), and that line;
        once its pipes are read (at most ``settle_s``): its last words may still be in them."""
        await self.settle(settle_s)
        said = with_error_line(reason, self.last_error_line, system_not_ready=self.system_not_ready)
        return said, self.last_error_line

    async def close(self) -> None:
        """Let the pipes drain (bounded), then stop reading."""
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(self._tasks, timeout=READERS_FLUSH_S)
        for task in pending:
            task.cancel()
        self._tasks = []

    def _is_probe_line(self, line: str) -> bool:
        if is_probe_access_line(line):
            return True
        now = time.monotonic()
        if "Avg prompt throughput" in line and _IDLE_STATS_RE.search(line):
            if self._idle_stats_at_s is not None and now - self._idle_stats_at_s < STATS_IDLE_EVERY_S:
                return True
            self._idle_stats_at_s = now
            return False
        return self._own is not None and is_own_canary_line(line, self._own, now)

    async def _forward(self, fd: int, default_level: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=OUTPUT_LINE_LIMIT, loop=loop)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(fd, "rb", buffering=0)
        )
        level = default_level
        in_traceback = False  # after "Traceback (most recent call last):", until its exception line
        extra = {"engine": self._engine, "engine_pid": self._pid}
        try:
            while True:
                try:
                    raw = await reader.readline()
                except ValueError:  # a line longer than the limit: forward what fits
                    raw = await reader.read(OUTPUT_LINE_LIMIT)
                if not raw:
                    return
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if not line:
                    continue
                if self._drop_probe_access and self._is_probe_line(line):
                    self.dropped_probe_lines += 1
                    continue
                level = engine_log_level(
                    line, level if line[:1].isspace() or line.startswith("Traceback") else default_level
                )
                if not self._planned_stop:
                    error, in_traceback = _error_line(line, level, in_traceback)
                    if error is not None:
                        self.last_error_line = error[:ERROR_LINE_LIMIT]
                    if SYSTEM_NOT_READY_RE.search(line):
                        self.system_not_ready = True
                if self._planned_stop:
                    shutdown = {**extra, "engine_shutdown": True, "engine_level": logging.getLevelName(level)}
                    engine_output_log.log(min(level, logging.INFO), "%s", line, extra=shutdown)
                else:
                    engine_output_log.log(level, "%s", line, extra=extra)
                oom, phase = OOM_RE.search(line) is not None, start_phase(line)
                if oom or phase is not None:
                    self._report(OutputSeen(oom=oom, phase=phase))
        finally:
            transport.close()


def _error_line(line: str, level: int, in_traceback: bool) -> tuple[str | None, bool]:
    """Whether ``line`` (logged at ``level``) is one a failure's reason quotes, as the reason
    quotes it, and whether a traceback goes on after it. An error line: a vLLM ERROR line, the
    line that ends a traceback (its exception, whatever its name), an exception line, or a line
    of the runtime's own (``runtime_error``). The traceback's body is none: it is indented."""
    body = _PROCESS_PREFIX_RE.sub("", line, count=1)
    if body[:1].isspace() or not body:
        return None, in_traceback
    if body.startswith("Traceback (most recent call last)"):
        return None, True
    if in_traceback or level >= logging.ERROR or _EXCEPTION_LINE_RE.match(body):
        return line, False
    return runtime_error(line), False
