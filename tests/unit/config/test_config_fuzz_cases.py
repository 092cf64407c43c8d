"""The config fuzzer's findings (issue 17, bench/fuzz_config.py), one test per class: every bad
file is a ``ConfigError`` naming file and line, never another exception, never a hang, and no
NaN or infinity gets into a config. A bounded run of the fuzzer itself is a system test
(tests/system/test_bench_fuzz_config.py)."""

from __future__ import annotations

import math
import re
import sys
import textwrap
from pathlib import Path

import pytest

from llmsupervisor.config import load_config
from llmsupervisor.config.problems import MAX_CONFIG_BYTES, MAX_DEPTH, MAX_NODES
from llmsupervisor.errors import ConfigError

BASE = """
supervisor:
  state_dir: /tmp/llmsup-fuzz
engines:
  - name: a
    model: org/m
    port: 8000
    command: [python3]
"""


def supervisor_with(line: str) -> str:
    return BASE.replace("state_dir: /tmp/llmsup-fuzz", line)


def write(directory: Path, text: str) -> Path:
    path = directory / "config.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def rejected(path: Path) -> list[str]:
    """The problems of a file that must not load; each one ``FILE:LINE: field: message``."""
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=False)
    rendered = [str(p) for p in info.value.problems]
    assert rendered
    for line in rendered:
        assert re.match(rf"{re.escape(str(path))}:[1-9][0-9]*: \S", line), line
    return rendered


def test_a_400_digit_integer(tmp_path: Path) -> None:
    lines = rejected(write(tmp_path, BASE.replace("port: 8000", "port: " + "9" * 400)))
    assert any(":6: engines[0].port: must be <= 65535" in line for line in lines), lines


def test_a_400_digit_integer_where_any_size_is_allowed(tmp_path: Path) -> None:
    lines = rejected(write(tmp_path, BASE + "    drain_grace_s: " + "9" * 400 + "\n"))
    assert any(":8: engines[0].drain_grace_s: must be <= " in line for line in lines), lines


def test_a_400_digit_integer_in_a_ladder_step(tmp_path: Path) -> None:
    text = BASE + "    ladder:\n      - max-num-seqs: " + "9" * 400 + "\n"
    lines = rejected(write(tmp_path, text))
    assert any("engines[0].ladder[0].max-num-seqs: must be <= " in line for line in lines), lines


@pytest.mark.parametrize("open_close", [("[", "]"), ("{a: ", "}")])
def test_500_deep_nesting(tmp_path: Path, open_close: tuple[str, str]) -> None:
    opening, closing = open_close
    lines = rejected(write(tmp_path, "engines: " + opening * 500 + "1" + closing * 500 + "\n"))
    assert any(f"nested deeper than {MAX_DEPTH} levels" in line for line in lines), lines


def test_deep_nesting_does_not_depend_on_the_recursion_limit(tmp_path: Path) -> None:
    path = write(tmp_path, "engines: " + "[" * 5000 + "]" * 5000 + "\n")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        lines = rejected(path)
    finally:
        sys.setrecursionlimit(limit)
    assert any("nested deeper" in line for line in lines), lines


def test_a_self_referencing_alias(tmp_path: Path) -> None:
    lines = rejected(write(tmp_path, "a: &a [*a]\n"))
    assert any(":1: yaml: alias *a refers to a node that contains it" in line for line in lines), lines


def test_a_self_referencing_alias_in_a_mapping(tmp_path: Path) -> None:
    lines = rejected(write(tmp_path, "engines:\n  - &e\n    name: a\n    self: *e\n"))
    assert any(":4: yaml: alias *e refers to a node that contains it" in line for line in lines), lines


