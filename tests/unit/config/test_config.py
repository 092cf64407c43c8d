"""load_config and ``llm-supervisor check-config``: every problem as ``PATH:LINE: field: message``."""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
from pathlib import Path

import pytest

from llmsupervisor.cli import main as cli
from llmsupervisor.config import (
    ENGINE_FIELDS,
    SUPERVISOR_FIELDS,
    VLLM_API_SERVER_MODULE,
    EngineSpec,
    SupervisorConfig,
    SupervisorSettings,
    load_config,
)
from llmsupervisor.detectors import DetectorConfig, FindingKind
from llmsupervisor.errors import EX_CONFIG, ConfigError
from tests.lib.paths import REPO

EXAMPLE_CONFIG = REPO / "etc" / "llm-supervisor" / "config.yaml"


def write(directory: Path, text: str, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def problems(path: Path, *, check_paths: bool = True) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=check_paths)
    rendered = [str(p) for p in info.value.problems]
    assert str(info.value) == "\n".join(rendered)
    return rendered


def check_config(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    """Run ``llm-supervisor check-config PATH``; (exit code, stderr lines, stdout)."""
    code = cli.main(["check-config", str(path)])
    captured = capsys.readouterr()
    return code, captured.err.splitlines(), captured.out


def local_model(directory: Path) -> Path:
    model = directory / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    return model


@pytest.fixture
def python3_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only ``python3``, so the default command (python3 -m vllm...) resolves."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


# ---- one case per class of problem ------------------------------------------------------------
# Each case: the file, then the expected problems as "LINE: field: message" (PATH: is prepended).
# Every case runs through load_config (paths checked) and through check-config.

CASES: dict[str, tuple[str, list[str]]] = {
    "yaml-syntax-flow": (
        """
        engines:
          - name: a
            model: [org/m
            port: 8000
        """,
        ["4: yaml: syntax error: while parsing a flow sequence expected ',' or ']', but got ':'"],
    ),
    "yaml-syntax-indent": (
        """
        engines:
          - name: a
           model: org/m
            port: 8000
        """,
        [
            "3: yaml: syntax error: while parsing a block collection"
            " expected <block end>, but found '<block mapping start>'"
        ],
    ),
    "yaml-tab": (
        "engines:\n\t- name: a\n",
        [
            "2: yaml: syntax error: while scanning for the next token"
            " found character '\\t' that cannot start any token"
        ],
    ),
    "unknown-keys": (
        """
        supervisr:
          log_level: info
        supervisor:
          log_levl: info
        frobnicate: 1
        engines:
          - name: a
            model: org/m
            port: 8000
            gpu: [0]
        """,
        [
            "1: supervisr: unknown top-level key (did you mean 'supervisor'?)",
            "4: supervisor.log_levl: unknown key (did you mean 'log_level'?)",
            "5: frobnicate: unknown top-level key",
            "10: engines[0].gpu: unknown key (did you mean 'gpus'?)",
        ],
    ),
    "unknown-key-defaults": (
        """
        defaults:
          start_timeout: 100
        engines:
          - {name: a, model: org/m, port: 8000}
        """,
        ["2: defaults.start_timeout: unknown key (did you mean 'start_timeout_s'?)"],
    ),
    "wrong-types": (
        """
        supervisor:
          tick_interval_s: fast
        engines:
          - name: a
            model: org/m
            port: "8000"
            gpus: "0,1"
            start_timeout_s: true
            max_failures: 2.5
            enabled: 1
            env: [A]
            args: --enforce-eager
            command: []
        """,
        [
            "2: supervisor.tick_interval_s: must be a number, got string 'fast'",
            "6: engines[0].port: must be an integer, got string '8000'",
            "7: engines[0].gpus: must be a list of GPU indices or UUIDs, got string '0,1'",
            "8: engines[0].start_timeout_s: must be a number, got boolean True",
            "9: engines[0].max_failures: must be an integer, got number 2.5",
            "10: engines[0].enabled: must be true or false, got integer 1",
            "11: engines[0].env: must be a mapping of NAME: value, got list",
            "12: engines[0].args: must be a mapping of vLLM flag: value, got string",
            "13: engines[0].command: must be a non-empty list of strings"
            " (or one string, split like a shell would)",
        ],
    ),
    "bad-gpu-entries": (
        """
        engines:
          - name: a
            model: org/m
            port: 8000
            gpus:
              - 0
              - -1
          - name: b
            model: org/m
            port: 8001
            gpus: [2, 2]
        """,
        [
            "7: engines[0].gpus[1]: must be a GPU index (an integer 0 to 1023) or UUID, got -1",
            "11: engines[1].gpus[1]: GPU 2 is listed twice",
        ],
    ),
    "out-of-range": (
        """
        supervisor:
          log_level: verbose
          tick_interval_s: 0.01
          http_listen: localhost
          shutdown_timeout_s: 0
        engines:
          - name: a
            model: org/m
            port: 70000
            stop_timeout_s: -1
            start_timeout_s: 0
            backoff_jitter_ratio: 1.5
            max_failures: 0
          - name: "b c"
            model: org/m
            port: 0
        """,
        [
            "2: supervisor.log_level: must be one of debug, info, warning, error, got 'verbose'",
            "3: supervisor.tick_interval_s: must be >= 0.05, got 0.01",
            "4: supervisor.http_listen: must be HOST:PORT, got 'localhost'",
            "5: supervisor.shutdown_timeout_s: must be > 0, got 0",
            "9: engines[0].port: must be <= 65535, got 70000",
            "10: engines[0].stop_timeout_s: must be >= 0, got -1",
            "11: engines[0].start_timeout_s: must be > 0, got 0",
            "12: engines[0].backoff_jitter_ratio: must be <= 1, got 1.5",
            "13: engines[0].max_failures: must be >= 1, got 0",
            "14: engines[1].name: must be at most 64 letters, digits, '-', '_' or '.', got 'b c'",
            "16: engines[1].port: must be >= 1, got 0",
        ],
    ),
    "duplicate-engine-names": (
        """
        engines:
          - name: a
            model: org/m
            port: 8000
          - name: b
            model: org/m
            port: 8001
          - name: a
            model: org/m
            port: 8002
        """,
        ["8: engines[2].name: duplicate engine name 'a' (also engines[0])"],
    ),
    "two-engines-one-port": (
        """
        engines:
          - {name: a, model: org/m, port: 8000}
          - {name: b, model: org/m, port: 8000}
        """,
        ["3: engines[1].port: port 8000 is already used by engines[0]"],
    ),
    "one-gpu-two-engines": (
        """
        engines:
          - name: a
            model: org/m
            gpus: [0, 1]
            port: 8000
          - name: b
            model: org/m
            gpus:
              - 2
              - 1
            port: 8001
        """,
        ["8: engines[1].gpus: GPU 1 is already claimed by engines[0]"],
    ),
    "bad-gpu-uuids": (
        """
        engines:
          - name: a
            model: org/m
            port: 8000
            gpus: [GPU-0000, 5]
          - name: b
            model: org/m
            port: 8001
            gpus: [GPU-00000000-1111-2222-3333-444444444444, 7]
          - name: c
            model: org/m
            port: 8002
            gpus: MIG-00000000-1111-2222-3333-444444444444
          - name: d
            model: org/m
            port: 8003
            gpus: [GPU-aaaaaaaa-1111-2222-3333-444444444444]
          - name: e
            model: org/m
            port: 8004
            gpus: GPU-AAAAAAAA-1111-2222-3333-444444444444
        """,
        [
            "5: engines[0].gpus[0]: must be a GPU index or a UUID like"
            " GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (nvidia-smi -L), got 'GPU-0000'",
            "9: engines[1].gpus[1]: name all of an engine's GPUs by index, or all by UUID",
            "13: engines[2].gpus[0]: 'MIG-00000000-1111-2222-3333-444444444444' is a MIG device: MIG is not"
            " supported (docs/gpu.md)",
            "21: engines[4].gpus: GPU GPU-AAAAAAAA-1111-2222-3333-444444444444 is already claimed by"
            " engines[3]",
        ],
    ),
    "tensor-parallel-mismatch": (
        """
        engines:
          - name: a
            model: org/m
            gpus: [0, 1]
            port: 8000
            args:
              tensor-parallel-size: 4
          - name: b
            model: org/m
            gpus: [2, 3, 4]
            port: 8001
            args:
              pipeline-parallel-size: 2
          - name: c
            model: org/m
            gpus: [5]
            port: 8002
            args:
              tensor-parallel-size: two
        """,
        [
            "7: engines[0].args.tensor-parallel-size: tensor-parallel-size 4 x pipeline-parallel-size 1"
            " = 4 GPUs, but the engine has 2 GPU(s) [0, 1]",
            "10: engines[1].gpus: tensor-parallel-size 1 x pipeline-parallel-size 2"
            " = 2 GPUs, but the engine has 3 GPU(s) [2, 3, 4]",
            "18: engines[2].args: tensor-parallel-size and pipeline-parallel-size must be positive integers",
        ],
    ),
    "reserved-and-forbidden-args": (
        """
        engines:
          - name: a
            model: org/m
            port: 8000
            args:
              port: 9000
              --model: other/m
              served_model_name: x
              host: 0.0.0.0
              disable-log-stats: true
              max-num-seqs: [1, true]
        """,
        [
            "6: engines[0].args.port: set by the supervisor; use the engine's 'port' field instead",
            "7: engines[0].args.--model: set by the supervisor; use the engine's 'model' field instead",
            "8: engines[0].args.served_model_name: set by the supervisor;"
            " use the engine's 'served_model_name' field instead",
            "9: engines[0].args.host: set by the supervisor; use the engine's 'host' field instead",
            "10: engines[0].args.disable-log-stats: not allowed:"
            " removes every vllm: metric the supervisor watches",
            "11: engines[0].args.max-num-seqs: a list value must hold only strings and numbers",
        ],
    ),
    "duplicate-yaml-keys": (
        """
        engines:
          - name: a
            model: org/m
            port: 8000
            port: 8001
        supervisor: {}
        supervisor: {}
        """,
        [
            "5: engines[0].port: duplicate key",
            "7: supervisor: duplicate key",
        ],
    ),
    "empty-engines-list": (
        """
        supervisor:
          log_level: info
        engines: []
        """,
        ["3: engines: no engines configured: the list is empty"],
    ),
    "engines-key-without-value": (
        """
        supervisor: {}
        engines:
        """,
        ["2: engines: no engines configured: add a list under 'engines:'"],
    ),
    "no-engines-key": (
        """
        supervisor:
          log_level: info
        """,
        ["1: (top level): no engines configured: add a list under 'engines:'"],
    ),
    "empty-file": ("", ["1: (top level): no engines configured: add a list under 'engines:'"]),
    "top-level-not-a-mapping": (
        "- name: a\n",
        ["1: (top level): the config must be a mapping with supervisor, defaults, engines, got list"],
    ),
    "engines-not-a-list": (
        """
        engines:
          name: a
        """,
        ["1: engines: must be a list of engines, got mapping"],
    ),
    "engine-not-a-mapping": (
        """
        engines:
          - a
          - {name: b, model: org/m, port: 8001}
        """,
        ["2: engines[0]: must be a mapping (one engine), got string"],
    ),
    "missing-required-keys": (
        """
        engines:
          - name: a
            gpus: [0]
          - model: org/m
            port: 8001
        """,
        [
            "2: engines[0]: missing required key 'model'",
            "2: engines[0]: missing required key 'port'",
            "4: engines[1]: missing required key 'name'",
        ],
    ),
    "defaults-with-per-engine-keys": (
        """
        defaults:
          port: 8000
          model: org/m
          stop_timeout_s: 45
        engines:
          - {name: a, model: org/m, port: 8000}
        """,
        [
            "2: defaults.port: must be set per engine, not in defaults",
            "3: defaults.model: must be set per engine, not in defaults",
        ],
    ),
    "venv-and-command": (
        """
        engines:
          - name: a
            model: org/m
            port: 8000
            venv: /opt/vllm
            command: [vllm, serve]
        """,
        ["6: engines[0].command: set either 'venv' or 'command', not both"],
    ),
    "tag-that-cannot-be-read": (
        """
        engines:
          - name: a
            model: org/m
            port: !!int eighty
        """,
        # The value is then checked as the plain text it was written as.
        [
            "4: engines[0].port: cannot read 'eighty' as tag:yaml.org,2002:int",
            "4: engines[0].port: must be an integer, got string 'eighty'",
        ],
    ),
    "unknown-tag": (
        """
        engines:
          - name: a
            model: !secret org/m
            port: 8000
        """,
        ["3: engines[0].model: cannot read 'org/m' as !secret"],
    ),
    "problems-sorted-by-line": (
        # Found in the order supervisor, defaults, engines, cross-checks; listed by line.
        """
        engines:
          - name: a
            model: org/m
            port: 8000
          - name: a
            model: org/m
            port: 8000
            gpus: nope
        defaults:
          kill_timeout_s: -3
        supervisor:
          log_level: loud
        """,
        [
            "5: engines[1].name: duplicate engine name 'a' (also engines[0])",
            "7: engines[1].port: port 8000 is already used by engines[0]",
            "8: engines[1].gpus: must be a list of GPU indices or UUIDs, got string 'nope'",
            "10: defaults.kill_timeout_s: must be > 0, got -3",
            "12: supervisor.log_level: must be one of debug, info, warning, error, got 'loud'",
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_problem_lines(case: str, tmp_path: Path, python3_on_path: Path) -> None:
    text, expected = CASES[case]
    path = write(tmp_path, text)
    assert problems(path) == [f"{path}:{line}" for line in expected]


@pytest.mark.parametrize("case", list(CASES))
def test_check_config_prints_problems_and_exits_78(
    case: str, tmp_path: Path, python3_on_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, expected = CASES[case]
    path = write(tmp_path, text)
    code, err, out = check_config(path, capsys)
    assert code == EX_CONFIG == 78
    assert err == [f"{path}:{line}" for line in expected]
    assert out == ""


def test_unreadable_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "absent.yaml"
    assert problems(path) == [f"{path}:1: (top level): cannot read config file: No such file or directory"]
    code, err, _ = check_config(path, capsys)
    assert (code, err) == (78, [f"{path}:1: (top level): cannot read config file: No such file or directory"])


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"engines:\n  - name: \xff\n")
    assert problems(path) == [f"{path}:1: (top level): not UTF-8 text: invalid start byte"]


# ---- paths: models, commands, venvs -----------------------------------------------------------


def test_missing_absolute_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "nope"
    path = write(
        tmp_path,
        f"""
        engines:
          - name: a
            model: {missing}
            port: 8000
            command: [{sys.executable}]
        """,
    )
    assert problems(path) == [f"{path}:3: engines[0].model: model path '{missing}' does not exist"]
    # Without path checks the same file loads.
    assert load_config(path, check_paths=False).engines[0].model == str(missing)


def test_missing_model_path_relative_to_the_config_file(tmp_path: Path) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    assert Path.cwd() != conf_dir  # relative to the file, not to the current directory
    path = write(
        conf_dir,
        f"""
        engines:
          - name: a
            model: ./models/m
            port: 8000
            command: [{sys.executable}]
        """,
    )
    assert problems(path) == [f"{path}:3: engines[0].model: model path '{conf_dir}/models/m' does not exist"]


def test_relative_model_path_is_resolved_against_the_config_file(tmp_path: Path) -> None:
    conf_dir = tmp_path / "conf"
    local_model(conf_dir / "models")
    path = write(
        conf_dir,
        f"""
        engines:
          - name: a
            model: ./models/model
            port: 8000
            command: [{sys.executable}]
          - name: b
            model: ../conf/models/model
            port: 8001
            command: [{sys.executable}]
        """,
    )
    config = load_config(path)
    # vLLM runs in the daemon's working directory, so it is handed the path that was checked.
    assert [e.model for e in config.engines] == [str(conf_dir / "models" / "model")] * 2
    assert config.engines[0].argv()[1:3] == ["--model", str(conf_dir / "models" / "model")]


def test_home_relative_model_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    model = local_model(tmp_path / "models")
    path = write(
        tmp_path,
        f"""
        engines:
          - {{name: a, model: ~/models/model, port: 8000, command: [{sys.executable}]}}
        """,
    )
    # No shell expands "~" in an argv: the engine gets the expanded path.
    assert load_config(path).engines[0].model == str(model)


def test_model_directory_without_config_json(tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    path = write(
        tmp_path,
        f"""
        engines:
          - name: a
            model: {empty}
            port: 8000
            command: [{sys.executable}]
        """,
    )
    assert problems(path) == [f"{path}:3: engines[0].model: model directory '{empty}' has no config.json"]


def test_gguf_model_directory_is_accepted(tmp_path: Path) -> None:
    model = tmp_path / "gguf"
    model.mkdir()
    (model / "m.Q4_K_M.gguf").write_bytes(b"GGUF")
    path = write(
        tmp_path,
        f"""
        engines:
          - {{name: a, model: {model}, port: 8000, command: [{sys.executable}]}}
        """,
    )
    assert load_config(path).engines[0].model == str(model)


def test_hub_model_id_is_not_checked(tmp_path: Path) -> None:
    # "org/name" has a slash but is a Hugging Face id, not a path; nothing on disk to check.
    assert not (tmp_path / "meta-llama").exists()
    path = write(
        tmp_path,
        f"""
        engines:
          - name: a
            model: meta-llama/Llama-3.1-8B-Instruct
            port: 8000
            command: [{sys.executable}]
        """,
    )
    spec = load_config(path).engines[0]
    assert spec.model == spec.model_id == "meta-llama/Llama-3.1-8B-Instruct"


def test_command_not_executable(tmp_path: Path) -> None:
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    directory = tmp_path / "a-directory"
    directory.mkdir()
    missing = tmp_path / "missing" / "vllm"
    path = write(
        tmp_path,
        f"""
        engines:
          - name: a
            model: org/m
            port: 8000
            command: [{script}, serve]
          - name: b
            model: org/m
            port: 8001
            command: {directory}
          - name: c
            model: org/m
            port: 8002
            command: {missing} serve --flag
        """,
    )
    assert problems(path) == [
        f"{path}:5: engines[0].command: command '{script}' is not executable",
        f"{path}:9: engines[1].command: command '{directory}' is not executable",
        f"{path}:13: engines[2].command: command '{missing}' does not exist",
    ]


def test_command_not_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    path = write(
        tmp_path,
        """
        engines:
          - name: a
            model: org/m
            port: 8000
            command: vllm serve
          - name: b
            model: org/m
            port: 8001
        """,
    )
    # engines[1] has neither venv nor command: the default python3 is looked up too.
    assert problems(path) == [
        f"{path}:5: engines[0].command: command 'vllm' is not on PATH",
        f"{path}:6: engines[1]: command 'python3' is not on PATH",
    ]


def test_venv_without_bin_python(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    path = write(
        tmp_path,
        f"""
        defaults:
          venv: {venv}
        engines:
          - name: a
            model: org/m
            port: 8000
          - name: b
            model: org/m
            port: 8001
            venv: {tmp_path / "other"}
        """,
    )
    assert problems(path) == [
        f"{path}:4: engines[0]: command '{venv}/bin/python' does not exist",
        f"{path}:10: engines[1].venv: command '{tmp_path}/other/bin/python' does not exist",
    ]
    (venv / "bin" / "python").symlink_to(sys.executable)
    assert problems(path) == [
        f"{path}:10: engines[1].venv: command '{tmp_path}/other/bin/python' does not exist"
    ]


def test_venv_renders_the_api_server_module(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    path = write(
        tmp_path,
        f"""
        defaults:
          command: [{sys.executable}, -m, some.module]
        engines:
          - {{name: a, model: org/m, port: 8000, venv: {venv}}}
          - {{name: b, model: org/m, port: 8001}}
        """,
    )
    a, b = load_config(path).engines
    # An engine's own venv beats a command from defaults.
    assert a.command == (f"{venv}/bin/python", "-m", VLLM_API_SERVER_MODULE)
    assert b.command == (sys.executable, "-m", "some.module")


# ---- valid configs ----------------------------------------------------------------------------


def test_check_config_accepts_a_minimal_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = local_model(tmp_path)
    path = write(
        tmp_path,
        f"""
        defaults:
          command: [{sys.executable}, -m, vllm.entrypoints.openai.api_server]
        engines:
          - name: qwen
            model: {model}
            gpus: [0]
            port: 8000
        """,
    )
    code, err, out = check_config(path, capsys)
    assert (code, err) == (0, [])
    assert out == f"{path}: OK, 1 engine(s): qwen\n"


def test_check_config_is_static_and_never_asks_nvml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # MIG mode, a UUID's presence and a GPU's health are facts of the host, changed without
    # touching the file: doctor and the daemon's start judge them (docs/gpu.md). check-config
    # gives the same answer on every machine (CI, a laptop, the reload's validation).
    import llmsupervisor.probes.nvml as nvml

    def no_nvml(*args: object, **kwargs: object) -> None:
        raise AssertionError("check-config opened NVML")

    monkeypatch.setattr(nvml.NvmlReader, "__init__", no_nvml)
    model = local_model(tmp_path)
    path = write(
        tmp_path,
        f"""
        engines:
          - name: qwen
            model: {model}
            gpus: [GPU-00000000-1111-2222-3333-444444444444]
            port: 8000
            command: [{sys.executable}]
        """,
    )
    code, err, out = check_config(path, capsys)
    assert out.endswith("OK, 1 engine(s): qwen\n")
    assert (code, err) == (0, [])


def test_minimal_engine_gets_the_defaults(tmp_path: Path) -> None:
    model = local_model(tmp_path)
    path = write(
        tmp_path,
        f"""
        engines:
          - name: qwen
            model: {model}
            gpus: 0
            port: 8000
            command: {sys.executable}
        """,
    )
    config = load_config(path)
    assert isinstance(config, SupervisorConfig)
    assert config.path == path
    assert config.supervisor.state_dir == Path("/var/lib/llm-supervisor")
    assert config.supervisor.log_level == "info"
    assert config.supervisor.http_listen == "127.0.0.1:9400"
    assert config.engine("qwen") == EngineSpec(
        name="qwen", model=str(model), gpus=(0,), port=8000, command=(sys.executable,)
    )
    with pytest.raises(KeyError):
        config.engine("other")


def test_two_gpus_imply_tensor_parallel_size(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
        engines:
          - name: big
            model: org/big
            gpus: [0, 1]
            port: 8000
            command: [{sys.executable}]
          - name: pipe
            model: org/big
            gpus: [2, 3, 4, 5]
            port: 8001
            command: [{sys.executable}]
            args: {{tensor-parallel-size: 2, pipeline-parallel-size: 2}}
        """,
    )
    big, pipe = load_config(path).engines
    assert big.args == {}
    argv = big.argv()
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert pipe.argv()[-4:] == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]


def test_gpus_named_by_uuid_are_resolved_through_nvml(tmp_path: Path) -> None:
    uuids = ["GPU-aaaaaaaa-1111-2222-3333-444444444444", "GPU-bbbbbbbb-1111-2222-3333-444444444444"]
    path = write(
        tmp_path,
        f"""
        engines:
          - name: big
            model: org/big
            gpus: [{uuids[0].upper()}, {uuids[1]}]
            port: 8000
            command: [{sys.executable}]
        """,
    )
    (big,) = load_config(path).engines
    # Unresolved until the daemon asks NVML: no index, but two GPUs' worth of tensor parallelism.
    assert big.gpus == () and big.gpu_uuids == (uuids[0], uuids[1]) and big.unresolved_gpus
    assert big.argv()[-2:] == ["--tensor-parallel-size", "2"]
    assert big.with_gpus({uuids[0]: 3}) == [uuids[1]]
    resolved = big.with_gpus({uuids[1]: 0, uuids[0].upper(): 3})
    assert isinstance(resolved, EngineSpec)
    assert resolved.gpus == (3, 0) and not resolved.unresolved_gpus
    assert resolved.cuda_devices == (uuids[0], uuids[1])


def test_supervisor_section(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        supervisor:
          state_dir: /srv/state
          log_level: WARNING
          tick_interval_s: 1
          http_listen: "[::1]:9500"
          shutdown_timeout_s: 120
        engines:
          - {name: a, model: org/m, port: 8000}
        """,
    )
    settings = load_config(path, check_paths=False).supervisor
    assert settings.state_dir == Path("/srv/state")
    assert settings.log_level == "warning"
    assert settings.tick_interval_s == 1.0
    assert settings.http_listen == "[::1]:9500"
    assert settings.shutdown_timeout_s == 120.0


# ---- argv rendering ---------------------------------------------------------------------------


def test_argv_renders_every_value_kind() -> None:
    spec = EngineSpec(
        name="a",
        model="org/m",
        gpus=(3,),
        port=8123,
        host="::1",
        served_model_name="chat",
        command=("/opt/vllm/bin/python", "-m", VLLM_API_SERVER_MODULE),
        args={
            "enforce-eager": True,
            "enable-prefix-caching": False,
            "quantization": None,
            "max-num-seqs": 64,
            "gpu-memory-utilization": 0.9,
            "middleware": ["a.b", "c.d"],
            "compilation-config": {"level": 3, "cudagraph_capture_sizes": [1, 2]},
        },
    )
    assert spec.argv() == [
        "/opt/vllm/bin/python",
        "-m",
        VLLM_API_SERVER_MODULE,
        "--model",
        "org/m",
        "--host",
        "::1",
        "--port",
        "8123",
        "--served-model-name",
        "chat",
        "--enforce-eager",
        "--max-num-seqs",
        "64",
        "--gpu-memory-utilization",
        "0.9",
        "--middleware",
        "a.b",
        "c.d",
        "--compilation-config",
        '{"level":3,"cudagraph_capture_sizes":[1,2]}',
    ]
    assert spec.model_id == "chat"
    assert spec.base_url == "http://[::1]:8123"


def test_argv_without_served_model_name() -> None:
    spec = EngineSpec(name="a", model="org/m", gpus=(), port=8000, command=("vllm", "serve"))
    assert spec.argv() == ["vllm", "serve", "--model", "org/m", "--host", "127.0.0.1", "--port", "8000"]
    assert spec.model_id == "org/m"
    assert spec.base_url == "http://127.0.0.1:8000"


def test_defaults_merge_with_engine_env_and_args(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults:
          command: vllm-stub
          start_timeout_s: 600
          env:
            HF_HUB_OFFLINE: 1
            SHARED: from-defaults
          args:
            max-model-len: 4096
            enforce-eager: true
            shutdown-timeout: 30
        engines:
          - name: a
            model: org/m
            port: 8000
            start_timeout_s: 1200
            env:
              SHARED: from-engine
              OWN: x
            args:
              max_model_len: 8192
              enforce-eager: false
              --max-num-seqs: 8
          - name: b
            model: org/m
            port: 8001
        """,
    )
    a, b = load_config(path, check_paths=False).engines
    assert a.env == {"HF_HUB_OFFLINE": "1", "SHARED": "from-engine", "OWN": "x"}
    assert a.args == {
        "max-model-len": 8192,
        "enforce-eager": False,
        "shutdown-timeout": 30,
        "max-num-seqs": 8,
    }
    assert a.start_timeout_s == 1200.0
    assert a.argv()[7:] == ["--max-model-len", "8192", "--shutdown-timeout", "30", "--max-num-seqs", "8"]
    assert b.env == {"HF_HUB_OFFLINE": "1", "SHARED": "from-defaults"}
    assert b.args == {"max-model-len": 4096, "enforce-eager": True, "shutdown-timeout": 30}
    assert b.start_timeout_s == 600.0
    assert b.command == ("vllm-stub",)
    assert b.argv() == [
        "vllm-stub",
        "--model",
        "org/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8001",
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--shutdown-timeout",
        "30",
    ]


# ---- the shipped example ----------------------------------------------------------------------


def test_example_config_parses() -> None:
    config = load_config(EXAMPLE_CONFIG, check_paths=False)
    settings = config.supervisor
    assert settings.state_dir == Path("/var/lib/llm-supervisor")
    assert settings.http_listen == "127.0.0.1:9400"
    assert [e.name for e in config.engines] == ["qwen-7b", "qwen-32b"]
    small, big = config.engines
    python = "/opt/llm-supervisor/engines/vllm/bin/python"
    assert small.command == big.command == (python, "-m", VLLM_API_SERVER_MODULE)
    assert small.gpus == (0,)
    assert big.gpus == (1, 2)
    assert small.port != big.port
    assert big.served_model_name is not None
    assert big.model_id == big.served_model_name
    for spec in config.engines:
        assert spec.env["HF_HUB_OFFLINE"] == "1"
        # vLLM drains only with --shutdown-timeout > 0; the stop ladder must outwait it.
        drain_s = float(spec.args["shutdown-timeout"])
        assert drain_s > 0
        assert spec.stop_timeout_s >= drain_s + 10
    argv = big.argv()
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--served-model-name") + 1] == big.served_model_name


def test_example_config_documents_every_field() -> None:
    text = EXAMPLE_CONFIG.read_text()
    for key in [*SUPERVISOR_FIELDS, *ENGINE_FIELDS]:
        assert re.search(rf"^\s*(#\s*)?(- )?{key}:", text, re.MULTILINE), f"{key} is not in the example"


def test_field_tables_cover_the_settings() -> None:
    # Every key of an engine is a field of EngineSpec and the other way round, except `venv`,
    # which the loader turns into `command` (and `launcher_reason`, why it chose that command);
    # the same for the supervisor section.
    # `placement` is where `cpus` put the engine.
    assert set(ENGINE_FIELDS) - {"venv"} == {f.name for f in dataclasses.fields(EngineSpec)} - {
        "launcher_reason",
        "placement",
        "api_key",  # read from api_key_file
        "gpu_uuids",  # where `gpus` names GPUs by UUID
    }
    assert set(SUPERVISOR_FIELDS) == {f.name for f in dataclasses.fields(SupervisorSettings)}


def test_env_cannot_override_gpu_selection_or_markers(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "engines:\n"
        "  - name: a\n"
        "    model: org/m\n"
        "    port: 8001\n"
        f"    command: [{sys.executable}]\n"
        "    env:\n"
        "      CUDA_VISIBLE_DEVICES: '3'\n"
        "      LLMSUPERVISOR_ENGINE: x\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = [str(p) for p in err.value.problems]
    assert lines == [
        f"{path}:7: engines[0].env.CUDA_VISIBLE_DEVICES: set by the supervisor: "
        "use the engine's 'gpus' field",
        f"{path}:8: engines[0].env.LLMSUPERVISOR_ENGINE: "
        "LLMSUPERVISOR_* variables are the supervisor's process markers",
    ]


def test_relative_command_resolves_against_the_config_file(tmp_path: Path) -> None:
    venv = tmp_path / "venvs" / "vllm" / "bin"
    venv.mkdir(parents=True)
    python = venv / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    path = tmp_path / "c.yaml"
    path.write_text("engines:\n  - name: a\n    model: org/m\n    port: 8001\n    venv: venvs/vllm\n")
    spec = load_config(path).engines[0]
    assert spec.command[0] == str(python)


# ---- actions: ladder, schedule, detectors, fleet limits ----


def test_actions_fields_parse(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        supervisor: {max_unavailable: 2, min_in_rotation: 0}
        defaults:
          command: [/bin/true]
          detectors: {hang_idle_after_s: 8, sustain_s: {thermal: 5}}
        engines:
          - name: a
            model: org/m
            port: 8001
            args: {max-num-seqs: 64, max-num-batched-tokens: 8192}
            ladder:
              - {max-num-seqs: 32}
              - {max_num_batched_tokens: 2048, gpu-memory-utilization: 0.8}
            restart_every_h: 24
            restart_window: "23:30-01:30"
            detectors: {thermal_temperature_c: 80, xid_engine_level: [13, 43]}
        """,
    )
    config = load_config(path)
    assert (config.supervisor.max_unavailable, config.supervisor.min_in_rotation) == (2, 0)
    (spec,) = config.engines
    assert spec.restart_window == (23 * 60 + 30, 90)
    assert spec.restart_every_h == 24
    # Step 2 keeps step 1's max-num-seqs: a step names only what it changes.
    assert dict(spec.step_args(2)) == {
        "max-num-seqs": 32,
        "max-num-batched-tokens": 2048,
        "gpu-memory-utilization": 0.8,
    }
    argv = spec.argv(2)
    assert argv[argv.index("--max-num-seqs") + 1] == "32"
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"
    assert spec.argv(0).count("--max-num-seqs") == 1 and "64" in spec.argv(0)
    # The defaults' detector settings and the engine's own, in one DetectorConfig.
    assert spec.detectors == DetectorConfig(
        hang_idle_after_s=8,
        sustain_s={FindingKind.THERMAL: 5},
        thermal_temperature_c=80,
        xid_engine_level=frozenset({13, 43}),
    )
    assert spec.detectors.sustain_s[FindingKind.THERMAL] == 5
    assert spec.detectors.sustain_s[FindingKind.HANG] == DetectorConfig().sustain_s[FindingKind.HANG]


def test_detector_settings_compare_by_value(tmp_path: Path) -> None:
    # A reload restarts nothing and swaps in the new spec only where new_spec != old_spec.
    text = """
        engines:
          - name: a
            model: org/m
            port: 8001
            command: [/bin/true]
            detectors: {hang_after_s: 20, sustain_s: {thermal: 5}}
          - name: b
            model: org/m
            port: 8002
            command: [/bin/true]
        """
    first = load_config(write(tmp_path, text))
    again = load_config(write(tmp_path, text))
    assert first.engines == again.engines
    assert first.engine("b").detectors == DetectorConfig()
    changed = load_config(write(tmp_path, text.replace("hang_after_s: 20", "hang_after_s: 25")))
    assert changed.engine("a") != first.engine("a")
    assert changed.engine("b") == first.engine("b")
    changed = load_config(write(tmp_path, text.replace("thermal: 5", "thermal: 6")))
    assert changed.engine("a") != first.engine("a")


def test_actions_fields_problems(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults:
          command: [/bin/true]
          detectors: {sustain_s: {kv_presure: 3}}
        engines:
          - name: a
            model: org/m
            port: 8001
            args: {max-num-seqs: 64}
            ladder:
              - {max-num-seqs: 128}
            restart_window: "23:00-25:00"
          - name: b
            model: org/m
            port: 8002
            ladder:
              - {max-num-seqs: 32}
              - {max-num-seqs: 48, enforce-eager: true}
            detectors: {hang_min_misses: 0, hang_aftr_s: 3}
        """,
    )
    found = problems(path)
    assert found == [
        f"{path}:3: defaults.detectors.sustain_s.kv_presure: unknown finding kind "
        "(did you mean 'kv_pressure'?)",
        # Every problem at once: the ladder's is not held back by the restart window's (issue 26).
        f"{path}:10: engines[0].ladder[0].max-num-seqs: steps go down: 128 is above the engine's own 64",
        f"{path}:11: engines[0].restart_window: must be a local time window like '02:00-05:00', "
        "got '23:00-25:00'",
        f"{path}:17: engines[1].ladder[1].max-num-seqs: steps go down: 48 is above the previous step's 32",
        f"{path}:17: engines[1].ladder[1].enforce-eager: a ladder step may set only "
        "max-num-batched-tokens, max-num-seqs, max-num-active-seqs, gpu-memory-utilization",
        f"{path}:18: engines[1].detectors.hang_min_misses: must be >= 1, got 0",
        f"{path}:18: engines[1].detectors.hang_aftr_s: unknown detector setting "
        "(did you mean 'hang_after_s'?)",
    ]
    path.write_text(path.read_text().replace('restart_window: "23:00-25:00"', "enabled: true"))
    assert (
        f"{path}:10: engines[0].ladder[0].max-num-seqs: steps go down: 128 is above the engine's own 64"
        in (problems(path))
    )


def test_live_canary_timeout_factor_below_one_is_a_problem(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults:
          command: [/bin/true]
        engines:
          - name: a
            model: org/m
            port: 8001
            live_canary_timeout_s: 0.5
            live_canary_timeout_factor: 0.5
        """,
    )
    assert problems(path, check_paths=False) == [
        f"{path}:8: engines[0].live_canary_timeout_factor: must be >= 1, got 0.5",
    ]


@pytest.mark.parametrize("separator", ["\u0085", "\u2028", "\u2029", "\u0085\u2028\u2029"])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_problem_lines_are_the_lines_an_editor_shows(tmp_path: Path, separator: str, newline: str) -> None:
    """YAML 1.1 breaks lines at U+0085, U+2028 and U+2029; editors do not (issue 28: a 3-line
    file reported at line 4). The line is the editor's, for a field and for a syntax error."""
    path = tmp_path / "config.yaml"
    text = f'engines:\n  - {{name: a, model: "org/m{separator}", port: 8000,\n     gpus: x}}\n'
    path.write_bytes(text.replace("\n", newline).encode("utf-8"))
    with pytest.raises(ConfigError) as err:
        load_config(path, check_paths=False)
    assert [p.line for p in err.value.problems] == [3]
    path.write_bytes(f'# a "{separator}" b\nengines: [\n  {{name: a\n'.replace("\n", newline).encode("utf-8"))
    with pytest.raises(ConfigError) as err:
        load_config(path, check_paths=False)
    assert err.value.problems[0].line <= 4  # the end of a 3-line file, not beyond


def test_drain_grace_is_bounded(tmp_path: Path) -> None:
    """drain_grace_s: 1e12 passed check-config and kept `restart` DRAINING for ever (issue 28);
    an hour covers the slowest load balancer, and more is refused at its line."""
    path = tmp_path / "config.yaml"
    path.write_text("engines:\n  - name: a\n    model: org/m\n    port: 8000\n    drain_grace_s: 1.0e+12\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, check_paths=False)
    assert [str(p).split(": ", 1)[1] for p in err.value.problems] == [
        "engines[0].drain_grace_s: must be <= 3600, got 1000000000000.0"
    ]
    assert err.value.problems[0].line == 5
    path.write_text(path.read_text().replace("1.0e+12", "3600"))
    spec = load_config(path, check_paths=False).engines[0]
    assert spec.drain_grace_s == 3600.0
    # The key's one meaning, by its own name: the drain waits it, the policy counts it.
    assert spec.rotation_grace_s == spec.rules.rotation_grace_s == 3600.0
