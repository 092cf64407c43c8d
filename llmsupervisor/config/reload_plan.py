"""A reload as a pure plan: what the new config adds, removes, restarts and only re-specs.

``plan_reload`` diffs two validated configs; nothing is touched until the whole new config has
validated (a bad reload keeps the old config running). Engines whose spec changed are restarted
only if they are meant to run, by the policy within ``max_unavailable`` (core/policy.py,
``CONFIG_RESTART``); a stopped engine gets its new spec and stays stopped (defect D5).
Supervisor settings that cannot change under a running daemon are listed, so the reload says so
instead of applying them partly and silently (D9).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from llmsupervisor.config.spec import EngineSpec, SupervisorConfig

# Supervisor settings read live on every use; the others take effect at the next start.
LIVE_SETTINGS = frozenset(
    {"log_level", "max_unavailable", "min_in_rotation", "shutdown_timeout_s", "readyz_requires"}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReloadPlan:
    added: tuple[EngineSpec, ...] = ()
    removed: tuple[str, ...] = ()
    restart: tuple[EngineSpec, ...] = ()  # changed and meant to run: the policy rolls them
    respec: tuple[EngineSpec, ...] = ()  # changed but not running: new spec, stays as it is
    enable: tuple[str, ...] = ()  # enabled: true now (after its respec)
    disable: tuple[str, ...] = ()  # enabled: false now: stopped
    # Disabled or removed engines that do not run now (stopped, FATAL): nothing to stop.
    idle: tuple[str, ...] = ()
    next_start_only: tuple[str, ...] = ()  # "supervisor.tick_interval_s", ...

    @property
    def changed(self) -> tuple[str, ...]:
        return tuple(sorted(s.name for s in (*self.restart, *self.respec)))


def plan_reload(old: SupervisorConfig, new: SupervisorConfig, running: Mapping[str, bool]) -> ReloadPlan:
    """``running``: per engine, whether it runs now (``EngineStatus.running``: not stopped, by an
    operator or the config's ``enabled: false``, and not FATAL; a disabled engine started by
    hand runs)."""
    old_specs = {s.name: s for s in old.engines}
    new_specs = {s.name: s for s in new.engines}
    restart, respec, enable, disable = [], [], [], []
    for name, spec in new_specs.items():
        before = old_specs.get(name)
        if before is None or before == spec:
            continue
        if before.enabled and not spec.enabled:
            disable.append(name)
            respec.append(spec)
        elif not before.enabled and spec.enabled:
            enable.append(name)
            respec.append(spec)
        elif running.get(name, False):
            restart.append(spec)
        else:
            respec.append(spec)
    next_start_only = tuple(
        f"supervisor.{f.name}"
        for f in fields(old.supervisor)
        if f.name not in LIVE_SETTINGS and getattr(old.supervisor, f.name) != getattr(new.supervisor, f.name)
    )
    removed = tuple(n for n in old_specs if n not in new_specs)
    return ReloadPlan(
        added=tuple(s for n, s in new_specs.items() if n not in old_specs),
        removed=removed,
        restart=tuple(restart),
        respec=tuple(respec),
        enable=tuple(enable),
        disable=tuple(disable),
        idle=tuple(n for n in (*disable, *removed) if not running.get(n, False)),
        next_start_only=next_start_only,
    )
