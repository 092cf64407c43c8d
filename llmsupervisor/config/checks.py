"""One engine's entry to an ``EngineSpec`` (defaults merged, command and model paths resolved,
then the checks that need the whole engine: executable, model, parallelism, ladder against its
own args), and the checks between engines (names, GPUs, CPUs; ports in listeners.py).

``_engine`` is two tables around one build: ``ENTRY_STEPS`` resolve the entry's fields in order
(each reporting its own problems), the spec is built whenever its fields allow, then
``SPEC_CHECKS`` check it as a whole. A new per-engine check is one function and one row.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from llmsupervisor.config.fields import ENGINE_FIELDS, REQUIRED_ENGINE_FIELDS
from llmsupervisor.config.kinds import _check_section
from llmsupervisor.config.launcher import choose
from llmsupervisor.config.problems import Path_, _Collector, _field_name
from llmsupervisor.config.spec import COMPILE_KEY_FLAGS, EngineSpec
from llmsupervisor.core.placement import AUTO
from llmsupervisor.detectors import DetectorConfig
from llmsupervisor.probes.cpus import format_cpu_list, host_cpus
from llmsupervisor.redact import register_secret


@dataclass(slots=True, kw_only=True)
class _Entry:
    """One engine's entry while it is resolved: its own keys as written (``own``), the defaults,
    the merge of the two that becomes the ``EngineSpec``'s fields (``merged``), and where it is."""

    own: Mapping[str, Any]
    defaults: Mapping[str, Any]
    merged: dict[str, Any]
    path: Path_
    file: Path
    out: _Collector
    check_paths: bool
    hub_env: Mapping[str, str] | None

    def relative(self, value: str) -> str:
        """A path as the config file means it: relative to the file, not to the daemon's
        working directory."""
        return os.path.abspath(self.file.parent / value)


