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
client that sent a request is ever closed on without an answer. One pushed out stops counting at
once (the newcomer has its slot) and leaves as it can: answered "busy" with the listener's
lingering close (HTTP), or with what it sent and the loop has not read yet dropped first
(``drop_unread``): a close over unread bytes is a reset, and a reset may lose the answer.

The reserve (issue 38): an attacker that closes and opens each of its partial requests every
0.35 s is never older than the grace, so none of its connections may make way, and every load
balancer check got "busy". A listener may keep ``reserve`` more connections for clients past
the cap whose request line has not arrived yet (http_api.py answers a probe there on that line
alone, anything else "busy"; a probe whose line is in the kernel already it answers at once,
without the reserve). The reserve makes way by other rules, since its connections are past the
cap anyway: the oldest answered one, else the oldest whose request line has not arrived, at any
age, unless the caller's ``keep`` says what waits for it unread is worth keeping (a probe's
request line, read with MSG_PEEK). An attacker's reserved connections are pushed out by its own
next ones; a check is answered as soon as its line is there. And a connection whose bytes wait
unread in the kernel (the loop is behind) is not silent: it is not pushed out of the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import termios
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Final, SupportsIndex

SILENT_GRACE_S: Final = 0.5
# The kernel queue of connections not accepted yet (capped by net.core.somaxconn): a burst of a
# thousand clients waits there instead of failing to connect (EAGAIN on a Unix socket).
LISTEN_BACKLOG: Final = 1024
DROP_UNREAD_BYTES: Final = 64 * 1024  # at most this much unread input is dropped before a close

ConnectionHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]


