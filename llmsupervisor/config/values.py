"""Domain value kinds: engine names, listen addresses, GPUs and CPUs, commands, vLLM args and
environment, the batch-size ladder, the restart window and the detector overrides. Each is a
``Kind`` (kinds.py): a check and the JSON Schema of what it accepts.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import fields
from typing import Any, Final

from llmsupervisor.config.kinds import (
    _MISSING,
    JsonSchema,
    Kind,
    _has_nul,
    _nonfinite,
    _number,
    _short,
    _string,
    _suggest,
    _type_name,
)
from llmsupervisor.config.problems import Path_, _Collector
from llmsupervisor.config.spec import LADDER_FLAGS
from llmsupervisor.core.placement import AUTO
from llmsupervisor.detectors import DetectorConfig, FindingKind
from llmsupervisor.probes.cpus import parse_cpu_list

# Flags the supervisor renders itself from engine fields; setting them in `args` would fight it.
RESERVED_ARGS: Final = frozenset({"model", "host", "port", "served-model-name"})
# Removes every vllm: metric (docs/vllm-notes.md §3.1): the supervisor would go blind.
FORBIDDEN_ARGS: Final = {"disable-log-stats": "removes every vllm: metric the supervisor watches"}


def _flag_pattern(flags: Any) -> str:
    """A regex matching the spellings ``_args`` and ``_ladder`` accept for these flags: leading
    dashes, and ``_`` for ``-``."""
    alternatives = "|".join(re.escape(f).replace("\\-", "[-_]") for f in sorted(flags))
    return f"^-*({alternatives})$"


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


# NVML numbers a host's GPUs from 0; the largest hosts have 16. A bound, so a 400-digit index
# is refused here and by the schema instead of reaching CUDA_VISIBLE_DEVICES.
MAX_GPU_INDEX: Final = 1023
_gpu_index: Final = _number(lo=0, hi=MAX_GPU_INDEX, integer=True)  # the schema; the check below
# A GPU's UUID as NVML (nvmlDeviceGetUUID) and `nvidia-smi -L` print it. Resolved to the NVML
# index at start, through NVML; CUDA_VISIBLE_DEVICES then carries the UUID itself, so the engine
# runs on that board whatever order CUDA numbers the GPUs in (docs/gpu.md).
GPU_UUID: Final = re.compile(r"GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_gpu_uuid_schema: Final = {"type": "string", "pattern": f"^{GPU_UUID.pattern}$"}
_gpu_item_schema: Final = {"anyOf": [_gpu_index.schema, _gpu_uuid_schema]}


def _check_gpus(value: Any, path: Path_, out: _Collector) -> Any:
    """A list of NVML indices, or of GPU UUIDs (hex lower-cased, as NVML prints them); one engine
    names its GPUs one way, so that CUDA_VISIBLE_DEVICES is all indices or all UUIDs."""
    one_index = isinstance(value, int | float) and not isinstance(value, bool)
    if one_index or (isinstance(value, str) and (GPU_UUID.fullmatch(value) or value.startswith("MIG-"))):
        value = [value]
    if not isinstance(value, list):
        out.add(path, f"must be a list of GPU indices or UUIDs, got {_type_name(value)} {value!r}")
        return _MISSING
    result: list[int | str] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if item.startswith("MIG-"):
                out.add(path + (i,), f"{item[:48]!r} is a MIG device: MIG is not supported (docs/gpu.md)")
                return _MISSING
            if not GPU_UUID.fullmatch(item):
                message = "must be a GPU index or a UUID like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
                out.add(path + (i,), f"{message} (nvidia-smi -L), got {_short(item)}")
                return _MISSING
            gpu: int | str = "GPU-" + item[4:].lower()  # as NVML prints it
        else:
            integral = isinstance(item, int) or (isinstance(item, float) and item.is_integer())
            if isinstance(item, bool) or not integral or not 0 <= item <= MAX_GPU_INDEX:
                message = f"must be a GPU index (an integer 0 to {MAX_GPU_INDEX}) or UUID, got {_short(item)}"
                out.add(path + (i,), message)
                return _MISSING
            gpu = int(item)
        if gpu in result:
            out.add(path + (i,), f"GPU {gpu} is listed twice")
            return _MISSING
        if result and isinstance(gpu, str) != isinstance(result[0], str):
            out.add(path + (i,), "name all of an engine's GPUs by index, or all by UUID")
            return _MISSING
        result.append(gpu)
    return tuple(result)


_gpus: Final = Kind(
    _check_gpus,
    {
        "anyOf": [
            _gpu_index.schema,
            _gpu_uuid_schema,
            {"type": "array", "items": _gpu_item_schema, "uniqueItems": True},
        ]
    },
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


def _ladder_value(flag: str) -> Kind:
    """A ladder step's value: a share of the GPU's memory, or a positive count."""
    if flag == "gpu-memory-utilization":
        return _number(lo=0, lo_open=True, hi=1)
    return _number(lo=0, lo_open=True, integer=True)


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
            number = _ladder_value(flag)(item, path + (i, key), out)
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
            "patternProperties": {_flag_pattern([flag]): _ladder_value(flag).schema for flag in LADDER_FLAGS},
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


def _detector_kind(name: str) -> Kind:
    """The kind of one value of the DetectorConfig field ``name`` (of each item, for the XID
    lists and the per-kind seconds), from the bounds the dataclass itself holds it to."""
    return _number(**DetectorConfig.bounds(name))


def _check_detectors(value: Any, path: Path_, out: _Collector) -> Any:
    """Overrides of DetectorConfig fields, checked by building one. The overrides, not that
    DetectorConfig, are the result: an engine's own keys go over the defaults' before
    ``_engine`` builds the engine's DetectorConfig."""
    if not isinstance(value, dict):
        out.add(path, f"must be a mapping of detector setting: value, got {_type_name(value)}")
        return _MISSING
    known = {f.name for f in fields(DetectorConfig)}
    result: dict[str, Any] = {}
    for key, item in value.items():
        if key not in known:
            out.add(path + (key,), f"unknown detector setting{_suggest(key, sorted(known))}")
            continue
        kind = _detector_kind(key)
        if key in ("sustain_s", "clear_s"):
            if not isinstance(item, dict):
                out.add(path + (key,), "must be a mapping of finding kind: seconds")
                continue
            kinds: dict[FindingKind, float] = {}
            for kind_name, seconds in item.items():
                try:
                    finding = FindingKind(kind_name)
                except ValueError:
                    names = [k.value for k in FindingKind]
                    out.add(path + (key, kind_name), f"unknown finding kind{_suggest(str(kind_name), names)}")
                    continue
                number = kind(seconds, path + (key, kind_name), out)
                if number is not _MISSING:
                    kinds[finding] = number
            result[key] = kinds
        elif key.startswith("xid_"):
            if not isinstance(item, list):
                out.add(path + (key,), f"must be a list of XID numbers, got {_type_name(item)}")
                continue
            xids = [kind(x, path + (key, i), out) for i, x in enumerate(item)]
            if _MISSING not in xids:
                result[key] = frozenset(xids)
        else:
            number = kind(item, path + (key,), out)
            if number is not _MISSING:
                result[key] = number
    try:
        DetectorConfig(**result)
    except (TypeError, ValueError) as exc:  # what no one field says: hang_cpu_max_span_s < min
        out.add(path, str(exc))
        return _MISSING
    return result


def _detector_schema() -> JsonSchema:
    names = [k.value for k in FindingKind]
    properties: dict[str, Any] = {}
    for spec in fields(DetectorConfig):
        one = _detector_kind(spec.name).schema
        if spec.name in ("sustain_s", "clear_s"):
            properties[spec.name] = {
                "type": "object",
                "propertyNames": {"enum": names},
                "additionalProperties": one,
            }
        elif spec.name.startswith("xid_"):
            properties[spec.name] = {"type": "array", "items": one}
        else:
            properties[spec.name] = one
    return {"type": "object", "properties": properties, "additionalProperties": False}


_detectors: Final = Kind(_check_detectors, _detector_schema())
