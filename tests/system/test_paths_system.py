"""Issue 39, points 1 and 2 through the real daemon and CLI: relative paths are next to the config
file whoever starts the daemon from wherever (its state dir, and what its engines read: the
command's arguments), an engine that dies at start shows what its runtime printed in `status`,
and a config with two listeners on one address is refused before anything binds."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from llmsupervisor import __version__
from llmsupervisor.errors import EX_CONFIG
from tests.lib.daemon import FAKE_VLLM, cli, fake_engine, free_port


def test_relative_paths_are_next_to_the_config_and_a_dying_engine_says_why(
    tmp_path: Path, daemon_factory: Any
) -> None:
    (tmp_path / "engines").mkdir()
    shutil.copy(FAKE_VLLM, tmp_path / "engines" / "serve.py")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    good = fake_engine("good", free_port(), command=[sys.executable, "engines/serve.py"])
    broken = fake_engine(
        "broken", free_port(), command=[sys.executable, "engines/missing.py"], max_failures=2
    )
    d = daemon_factory({"supervisor": {"state_dir": "state"}, "engines": [good, broken]})
    assert d.state_dir == tmp_path / "state"  # where the relative path must land
    d.cwd = elsewhere
    d.start()
    d.wait_state("good", "ready")  # its script was found next to the config
    d.wait_state("broken", "fatal")
    assert not (elsewhere / "state").exists()
    assert f"llm-supervisor {__version__} (Python " in d.log()
    assert f"config {d.config_path}; engines start in {tmp_path}" in d.log()

    # The CLI from a third directory, the config named relative to it, finds the daemon.
    third = tmp_path / "third"
    third.mkdir()
    relative = Path(os.path.relpath(d.config_path, third))
    table = cli(None, "status", config=relative, cwd=third)
    assert table.returncode != 0  # an engine is FATAL
    row = next(line for line in table.stdout.splitlines() if line.startswith("broken "))
    missing = f"can't open file '{tmp_path / 'engines' / 'missing.py'}': [Errno 2] No such file or directory"
    assert f"{Path(sys.executable).name}: {missing}; process exited with code 2" in row, table.stdout

    as_json = cli(None, "status", "--json", "broken", config=relative, cwd=third)
    engine = json.loads(as_json.stdout)["engines"]["broken"]
    assert engine["last_error_line"] == f"{Path(sys.executable).name}: {missing}"
    assert engine["last_error_line"] in engine["reason"]
    assert d.stop() == 0


def test_http_listen_on_an_engines_port_is_refused_by_check_config_doctor_and_the_daemon(
    tmp_path: Path, daemon_factory: Any
) -> None:
    port = free_port()
    d = daemon_factory(
        {"supervisor": {"http_listen": f"0.0.0.0:{port}"}, "engines": [fake_engine("a", port)]}
    )
    line = (
        f"{d.config_path}:2: supervisor.http_listen: 0.0.0.0:{port} is also engines[0] (a)'s port "
        f"(127.0.0.1:{port}): the daemon and the engine cannot both listen there"
    )
    checked = cli(d, "check-config")
    assert (checked.returncode, checked.stderr.splitlines()) == (EX_CONFIG, [line])
    doctor = cli(d, "doctor")
    assert doctor.returncode == 1
    assert f"FAIL  config: {line}" in doctor.stdout.splitlines()
    d.start()
    assert d.wait_exit() == EX_CONFIG
    assert line in d.log()
