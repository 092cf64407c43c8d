"""Value checks: one ``Kind`` per kind of field, a check taking (value, path, collector) and
returning the checked value or ``_MISSING`` after reporting why, made together with the JSON
Schema of the values it accepts; and the tables that map every key of an engine and of the
``supervisor:`` section to its ``Field`` (kind and one-line meaning). ``schema.py`` publishes
these tables as a JSON Schema and docs/configuration.md lists them, so neither can drift from
what the validator accepts.
"""

from __future__ import annotations

import difflib
import math
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from llmsupervisor.config.launcher import LAUNCHER_CHOICES
from llmsupervisor.config.problems import Path_, _Collector
from llmsupervisor.config.spec import CANARY_KINDS, LADDER_FLAGS
from llmsupervisor.core.placement import AUTO
from llmsupervisor.detectors import DetectorConfig, FindingKind
from llmsupervisor.probes.cpus import parse_cpu_list

# Flags the supervisor renders itself from engine fields; setting them in `args` would fight it.
RESERVED_ARGS: Final = frozenset({"model", "host", "port", "served-model-name"})
# Removes every vllm: metric (docs/vllm-notes.md §3.1): the supervisor would go blind.
FORBIDDEN_ARGS: Final = {"disable-log-stats": "removes every vllm: metric the supervisor watches"}

LOG_LEVELS: Final = ("debug", "info", "warning", "error")

_Check = Callable[[Any, Path_, _Collector], Any]
JsonSchema = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Kind:
    """A check and the JSON Schema of the values it accepts, built by one factory from the same
    bounds. The schema may be looser than the check where JSON Schema cannot say it (ladder
    steps that must go down), never stricter except where noted at the factory."""

    check: _Check
    schema: JsonSchema

    def __call__(self, value: Any, path: Path_, out: _Collector) -> Any:
        return self.check(value, path, out)


@dataclass(frozen=True, slots=True)
class Field:
    """One key of a section: what it accepts, and what it means (for the schema and the docs)."""

    kind: Kind
    doc: str

    def __call__(self, value: Any, path: Path_, out: _Collector) -> Any:
        return self.kind.check(value, path, out)


def _flag_pattern(flags: Any) -> str:
    """A regex matching the spellings ``_args`` and ``_ladder`` accept for these flags: leading
    dashes, and ``_`` for ``-``."""
    alternatives = "|".join(re.escape(f).replace("\\-", "[-_]") for f in sorted(flags))
    return f"^-*({alternatives})$"


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

# The largest magnitude any number in the file may have: 1e12 seconds is 30,000 years, and a
# bigger value only overflows later (time.sleep, float(), a thread's wait) in the running daemon.
MAX_MAGNITUDE: Final = 1e12


def _nonfinite(value: Any) -> bool:
    """A NaN or an infinity anywhere in ``value`` (a scalar, list or mapping). NaN passes every
    ``<``/``>`` range check, so it must be refused by name."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list | tuple):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_nonfinite(v) for v in value.values())
    return False


def _has_nul(value: Any) -> bool:
    """A NUL character anywhere in ``value``: no argv, environment or path can carry one."""
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


def _number(
    *, lo: float | None = None, hi: float | None = None, integer: bool = False, lo_open: bool = False
) -> Kind:
    schema: dict[str, Any] = {"type": "integer" if integer else "number"}
    if lo is not None:
        schema["exclusiveMinimum" if lo_open else "minimum"] = int(lo) if integer else lo
    if hi is not None:
        schema["maximum"] = int(hi) if integer else hi

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
        if _nonfinite(value):
            out.add(path, f"must be a finite number, got {value!r}")
            return _MISSING
        # Compared as given: an int and a float compare exactly, float() of 400 digits overflows.
        if lo is not None and (value <= lo if lo_open else value < lo):
            out.add(path, f"must be {'>' if lo_open else '>='} {lo:g}, got {_short(value)}")
            return _MISSING
        if lo is None and value < -MAX_MAGNITUDE:
            out.add(path, f"must be >= {-MAX_MAGNITUDE:g}, got {_short(value)}")
            return _MISSING
        limit = MAX_MAGNITUDE if hi is None else hi
        if value > limit:
            out.add(path, f"must be <= {limit:g}, got {_short(value)}")
            return _MISSING
        number = float(value)
        return int(value) if integer else number

    return Kind(check, schema)


def _short(value: Any) -> str:
    """``repr`` of a number, cut short: a 400-digit number in a message helps nobody."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def _any_case(word: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in word)


