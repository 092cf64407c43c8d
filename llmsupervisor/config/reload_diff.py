"""What a reload plan (config/reload_plan.py) means, engine by engine, for the operator: the
fields that changed (old -> new, secrets masked) and what will happen to each engine.

Pure: two validated configs, the plan and the engines the policy will roll in, a table out. The
same table answers `llm-supervisor reload --dry-run` (nothing applied) and the real reload's reply,
so an operator sees why an engine restarts ("port: 8001 -> 8002") and which restarts load another
model, before and after.

What happens to an engine (``EngineChange.action``):

======================  =======================================================================
``restart``             changed and meant to run: the policy restarts it onto the new spec, within
                        ``max_unavailable`` (also one a halted roll never reached)
``stop``                removed from the config, or ``enabled: false`` now, and running
``remove``              removed from the config, and not running (stopped, FATAL): nothing to stop
``start``               added, or ``enabled: true`` now
``next start``          changed, but not running (stopped by an operator, or FATAL): it gets the
                        new spec, which applies when it is next started
``nothing``             unchanged (or added disabled, or disabled now and not running)
======================  =======================================================================

A restart is a *model reload* when what the engine serves changes (``MODEL_FIELDS``, or a flag in
``MODEL_ARGS``); every other restart loads the same weights again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Final

from llmsupervisor.config.reload_plan import LIVE_SETTINGS, ReloadPlan
from llmsupervisor.config.spec import EngineSpec, SupervisorConfig
from llmsupervisor.redact import MASK, SECRET_FLAGS, redact, secret_env_name

RESTART: Final = "restart"
STOP: Final = "stop"
START: Final = "start"
NEXT_START: Final = "next start"
NOTHING: Final = "nothing"
REMOVE: Final = "remove"

# Fields whose change means the engine serves something else: its weights are another model's.
MODEL_FIELDS: Final = frozenset({"model", "served_model_name"})
MODEL_ARGS: Final = frozenset(
    {"revision", "tokenizer", "tokenizer-revision", "quantization", "dtype", "load-format", "code-revision"}
)
# Never shown: the key read from api_key_file (its file's path is, and says it changed); derived.
HIDDEN_FIELDS: Final = frozenset({"api_key", "launcher_reason"})


@dataclass(frozen=True, slots=True)
class FieldChange:
    field: str  # "port", "args.max-num-seqs", "env.HF_TOKEN", "detectors.stale_after_s"
    old: str  # formatted, secrets masked; "-" where unset
    new: str

    def __str__(self) -> str:
        return f"{self.field}: {self.old} -> {self.new}"

    def as_json(self) -> dict[str, str]:
        return {"field": self.field, "old": self.old, "new": self.new}


@dataclass(frozen=True, slots=True)
class EngineChange:
    engine: str
    action: str  # RESTART, STOP, START, NEXT_START, NOTHING
    why: str  # "changed", "added", "removed", "disabled", "enabled", "unchanged", ...
    changes: tuple[FieldChange, ...] = ()
    model_reload: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "action": self.action,
            "why": self.why,
            "model_reload": self.model_reload,
            "changes": [c.as_json() for c in self.changes],
        }


@dataclass(frozen=True, slots=True)
class SettingChange:
    change: FieldChange
    live: bool  # applied now; else at the next daemon start

    def as_json(self) -> dict[str, Any]:
        return {**self.change.as_json(), "when": "now" if self.live else "next daemon start"}


def _format(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str | PurePath):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, tuple | list) and all(isinstance(v, int) for v in value):
        return ",".join(str(v) for v in value) or "-"
    if isinstance(value, tuple | list) and all(isinstance(v, str) for v in value):
        return " ".join(value) or "-"
    return json.dumps(value, default=str, sort_keys=True)


def _flat(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    """(dotted field, leaf value): dataclasses and mappings are walked, the rest are leaves."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _flat(f"{prefix}.{f.name}" if prefix else f.name, getattr(value, f.name))
    elif isinstance(value, Mapping) and prefix:
        for key in value:
            yield from _flat(f"{prefix}.{key}", value[key])
    else:
        yield prefix, value


def _secret(field: str) -> bool:
    head, _, key = field.partition(".")
    if head == "env":
        return secret_env_name(key)
    if head == "args":
        return "--" + key.lstrip("-") in SECRET_FLAGS
    return False


