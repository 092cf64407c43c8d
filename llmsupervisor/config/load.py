"""``load_config``: the file's three sections checked in order, then the engines against each
other. Any problem anywhere means no ``SupervisorConfig`` at all, which is what lets a reload
keep the config it has.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from llmsupervisor.config.checks import _cross_checks, _engine, _home_expanded, check_placement
from llmsupervisor.config.fields import ENGINE_FIELDS, PER_ENGINE_ONLY, SUPERVISOR_FIELDS
from llmsupervisor.config.kinds import _check_section, _suggest, _type_name
from llmsupervisor.config.listeners import check_listeners
from llmsupervisor.config.problems import _Collector, _parse
from llmsupervisor.config.spec import EngineSpec, SupervisorConfig, SupervisorSettings
from llmsupervisor.errors import ConfigError, ConfigProblem

log = logging.getLogger(__name__)

DEFAULT_CONFIG_PATH: Final = Path("/etc/llm-supervisor/config.yaml")

TOP_LEVEL: Final = ("supervisor", "defaults", "engines")

# The message of the one problem a loader bug becomes. The fuzzer and the property tests treat
# it as a failure; the daemon treats it as a bad file (exit 78, or the old config kept on reload).
INTERNAL_PROBLEM: Final = "the loader failed on this file (a bug in llm-supervisor; please report it)"


def load_config(
    path: Path | str, *, check_paths: bool = True, hub_env: Mapping[str, str] | None = None
) -> SupervisorConfig:
    """Parse and validate ``path``; raise ``ConfigError`` listing every problem found.

    With ``hub_env`` (the environment the daemon runs its engines with; ``check-config`` and
    ``doctor`` pass one, the daemon does not), a Hugging Face hub id that cannot be loaded
    offline is a problem too (``checks.hub_offline_problem``). The daemon itself does not refuse
    to start on it: its own environment decides, and the cache may be filled after the check.

    Never raises anything else: an unexpected exception while checking a file (a bug) becomes
    a ``ConfigError`` naming the file, so startup exits 78 and a reload keeps the old config
    and says why, instead of a traceback or an "internal error" mid-reload.
    """
    file = Path(path)
    try:
        raw, out = _parse(file)
        config = _validate(raw, file, out, check_paths=check_paths, hub_env=hub_env)
    except ConfigError:
        raise
    except Exception as exc:
        log.debug("checking %s raised", file, exc_info=True)
        message = f"{INTERNAL_PROBLEM}: {type(exc).__name__}: {exc}"
        problem = ConfigProblem(file=str(file), line=1, field="(top level)", message=message[:500])
        raise ConfigError([problem]) from None
    if out.problems or config is None:
        raise ConfigError(out.problems)
    return config


def state_dir_named_in(path: Path) -> Path | None:
    """The ``supervisor.state_dir`` a config file names, read with the loader's bounds and
    without validating the rest (the CLI finds the control socket with it, also while the file
    is being fixed); None when the file cannot be read that far."""
    try:
        raw, _ = _parse(path)
    except Exception:  # ConfigError, or anything else: only a hint, the default socket is tried
        return None
    section = raw.get("supervisor") if isinstance(raw, dict) else None
    state_dir = section.get("state_dir") if isinstance(section, dict) else None
    if not isinstance(state_dir, str) or not state_dir or "\0" in state_dir:
        return None
    return beside(path, os.path.expanduser(state_dir))


def beside(file: Path, value: str) -> Path:
    """A path as the config file means it: a relative one is next to the file (as docker compose
    reads its file), never against the working directory of whoever reads it (the daemon's is
    ``/`` under systemd, the CLI's anything)."""
    return Path(os.path.abspath(file.parent / value))


def _validate(
    raw: Any, file: Path, out: _Collector, *, check_paths: bool, hub_env: Mapping[str, str] | None
) -> SupervisorConfig | None:
    if not isinstance(raw, dict):
        out.add((), f"the config must be a mapping with {', '.join(TOP_LEVEL)}, got {_type_name(raw)}")
        return None
    for key in raw:
        if key not in TOP_LEVEL:
            out.add((key,), f"unknown top-level key{_suggest(key, list(TOP_LEVEL))}")

    sup_raw = raw.get("supervisor")
    sup = _check_section(sup_raw, ("supervisor",), SUPERVISOR_FIELDS, out, what="daemon settings")
    settings = None
    http_listen: str | None = None  # None: not known (it has a problem of its own)
    if sup is not None:
        if "state_dir" in sup:
            state_dir = _home_expanded(sup["state_dir"], ("supervisor", "state_dir"), out)
            sup["state_dir"] = beside(file, state_dir if state_dir is not None else sup["state_dir"])
        settings = SupervisorSettings(**sup)
        http_listen = settings.http_listen
    listen_set = isinstance(sup_raw, dict) and "http_listen" in sup_raw
    if listen_set and (sup is None or "http_listen" not in sup):
        http_listen = None

    defaults_fields = {k: v for k, v in ENGINE_FIELDS.items() if k not in PER_ENGINE_ONLY}
    defaults_raw = raw.get("defaults")
    if isinstance(defaults_raw, dict):
        # Reported once, here; _check_section would add "unknown key" for the same line.
        for key in PER_ENGINE_ONLY & set(defaults_raw):
            out.add(("defaults", key), "must be set per engine, not in defaults")
        defaults_raw = {k: v for k, v in defaults_raw.items() if k not in PER_ENGINE_ONLY}
    defaults = _check_section(defaults_raw, ("defaults",), defaults_fields, out, what="engine defaults")

    engines_raw = raw.get("engines")
    if engines_raw is None:
        out.add(
            ("engines",) if "engines" in raw else (), "no engines configured: add a list under 'engines:'"
        )
        return None
    if not isinstance(engines_raw, list):
        out.add(("engines",), f"must be a list of engines, got {_type_name(engines_raw)}")
        return None
    if not engines_raw:
        out.add(("engines",), "no engines configured: the list is empty")

    engines: list[EngineSpec] = []
    indexed: list[tuple[int, EngineSpec]] = []
    for i, engine_raw in enumerate(engines_raw):
        spec = _engine(
            engine_raw, ("engines", i), defaults or {}, file, out, check_paths=check_paths, hub_env=hub_env
        )
        if spec is not None:
            engines.append(spec)
            indexed.append((i, spec))
    _cross_checks(engines_raw, engines, out)
    defaults_for_hosts = defaults_raw if isinstance(defaults_raw, dict) else {}
    check_listeners(engines_raw, defaults_for_hosts, out, http_listen=http_listen, http_listen_set=listen_set)
    check_placement(indexed, out, check_host=check_paths)
    if settings is None or defaults is None:
        return None
    return SupervisorConfig(
        path=Path(os.path.abspath(file)),
        supervisor=settings,
        engines=tuple(engines),
        warnings=tuple(out.warnings),
    )