def _merge(defaults: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's keys over the defaults'; ``env`` and ``args`` merged key by key."""
    merged: dict[str, Any] = {**defaults, **own}
    merged["env"] = {**defaults.get("env", {}), **own.get("env", {})}
    merged["args"] = {**defaults.get("args", {}), **own.get("args", {})}
    return merged


def _required(e: _Entry) -> None:
    """Every required key is the engine's own (not where the key has a problem already)."""
    for key in REQUIRED_ENGINE_FIELDS:
        if key not in e.own and not any(p.field == _field_name(e.path + (key,)) for p in e.out.problems):
            e.out.add(e.path, f"missing required key '{key}'")


def _detectors(e: _Entry) -> None:
    """The engine's overrides over the defaults', key by key (a `sustain_s` replaces the
    defaults' `sustain_s`), built into the DetectorConfig the engine runs with."""
    detectors = {**e.defaults.get("detectors", {}), **e.own.get("detectors", {})}
    try:
        e.merged["detectors"] = DetectorConfig(**detectors)
    except (TypeError, ValueError) as exc:  # only if a DetectorConfig rule ever spans two fields
        e.out.add(e.path + ("detectors",), str(exc))


def _command(e: _Entry) -> None:
    """What to run: the engine's ``command`` as written, or one chosen for its ``venv``."""
    own, merged, path = e.own, e.merged, e.path
    if "venv" in own and "command" in own:
        e.out.add(path + ("command",), "set either 'venv' or 'command', not both")
    if "launcher" in own and "command" in own:
        e.out.add(path + ("launcher",), "applies to engines started from a venv; 'command' is run as written")
    venv = merged.pop("venv", None)
    launcher = merged.pop("launcher", "auto")
    if venv is not None:
        venv = _home_expanded(venv, path + ("venv",), e.out)
    if "command" not in merged or ("venv" in own and "command" not in own):
        if venv is not None and not os.path.isabs(venv):
            venv = e.relative(venv)  # like model paths
        choice = choose(venv, launcher)
        merged["command"] = choice.command
        merged["launcher"] = choice.launcher
        merged["launcher_reason"] = choice.why
    else:
        merged["launcher"] = "command"
    program = _home_expanded(merged["command"][0], path + ("command",), e.out) or merged["command"][0]
    if "/" in program:
        merged["command"] = (e.relative(program), *merged["command"][1:])  # like model paths


def _gpus(e: _Entry) -> None:
    e.merged.setdefault("gpus", ())
    if any(isinstance(g, str) for g in e.merged["gpus"]):
        # Named by UUID: resolved to NVML indices at start (EngineSpec.with_gpus).
        e.merged["gpu_uuids"], e.merged["gpus"] = e.merged["gpus"], ()


def _cpus(e: _Entry) -> None:
    """An explicit CPU list is the placement (and exists on this host); the supervisor, not
    ``env``, binds vLLM's OpenMP threads to it."""
    merged = e.merged
    if isinstance(merged.get("cpus"), tuple):
        merged["placement"] = merged["cpus"]
        if e.check_paths:
            _check_cpus_exist(merged["cpus"], e.path + ("cpus",), e.out)
    if merged.get("cpus") and "VLLM_CPU_OMP_THREADS_BIND" in merged["env"]:
        e.out.add(
            e.path + ("env", "VLLM_CPU_OMP_THREADS_BIND"),
            "set by the supervisor from the engine's 'cpus'; leave one of them out",
        )


def _model(e: _Entry) -> None:
    if isinstance(e.merged.get("model"), str) and _is_local_model(e.merged["model"]):
        # vLLM runs in the daemon's working directory, not the config's: give it the checked path.
        model = _home_expanded(e.merged["model"], e.path + ("model",), e.out)
        e.merged["model"] = e.relative(model) if model is not None else e.merged["model"]


def _api_key(e: _Entry) -> None:
    """The key in ``api_key_file``, the one way to give it: vLLM takes --api-key over
    VLLM_API_KEY, and two keys would leave the probes with the wrong one."""
    merged, path = e.merged, e.path
    if not isinstance(merged.get("api_key_file"), str):
        return
    if "api-key" in merged["args"]:
        e.out.add(path + ("args", "api-key"), "set either 'api_key_file' or args 'api-key', not both")
    if "VLLM_API_KEY" in merged["env"]:
        e.out.add(path + ("env", "VLLM_API_KEY"), "set either 'api_key_file' or env VLLM_API_KEY, not both")
    key_file = _home_expanded(merged["api_key_file"], path + ("api_key_file",), e.out)
    merged["api_key_file"] = e.relative(key_file) if key_file else merged["api_key_file"]
    if e.check_paths and key_file:
        merged["api_key"] = _read_api_key(merged["api_key_file"], path + ("api_key_file",), e.out)


# The entry's fields in this order, each step reporting its own problems, before the spec is built.
ENTRY_STEPS: Final[tuple[Callable[[_Entry], None], ...]] = (
    _required,
    _detectors,
    _command,
    _gpus,
    _cpus,
    _model,
    _api_key,
)


def _files(spec: EngineSpec, e: _Entry) -> None:
    """With ``check_paths``: the executable, a local model, a hub model offline. Not where the
    field has a problem of its own already: its fix decides what to run."""
    if not e.check_paths:
        return
    path, own = e.path, e.own
    cmd_path = path + (("command",) if "command" in own else ("venv",) if "venv" in own else ())
    said = {p.field for p in e.out.problems}
    if _field_name(cmd_path) not in said and _field_name(path + ("command",)) not in said:
        _check_executable(spec.command[0], cmd_path, e.out)
    if _field_name(path + ("model",)) not in said:
        _check_model(spec.model, e.file, path + ("model",), e.out)
    if e.hub_env is not None:
        problem = hub_offline_problem(spec, e.hub_env)
        if problem is not None:
            e.out.add(path + ("model",), problem)


def _parallelism(spec: EngineSpec, e: _Entry) -> None:
    _check_parallelism(spec, e.path, e.out)


def _ladder_steps(spec: EngineSpec, e: _Entry) -> None:
    """Per ladder step: a warning for a flag that costs the compile cache, and a problem for a
    max-num-active-seqs above the step's max-num-seqs."""
    for i, step in enumerate(spec.ladder):
        changed = [f for f in COMPILE_KEY_FLAGS if f in step]
        if changed:
            e.out.warn(
                e.path + ("ladder", i),
                f"sets {', '.join(changed)}, part of vLLM's torch.compile cache key: the first start at "
                "this step compiles from scratch (minutes on a big model) instead of loading the "
                "compile cache; steps of max-num-active-seqs (vLLM 0.32 and later) and "
                "gpu-memory-utilization keep the cache",
            )
        # vLLM refuses max_num_active_seqs above max_num_seqs (config/scheduler.py): caught here
        # rather than as a failed start at the step.
        args = spec.args_at(i + 1)
        active, seqs = args.get("max-num-active-seqs"), args.get("max-num-seqs")
        if (
            "max-num-active-seqs" in step
            and isinstance(active, int)
            and isinstance(seqs, int)
            and active > seqs
        ):
            e.out.add(
                e.path + ("ladder", i, "max-num-active-seqs"),
                f"{active} is above this step's max-num-seqs {seqs}: vLLM refuses to start with it",
            )


def _ladder_goes_down(spec: EngineSpec, e: _Entry) -> None:
    """The first step is not above the engine's own args."""
    for flag, value in spec.ladder[0].items() if spec.ladder else ():
        top = spec.args.get(flag)
        if isinstance(top, int | float) and not isinstance(top, bool) and value > top:
            e.out.add(e.path + ("ladder", 0, flag), f"steps go down: {value} is above the engine's own {top}")


# The checks that need the whole engine, in this order, on the built spec.
SPEC_CHECKS: Final[tuple[Callable[[EngineSpec, _Entry], None], ...]] = (
    _files,
    _parallelism,
    _ladder_steps,
    _ladder_goes_down,
)


def _engine(
    raw: Any,
    path: Path_,
    defaults: Mapping[str, Any],
    file: Path,
    out: _Collector,
    *,
    check_paths: bool,
    hub_env: Mapping[str, str] | None = None,
) -> EngineSpec | None:
    """The entry's keys checked, its fields resolved (ENTRY_STEPS), the spec built, then checked
    as a whole (SPEC_CHECKS); None when no spec can be built (its problems are reported)."""
    own = _check_section(raw, path, ENGINE_FIELDS, out, what="one engine")
    if own is None:
        return None
    entry = _Entry(
        own=own,
        defaults=defaults,
        merged=_merge(defaults, own),
        path=path,
        file=file,
        out=out,
        check_paths=check_paths,
        hub_env=hub_env,
    )
    for step in ENTRY_STEPS:
        step(entry)
    # Built whenever its fields allow, problems or not, so that the checks below and those between
    # engines (CPU overlap, placement) still run on it: every problem at once (a missing command
    # hid a CPU overlap until it was fixed, issue 26). Any problem rejects the whole config
    # (load_config), so a spec with problems never runs.
    try:
        spec = EngineSpec(**entry.merged)
    except (TypeError, ValueError):
        return None  # a required field is missing or unusable: that problem is reported
    for secret in (spec.api_key, spec.bearer_key):
        if secret:
            register_secret(secret)
    for check in SPEC_CHECKS:
        check(spec, entry)
    return spec


API_KEY_FILE_LIMIT: Final = 4096


def _read_api_key(key_file: str, path: Path_, out: _Collector) -> str | None:
    """The key in ``key_file``: its first line, stripped. The problem names the file, never
    the key."""
    try:
        with open(key_file, "rb") as f:
            data = f.read(API_KEY_FILE_LIMIT + 1)
    except OSError as exc:
        out.add(path, f"cannot read api_key_file {key_file!r}: {exc.strerror or exc}")
        return None
    if len(data) > API_KEY_FILE_LIMIT:
        out.add(path, f"api_key_file {key_file!r} is over {API_KEY_FILE_LIMIT} bytes: not a key file?")
        return None
    try:
        lines = data.decode("utf-8").strip().splitlines()
    except UnicodeDecodeError:
        out.add(path, f"api_key_file {key_file!r} is not UTF-8 text")
        return None
    key = lines[0].strip() if lines else ""
    if not key:
        out.add(path, f"api_key_file {key_file!r} is empty")
        return None
    if any(c.isspace() for c in key):
        out.add(path, f"api_key_file {key_file!r}: the key's line holds whitespace")
        return None
    return key


def _check_cpus_exist(cpus: tuple[int, ...], path: Path_, out: _Collector) -> None:
    online = host_cpus()
    missing = [c for c in cpus if c not in online]
    if missing:
        out.add(
            path,
            f"CPU(s) {format_cpu_list(missing)} do not exist on this host "
            f"(the daemon may use {format_cpu_list(online)})",
        )


def check_placement(engines: list[tuple[int, EngineSpec]], out: _Collector, *, check_host: bool) -> None:
    """Explicit CPU lists must not overlap; auto engines need a CPU each (on this host)."""
    claimed: dict[int, int] = {}
    for i, spec in engines:
        if not isinstance(spec.cpus, tuple):
            continue
        shared = sorted(c for c in spec.cpus if c in claimed)
        if shared:
            other = claimed[shared[0]]
            out.add(
                ("engines", i, "cpus"),
                f"CPU(s) {format_cpu_list(shared)} are already placed with engines[{other}]",
            )
        for c in spec.cpus:
            claimed.setdefault(c, i)
    auto = [i for i, spec in engines if spec.cpus == AUTO]
    if check_host and auto:
        free = host_cpus() - set(claimed)
        if len(auto) > len(free):
            out.add(
                ("engines", auto[len(free)], "cpus"),
                f"auto: {len(auto)} engines but {len(free)} CPU(s) left for them "
                f"({format_cpu_list(free) or 'none'}): they cannot have disjoint sets",
            )


def _check_executable(program: str, path: Path_, out: _Collector) -> None:
    if "/" in program:
        if not os.path.exists(program):
            out.add(path, f"command {program!r} does not exist")
        elif os.path.isdir(program) or not os.access(program, os.X_OK):
            out.add(path, f"command {program!r} is not executable")
    elif shutil.which(program) is None:
        out.add(path, f"command {program!r} is not on PATH")


def _home_expanded(text: str, path: Path_, out: _Collector) -> str | None:
    """``text`` with a leading ``~`` or ``~user`` expanded; None, reported, when there is no
    such user (``Path.expanduser`` raises RuntimeError there, ``os.path`` returns it as is)."""
    if not text.startswith("~"):
        return text
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        user = text[1:].split("/", 1)[0]
        out.add(path, f"no user {user!r} for {text!r}" if user else f"no home directory for {text!r}")
        return None
    return expanded


def _is_local_model(model: str) -> bool:
    # Hub ids look like "org/name"; local models are written as paths.
    return model.startswith(("/", "./", "../", "~"))


def _check_model(model: str, file: Path, path: Path_, out: _Collector) -> None:
    if not _is_local_model(model):
        return
    local = Path(model)
    if not local.is_absolute():
        local = file.parent / local
    if not local.exists():
        out.add(path, f"model path {model!r} does not exist")
    elif local.is_dir() and not (local / "config.json").exists() and not any(local.glob("*.gguf")):
        out.add(path, f"model directory {model!r} has no config.json")


# huggingface_hub's own rules (constants.py, the version vLLM 0.32 pulls in): which values switch
# offline mode on, and where the hub cache is.
_HF_TRUE: Final = frozenset({"1", "ON", "YES", "TRUE"})
_ENV_VAR: Final = re.compile(r"\$(\w+|\{[^}]*\})")
_COMMIT_HASH: Final = re.compile(r"[0-9a-f]{40}")


def hub_offline(env: Mapping[str, str]) -> str | None:
    """The variable that puts huggingface_hub offline in ``env`` (it reads HF_HUB_OFFLINE, and
    only when that is unset or empty, TRANSFORMERS_OFFLINE), or None."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = env.get(name)
        if value:
            return name if value.upper() in _HF_TRUE else None
    return None


def _expand(value: str, env: Mapping[str, str]) -> str:
    """``os.path.expandvars(os.path.expanduser(value))`` against ``env`` instead of os.environ."""
    if value.startswith("~"):
        home = env.get("HOME") or os.path.expanduser("~")
        value = home + value[1:] if value == "~" or value.startswith("~/") else os.path.expanduser(value)

    def var(match: re.Match[str]) -> str:
        name = match.group(1).strip("{}")
        return env.get(name, match.group(0))

    return _ENV_VAR.sub(var, value)


def hub_cache_dir(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub looks for models with ``env``: $HF_HUB_CACHE, else the legacy
    $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub."""
    cache_home = env.get("XDG_CACHE_HOME") or "~/.cache"
    hf_home = _expand(env.get("HF_HOME") or f"{cache_home}/huggingface", env)
    legacy = env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(hf_home, "hub")
    return Path(_expand(env.get("HF_HUB_CACHE") or legacy, env))


def hub_snapshot(model: str, revision: str, cache: Path) -> Path | None:
    """The cached snapshot huggingface_hub would use offline for ``model`` at ``revision`` (a
    branch or tag resolved through refs/, or a commit hash), or None."""
    repo = cache / ("models--" + model.replace("/", "--"))
    commit = revision
    if not _COMMIT_HASH.fullmatch(revision):
        try:
            commit = (repo / "refs" / revision).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
    snapshot = repo / "snapshots" / commit
    try:
        return snapshot if commit and snapshot.is_dir() and any(snapshot.iterdir()) else None
    except OSError:
        return None


def hub_offline_problem(spec: EngineSpec, environ: Mapping[str, str]) -> str | None:
    """Why ``spec`` cannot start offline, or None: its model is a hub id, huggingface_hub is
    offline in the engine's environment (``environ``, the daemon's, under the engine's ``env``),
    and the hub cache that environment points at holds no snapshot of it. vLLM then fails at
    start with a LocalEntryNotFoundError after loading nothing (docs/operations.md,
    troubleshooting)."""
    model = spec.model
    if _is_local_model(model) or "://" in model or os.path.exists(model):
        return None  # a path (vLLM checks os.path.exists first) or cloud storage
    env = {**environ, **spec.env}
    switch = hub_offline(env)
    if switch is None or env.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true"):
        return None
    revision = str(spec.args.get("revision") or "main")
    cache = hub_cache_dir(env)
    if hub_snapshot(model, revision, cache) is not None:
        return None
    where = "the engine's env" if switch in spec.env else "the daemon's environment"
    return (
        f"{model!r} is a Hugging Face hub id, {switch}={env[switch]} (from {where}) forbids "
        f"downloading it, and the hub cache {cache} has no snapshot of it at revision {revision!r} "
        f"(models--{model.replace('/', '--')}/snapshots/): download it first "
        f"(HF_HUB_CACHE={cache} hf download {model}, as the engine's user), or give a local path"
    )


def _parallel_size(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _check_parallelism(spec: EngineSpec, path: Path_, out: _Collector) -> None:
    if not spec.gpu_count:
        return
    tp = spec.args.get(
        "tensor-parallel-size", spec.gpu_count if "pipeline-parallel-size" not in spec.args else 1
    )
    pp = spec.args.get("pipeline-parallel-size", 1)
    tp_n, pp_n = _parallel_size(tp), _parallel_size(pp)
    if tp_n is None or pp_n is None or tp_n < 1 or pp_n < 1:
        out.add(path + ("args",), "tensor-parallel-size and pipeline-parallel-size must be positive integers")
        return
    if tp_n * pp_n != spec.gpu_count:
        where = path + (
            ("args", "tensor-parallel-size") if "tensor-parallel-size" in spec.args else ("gpus",)
        )
        out.add(
            where,
            f"tensor-parallel-size {tp_n} x pipeline-parallel-size {pp_n} = {tp_n * pp_n} GPUs, "
            f"but the engine has {spec.gpu_count} GPU(s) {list(spec.cuda_devices)}",
        )


def _cross_checks(engines_raw: list[Any], engines: list[EngineSpec], out: _Collector) -> None:
    """Problems between engines: names and GPUs (ports: config/listeners.py). Checked on the raw
    entries so that an engine with an unrelated problem still takes part."""
    seen_names: dict[str, int] = {}
    seen_gpus: dict[int | str, int] = {}
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
        gpus = raw.get("gpus")
        gpu_list = [gpus] if isinstance(gpus, int | str) else gpus if isinstance(gpus, list) else []
        for gpu in gpu_list:
            # One board named by index here and by UUID there is found at start, through NVML.
            claim = gpu.lower() if isinstance(gpu, str) else gpu
            if isinstance(claim, int | str) and not isinstance(claim, bool):
                if claim in seen_gpus and seen_gpus[claim] != i:
                    out.add(
                        ("engines", i, "gpus"), f"GPU {gpu} is already claimed by engines[{seen_gpus[claim]}]"
                    )
                else:
                    seen_gpus[claim] = i
