"""Which connection makes way when the daemon's listeners are full (the control socket and the
HTTP listener; control.py, http_api.py).

Each listener holds at most ``max_connections`` open (issue 17: 1,100 idle clients used up the
daemon's descriptors). Past that, a new connection may push out one that costs nothing to drop:

- one already answered (lingering after an error response, see http_api) whose request has
  arrived or that stayed silent for ``silent_grace_s``, else
- the oldest one whose request has not arrived after ``silent_grace_s`` since it was accepted
  (silent, or a slowloris that sends its head a byte at a time).

A connection whose request has arrived is never pushed out, even before its task has run: in a
burst, the oldest accepted connections are not scheduled yet while their requests sit in their
buffers, and pushing those out lost requests that had been sent (issue 28: 32 of 100 `status`
calls got "the daemon went away", 161 of 400 `GET /healthz` no status line). "Arrived" is read
where the bytes land, in the connection's ``RequestReader`` (fed by the transport as soon as the
loop reads the socket), not by the task that parses them. When nobody can make way, the new
connection is answered "busy" (503) at once, and one pushed out is answered "busy" too, so no
client that sent a request is ever closed on without an answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Final, SupportsIndex

SILENT_GRACE_S: Final = 0.5
# The kernel queue of connections not accepted yet (capped by net.core.somaxconn): a burst of a
# thousand clients waits there instead of failing to connect (EAGAIN on a Unix socket).
LISTEN_BACKLOG: Final = 1024

ConnectionHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]


class RequestReader(asyncio.StreamReader):
    """A StreamReader that notes when a whole request has arrived in its buffer (one of
    ``terminators`` seen, or EOF), whether or not anyone has read it yet."""

    def __init__(
        self, terminators: tuple[bytes, ...], *, limit: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(limit=limit, loop=loop)
        self.accepted_at_s = loop.time()
        self.arrived = False
        self._terminators = terminators
        self._keep = max(len(t) for t in terminators) - 1  # a terminator split across two reads
        self._tail = b""

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        if not self.arrived:
            window = self._tail + (data if isinstance(data, bytes) else bytes(data))
            if any(t in window for t in self._terminators):
                self.arrived = True
                self._tail = b""
            else:
                self._tail = window[-self._keep :] if self._keep else b""
        super().feed_data(data)

    def feed_eof(self) -> None:
        self.arrived = True  # what came is all there is: the task answers it
        super().feed_eof()


def protocol_factory(
    handler: ConnectionHandler, terminators: tuple[bytes, ...], *, limit: int
) -> Callable[[], asyncio.StreamReaderProtocol]:
    """What ``asyncio.start_server`` builds for each connection, with a ``RequestReader``."""
    loop = asyncio.get_running_loop()

    def factory() -> asyncio.StreamReaderProtocol:
        return asyncio.StreamReaderProtocol(
            RequestReader(terminators, limit=limit, loop=loop), handler, loop=loop
        )

    return factory


class Crowd:
    """The open connections of one listener, in accept order, and which of them may make way."""

    def __init__(self, *, max_connections: int, silent_grace_s: float = SILENT_GRACE_S) -> None:
        self.max_connections = max_connections
        self.silent_grace_s = silent_grace_s
        self._open: dict[asyncio.Task[None], RequestReader] = {}
        self._answered: dict[asyncio.Task[None], None] = {}  # lingering after an answer, oldest first
        self._pushed_out: set[asyncio.Task[None]] = set()
        self._was_answered: set[asyncio.Task[None]] = set()  # pushed out while lingering
        self.pushed_out_total = 0
        self.busy_total = 0

    def __len__(self) -> int:
        return len(self._open)

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._open)

    def join(self, task: asyncio.Task[None], reader: asyncio.StreamReader) -> bool:
        """Count a new connection; past the cap, push out one that may make way. False when none
        may: the caller answers "busy" without reading the request."""
        assert isinstance(reader, RequestReader), "serve with protocol_factory()"
        self._open[task] = reader
        if len(self._open) <= self.max_connections or self._push_out_one():
            return True
        self.busy_total += 1
        return False

    def leave(self, task: asyncio.Task[None]) -> None:
        self._open.pop(task, None)
        self._answered.pop(task, None)
        self._pushed_out.discard(task)
        self._was_answered.discard(task)

    def answered(self, task: asyncio.Task[None]) -> None:
        """The connection has its answer and only lingers: the first to make way."""
        self._answered[task] = None

    def owes_answer(self, task: asyncio.Task[None]) -> bool:
        """Whether ``task`` was cancelled to make way before it was answered (else it was
        answered already, or the server is closing): it answers "busy" as it closes."""
        return task in self._pushed_out and task not in self._was_answered

    def _push_out_one(self) -> bool:
        now = asyncio.get_running_loop().time()
        # An answered one whose request is still in the kernel's buffer must not be closed yet:
        # closing over unread bytes sends a reset, and the client loses the answer it has not
        # read (seen in bursts: hundreds of 503s lost). Once its bytes have arrived here, or after
        # the grace with none, closing sends a plain FIN.
        victim = next(
            (
                task
                for task in self._answered
                if self._open[task].arrived or now - self._open[task].accepted_at_s >= self.silent_grace_s
            ),
            None,
        )
        if victim is not None:
            self._was_answered.add(victim)
        else:
            for task, reader in self._open.items():
                if task in self._pushed_out:
                    continue  # cancelled already, not gone yet
                if not reader.arrived and now - reader.accepted_at_s >= self.silent_grace_s:
                    victim = task
                    break
                if now - reader.accepted_at_s < self.silent_grace_s:
                    break  # accept order: every later one is younger still
        if victim is None:
            return False
        self._answered.pop(victim, None)
        self._pushed_out.add(victim)
        victim.cancel()
        self.pushed_out_total += 1
        return True


__all__ = ["LISTEN_BACKLOG", "SILENT_GRACE_S", "Crowd", "RequestReader", "protocol_factory"]
