"""Carrying out a reload plan (config/reload_plan.py) on the fleet.

Removed engines are retired, added ones start, stopped ones get their new spec and stay
stopped. Engines that run and changed are restarted one at a time: each waits until fewer than
``max_unavailable`` other engines are out of rotation, and the next one waits until this one is
READY again (or has failed), so a config change never takes more than one engine away. The roll
waits on the fleet's changes, not on a polling timer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec, SupervisorConfig, load_config
from llmsupervisor.config.reload_plan import ReloadPlan, plan_reload
from llmsupervisor.core.policy import back_in_rotation
from llmsupervisor.core.policy_memory import PolicyMemory
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.fleet import Fleet
from llmsupervisor.daemon.reconcile import view_of
from llmsupervisor.engine.commands import Respec, Restart, Start, Stop
from llmsupervisor.errors import ConfigError
from llmsupervisor.notify import Notifier

log = logging.getLogger("llmsupervisor")

CAPACITY_WAIT_S: Final = 600.0
SETTLE_MARGIN_S: Final = 120.0
_SETTLED = (EngineState.READY, EngineState.FATAL, EngineState.BACKOFF, EngineState.STOPPED)


def apply_now(plan: ReloadPlan, fleet: Fleet) -> None:
    """Everything of the plan that takes no engine out of rotation."""
    for name in plan.removed:
        fleet.retire(name)
    for spec in plan.added:
        fleet.add(spec)
    for spec in plan.respec:
        fleet.send(spec.name, Respec(spec))
    for name in plan.disable:
        fleet.send(name, Stop())
    for name in plan.enable:
        fleet.send(name, Start())


async def roll(
    specs: tuple[EngineSpec, ...],
    fleet: Fleet,
    memory: PolicyMemory,
    *,
    max_unavailable: Callable[[], int],
) -> None:
    for spec in specs:
        if fleet.shutting_down or fleet.status(spec.name) is None:
            continue
        await _await_capacity(spec.name, fleet, memory, max_unavailable)
        status = fleet.status(spec.name)
        if fleet.shutting_down or status is None:
            continue
        changes_before = status.state_changes_total
        fleet.send(spec.name, Restart(cause="config_change", reason="config changed", spec=spec))
        deadline = aio.now() + spec.start_timeout_s + spec.drain_timeout_s + SETTLE_MARGIN_S
        while not fleet.shutting_down and aio.now() < deadline:
            status = fleet.status(spec.name)
            if status is None or (
                status.state_changes_total > changes_before + 1 and status.state in _SETTLED
            ):
                break
            seen = fleet.changes.version
            await aio.wait_any(fleet.changes.wait(seen), timeout_s=deadline - aio.now())


async def _await_capacity(
    name: str, fleet: Fleet, memory: PolicyMemory, max_unavailable: Callable[[], int]
) -> None:
    """A config change is a planned action: wait (bounded) while max_unavailable other engines
    are already out of rotation, whatever took them out."""
    deadline = aio.now() + CAPACITY_WAIT_S
    logged = False
    while not fleet.shutting_down and aio.now() < deadline:
        now = aio.now()
        out = [
            s.name
            for s in fleet.statuses()
            if s.name != name and s.spec.enabled and not back_in_rotation(view_of(s, memory.of(s.name)), now)
        ]
        if len(out) < max_unavailable():
            return
        if not logged:
            log.info(
                "config change waits: %s out of rotation (max_unavailable=%d)",
                ", ".join(out),
                max_unavailable(),
                extra={"engine": name},
            )
            logged = True
        # Rotation grace passes without a status change: wake for it too.
        seen = fleet.changes.version
        await aio.wait_any(fleet.changes.wait(seen), timeout_s=min(1.0, deadline - aio.now()))


class Reloader:
    """Reads, validates and applies a new config; one reload at a time, rolls one after another.

    On any problem in the new file the old config keeps running and the problem stays in
    STATUS= until a reload succeeds (the operator must see it in `systemctl status`)."""

    def __init__(
        self,
        fleet: Fleet,
        memory: PolicyMemory,
        notifier: Notifier,
        *,
        summary: Callable[[], str],
        stopping: Callable[[], bool],
        place: Callable[[SupervisorConfig], Awaitable[SupervisorConfig]] | None = None,
    ) -> None:
        self._place = place
        self._fleet = fleet
        self._memory = memory
        self._notifier = notifier
        self._summary = summary
        self._stopping = stopping
        self._lock = asyncio.Lock()
        self._roll: asyncio.Task[None] | None = None
        self.totals: dict[str, int] = {"ok": 0, "invalid": 0}
        self.problem: str | None = None

    async def reload(self, current: SupervisorConfig) -> tuple[SupervisorConfig | None, dict[str, Any]]:
        """(the new config, or None when nothing changed hands; the reply for the operator)."""
        async with self._lock:
            self._notifier.reloading()
            try:
                return await self._reload_locked(current)
            except BaseException:
                # systemd waits in "reloading" until READY=1: never leave it there, even on a bug
                # (or a cancellation) between reading the file and applying it.
                self._notifier.ready(self._summary())
                raise

    async def _reload_locked(
        self, current: SupervisorConfig
    ) -> tuple[SupervisorConfig | None, dict[str, Any]]:
        try:
            new = await asyncio.to_thread(load_config, current.path)
        except ConfigError as exc:  # every bad file, loader bugs included (load_config)
            self.totals["invalid"] += 1
            for problem in exc.problems:
                log.error("reload: %s", problem)
            log.error(
                "reload rejected: %d problem(s); still running the previous config",
                len(exc.problems),
                extra={"event": "reload"},
            )
            self.problem = f"reload failed ({len(exc.problems)} problems), old config kept"
            self._notifier.ready(self._summary())
            return None, {"reloaded": False, "problems": [str(p) for p in exc.problems]}
        if self._place is not None:  # placed like the running config, or every auto engine differs
            new = await self._place(new)
        if self._stopping():  # a shutdown began while the file was read: change nothing
            return None, {"reloaded": False, "problems": ["the daemon is shutting down"]}
        fleet = self._fleet
        running = {s.name: s.wants_run and s.state is not EngineState.FATAL for s in fleet.statuses()}
        plan = plan_reload(current, new, running)
        for setting in plan.next_start_only:
            log.warning("reload: %s changed; it takes effect at the next daemon start", setting)
        apply_now(plan, fleet)
        if plan.restart:
            previous = self._roll
            self._roll = asyncio.create_task(self._roll_after(previous, plan.restart, new), name="roll")
        self.totals["ok"] += 1
        self.problem = None
        changed = list(plan.changed)
        log.info(
            "reloaded %s: %d added, %d removed, %d changed (%s), %d unchanged",
            current.path,
            len(plan.added),
            len(plan.removed),
            len(changed),
            ", ".join(changed) or "-",
            len(new.engines) - len(plan.added) - len(changed),
            extra={"event": "reload"},
        )
        return new, {
            "reloaded": True,
            "added": [s.name for s in plan.added],
            "removed": list(plan.removed),
            "changed": changed,
            "next_start_only": list(plan.next_start_only),
        }

    async def _roll_after(
        self, previous: asyncio.Task[None] | None, specs: tuple[EngineSpec, ...], config: SupervisorConfig
    ) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait({previous})
        await roll(
            specs, self._fleet, self._memory, max_unavailable=lambda: config.supervisor.max_unavailable
        )

    def cancel(self) -> None:
        if self._roll is not None:
            self._roll.cancel()
