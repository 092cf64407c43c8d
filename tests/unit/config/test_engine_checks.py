"""One engine's entry (config/checks.py): its fields resolved by ENTRY_STEPS, then the spec
checked by SPEC_CHECKS, each table in its order, and each step's problem reported with the rest
(load_config lists them by line)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from llmsupervisor.config import load_config
from llmsupervisor.config.checks import ENTRY_STEPS, SPEC_CHECKS
from llmsupervisor.errors import ConfigError


def test_the_steps_run_in_this_order() -> None:
    assert [step.__name__ for step in ENTRY_STEPS] == [
        "_required",
        "_detectors",
        "_command",
        "_gpus",
        "_cpus",
        "_model",
        "_api_key",
    ]
    assert [check.__name__ for check in SPEC_CHECKS] == [
        "_files",
        "_parallelism",
        "_ladder_steps",
        "_ladder_goes_down",
    ]


def test_each_step_reports_its_own_problem_in_one_engine(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "key").write_text("k\n")
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            engines:
              - name: a
                port: 8001
                model: ./model
                venv: /opt/venv
                command: [/nonexistent/vllm]
                gpus: [0, 1]
                cpus: "0"
                env: {VLLM_CPU_OMP_THREADS_BIND: "0"}
                api_key_file: key
                args: {max-num-seqs: 64, max-num-batched-tokens: 4096, api-key: x, tensor-parallel-size: 3}
                ladder:
                  - {max-num-batched-tokens: 8192}
                  - {max-num-active-seqs: 100}
            """
        )
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=False)
    assert [(p.field, p.message) for p in info.value.problems] == [
        ("engines[0].command", "set either 'venv' or 'command', not both"),  # _command
        (  # _cpus
            "engines[0].env.VLLM_CPU_OMP_THREADS_BIND",
            "set by the supervisor from the engine's 'cpus'; leave one of them out",
        ),
        ("engines[0].args.api-key", "set either 'api_key_file' or args 'api-key', not both"),  # _api_key
        (  # _parallelism
            "engines[0].args.tensor-parallel-size",
            "tensor-parallel-size 3 x pipeline-parallel-size 1 = 3 GPUs, but the engine has 2 GPU(s) [0, 1]",
        ),
        (  # _ladder_goes_down
            "engines[0].ladder[0].max-num-batched-tokens",
            "steps go down: 8192 is above the engine's own 4096",
        ),
        (  # _ladder_steps
            "engines[0].ladder[1].max-num-active-seqs",
            "100 is above this step's max-num-seqs 64: vLLM refuses to start with it",
        ),
    ]
