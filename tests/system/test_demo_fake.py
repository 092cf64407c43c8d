"""Issue 39, point 7: `scripts/demo --fake --once`, the newcomer's first minute without vLLM (the
README's third command), runs to its end: a drain, a hang found and restarted, a crash loop that
says what Python printed, and the status table last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmsupervisor import __version__
from tests.lib.daemon import free_port
from tests.lib.paths import REPO


def test_the_fake_demo_runs_and_ends_with_the_status_table(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LLMSUP_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "DEMO_DIR": str(tmp_path / "demo"),
        "DEMO_HTTP_PORT": str(free_port()),
        **{f"DEMO_PORT{i}": str(free_port()) for i in range(3)},
    }
    done = subprocess.run(
        [str(REPO / "scripts" / "demo"), "--fake", "--once"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    out = done.stdout
    log = (tmp_path / "demo" / "daemon.log").read_text(errors="replace")
    assert done.returncode == 0, f"{out}\n{done.stderr}\n{log[-4000:]}"
    steps = [line for line in out.splitlines() if line.startswith("==> ")]
    assert [s.split(".")[0] for s in steps] == ["==> 1", "==> 2", "==> 3", "==> 4", "==> 5"], out
    assert f"INFO    llm-supervisor {__version__} (Python " in out  # the start-up line names the version
    assert "fake0: READY" in out and "fake1: READY" in out
    assert "\n503 " in out  # drained: the load balancer's endpoint says no
    assert "Last restart: hang" in out  # describe fake1 after the hang
    # It ends with the table: the command, the header, one row per engine, nothing after.
    last = out.rstrip("\n").split("$ llm-supervisor status\n")[-1].splitlines()
    assert last[0].startswith("ENGINE ") and [row.split()[0] for row in last[1:]] == [
        "fake0",
        "fake1",
        "broken",
    ]
    fake0, fake1, broken = last[1:]
    assert fake0.split()[1] == "READY" and fake1.split()[1] == "READY", last
    assert broken.split()[1] == "FATAL" and "can't open file" in broken, broken
    assert f"can't open file '{tmp_path / 'demo' / 'no-such-engine.py'}'" in broken  # next to the config