def _string(*, choices: tuple[str, ...] = (), nonempty: bool = True) -> Kind:
    schema: dict[str, Any] = {"type": "string"}
    if choices:  # the check lower-cases the value first
        schema["pattern"] = f"^({'|'.join(_any_case(c) for c in choices)})$"
    elif nonempty:
        schema["pattern"] = "\\S"  # not empty, not only blanks

    def check(value: Any, path: Path_, out: _Collector) -> Any:
        if not isinstance(value, str):
            out.add(path, f"must be a string, got {_type_name(value)} {value!r}")
            return _MISSING
        if _has_nul(value):
            out.add(path, "must not contain a NUL character")
            return _MISSING
        if nonempty and not value.strip():
            out.add(path, "must not be empty")
            return _MISSING
        if choices and value.lower() not in choices:
            out.add(path, f"must be one of {', '.join(choices)}, got {value!r}")
            return _MISSING
        return value.lower() if choices else value

    return Kind(check, schema)


def _check_boolean(value: Any, path: Path_, out: _Collector) -> Any:
    if not isinstance(value, bool):
        out.add(path, f"must be true or false, got {_type_name(value)} {value!r}")
        return _MISSING
    return value


_boolean: Final = Kind(_check_boolean, {"type": "boolean"})


def _check_name(value: Any, path: Path_, out: _Collector) -> Any:
    value = _string()(value, path, out)
    if value is _MISSING:
        return value
    if not all(c.isalnum() or c in "-_." for c in value) or len(value) > 64:
        out.add(path, f"must be at most 64 letters, digits, '-', '_' or '.', got {value!r}")
        return _MISSING
    return value


# The schema is ASCII only; the check also takes non-ASCII letters (str.isalnum).
_name: Final = Kind(_check_name, {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"})


def _check_listen(value: Any, path: Path_, out: _Collector) -> Any:
    value = _string()(value, path, out)
    if value is _MISSING:
        return value
    host, sep, port = value.rpartition(":")
    # isdigit() alone takes '²' and '٣', which int() then refuses or reads as another number.
    digits = port.isascii() and port.isdigit() and len(port) <= 5
    if not sep or not host or not digits or not 0 < int(port) < 65536:
        out.add(path, f"must be HOST:PORT, got {value!r}")
        return _MISSING
    return value


_listen: Final = Kind(_check_listen, {"type": "string", "pattern": "^.+:[0-9]{1,5}$"})


def _check_gpus(value: Any, path: Path_, out: _Collector) -> Any:
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


_GPU_INDEX: Final = {"type": "integer", "minimum": 0}
_gpus: Final = Kind(
    _check_gpus,
    {"anyOf": [_GPU_INDEX, {"type": "array", "items": _GPU_INDEX, "uniqueItems": True}]},
)


def _check_cpus(value: Any, path: Path_, out: _Collector) -> Any:
    """``auto``, a cpulist string ``"0-3,8"``, or a list of CPU ids and cpulist strings."""
    if value == AUTO:
        return AUTO
    items = value if isinstance(value, list) else [value]
    cpus: set[int] = set()
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            cpus.add(item)
            continue
        try:
            if not isinstance(item, str):
                raise ValueError
            cpus.update(parse_cpu_list(item))
        except ValueError:
            out.add(path, f"must be 'auto', or CPU ids and ranges like [0, 1] or \"0-3,8\", got {item!r}")
            return _MISSING
    if not cpus:
        out.add(path, "must name at least one CPU (leave it out to not place the engine)")
        return _MISSING
    return tuple(sorted(cpus))


_CPU_LIST: Final = {"type": "string", "pattern": r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$"}
_cpus: Final = Kind(
    _check_cpus,
    {
        "anyOf": [
            {"const": AUTO},
            _CPU_LIST,
            {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0}, _CPU_LIST]}},
        ]
    },
)


