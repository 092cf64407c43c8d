"""The daemon's one clock and one wait primitive.

Time is the event loop's (``loop.time()``, monotonic): every deadline, backoff and observation
stamp reads it, so a test that runs the loop on virtual time (tests/lib/virtual_time.py) moves all
of them at once, and nothing mixes time bases. Wall-clock time appears only where it is shown to
people or exported as a ``*_timestamp_seconds`` value.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import Awaitable
from typing import Any


def now() -> float:
    """Monotonic seconds on the running loop's clock."""
    return asyncio.get_running_loop().time()


async def wait_any(*aws: Awaitable[Any], timeout_s: float | None) -> bool:
    """Wait until the first of ``aws`` completes or ``timeout_s`` passes; cancel the rest.
    True when one completed, False at the deadline. Exceptions of the awaitables are swallowed:
    a caller waits on *whether* something happened and reads *what* from its own state."""
    if not aws:  # a plain sleep, on the same clock
        await asyncio.sleep(max(0.0, timeout_s or 0.0))
        return False
    futures = [asyncio.ensure_future(aw) for aw in aws]
    try:
        if timeout_s is not None and timeout_s <= 0:
            await asyncio.sleep(0)
            return any(f.done() for f in futures)
        done, _ = await asyncio.wait(futures, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        return bool(done)
    finally:
        for future in futures:
            if not future.done():
                future.cancel()
        for future in futures:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                if future.done() and not future.cancelled():
                    future.exception()


class Changes:
    """A change counter that any number of tasks can wait on: runners ``set(name)`` it after
    each status they publish; the reconcile loop and a rolling reload wait for the next change.

    It also keeps which engines changed, for one reader (the reconcile loop) to ``take_changed``:
    eight engines publish eight times a tick, and a loop that looked at every engine on each of
    them did O(engines^2) work per tick.
    """

    def __init__(self) -> None:
        self._version = 0
        self._event = asyncio.Event()
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
        event, self._event = self._event, asyncio.Event()
        event.set()

    def take_changed(self) -> builtins.set[str] | None:  # `set` here is the method above
        """The engines that changed since the last call; None if anything else changed too."""
        changed, self._changed = self._changed, set()
        return changed

    async def wait(self, since: int) -> None:
        """Return once there has been a change after ``since`` (a ``version`` read earlier)."""
        while self._version <= since:
            await self._event.wait()