def _show(field: str, value: Any, present: bool) -> str:
    if not present:
        return "-"
    if _secret(field):
        return MASK
    if field == "command" and isinstance(value, tuple | list):
        # As a command line, so that the filter masks a credential flag's value (redact.py).
        return redact(" ".join(str(v) for v in value))
    return redact(_format(value))


def field_changes(old: Any, new: Any) -> tuple[FieldChange, ...]:
    """Every leaf field that differs between two specs (or settings), in field order."""
    before = dict(_flat("", old))
    after = dict(_flat("", new))
    out = []
    for name in [*before, *(n for n in after if n not in before)]:
        if name.partition(".")[0] in HIDDEN_FIELDS:
            continue
        if name in before and name in after and before[name] == after[name]:
            continue
        shown_old = _show(name, before.get(name), name in before)
        shown_new = _show(name, after.get(name), name in after)
        if shown_old == shown_new == MASK:
            shown_old, shown_new = MASK, f"{MASK} (changed)"
        out.append(FieldChange(name, shown_old, shown_new))
    return tuple(out)


def model_reload(changes: Sequence[FieldChange]) -> bool:
    for change in changes:
        head, _, key = change.field.partition(".")
        if change.field in MODEL_FIELDS or (head == "args" and key in MODEL_ARGS):
            return True
    return False


def engine_changes(
    old: SupervisorConfig, new: SupervisorConfig, plan: ReloadPlan, rolling: Sequence[str] = ()
) -> tuple[EngineChange, ...]:
    """One row per engine of either config (the new config's order, removed ones last).

    ``rolling``: the engines the policy will restart onto ``new`` (daemon/reload.py ``rolling``),
    which may include one a halted roll of an earlier reload never reached."""
    old_specs = {s.name: s for s in old.engines}
    restart = {s.name for s in plan.restart} | set(rolling)
    added = {s.name for s in plan.added}
    respec = {s.name for s in plan.respec}
    rows = []
    for spec in new.engines:
        name = spec.name
        before: EngineSpec | None = old_specs.get(name)
        changes = field_changes(before, spec) if before is not None else ()
        if name in added:
            row = EngineChange(
                name, START if spec.enabled else NOTHING, "added" if spec.enabled else "added, disabled"
            )
        elif name in plan.disable:
            if name in plan.idle:  # already stopped: a dry run must not say it stops it
                row = EngineChange(name, NOTHING, "disabled, not running", changes)
            else:
                row = EngineChange(name, STOP, "disabled", changes)
        elif name in plan.enable:
            row = EngineChange(name, START, "enabled", changes)
        elif name in restart:
            why = "changed" if changes else "an earlier roll did not reach it"
            row = EngineChange(name, RESTART, why, changes, model_reload(changes))
        elif name in respec:
            row = EngineChange(name, NEXT_START, "changed, not running", changes, model_reload(changes))
        else:
            row = EngineChange(name, NOTHING, "unchanged")
        rows.append(row)
    rows += [
        EngineChange(name, *((REMOVE, "not running") if name in plan.idle else (STOP, "removed")))
        for name in plan.removed
    ]
    return tuple(rows)


def setting_changes(old: SupervisorConfig, new: SupervisorConfig) -> tuple[SettingChange, ...]:
    return tuple(
        SettingChange(
            FieldChange(f"supervisor.{c.field}", c.old, c.new), c.field.split(".")[0] in LIVE_SETTINGS
        )
        for c in field_changes(old.supervisor, new.supervisor)
    )


def describe(change: EngineChange) -> str:
    """``gpu1: restart (model reload): model: llama-8b -> llama-70b; port: 8001 -> 8002``."""
    what = {
        RESTART: "restart" + (" (model reload)" if change.model_reload else ""),
        STOP: f"stop ({change.why})",
        START: f"start ({change.why})",
        NEXT_START: "new spec, applied at its next start (not running now)",
        NOTHING: f"nothing ({change.why})",
        REMOVE: f"remove ({change.why})",
    }[change.action]
    if change.action == RESTART and not change.changes:
        what += f" ({change.why})"
    details = "; ".join(str(c) for c in change.changes)
    return f"{change.engine}: {what}" + (f": {details}" if details else "")


__all__ = [
    "MODEL_ARGS",
    "MODEL_FIELDS",
    "NEXT_START",
    "NOTHING",
    "REMOVE",
    "RESTART",
    "START",
    "STOP",
    "EngineChange",
    "FieldChange",
    "SettingChange",
    "describe",
    "engine_changes",
    "field_changes",
    "model_reload",
    "setting_changes",
]
