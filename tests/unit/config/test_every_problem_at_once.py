"""check-config reports every problem at once: an engine with a missing command still takes part
in the checks of its other fields and of the engines against each other (issue 26: the CPU
overlap showed only once the command was fixed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from llmsupervisor.config import load_config
from llmsupervisor.errors import ConfigError
from llmsupervisor.probes.cpus import host_cpus


def test_a_missing_command_does_not_hide_the_cpu_overlap_or_the_ladder(tmp_path: Path) -> None:
    cpu = min(host_cpus())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            engines:
              - name: a
                model: ./model
                port: 8001
                command: [/nonexistent/vllm]
                cpus: "{cpu}"
                args: {{max-num-seqs: 64}}
                ladder:
                  - {{max-num-seqs: 128}}
              - name: b
                model: ./model
                port: 8001
                command: [/bin/true]
                cpus: "{cpu}"
            """
        )
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [str(p) for p in info.value.problems] == [
        f"{path}:5: engines[0].command: command '/nonexistent/vllm' does not exist",
        f"{path}:9: engines[0].ladder[0].max-num-seqs: steps go down: 128 is above the engine's own 64",
        f"{path}:12: engines[1].port: port 8001 is already used by engines[0]",
        f"{path}:14: engines[1].cpus: CPU(s) {cpu} are already placed with engines[0]",
    ]