def test_billion_laughs(tmp_path: Path) -> None:
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for name, previous in zip("bcdefghi", "abcdefgh", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    path = write(tmp_path, "\n".join(levels) + "\n")
    assert path.stat().st_size < 600
    lines = rejected(path)
    assert any(f"more than {MAX_NODES} values once aliases are expanded" in line for line in lines), lines


def test_aliases_that_stay_small_still_work(tmp_path: Path) -> None:
    text = BASE.replace("    command: [python3]\n", "    command: &cmd [python3]\n") + (
        "  - name: b\n    model: org/m\n    port: 8001\n    command: *cmd\n"
    )
    config = load_config(write(tmp_path, text), check_paths=False)
    assert [e.command for e in config.engines] == [("python3",), ("python3",)]


def test_a_file_too_large(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "#" * MAX_CONFIG_BYTES + "\n")
    lines = rejected(path)
    assert any(f":1: (top level): the file is larger than {MAX_CONFIG_BYTES} bytes" in x for x in lines)


def test_model_under_an_unknown_home(tmp_path: Path) -> None:
    lines = rejected(write(tmp_path, BASE.replace("org/m", "~nosuchuser/m")))
    assert any(":5: engines[0].model: no user 'nosuchuser' for '~nosuchuser/m'" in x for x in lines), lines


def test_model_under_an_unknown_home_without_path_checks_is_rejected_too(tmp_path: Path) -> None:
    # check_paths=False (doctor, tests) still resolves the path; an unknown user is a problem.
    lines = rejected(write(tmp_path, BASE.replace("org/m", "~nosuchuser")))
    assert any("engines[0].model: no user 'nosuchuser'" in x for x in lines), lines


def test_command_and_venv_under_an_unknown_home(tmp_path: Path) -> None:
    lines = rejected(write(tmp_path, BASE.replace("[python3]", "[~nosuchuser/bin/vllm]")))
    assert any("engines[0].command: no user 'nosuchuser'" in x for x in lines), lines
    text = BASE.replace("    command: [python3]\n", "    venv: ~nosuchuser/venv\n")
    lines = rejected(write(tmp_path, text))
    assert any("engines[0].venv: no user 'nosuchuser'" in x for x in lines), lines


@pytest.mark.parametrize("port", ["²", "٣", "0x10", "99999999999999999999", ""])
def test_http_listen_with_a_port_that_is_not_ascii_digits(tmp_path: Path, port: str) -> None:
    text = BASE.replace("state_dir: /tmp/llmsup-fuzz", f"http_listen: '127.0.0.1:{port}'")
    lines = rejected(write(tmp_path, text))
    assert any(":2: supervisor.http_listen: must be HOST:PORT" in line for line in lines), lines


def test_an_unclosed_quote_in_command(tmp_path: Path) -> None:
    lines = rejected(write(tmp_path, BASE.replace("[python3]", '"python3 -m \'vllm"')))
    assert any(":7: engines[0].command: cannot split" in line for line in lines), lines


def test_tensor_parallel_size_infinite(tmp_path: Path) -> None:
    text = BASE + "    gpus: [0]\n    args: {tensor-parallel-size: .inf}\n"
    lines = rejected(write(tmp_path, text))
    assert any("engines[0].args.tensor-parallel-size: must be a finite number" in x for x in lines), lines


@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("supervisor.tick_interval_s", supervisor_with("tick_interval_s: .nan")),
        ("supervisor.shutdown_timeout_s", supervisor_with("shutdown_timeout_s: .inf")),
        ("engines[0].drain_grace_s", BASE + "    drain_grace_s: .NaN\n"),
        ("engines[0].backoff_max_s", BASE + "    backoff_max_s: .inf\n"),
        ("engines[0].backoff_initial_s", BASE + "    backoff_initial_s: -.inf\n"),
        ("engines[0].restart_every_h", BASE + "    restart_every_h: .inf\n"),
        ("engines[0].args.max-num-seqs", BASE + "    args: {max-num-seqs: .nan}\n"),
        ("engines[0].args.foo", BASE + "    args: {foo: [1, .nan]}\n"),
        ("engines[0].args.compilation-config", BASE + "    args: {compilation-config: {level: .inf}}\n"),
        ("engines[0].env.X", BASE + "    env: {X: .nan}\n"),
        (
            "engines[0].ladder[0].gpu-memory-utilization",
            BASE + "    ladder: [{gpu-memory-utilization: .nan}]\n",
        ),
        ("engines[0].detectors.stall_after_s", BASE + "    detectors: {stall_after_s: .nan}\n"),
        ("defaults.drain_timeout_s", "defaults:\n  drain_timeout_s: .nan\n" + BASE),
    ],
)
def test_nan_and_infinity_are_rejected_everywhere(tmp_path: Path, where: str, text: str) -> None:
    lines = rejected(write(tmp_path, text))
    assert any(f"{where}: must be a finite number" in line for line in lines), lines


def test_a_loaded_config_holds_no_nan(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, BASE + "    drain_grace_s: 1.5e+3\n"), check_paths=False)
    assert math.isfinite(config.engines[0].drain_grace_s)
    assert config.engines[0].drain_grace_s == 1500.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BASE + "    env: {'A=B': x}\n", "engines[0].env.A=B: not a valid environment variable name"),
        (BASE + '    env: {A: "x\\0y"}\n', "engines[0].env.A: must not contain a NUL character"),
        (BASE.replace("[python3]", '["python3", "a\\0b"]'), "engines[0].command: must not contain a NUL"),
        (BASE + '    args: {foo: "a\\0b"}\n', "engines[0].args.foo: must not contain a NUL character"),
        (BASE.replace("org/m", '"org/\\0m"'), "engines[0].model: must not contain a NUL character"),
    ],
)
def test_values_the_kernel_cannot_pass_to_an_engine(tmp_path: Path, text: str, message: str) -> None:
    lines = rejected(write(tmp_path, text))
    assert any(message in line for line in lines), lines


@pytest.mark.parametrize(
    ("key", "field"), [("", "['']"), ("\r", "['\\r']"), ("a b", "['a b']"), ("a.b", "['a.b']")]
)
def test_a_key_that_is_not_a_plain_word_is_quoted_in_the_field(tmp_path: Path, key: str, field: str) -> None:
    # Found by tests/unit/test_properties.py: {"\r": null} rendered as "FILE:1: : unknown top-level key".
    path = tmp_path / "config.yaml"
    path.write_text(f"{key!r}: 1\n".replace("'\\r'", '"\\r"'))
    lines = rejected(path)
    assert any(f":1: {field}: unknown top-level key" in line for line in lines), lines