def _check_command(value: Any, path: Path_, out: _Collector) -> Any:
    if isinstance(value, str):
        try:
            value = shlex.split(value)
        except ValueError as exc:  # "No closing quotation", "No escaped character"
            out.add(path, f"cannot split {value!r} like a shell would: {exc}")
            return _MISSING
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        out.add(path, "must be a non-empty list of strings (or one string, split like a shell would)")
        return _MISSING
    if _has_nul(value):
        out.add(path, "must not contain a NUL character")
        return _MISSING
    return tuple(value)


_command: Final = Kind(
    _check_command,
    {
        "anyOf": [
            {"type": "string", "pattern": "\\S"},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        ]
    },
)


# Set by the supervisor from engine fields; an env override would defeat the GPU-claim checks
# or hide the engine from the sweeps.
RESERVED_ENV: Final = {
    "CUDA_VISIBLE_DEVICES": "use the engine's 'gpus' field",
    "CUDA_DEVICE_ORDER": "always PCI_BUS_ID, so NVML and CUDA indices agree",
}


# What a shell, systemd and execve all accept as a variable name.
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_env(value: Any, path: Path_, out: _Collector) -> Any:
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
        if not _ENV_NAME.fullmatch(key):
            out.add(path + (key,), "not a valid environment variable name (letters, digits, '_')")
            continue
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            out.add(path + (key,), f"must be a string or number, got {_type_name(item)}")
            continue
        if _nonfinite(item):
            out.add(path + (key,), f"must be a finite number, got {item!r}")
            continue
        if _has_nul(item):
            out.add(path + (key,), "must not contain a NUL character")
            continue
        result[key] = str(item)
    return result


_env: Final = Kind(
    _check_env,
    {
        "type": "object",
        "propertyNames": {"not": {"anyOf": [{"enum": sorted(RESERVED_ENV)}, {"pattern": "^LLMSUPERVISOR_"}]}},
        "additionalProperties": {"type": ["string", "number"]},
    },
)


def _check_args(value: Any, path: Path_, out: _Collector) -> Any:
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
        if _nonfinite(item):
            # vLLM would get "nan" or "inf" (or JSON it cannot parse) for a size or a ratio.
            out.add(path + (key,), f"must be a finite number, got {item!r}")
            continue
        if _has_nul(item) or _has_nul(key):
            out.add(path + (key,), "must not contain a NUL character")
            continue
        result[flag] = item
    return result


_args: Final = Kind(
    _check_args,
    {
        "type": "object",
        "propertyNames": {"not": {"pattern": _flag_pattern(RESERVED_ARGS | set(FORBIDDEN_ARGS))}},
        "additionalProperties": {
            "anyOf": [
                {"type": ["null", "string", "number", "boolean", "object"]},
                {"type": "array", "items": {"type": ["string", "number"]}},
            ]
        },
    },
)


def _check_ladder(value: Any, path: Path_, out: _Collector) -> Any:
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


