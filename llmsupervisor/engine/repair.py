"""vLLM's cheapest repair, the prefix-cache reset, run beside the runner's loop.

At most one at a time. Its result (``ResetDone``: whether the route exists; vLLM offers it only in
dev mode) is reported to the runner's inbox, never published from here: the runner takes it at
its next wait and publishes it from its own task. The policy checks after ``repair_verify_s``
whether the reset helped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from llmsupervisor.engine.http import EngineHttp, PrefixReset

log = logging.getLogger("llmsupervisor.engine")


@dataclass(frozen=True, slots=True)
class ResetDone:
    """A prefix-cache reset has ended; ``supported``: vLLM offers the route."""

    supported: bool


class PrefixRepair:
    def __init__(self, engine: str, *, report: Callable[[ResetDone], None]) -> None:
        self._engine = engine
        self._report = report
        self._task: asyncio.Task[None] | None = None

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
        self._report(ResetDone(result is PrefixReset.DONE))
