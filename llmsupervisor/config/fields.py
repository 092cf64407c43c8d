"""Value checks: one function per kind of field, each taking (value, path, collector) and
returning the checked value or ``_MISSING`` after reporting why; and the tables that map every
key of an engine and of the ``supervisor:`` section to its check.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, Final

from llmsupervisor.config.problems import Path_, _Collector
from llmsupervisor.config.spec import LADDER_FLAGS
from llmsupervisor.detectors import DetectorConfig, FindingKind

# Flags the supervisor renders itself from engine fields; setting them in `args` would fight it.
RESERVED_ARGS: Final = frozenset({"model", "host", "port", "served-model-name"})
# Removes every vllm: metric (docs/vllm-notes.md §3.1): the supervisor would go blind.
FORBIDDEN_ARGS: Final = {"disable-log-stats": "removes every vllm: metric the supervisor watches"}

LOG_LEVELS: Final = ("debug", "info", "warning", "error")

_Check = Callable[[Any, Path_, _Collector], Any]


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "mapping",
    }.get(type(value), type(value).__name__)


_MISSING: Final = object()


def _number(
    *, lo: float | None = None, hi: float | None = None, integer: bool = False, lo_open: bool = False
) -> _Check:
    def check(value: Any, path: Path_, out: _Collector) -> Any:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (integer and isinstance(value, float))
        ):
            out.add(
                path, f"must be {'an integer' if integer else 'a number'}, got {_type_name(value)} {value!r}"
            )
            return _MISSING
        number = float(value)
        if lo is not None and (number <= lo if lo_open else number < lo):
            out.add(path, f"must be {'>' if lo_open else '>='} {lo:g}, got {value!r}")
            return _MISSING
        if hi is not None and number > hi:
            out.add(path, f"must be <= {hi:g}, got {value!r}")
            return _MISSING
        return int(value) if integer else number

    return check


def _string(*, choices: tuple[str, ...] = (), nonempty: bool = True) -> _Check:
    def check(value: Any, path: Path_, out: _Collector) -> Any:
        if not isinstance(value, str):
            out.add(path, f"must be a string, got {_type_name(value)} {value!r}")
            return _MISSING
        if nonempty and not value.strip():
            out.add(path, "must not be empty")
            return _MISSING
        if choices and value.lower() not in choices:
            out.add(path, f"must be one of {', '.join(choices)}, got {value!r}")
            return _MISSING
        return value.lower() if choices else value

    return check


def _boolean(value: Any, path: Path_, out: _Collector) -> Any:
    if not isinstance(value, bool):
        out.add(path, f"must be true or false, got {_type_name(value)} {value!r}")
        return _MISSING
    return value


def _name(value: Any, path: Path_, out: _Collector) -> Any:
    value = _string()(value, path, out)
    if value is _MISSING:
        return value
    if not all(c.isalnum() or c in "-_." for c in value) or len(value) > 64:
        out.add(path, f"must be at most 64 letters, digits, '-', '_' or '.', got {value!r}")
        return _MISSING
    return value


def _gpus(value: Any, path: Path_, out: _Collector) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        out.add(path, f"must be a list of GPU indices, got {_type_name(value)} {value!r}")
        return _MISSING
    result: list[int] = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            out.add(path + (i,), f"must be a GPU index (an integer >= 0), got {item!r}")
            return _MISSING
        if item in result:
            out.add(path + (i,), f"GPU {item} is listed twice")
            return _MISSING
        result.append(item)
    return tuple(result)


def _command(value: Any, path: Path_, out: _Collector) -> Any:
    if isinstance(value, str):
        import shlex

        value = shlex.split(value)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        out.add(path, "must be a non-empty list of strings (or one string, split like a shell would)")
        return _MISSING
    return tuple(value)


# Set by the supervisor from engine fields; an env override would defeat the GPU-claim checks
# or hide the engine from the sweeps.
RESERVED_ENV: Final = {
    "CUDA_VISIBLE_DEVICES": "use the engine's 'gpus' field",
    "CUDA_DEVICE_ORDER": "always PCI_BUS_ID, so NVML and CUDA indices agree",
}


def _env(value: Any, path: Path_, out: _Collector) -> Any:
    if not isinstance(value, dict):
        out.add(path, f"must be a mapping of NAME: value, got {_type_name(value)}")
        return _MISSING
    result: dict[str, str] = {}
    for key, item in value.items():
        if key in RESERVED_ENV:
            out.add(path + (key,), f"set by the supervisor: {RESERVED_ENV[key]}")
            continue
        if key.startswith("LLMSUPERVISOR_"):
            out.add(path + (key,), "LLMSUPERVISOR_* variables are the supervisor's process markers")
            continue
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            out.add(path + (key,), f"must be a string or number, got {_type_name(item)}")
            continue
        result[key] = str(item)
    return result


def _args(value: Any, path: Path_, out: _Collector) -> Any:
    if not isinstance(value, dict):
        out.add(path, f"must be a mapping of vLLM flag: value, got {_type_name(value)}")
        return _MISSING
    result: dict[str, Any] = {}
    for key, item in value.items():
        flag = key.lstrip("-").replace("_", "-")
        if flag in RESERVED_ARGS:
            field_name = flag.replace("-", "_")
            out.add(path + (key,), f"set by the supervisor; use the engine's '{field_name}' field instead")
            continue
        if flag in FORBIDDEN_ARGS:
            out.add(path + (key,), f"not allowed: {FORBIDDEN_ARGS[flag]}")
            continue
        if isinstance(item, list):
            if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in item):
                out.add(path + (key,), "a list value must hold only strings and numbers")
                continue
        elif item is not None and not isinstance(item, str | int | float | bool | dict):
            out.add(path + (key,), f"unsupported value type {_type_name(item)}")
            continue
        result[flag] = item
    return result


def _ladder(value: Any, path: Path_, out: _Collector) -> Any:
    """A list of steps down; each sets some of LADDER_FLAGS, and no value rises from one step to
    the next (a flag a step leaves out keeps the previous step's value)."""
    if not isinstance(value, list):
        out.add(
            path, f"must be a list of steps (mappings of {', '.join(LADDER_FLAGS)}), got {_type_name(value)}"
        )
        return _MISSING
    steps: list[dict[str, float | int]] = []
    current: dict[str, float] = {}
    ok = True
    for i, step in enumerate(value):
        if not isinstance(step, dict) or not step:
            out.add(path + (i,), f"must be a mapping of {', '.join(LADDER_FLAGS)}")
            ok = False
            continue
        checked: dict[str, float | int] = {}
        for key, item in step.items():
            flag = str(key).lstrip("-").replace("_", "-")
            if flag not in LADDER_FLAGS:
                out.add(path + (i, key), f"a ladder step may set only {', '.join(LADDER_FLAGS)}")
                ok = False
                continue
            integer = flag != "gpu-memory-utilization"
            number = _number(lo=0, lo_open=True, hi=None if integer else 1, integer=integer)(
                item, path + (i, key), out
            )
            if number is _MISSING:
                ok = False
                continue
            if flag in current and number > current[flag]:
                out.add(
                    path + (i, key), f"steps go down: {number} is above the previous step's {current[flag]}"
                )
                ok = False
            current[flag] = number
            checked[flag] = number
        steps.append(checked)
    return tuple(steps) if ok else _MISSING


def _time_window(value: Any, path: Path_, out: _Collector) -> Any:
    """``"02:00-05:00"`` (local time; may wrap past midnight) -> minutes of the day."""
    text = value if isinstance(value, str) else ""
    parts = text.replace(" ", "").split("-")
    try:
        minutes = []
        for part in parts:
            hours, _, mins = part.partition(":")
            h, m = int(hours), int(mins)
            if not (0 <= h <= 24 and 0 <= m < 60) or h * 60 + m > 24 * 60:
                raise ValueError
            minutes.append(h * 60 + m)
        start, end = minutes
    except ValueError:
        out.add(path, f"must be a local time window like '02:00-05:00', got {value!r}")
        return _MISSING
    if start == end:
        out.add(path, "the window is empty (start equals end)")
        return _MISSING
    return (start % 1440, end % 1440 if end != 1440 else 1440)


def _detectors(value: Any, path: Path_, out: _Collector) -> Any:
    """Overrides of DetectorConfig fields, checked by building one. The overrides, not that
    DetectorConfig, are the result: an engine's own keys go over the defaults' before
    ``_engine`` builds the engine's DetectorConfig."""
    if not isinstance(value, dict):
        out.add(path, f"must be a mapping of detector setting: value, got {_type_name(value)}")
        return _MISSING
    known = {f.name: f for f in fields(DetectorConfig)}
    result: dict[str, Any] = {}
    for key, item in value.items():
        spec = known.get(key)
        if spec is None:
            out.add(path + (key,), f"unknown detector setting{_suggest(key, list(known))}")
            continue
        if key in ("sustain_s", "clear_s"):
            if not isinstance(item, dict):
                out.add(path + (key,), "must be a mapping of finding kind: seconds")
                continue
            kinds: dict[FindingKind, float] = {}
            for kind_name, seconds in item.items():
                try:
                    kind = FindingKind(kind_name)
                except ValueError:
                    names = [k.value for k in FindingKind]
                    out.add(path + (key, kind_name), f"unknown finding kind{_suggest(str(kind_name), names)}")
                    continue
                number = _number(lo=0)(seconds, path + (key, kind_name), out)
                if number is not _MISSING:
                    kinds[kind] = number
            result[key] = kinds
        elif key.startswith("xid_"):
            if not isinstance(item, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in item
            ):
                out.add(path + (key,), "must be a list of XID numbers")
                continue
            result[key] = frozenset(item)
        else:
            number = _number(lo=0, integer=spec.type in ("int", int))(item, path + (key,), out)
            if number is not _MISSING:
                result[key] = number
    try:
        DetectorConfig(**result)
    except (TypeError, ValueError) as exc:
        out.add(path, str(exc))
        return _MISSING
    return result


ENGINE_FIELDS: Final[dict[str, _Check]] = {
    "name": _name,
    "model": _string(),
    "gpus": _gpus,
    "port": _number(lo=1, hi=65535, integer=True),
    "host": _string(),
    "served_model_name": _string(),
    "venv": _string(),
    "command": _command,
    "args": _args,
    "env": _env,
    "enabled": _boolean,
    "start_timeout_s": _number(lo=0, lo_open=True),
    "drain_grace_s": _number(lo=0),
    "drain_timeout_s": _number(lo=0),
    "stop_timeout_s": _number(lo=0),
    "group_term_timeout_s": _number(lo=0),
    "kill_timeout_s": _number(lo=0, lo_open=True),
    "canary_timeout_s": _number(lo=0, lo_open=True),
    "canary_interval_s": _number(lo=0, lo_open=True),
    "live_canary_timeout_s": _number(lo=0, lo_open=True),
    "live_canary_min_timeout_s": _number(lo=0, lo_open=True),
    "live_canary_timeout_factor": _number(lo=1),
    "canary_prompt": _string(),
    "health_timeout_s": _number(lo=0, lo_open=True),
    "metrics_interval_s": _number(lo=0),
    "backoff_initial_s": _number(lo=0),
    "backoff_max_s": _number(lo=0),
    "backoff_jitter_ratio": _number(lo=0, hi=1),
    "max_failures": _number(lo=1, integer=True),
    "failure_window_s": _number(lo=0, lo_open=True),
    "stable_after_s": _number(lo=0),
    "automatic_actions": _boolean,
    "max_actions_per_hour": _number(lo=1, integer=True),
    "action_cooldown_s": _number(lo=0),
    "ladder": _ladder,
    "ladder_calm_s": _number(lo=0),
    "repair_verify_s": _number(lo=0),
    "restart_every_h": _number(lo=0, lo_open=True),
    "restart_jitter_s": _number(lo=0),
    "restart_window": _time_window,
    "gpu_release_timeout_s": _number(lo=0),
    "detectors": _detectors,
}
REQUIRED_ENGINE_FIELDS: Final = ("name", "model", "port")
# Fields that make no sense shared by every engine.
PER_ENGINE_ONLY: Final = frozenset({"name", "model", "gpus", "port", "served_model_name"})

SUPERVISOR_FIELDS: Final[dict[str, _Check]] = {
    "state_dir": _string(),
    "log_level": _string(choices=LOG_LEVELS),
    "tick_interval_s": _number(lo=0.05, hi=60),
    "http_listen": _string(),
    "shutdown_timeout_s": _number(lo=0, lo_open=True),
    "max_unavailable": _number(lo=1, integer=True),
    "min_in_rotation": _number(lo=0, integer=True),
}


def _check_section(
    raw: Any, path: Path_, fields: Mapping[str, _Check], out: _Collector, *, what: str
) -> dict[str, Any] | None:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        out.add(path, f"must be a mapping ({what}), got {_type_name(raw)}")
        return None
    result: dict[str, Any] = {}
    for key, value in raw.items():
        check = fields.get(key)
        if check is None:
            out.add(path + (key,), f"unknown key{_suggest(key, list(fields))}")
            continue
        checked = check(value, path + (key,), out)
        if checked is not _MISSING:
            result[key] = checked
    return result


def _check_listen(value: str, path: Path_, out: _Collector) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        out.add(path, f"must be HOST:PORT, got {value!r}")
