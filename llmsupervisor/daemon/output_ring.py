"""Each engine's recent output in a bounded ring, for `llm-supervisor logs NAME` and `describe`.

Like the events ring (daemon/events.py) it is a logging handler: it keeps the records the output
forwarder (engine/output.py) logs for each engine's lines, so it holds exactly what the journal
holds (the supervisor's probe lines dropped, shutdown output marked), redacted as every handler
is. Per engine it keeps the current incarnation's last ``LINES_KEPT`` lines and the previous
incarnation's, so after a crash `logs NAME --previous` shows what the dead process printed last.
An incarnation is told by the engine's pid (``engine_pid`` on each record).

Each incarnation's lines are bounded in bytes too (``BYTES_KEPT``, the UTF-8 of their texts), and
a line longer than ``LINE_BYTES_KEPT`` is kept cut, saying how much was cut (the journal has the
whole line). So one `logs` reply, which is at most one incarnation's lines, is bounded as well:
before issue 38, 1,000 lines of 64 KiB made a 71 MB reply built on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass
from typing import Any, Final

from llmsupervisor import aio
from llmsupervisor.redact import RedactFilter

LINES_KEPT: Final = 1000  # per incarnation, two incarnations per engine
BYTES_KEPT: Final = 1024 * 1024  # per incarnation: the newest lines that fit
LINE_BYTES_KEPT: Final = 16 * 1024  # of one line; what is past it is cut, and said
WAIT_POLL_S: Final = 0.1
WAIT_LIMIT_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class OutputLine:
    seq: int  # per ring, in the order logged: a follower asks for those after the last it saw
    time_s: float  # wall clock
    pid: int
    level: str  # the engine's own level word (a shutdown line keeps it here)
    shutdown: bool  # printed during a stop the daemon ordered
    text: str
    size: int = 0  # bytes of the text (UTF-8), counted against BYTES_KEPT

    def as_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "time": round(self.time_s, 3),
            "pid": self.pid,
            "level": self.level,
            "shutdown": self.shutdown,
            "text": self.text,
        }


def engine_process(pid: int) -> dict[str, Any]:
    """What `describe` shows of the engine's main process: its command line (redacted with the
    reply it goes out in: control.py) and resident memory, read from /proc; None where the
    process is gone or unreadable. Blocking: call it in a thread."""
    command: str | None = None
    rss_bytes: int | None = None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = " ".join(part.decode("utf-8", "replace") for part in f.read().split(b"\0") if part)
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss_bytes = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return {"pid": pid, "command": command, "rss_bytes": rss_bytes}


def kept_text(text: str) -> tuple[str, int]:
    """``text`` as kept (cut past ``LINE_BYTES_KEPT``, on a character boundary) and its size."""
    data = text.encode()
    if len(data) <= LINE_BYTES_KEPT:
        return text, len(data)
    head = data[:LINE_BYTES_KEPT].decode(errors="ignore")  # a character split at the cut goes
    kept = f"{head} [... {len(data) - len(head.encode())} bytes cut; the journal has the whole line]"
    return kept, len(kept.encode())


class _Lines:
    """One incarnation's lines: at most ``capacity`` of them and ``BYTES_KEPT`` of text."""

    def __init__(self, capacity: int) -> None:
        self.lines: collections.deque[OutputLine] = collections.deque()
        self.size = 0
        self._capacity = capacity

    def append(self, line: OutputLine) -> None:
        self.lines.append(line)
        self.size += line.size
        while len(self.lines) > self._capacity or (self.size > BYTES_KEPT and len(self.lines) > 1):
            self.size -= self.lines.popleft().size


class _Engine:
    def __init__(self, capacity: int) -> None:
        self.pid: int | None = None
        self.current = _Lines(capacity)
        self.previous = _Lines(capacity)


class OutputRing(logging.Handler):
    def __init__(self, capacity: int = LINES_KEPT) -> None:
        super().__init__(logging.NOTSET)
        self._capacity = capacity
        self._engines: dict[str, _Engine] = {}
        self._seq = 0
        self._guard = threading.Lock()
        self.addFilter(RedactFilter())

    def emit(self, record: logging.LogRecord) -> None:
        engine, pid = getattr(record, "engine", None), getattr(record, "engine_pid", None)
        if not isinstance(engine, str) or not isinstance(pid, int):
            return
        try:
            text, size = kept_text(record.getMessage())
        except Exception:
            self.handleError(record)
            return
        with self._guard:
            kept = self._engines.setdefault(engine, _Engine(self._capacity))
            if kept.pid != pid:
                if kept.pid is not None:
                    kept.previous = kept.current
                    kept.current = _Lines(self._capacity)
                kept.pid = pid
            self._seq += 1
            kept.current.append(
                OutputLine(
                    seq=self._seq,
                    time_s=record.created,
                    pid=pid,
                    level=str(getattr(record, "engine_level", None) or record.levelname),
                    shutdown=bool(getattr(record, "engine_shutdown", False)),
                    text=text,
                    size=size,
                )
            )

    @property
    def last_seq(self) -> int:
        return self._seq

    def select(
        self, engine: str, *, previous: bool = False, last: int | None = None, after_seq: int = 0
    ) -> list[OutputLine]:
        """The engine's lines (its previous incarnation's with ``previous``), the ``last`` N of
        those after ``after_seq``."""
        with self._guard:
            kept = self._engines.get(engine)
            lines = list((kept.previous if previous else kept.current).lines if kept is not None else ())
        lines = [line for line in lines if line.seq > after_seq]
        return lines[-last:] if last is not None and last >= 0 else lines

    async def wait_select(self, engine: str, *, after_seq: int, wait_s: float) -> list[OutputLine]:
        """New lines of the current incarnation after ``after_seq``; when there are none, wait up to
        ``wait_s`` for some (a long poll: `logs -f` asks again with the last seq it got). A new
        incarnation's first lines count as new."""
        deadline = aio.now() + min(max(wait_s, 0.0), WAIT_LIMIT_S)
        while True:
            found = self.select(engine, after_seq=after_seq)
            if found or aio.now() >= deadline:
                return found
            await asyncio.sleep(min(WAIT_POLL_S, max(0.0, deadline - aio.now())))


__all__ = [
    "BYTES_KEPT",
    "LINES_KEPT",
    "LINE_BYTES_KEPT",
    "OutputLine",
    "OutputRing",
    "engine_process",
    "kept_text",
]
