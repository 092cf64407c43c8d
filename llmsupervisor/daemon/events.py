"""The recent events (state transitions, findings, actions, operator commands, reloads) in a
bounded ring, for `llm-supervisor events`: the at-a-glance view; journald keeps the history.

The ring is a logging handler: each place that logs one of these already logs it once (the
lifecycle its transitions, the observer its findings, the executor its actions), and marks the
record with ``extra={"event": KIND}``. So the ring and the journal can never disagree, and no
second writer has to be kept in step. It holds what the log holds: with ``log_level: warning``
the INFO transitions are not logged, and not here either. Like every handler, it redacts what it
keeps (redact.py): a reason may quote an engine's command line, and this is where it leaves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from llmsupervisor import aio
from llmsupervisor.redact import RedactFilter

EVENTS_KEPT: Final = 1000
EVENT_KINDS: Final = ("transition", "finding", "action", "operator", "reload")
WAIT_POLL_S: Final = 0.1
WAIT_LIMIT_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class Event:
    seq: int  # 1, 2, ... in the order logged; a follower asks for those after the last it saw
    time_s: float  # wall clock (epoch seconds)
    engine: str | None
    kind: str
    level: str
    message: str
    to_state: str | None = None  # a transition's new state ("ready", "fatal", ...)
    # A finding's evidence as the detector measured it: the message has it rounded, for a person.
    evidence: Mapping[str, float | str] | None = None

    def as_json(self) -> dict[str, Any]:
        found = {"evidence": dict(self.evidence)} if self.evidence is not None else {}
        return {
            "seq": self.seq,
            "time": round(self.time_s, 3),
            "engine": self.engine,
            "kind": self.kind,
            "level": self.level,
            "message": self.message,
            "to_state": self.to_state,
            **found,
        }


class EventRing(logging.Handler):
    """Keeps the last ``capacity`` records that carry an ``event`` kind."""

    def __init__(self, capacity: int = EVENTS_KEPT) -> None:
        super().__init__(logging.NOTSET)
        self._events: collections.deque[Event] = collections.deque(maxlen=capacity)
        self._seq = 0
        self._guard = threading.Lock()  # a record may come from a worker thread
        self.addFilter(RedactFilter())

    def handle(self, record: logging.LogRecord) -> bool:
        # Most records (every forwarded vLLM line) are not events: skip them before the lock.
        if getattr(record, "event", None) is None:
            return False
        return super().handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        kind = getattr(record, "event", None)
        if kind is None:
            return
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not break logging
            self.handleError(record)
            return
        with self._guard:
            self._seq += 1
            self._events.append(
                Event(
                    seq=self._seq,
                    time_s=record.created,
                    engine=getattr(record, "engine", None),
                    kind=str(kind),
                    level=record.levelname,
                    message=message,
                    to_state=getattr(record, "to_state", None),
                    evidence=getattr(record, "evidence", None),
                )
            )

    @property
    def last_seq(self) -> int:
        return self._seq

    def select(
        self, *, engine: str | None = None, after_seq: int = 0, since_time_s: float | None = None
    ) -> list[Event]:
        with self._guard:
            events = list(self._events)
        return list(_matching(events, engine=engine, after_seq=after_seq, since_time_s=since_time_s))

    async def wait_select(
        self,
        *,
        engine: str | None = None,
        after_seq: int = 0,
        since_time_s: float | None = None,
        wait_s: float = 0.0,
    ) -> list[Event]:
        """Like ``select``; when nothing matches, wait up to ``wait_s`` for something that does
        (a long poll: `events --follow` asks again at once with the last seq it got)."""
        deadline = aio.now() + min(max(wait_s, 0.0), WAIT_LIMIT_S)
        while True:
            found = self.select(engine=engine, after_seq=after_seq, since_time_s=since_time_s)
            if found or aio.now() >= deadline:
                return found
            await asyncio.sleep(min(WAIT_POLL_S, max(0.0, deadline - aio.now())))


def _matching(
    events: list[Event], *, engine: str | None, after_seq: int, since_time_s: float | None
) -> Iterator[Event]:
    for event in events:
        if event.seq <= after_seq:
            continue
        if since_time_s is not None and event.time_s < since_time_s:
            continue
        if engine is not None and event.engine != engine:
            continue
        yield event
