"""The daemon's one clock and one wait primitive.

Time is the event loop's (``loop.time()``, monotonic): every deadline, backoff and observation
stamp reads it, so a test that runs the loop on virtual time (tests/lib/virtual_time.py) moves all
of them at once, and nothing mixes time bases. Wall-clock time appears only where it is shown to
people or exported as a ``*_timestamp_seconds`` value.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Awaitable, Callable
from typing import Any


def now() -> float:
    """Monotonic seconds on the running loop's clock."""
    return asyncio.get_running_loop().time()


async def wait_any(*aws: Awaitable[Any], timeout_s: float | None) -> bool:
    """Wait until the first of ``aws`` completes or ``timeout_s`` passes.
    True when one completed, False at the deadline. Exceptions of the awaitables are swallowed:
    a caller waits on *whether* something happened and reads *what* from its own state.

    A coroutine becomes a task of this wait, cancelled when it returns. A future (a task, a
    ``Flag``'s, a process's exit) is only watched, never cancelled: a caller that owns it decides
    its fate, and one it shares (the runner's wake, a process's exit) goes on for its other
    waiters. Watching a future costs no task: the runner's pause and round each waited on two or
    three coroutines as tasks, every round of every engine, a third of what those waits cost on
    the daemon's loop (docs/benchmarks.md, "Fewer tasks per round")."""
    if not aws:  # a plain sleep, on the same clock
        await asyncio.sleep(max(0.0, timeout_s or 0.0))
        return False
    loop = asyncio.get_running_loop()
    created: list[asyncio.Future[Any]] = []
    futures: list[asyncio.Future[Any]] = []
    for aw in aws:
        if asyncio.isfuture(aw):
            futures.append(aw)
        else:
            task = asyncio.ensure_future(aw)
            created.append(task)
            futures.append(task)
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    if timeout_s is not None and timeout_s <= 0:
        # No wait: a turn of the loop, so that a coroutine made a task here gets its first step.
        await asyncio.sleep(0)
        return _finish(futures, created, wake)
    for future in futures:
        if future.done():
            wake()
            break
        future.add_done_callback(wake)
    deadline = loop.call_later(timeout_s, wake) if timeout_s is not None else None
    try:
        await waiter
    finally:
        if deadline is not None:
            deadline.cancel()
        done = _finish(futures, created, wake)
    return done


def _finish(
    futures: list[asyncio.Future[Any]], created: list[asyncio.Future[Any]], wake: Callable[..., None]
) -> bool:
    """Stop watching; cancel this wait's own tasks; mark what ended as read (no "exception was
    never retrieved" for what the caller waited on only to know *whether* it ended)."""
    for future in futures:
        future.remove_done_callback(wake)
    for task in created:
        if not task.done():
            task.cancel()
    done = False
    for future in futures:
        if future.done():
            done = True
            if not future.cancelled():
                future.exception()
    return done


class Flag:
    """What ``asyncio.Event`` does, with a future to wait on instead of a coroutine, so that
    ``wait_any`` watches it without a task of its own. One future per time the flag is set: every
    waiter watches that one, and ``clear`` after it fired starts the next."""

    __slots__ = ("_future", "_set")

    def __init__(self) -> None:
        self._set = False
        self._future: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    def clear(self) -> None:
        self._set = False
        if self._future is not None and self._future.done():
            self._future = None

    def future(self) -> asyncio.Future[None]:
        """Done once the flag is set (at once if it is). Not to be cancelled: it is shared."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self._set:
                self._future.set_result(None)
        return self._future


class Changes:
    """A change counter that any number of tasks can wait on: runners ``set(name)`` it after
    each status they publish; the reconcile loop and a rolling reload wait for the next change.

    It also keeps which engines changed, for one reader (the reconcile loop) to ``take_changed``:
    eight engines publish eight times a tick, and a loop that looked at every engine on each of
    them did O(engines^2) work per tick.
    """

    def __init__(self) -> None:
        self._version = 0
        self._next: asyncio.Future[None] | None = None  # done at the next change; made when asked
        self._changed: set[str] | None = set()  # None: a change not tied to one engine

    @property
    def version(self) -> int:
        return self._version

    def set(self, name: str | None = None) -> None:
        """A change; ``name`` the engine whose status changed, None for anything else."""
        self._version += 1
        if name is None:
            self._changed = None
        elif self._changed is not None:
            self._changed.add(name)
        following, self._next = self._next, None
        if following is not None and not following.done():
            following.set_result(None)

    def take_changed(self) -> builtins.set[str] | None:  # `set` here is the method above
        """The engines that changed since the last call; None if anything else changed too."""
        changed, self._changed = self._changed, set()
        return changed

    def future(self, since: int) -> asyncio.Future[None]:
        """Done once there has been a change after ``since`` (a ``version`` read earlier): for
        ``wait_any``, which watches it without a task. Shared: not to be cancelled."""
        if self._version > since:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    async def wait(self, since: int) -> None:
        """Return once there has been a change after ``since`` (a ``version`` read earlier)."""
        while self._version <= since:
            await asyncio.shield(self.future(since))