class RequestReader(asyncio.StreamReader):
    """A StreamReader that notes when a whole request has arrived in its buffer (one of
    ``terminators`` seen, or EOF), and when its first line has, whether or not anyone has read
    them yet; and that can look at what the kernel holds for it, unread by the loop."""

    def __init__(
        self, terminators: tuple[bytes, ...], *, limit: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(limit=limit, loop=loop)
        self.accepted_at_s = loop.time()
        self.arrived = False
        self.line_arrived = False  # a line with something in it (empty lines before do not count)
        self._started = False
        self._terminators = terminators
        self._keep = max(len(t) for t in terminators) - 1  # a terminator split across two reads
        self._tail = b""
        self._fd = -1
        self._connection: asyncio.BaseTransport | None = None

    def set_transport(self, transport: asyncio.BaseTransport) -> None:
        super().set_transport(transport)
        sock = transport.get_extra_info("socket")
        self._fd, self._connection = (sock.fileno() if sock is not None else -1), transport

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        chunk = data if isinstance(data, bytes) else bytes(data)
        if not self.line_arrived:
            rest = chunk if self._started else chunk.lstrip(b"\r\n")
            self._started = self._started or bool(rest)
            self.line_arrived = b"\n" in rest
        if not self.arrived:
            window = self._tail + chunk
            if any(t in window for t in self._terminators):
                self.arrived = True
                self._tail = b""
            else:
                self._tail = window[-self._keep :] if self._keep else b""
        super().feed_data(data)

    def feed_eof(self) -> None:
        self.arrived = self.line_arrived = True  # what came is all there is: the task answers it
        super().feed_eof()

    def _socket(self) -> socket.socket | None:
        """The connection's socket, borrowed (``detach`` it): None once the transport closed it."""
        if not self._socket_open():
            return None
        try:
            return socket.socket(fileno=self._fd)
        except OSError:
            return None

    def unread(self) -> int:
        """How many bytes the client sent that the loop has not read yet (FIONREAD)."""
        if not self._socket_open():
            return 0
        try:
            return int(struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"))[0])
        except OSError:
            return 0

    def peek_unread(self, size: int) -> bytes:
        """Up to ``size`` bytes the client sent that the loop has not read yet, left there."""
        sock = self._socket()
        if sock is None:
            return b""
        try:
            return sock.recv(size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return b""
        finally:
            sock.detach()

    def drop_unread(self) -> None:
        """Read and drop what the kernel holds for this connection (at most DROP_UNREAD_BYTES),
        so that the close that follows is a FIN, not a reset that may lose our answer."""
        if self._socket_open():
            with contextlib.suppress(OSError):
                budget = DROP_UNREAD_BYTES
                while budget > 0 and (chunk := os.read(self._fd, min(budget, 16384))):
                    budget -= len(chunk)

    def _socket_open(self) -> bool:
        return self._fd >= 0 and self._connection is not None and not self._connection.is_closing()


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

    def __init__(
        self, *, max_connections: int, silent_grace_s: float = SILENT_GRACE_S, reserve: int = 0
    ) -> None:
        self.max_connections = max_connections
        self.silent_grace_s = silent_grace_s
        self.reserve = reserve
        self._open: dict[asyncio.Task[None], RequestReader] = {}
        self._reserved: dict[asyncio.Task[None], None] = {}  # in the reserve, oldest first
        self._answered: dict[asyncio.Task[None], None] = {}  # lingering after an answer, oldest first
        self._pushed_out: set[asyncio.Task[None]] = set()
        self._was_answered: set[asyncio.Task[None]] = set()  # pushed out while lingering
        # Pushed out and on their way out (answered "busy", lingering): counted nowhere else.
        self._leaving: dict[asyncio.Task[None], None] = {}
        self.pushed_out_total = 0
        self.busy_total = 0

    def __len__(self) -> int:
        return len(self._open) + len(self._leaving)

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return [*self._open, *self._leaving]

    def join(self, task: asyncio.Task[None], reader: asyncio.StreamReader) -> bool:
        """Count a new connection; past the cap, push out one that may make way. False when none
        may: the caller answers "busy" without reading the request (``refused``), or takes it
        into the reserve (``take_reserve``)."""
        assert isinstance(reader, RequestReader), "serve with protocol_factory()"
        self._open[task] = reader
        return len(self._open) - len(self._reserved) <= self.max_connections or self._push_out_one()

    def refused(self) -> None:
        """A connection past the cap was answered "busy" (counted for the metrics)."""
        self.busy_total += 1

    def take_reserve(self, task: asyncio.Task[None], keep: Callable[[RequestReader], bool]) -> bool:
        """Move a connection that ``join`` did not admit into the reserve, pushing out one there
        if it is full; False when none may make way (``keep``: one whose unread input is worth
        keeping, never pushed out while its request line has not arrived)."""
        if len(self._reserved) >= self.reserve and not self._push_out_of_reserve(keep):
            return False
        self._reserved[task] = None
        return True

    def leave(self, task: asyncio.Task[None]) -> None:
        self._open.pop(task, None)
        self._leaving.pop(task, None)
        self._reserved.pop(task, None)
        self._answered.pop(task, None)
        self._pushed_out.discard(task)
        self._was_answered.discard(task)

    def answered(self, task: asyncio.Task[None]) -> None:
        """The connection has its answer and only lingers: the first to make way."""
        if task in self._open:  # not one pushed out already
            self._answered[task] = None

    def pushed_out(self, task: asyncio.Task[None]) -> bool:
        return task in self._pushed_out

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
                if task not in self._reserved
                and (self._open[task].arrived or now - self._open[task].accepted_at_s >= self.silent_grace_s)
            ),
            None,
        )
        if victim is not None:
            self._was_answered.add(victim)
        else:
            for task, reader in self._open.items():
                if task in self._reserved:
                    continue  # not one of the cap's
                if not reader.arrived and now - reader.accepted_at_s >= self.silent_grace_s:
                    if reader.unread():
                        continue  # not silent: what it sent waits for a loop that is behind
                    victim = task
                    break
                if now - reader.accepted_at_s < self.silent_grace_s:
                    break  # accept order: every later one is younger still
        return self._push_out(victim)

    def _push_out_of_reserve(self, keep: Callable[[RequestReader], bool]) -> bool:
        victim = next((task for task in self._reserved if task in self._answered), None)
        if victim is not None:
            self._was_answered.add(victim)
        else:
            victim = next(
                (t for t in self._reserved if not self._open[t].line_arrived and not keep(self._open[t])),
                None,
            )
        return self._push_out(victim)

    def _push_out(self, victim: asyncio.Task[None] | None) -> bool:
        """``victim`` makes way at once (its slot is the newcomer's) and leaves as it can."""
        if victim is None:
            return False
        del self._open[victim]
        self._leaving[victim] = None
        self._answered.pop(victim, None)
        self._reserved.pop(victim, None)
        self._pushed_out.add(victim)
        victim.cancel()
        self.pushed_out_total += 1
        return True


__all__ = [
    "DROP_UNREAD_BYTES",
    "LISTEN_BACKLOG",
    "SILENT_GRACE_S",
    "Crowd",
    "RequestReader",
    "protocol_factory",
]
