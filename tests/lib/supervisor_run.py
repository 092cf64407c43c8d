"""Ending a Supervisor run inside a test's virtual-time loop (shared by the supervisor's loop tests
and the NVML-at-boot tests)."""

from __future__ import annotations

import asyncio

from llmsupervisor.daemon.requests import Request
from llmsupervisor.daemon.supervisor import Supervisor


async def stopped(sup: Supervisor, loop: asyncio.Task[None]) -> None:
    """Shut the supervisor down as SIGTERM would, wait for every runner, flush the status file."""
    sup.submit(Request.SHUTDOWN)
    await loop
    sup.fleet.stop_all()
    await asyncio.wait_for(asyncio.gather(*sup.fleet.all_tasks()), 600)
    await sup.status_file.flush()