# The schema cannot say "steps go down"; the check does.
_ladder: Final = Kind(
    _check_ladder,
    {
        "type": "array",
        "items": {
            "type": "object",
            "minProperties": 1,
            "patternProperties": {
                _flag_pattern([flag]): (
                    {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
                    if flag == "gpu-memory-utilization"
                    else {"type": "integer", "exclusiveMinimum": 0}
                )
                for flag in LADDER_FLAGS
            },
            "additionalProperties": False,
        },
    },
)


def _check_time_window(value: Any, path: Path_, out: _Collector) -> Any:
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


_HH_MM: Final = " *[0-9]{1,2} *: *[0-9]{1,2} *"
_time_window: Final = Kind(_check_time_window, {"type": "string", "pattern": f"^{_HH_MM}-{_HH_MM}$"})


def _check_detectors(value: Any, path: Path_, out: _Collector) -> Any:
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


# One line per DetectorConfig field (llmsupervisor/detectors/config.py has the reasoning).
DETECTOR_DOCS: Final[Mapping[str, str]] = {
    "stale_after_s": (
        "a reading older than this is unknown (one failed probe neither raises nor clears a finding)"
    ),
    "hang_after_s": (
        "hang: no sign of life (canary, moving step/token counters) this long while work was queued"
    ),
    "hang_idle_after_s": "hang: the same while the last reading showed no running or waiting request",
    "hang_min_misses": (
        "hang: at least this many missed deadlines (canary, /health, /metrics) since the last sign of life"
    ),
    "hang_stopped_after_s": (
        "hang: a process of the engine stopped (SIGSTOP, a tracer) with no CPU time gained this long"
    ),
    "hang_cpu_idle_ratio": (
        "hang: a missed canary while the engine's processes used under this share of a core"
    ),
    "hang_cpu_min_span_s": "hang (CPU idle): the CPU reading must span at least this",
    "hang_cpu_max_span_s": "hang (CPU idle): and at most this (older readings say nothing of now)",
    "hang_step_factor": (
        "hang (step heartbeat): a step is overdue after this x the engine's longest recent step"
    ),
    "hang_spin_after_s": "hang (spinning): and no step completed for at least this long",
    "hang_spin_busy_ratio": (
        "hang (spinning): the engine's processes (API server aside) used this share of a core, "
        "its Worker almost none"
    ),
    "hang_worker_poll_s": (
        "hang (step heartbeat): vLLM's Worker polls for its next step this long after the last "
        "(a core's worth of CPU that is not a forward)"
    ),
    "hang_probe_late_s": (
        "hang: a /health answer later than this is a miss; the round waits no longer for it"
    ),
    "stall_after_s": (
        "stall: requests running or waiting in every reading while the counters stood still this long"
    ),
    "kv_usage_threshold_ratio": "KV-cache pressure opens at or above this KV-cache usage (0..1]",
    "kv_usage_clear_ratio": "... and clears only below this x the threshold (0..1]",
    "preemptions_per_min_threshold": "preemption storm: preemptions per minute over preemption_window_s",
    "preemption_window_s": "preemption storm: the window the rate is taken over",
    "preemption_min_span_s": "preemption storm: readings must span at least this to make a rate",
    "degradation_baseline_s": "degradation: the baseline is the first this-many seconds of traffic",
    "degradation_eval_s": "degradation: compared over the last this-many seconds",
    "degradation_ttft_factor": "degradation: TTFT p95 at or above this x the baseline",
    "degradation_throughput_factor": "degradation: tokens/s per running request at or below this x baseline",
    "degradation_prefix_hit_factor": "degradation: prefix-cache hit rate at or below this x the baseline",
    "degradation_min_requests": "degradation: finished requests (canaries excluded) needed in each span",
    "degradation_min_running": "degradation: mean running requests needed in each span",
    "degradation_min_busy_ratio": "degradation: share of a baseline span's readings with requests running",
    "degradation_max_load_ratio": "degradation: compare only at a load within this factor of the baseline's",
    "degradation_min_prefix_queries": "degradation: prompt tokens looked up per span for hit rates to count",
    "degradation_min_prefix_hit_ratio": "degradation: a baseline hit rate below this is not compared",
    "thermal_temperature_c": "thermal: this GPU temperature or above, on a board that reports no slowdown"
    " threshold (0: off)",
    "gpu_fault_lookback_s": "GPU fault/lost: an XID or ECC event stays evidence this long",
    "xid_engine_level": "application-level XIDs (the engine's fault, not the GPU's): INFO, no action",
    "xid_info_only": "XIDs only logged and counted (an INFO finding)",
    "gpu_lost_min_samples": "GPU lost: consecutive 'GPU lost' probe failures needed",
    "memory_window_s": "memory growth: the RSS slope is fitted over this window",
    "memory_min_span_s": "memory growth: readings must span at least this",
    "memory_min_samples": "memory growth: readings needed (>= 3)",
    "memory_growth_mib_per_h": "memory growth: the engine's RSS growing at least this fast",
    "memory_min_r2": "memory growth: the fitted line must explain this share of the variance",
    "foreign_min_mib": "foreign GPU memory: a process outside the engine holding this much on its GPU",
    "sustain_s": (
        "per finding kind: how long a finding must hold before it opens (the kinds not named "
        "keep their defaults)"
    ),
    "clear_s": "per finding kind: how long a finding must be absent before it closes",
}


def _detector_schema() -> JsonSchema:
    kinds = [k.value for k in FindingKind]
    properties: dict[str, Any] = {}
    for spec in fields(DetectorConfig):
        if spec.name in ("sustain_s", "clear_s"):
            schema: dict[str, Any] = {
                "type": "object",
                "propertyNames": {"enum": kinds},
                "additionalProperties": {"type": "number", "minimum": 0},
            }
        elif spec.name.startswith("xid_"):
            schema = {"type": "array", "items": {"type": "integer"}}
        else:
            schema = {"type": "integer" if spec.type in ("int", int) else "number", "minimum": 0}
        properties[spec.name] = schema
    return {"type": "object", "properties": properties, "additionalProperties": False}


_detectors: Final = Kind(_check_detectors, _detector_schema())


ENGINE_FIELDS: Final[dict[str, Field]] = {
    # ---- what to run
    "name": Field(_name, "the engine's name in logs, status and /engines/NAME/ready; unique"),
    "model": Field(
        _string(),
        "a local directory (starts with /, ./, ../ or ~; relative to the config file; must hold "
        "config.json or a *.gguf file) or a Hugging Face hub id such as org/name",
    ),
    "gpus": Field(
        _gpus,
        "GPU indices in PCI bus order (as nvidia-smi shows them), or one index; no GPU in two "
        "engines; none: no GPU (the vLLM CPU build)",
    ),
    "cpus": Field(
        _cpus,
        "CPU placement: auto (disjoint sets: the CPUs of the GPUs' NUMA node, or an even split "
        'without GPUs), or CPU ids and ranges like [0, 1] or "0-3,8"; no CPU in two engines',
    ),
    "port": Field(
        _number(lo=1, hi=65535, integer=True), "the port vLLM listens on; unique among the engines"
    ),
    "host": Field(_string(), "the address vLLM binds to (0.0.0.0 or :: serves other hosts directly)"),
    "served_model_name": Field(
        _string(), 'the id clients send as "model"; /v1/models lists it and the canary asks for it'
    ),
    "venv": Field(
        _string(),
        "the virtualenv vLLM is installed in: runs VENV/bin/vllm serve MODEL (see launcher)",
    ),
    "launcher": Field(
        _string(choices=LAUNCHER_CHOICES),
        "with venv: serve (VENV/bin/vllm serve), module (python -m vllm.entrypoints.openai."
        "api_server, deprecated since vLLM 0.32) or auto (serve where the venv's vllm works)",
    ),
    "command": Field(
        _command,
        "instead of venv: the program and its first arguments (a list, or one string split like a "
        "shell); the supervisor appends --model, --host, --port, --served-model-name, then args",
    ),
    "args": Field(
        _args,
        "vLLM flags without the leading --: true a bare flag, false or null left out, a list "
        "repeated values after one flag, a mapping compact JSON; merged key by key with defaults",
    ),
    "env": Field(_env, "extra environment for the engine, NAME: value; merged key by key with defaults"),
    "enabled": Field(_boolean, "false: keep the engine configured but do not start it"),
    # ---- starting and readiness
    "start_timeout_s": Field(
        _number(lo=0, lo_open=True),
        "from spawn to READY: /health 200, the model in /v1/models, one canary completion",
    ),
    "canary_timeout_s": Field(_number(lo=0, lo_open=True), "deadline of the canary completion at start"),
    "canary_interval_s": Field(
        _number(lo=0, lo_open=True),
        "while READY and vLLM's counters stand still, a canary this often (never while they move)",
    ),
    "live_canary_timeout_s": Field(
        _number(lo=0, lo_open=True),
        "the longest deadline of a canary while READY (the deadline is learned from the engine's "
        "own recent canaries: live_canary_timeout_factor x the slowest of the last 8)",
    ),
    "live_canary_min_timeout_s": Field(
        _number(lo=0, lo_open=True), "the shortest deadline of a canary while READY"
    ),
    "live_canary_timeout_factor": Field(
        _number(lo=1), "the live canary's deadline: this x the slowest of the engine's last 8 canaries"
    ),
    "canary_prompt": Field(_string(), "the prompt of the one-token canary completion"),
    "canary": Field(
        _string(choices=CANARY_KINDS),
        "which canary proves the engine serves: auto (from args: embedding for --task/--convert "
        "embed, none for other pooling models, else completion), completion, chat, embedding, none",
    ),
    "api_key_file": Field(
        _string(),
        "a file whose first line is the engine's API key: given to vLLM as VLLM_API_KEY and sent "
        "by every probe; never logged",
    ),
    "log_probe_requests": Field(
        _boolean, "true: keep vLLM's access lines for the supervisor's own probes in the journal"
    ),
    "step_heartbeat": Field(
        _boolean,
        "false: do not give vLLM the daemon's --scheduler-cls step heartbeat (hangs are then found "
        "without it, some more slowly)",
    ),
    "health_timeout_s": Field(_number(lo=0, lo_open=True), "deadline of each /health probe"),
    "metrics_interval_s": Field(
        _number(lo=0),
        "vLLM's full /metrics body is read this often (0: every tick); /health, the process sweep "
        "and the canary every tick",
    ),
    # 64 KiB to 1 GiB: below, a real vLLM body would not fit; above, parsing it takes minutes.
    "metrics_max_body_bytes": Field(
        _number(lo=64 * 1024, hi=1024**3, integer=True),
        "a /metrics body larger than this is a probe failure (read as a stream, abandoned at the cap)",
    ),
    "agent_port": Field(
        _number(lo=1, hi=65535, integer=True),
        "serve HAProxy's agent-check protocol for this engine on this port (docs/fleet.md)",
    ),
    # ---- draining and stopping
    "drain_grace_s": Field(
        _number(lo=0),
        "after leaving rotation, wait this long for load balancers to notice before stopping; "
        "also how long an engine READY again still counts as out of rotation",
    ),
    "drain_timeout_s": Field(
        _number(lo=0), "then wait at most this long for vLLM to report no running or waiting request"
    ),
    "stop_timeout_s": Field(
        _number(lo=0),
        "stop ladder 1: SIGTERM to the API server, wait this long for the process group (keep it "
        "about 15 s above args.shutdown-timeout)",
    ),
    "group_term_timeout_s": Field(_number(lo=0), "stop ladder 2: SIGTERM to the whole process group, wait"),
    "kill_timeout_s": Field(
        _number(lo=0, lo_open=True), "stop ladder 3: SIGKILL to the process group, wait for it to be gone"
    ),
    "gpu_release_timeout_s": Field(
        _number(lo=0), "after a stop, wait up to this long for NVML to show the GPU memory released"
    ),
    # ---- crashes
    "backoff_initial_s": Field(
        _number(lo=0), "failure n >= 2 within failure_window_s waits backoff_initial_s x 2^(n-2)"
    ),
    "backoff_max_s": Field(_number(lo=0), "... capped at this"),
    "backoff_jitter_ratio": Field(_number(lo=0, hi=1), "... times a random 1 +- this"),
    "max_failures": Field(
        _number(lo=1, integer=True), "this many failures within failure_window_s: FATAL, left stopped"
    ),
    "failure_window_s": Field(_number(lo=0, lo_open=True), "the window failures are counted in"),
    "stable_after_s": Field(_number(lo=0), "READY this long clears the failure count"),
    # ---- actions
    "automatic_actions": Field(_boolean, "false: report findings (log, status, metrics), never act on them"),
    "max_actions_per_hour": Field(
        _number(lo=1, integer=True),
        "automatic actions per engine per hour (shedding and crash restarts aside)",
    ),
    "action_cooldown_s": Field(_number(lo=0), "at least this long between two automatic actions"),
    "repair_verify_s": Field(
        _number(lo=0), "after a repair short of a restart, wait this long before judging it failed"
    ),
    "ladder": Field(
        _ladder,
        "batch-size steps below the engine's own args, each setting some of max-num-batched-tokens, "
        "max-num-seqs, max-num-active-seqs (vLLM 0.32+), gpu-memory-utilization; values never rise "
        "going down; max-num-batched-tokens and max-num-seqs are in vLLM's compile cache key (a cold "
        "compile at the step's first start), the other two are not",
    ),
    "ladder_calm_s": Field(
        _number(lo=0), "this long without throttling or a preemption storm: one ladder step back up"
    ),
    "restart_every_h": Field(_number(lo=0, lo_open=True), "scheduled restart after this many hours READY"),
    "restart_jitter_s": Field(_number(lo=0), "... plus a random 0 to this many seconds"),
    "restart_window": Field(
        _time_window, 'scheduled restarts only inside this local time window, "02:00-05:00" (may wrap)'
    ),
    "detectors": Field(
        _detectors, "detector thresholds (DetectorConfig fields); merged key by key with defaults"
    ),
}
REQUIRED_ENGINE_FIELDS: Final = ("name", "model", "port")
# Fields that make no sense shared by every engine.
PER_ENGINE_ONLY: Final = frozenset({"name", "model", "gpus", "port", "served_model_name", "agent_port"})

SUPERVISOR_FIELDS: Final[dict[str, Field]] = {
    "state_dir": Field(
        _string(),
        "status.json, the control socket outside systemd, the lock, and per engine its vLLM "
        "compile cache and ladder step",
    ),
    "log_level": Field(_string(choices=LOG_LEVELS), "debug, info, warning or error"),
    "tick_interval_s": Field(_number(lo=0.05, hi=60), "how often the daemon looks at every engine"),
    "http_listen": Field(_listen, "HOST:PORT of the daemon's HTTP listener (readiness, /metrics)"),
    "shutdown_timeout_s": Field(
        _number(lo=0, lo_open=True),
        "on SIGTERM, how long every engine's stop may take (cover stop + group_term + kill timeouts)",
    ),
    "max_unavailable": Field(
        _number(lo=1, integer=True),
        "planned actions never take more engines out of rotation at once (engines already out count)",
    ),
    "min_in_rotation": Field(
        _number(lo=0, integer=True), "load shedding keeps at least this many engines in rotation"
    ),
    "readyz_requires": Field(
        _string(choices=("all", "any")),
        "/readyz is 200 when all engines meant to serve are in rotation, or any one (docs/fleet.md)",
    ),
}


def _check_section(
    raw: Any, path: Path_, fields: Mapping[str, Field], out: _Collector, *, what: str
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
