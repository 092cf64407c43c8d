"""Carrying out a reload plan (config/reload_plan.py) on the fleet: read, validate, place, plan,
and apply what takes no engine out of rotation.

Removed engines are retired, added ones start, engines that do not run get their new spec and
stay as they are. Engines that run and changed keep their old spec for now: the policy rolls
them (core/policy.py, ``CONFIG_RESTART``), since it is the one decider of capacity and counts
everything that takes an engine out (a roll deciding on its own raced it: defect E1). The reload
itself never waits for a restart, so READY=1 follows RELOADING=1 as soon as the plan is applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from llmsupervisor.config import SupervisorConfig, load_config
from llmsupervisor.config.reload_diff import NOTHING, describe, engine_changes, setting_changes
from llmsupervisor.config.reload_plan import ReloadPlan, plan_reload
from llmsupervisor.daemon.fleet import Fleet
from llmsupervisor.daemon.reconcile import roll_due
from llmsupervisor.engine.commands import Respec, Start, Stop
from llmsupervisor.errors import ConfigError
from llmsupervisor.notify import Notifier

log = logging.getLogger("llmsupervisor")


def apply_now(plan: ReloadPlan, fleet: Fleet) -> None:
    """Everything of the plan that takes no engine out of rotation (``plan.restart`` is the
    policy's to roll)."""
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


def rolling(config: SupervisorConfig, fleet: Fleet) -> list[str]:
    """The engines the policy will restart onto ``config`` (daemon/reconcile.py ``roll_due``):
    running another spec, a hand-started disabled engine included. Besides this reload's changes,
    those a halted roll never reached. The same before the plan is applied (a dry run): added
    engines are not in the fleet yet, removed and disabled ones are stopped instead."""
    specs = {s.name: s for s in config.engines}
    return [s.name for s in fleet.statuses() if roll_due(s, specs.get(s.name))]


def _reply(
    current: SupervisorConfig, new: SupervisorConfig, plan: ReloadPlan, to_roll: list[str]
) -> dict[str, Any]:
    """What a reload did (or, dry, would do): the names by kind, as before, and per engine the
    fields that changed and what happens (config/reload_diff.py), as data and as lines."""
    engines = engine_changes(current, new, plan, to_roll)
    settings = setting_changes(current, new)
    return {
        "added": [s.name for s in plan.added],
        "removed": list(plan.removed),
        "changed": list(plan.changed),
        "rolling": to_roll,  # restarted by the policy, within max_unavailable
        "max_unavailable": new.supervisor.max_unavailable,
        "next_start_only": list(plan.next_start_only),
        "engines": [e.as_json() for e in engines],
        "settings": [s.as_json() for s in settings],
        "lines": [describe(e) for e in engines]
        + [f"{s.change} ({'now' if s.live else 'at the next daemon start'})" for s in settings],
    }


class Reloader:
    """Reads, validates and applies a new config; one reload at a time.

    On any problem in the new file the old config keeps running and the problem stays in
    STATUS= until a reload succeeds (the operator must see it in `systemctl status`)."""

    def __init__(
        self,
        fleet: Fleet,
        notifier: Notifier,
        *,
        summary: Callable[[], str],
        stopping: Callable[[], bool],
        place: Callable[[SupervisorConfig], Awaitable[SupervisorConfig]] | None = None,
    ) -> None:
        self._place = place
        self._fleet = fleet
        self._notifier = notifier
        self._summary = summary
        self._stopping = stopping
        self._lock = asyncio.Lock()
        self.totals: dict[str, int] = {"ok": 0, "invalid": 0}
        self.problem: str | None = None

    async def reload(
        self, current: SupervisorConfig, *, dry_run: bool = False
    ) -> tuple[SupervisorConfig | None, dict[str, Any]]:
        """(the new config, or None when nothing changed hands; the reply for the operator).

        ``dry_run``: read, validate, place and plan the same way, and answer what would happen,
        applying nothing (no RELOADING=1 either: systemd is told of reloads only)."""
        async with self._lock:
            if dry_run:
                return None, await self._preview(current)
            self._notifier.reloading()
            try:
                return await self._reload_locked(current)
            except BaseException:
                # systemd waits in "reloading" until READY=1: never leave it there, even on a bug
                # (or a cancellation) between reading the file and applying it.
                self._notifier.ready(self._summary())
                raise

    async def _read(self, current: SupervisorConfig) -> SupervisorConfig | list[str]:
        """The new config, placed like the running one, or its problems."""
        try:
            new = await asyncio.to_thread(load_config, current.path)
        except ConfigError as exc:  # every bad file, loader bugs included (load_config)
            return [str(p) for p in exc.problems]
        if self._place is not None:  # placed like the running config, or every auto engine differs
            new = await self._place(new)
        return new

    def _plan(self, current: SupervisorConfig, new: SupervisorConfig) -> ReloadPlan:
        running = {s.name: s.running for s in self._fleet.statuses()}
        return plan_reload(current, new, running)

    async def _preview(self, current: SupervisorConfig) -> dict[str, Any]:
        new = await self._read(current)
        if isinstance(new, list):
            return {"reloaded": False, "dry_run": True, "problems": new}
        plan = self._plan(current, new)
        return {
            "reloaded": False,
            "dry_run": True,
            **_reply(current, new, plan, rolling(new, self._fleet)),
        }

    async def _reload_locked(
        self, current: SupervisorConfig
    ) -> tuple[SupervisorConfig | None, dict[str, Any]]:
        new = await self._read(current)
        if isinstance(new, list):
            self.totals["invalid"] += 1
            for problem in new:
                log.error("reload: %s", problem)
            log.error(
                "reload rejected: %d problem(s); still running the previous config",
                len(new),
                extra={"event": "reload"},
            )
            self.problem = f"reload failed ({len(new)} problems), old config kept"
            self._notifier.ready(self._summary())
            return None, {"reloaded": False, "problems": new}
        if self._stopping():  # a shutdown began while the file was read: change nothing
            return None, {"reloaded": False, "problems": ["the daemon is shutting down"]}
        fleet = self._fleet
        plan = self._plan(current, new)
        for setting in plan.next_start_only:
            log.warning("reload: %s changed; it takes effect at the next daemon start", setting)
        apply_now(plan, fleet)
        to_roll = rolling(new, fleet)
        self.totals["ok"] += 1
        self.problem = None
        changed = list(plan.changed)
        log.info(
            "reloaded %s: %d added, %d removed, %d changed (%s), %d unchanged; to restart within "
            "max_unavailable=%d: %s",
            current.path,
            len(plan.added),
            len(plan.removed),
            len(changed),
            ", ".join(changed) or "-",
            len(new.engines) - len(plan.added) - len(changed),
            new.supervisor.max_unavailable,
            ", ".join(to_roll) or "-",
            extra={"event": "reload"},
        )
        reply = _reply(current, new, plan, to_roll)
        for engine, line in zip(reply["engines"], reply["lines"], strict=False):
            if engine["action"] != NOTHING:  # why each engine restarts, in the journal and `events`
                log.info("reload: %s", line, extra={"engine": engine["engine"], "event": "reload"})
        return new, {"reloaded": True, **reply}
