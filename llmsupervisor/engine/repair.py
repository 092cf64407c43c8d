"""vLLM's cheapest repair, the prefix-cache reset, run beside the runner's loop.

At most one at a time; the runner publishes whether the route exists (vLLM offers it only in dev
mode), and the policy checks after ``repair_verify_s`` whether the reset helped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from llmsupervisor.engine.http import EngineHttp, PrefixReset

log = logging.getLogger("llmsupervisor.engine")


class PrefixRepair:
    def __init__(self, engine: str, *, on_done: Callable[[], None]) -> None:
        self._engine = engine
        self._on_done = on_done
        self._task: asyncio.Task[None] | None = None
        self.supported: bool | None = None  # None: not tried yet

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, http: EngineHttp, reason: str, *, verify_s: float) -> None:
        if not self.running:
            self._task = asyncio.create_task(self._run(http, reason, verify_s), name=f"repair:{self._engine}")

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self, http: EngineHttp, reason: str, verify_s: float) -> None:
        result = await http.reset_prefix_cache()
        extra = {"engine": self._engine}
        self.supported = result is PrefixReset.DONE
        if result is PrefixReset.DONE:
            log.info(
                "prefix cache reset (%s); checking for %g s whether that helped",
                reason,
                verify_s,
                extra=extra,
            )
        elif result is PrefixReset.UNSUPPORTED:
            log.info(
                "reset_prefix_cache is not offered (vLLM dev mode is off): a restart is the repair",
                extra=extra,
            )
        else:
            log.warning("reset_prefix_cache kept failing: a restart is the repair", extra=extra)
        self._on_done()
