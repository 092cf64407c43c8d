"""The real module on a bad config, as systemd runs it (``python -m llmsupervisor --config
PATH``): exit 78, which the unit's RestartPreventExitStatus= keeps from a restart loop, with every
problem on stderr in file order, the same lines ``check-config`` prints, and no traceback however
the file is broken (issue 17). The checks themselves are unit tests
(tests/unit/config/test_config.py, tests/unit/daemon/test_reload_bad_config.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmsupervisor.config import load_config
from llmsupervisor.errors import EX_CONFIG, ConfigError
from tests.lib.paths import REPO


def start_on(path: Path) -> subprocess.CompletedProcess[str]:
    """The daemon started on ``path`` (outside a unit: no journal stream), run to its exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "PYTHONPATH")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "llmsupervisor", "--config", str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_module_with_bad_config_exits_78_with_the_same_lines(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            supervisor:
              log_level: loud
            engines:
              - name: a
                model: org/m
                port: "8000"
              - name: a
                model: org/m
                port: 8001
            """
        ),
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    expected = [str(p) for p in info.value.problems]
    assert len(expected) == 3
    result = start_on(path)
    assert result.returncode == EX_CONFIG, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    for problem in expected:
        assert sum(line.endswith(problem) and " ERROR " in line for line in lines) == 1, result.stderr
    # Problems come out in file order, then the verdict.
    found = [i for i, line in enumerate(lines) for p in expected if line.endswith(p)]
    assert found == sorted(found)
    assert "invalid config, not starting (exit 78)" in lines[-1]


@pytest.mark.parametrize(
    "bad",
    ["a: &a [*a]\n", "engines: " + "{a: " * 500 + "1" + "}" * 500 + "\n"],
    ids=["self-alias", "deep"],
)
def test_startup_on_a_bad_file_exits_78_without_a_traceback(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(bad)
    result = start_on(path)
    assert result.returncode == EX_CONFIG, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{path}:1: yaml: " in result.stderr
