"""An event loop on virtual time, for runner and daemon tests with fake processes and HTTP.

When nothing is ready to run, the loop jumps its clock to the next timer instead of sleeping,
so a test of a 15-minute start timeout or a 5-minute backoff takes milliseconds and sees the
same ``loop.time()`` arithmetic the daemon does in production (llmsupervisor/aio.py). It must
not wait on real I/O: with a timer pending, a real socket would simply never be waited for.

Work handed to a thread (``asyncio.to_thread``: a state file's fsync, a /proc sweep) takes no
virtual time: while any is under way the clock stands still and the loop waits for it for real.
Otherwise a timeout around a thread fired at once (the clock jumped to it while the thread was
still writing a few bytes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start_s: float = 1000.0) -> None:
        super().__init__()
        self._virtual_s = start_s
        self._in_threads = 0

    def time(self) -> float:
        return self._virtual_s

    def hold(self, seconds: float) -> None:
        """What a blocking call on the loop does: ``seconds`` pass while no callback runs."""
        self._virtual_s += seconds

    def run_in_executor(  # type: ignore[override]
        self, executor: concurrent.futures.Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self._in_threads += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: asyncio.Future[Any]) -> None:
        self._in_threads -= 1

    def _run_once(self) -> None:
        # Nothing to run now: the earliest timer is due now (asyncio internals, stable in 3.11+).
        ready = self._ready  # type: ignore[attr-defined]
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if scheduled and not self._in_threads:
            when = scheduled[0].when()
            # A timer within the clock's resolution runs now even with other callbacks ready;
            # the clock must reach it too, or a task that waits "until t" (t a hair ahead) finds
            # t still ahead and waits again, forever while others keep the loop busy.
            if not ready or when < self._virtual_s + self._clock_resolution:  # type: ignore[attr-defined]
                self._virtual_s = max(self._virtual_s, when)
        super()._run_once()  # type: ignore[misc]


def run_virtual(coro: Coroutine[Any, Any, T], *, start_s: float = 1000.0) -> T:
    loop = VirtualTimeLoop(start_s)
    try:
        return loop.run_until_complete(coro)
    finally:
        # As asyncio.run does: a test that failed half-way leaves tasks behind; end them here.
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
