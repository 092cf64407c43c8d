"""The one wait primitive (``aio.wait_any``) and the task-free things it watches (``aio.Flag``,
``aio.Changes.future``): what it returns, what it cancels and what it leaves alone."""

from __future__ import annotations

import asyncio
import functools
import gc
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from llmsupervisor import aio


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """A test body run on a fresh event loop."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@in_loop
async def test_a_future_that_completes_ends_the_wait_and_is_not_cancelled() -> None:
    loop = asyncio.get_running_loop()
    shared: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.01, shared.set_result, 7)
    assert await aio.wait_any(shared, timeout_s=5) is True
    assert shared.result() == 7


@in_loop
async def test_at_the_deadline_a_watched_future_goes_on_and_keeps_no_callback() -> None:
    shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert await aio.wait_any(shared, timeout_s=0.01) is False
    assert not shared.done()  # shared with other waiters: never cancelled by one of them
    # Watched without a task, and watched no more: nothing of this wait is left on it.
    assert not shared._callbacks


@in_loop
async def test_a_coroutine_becomes_a_task_of_the_wait_and_is_cancelled_with_it() -> None:
    started, cancelled = asyncio.Event(), []

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    assert await aio.wait_any(forever(), timeout_s=0.01) is False
    await asyncio.sleep(0)
    assert started.is_set() and cancelled == [True]


@in_loop
async def test_an_exception_of_what_was_waited_on_is_swallowed_and_marked_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.ensure_future(fails())
    assert await aio.wait_any(task, timeout_s=5) is True
    del task
    gc.collect()
    assert "never retrieved" not in caplog.text


@in_loop
async def test_a_zero_timeout_gives_a_coroutine_its_first_step() -> None:
    async def at_once() -> None:
        return None

    assert await aio.wait_any(at_once(), timeout_s=0) is True


@in_loop
async def test_no_awaitables_is_a_sleep() -> None:
    started = aio.now()
    assert await aio.wait_any(timeout_s=0.02) is False
    assert aio.now() >= started + 0.02


@in_loop
async def test_a_flag_set_before_the_wait_ends_it_at_once_and_clear_rearms_it() -> None:
    flag = aio.Flag()
    flag.set()
    assert await aio.wait_any(flag.future(), timeout_s=5) is True
    flag.clear()
    assert not flag.is_set()
    assert await aio.wait_any(flag.future(), timeout_s=0.01) is False
    asyncio.get_running_loop().call_later(0.01, flag.set)
    assert await aio.wait_any(flag.future(), timeout_s=5) is True


@in_loop
async def test_a_flag_wakes_every_waiter_and_a_cancelled_waiter_leaves_it_working() -> None:
    flag = aio.Flag()
    first = asyncio.ensure_future(aio.wait_any(flag.future(), timeout_s=5))
    second = asyncio.ensure_future(aio.wait_any(flag.future(), timeout_s=5))
    gone = asyncio.ensure_future(aio.wait_any(flag.future(), timeout_s=5))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    flag.set()
    assert await first is True
    assert await second is True
    assert gone.cancelled()


@in_loop
async def test_changes_future_is_done_after_a_change_since_the_version_read() -> None:
    changes = aio.Changes()
    seen = changes.version
    assert await aio.wait_any(changes.future(seen), timeout_s=0.01) is False
    asyncio.get_running_loop().call_later(0.01, changes.set, "a")
    assert await aio.wait_any(changes.future(seen), timeout_s=5) is True
    assert changes.future(seen).done()  # a change after `seen` already happened
    assert changes.take_changed() == {"a"}
    await changes.wait(seen)  # returns at once as well
