"""Issue 39, points 1 and 2: one rule for relative paths (next to the config file, for every
field, whoever reads the file from wherever), and no two listeners of one config on one address
and port (``http_listen`` on an engine's port passed check-config, and the engine went FATAL on
its own daemon's listener)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from llmsupervisor.cli import main as cli
from llmsupervisor.config import load_config, state_dir_named_in
from llmsupervisor.config.listeners import addresses, overlap
from llmsupervisor.errors import EX_CONFIG, ConfigError


def write(directory: Path, text: str) -> Path:
    path = directory / "config.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def problems(path: Path, *, check_paths: bool) -> list[str]:
    """Every problem ``load_config`` finds in the file, as check-config prints it."""
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=check_paths)
    return [str(p) for p in info.value.problems]


# ---- relative paths: next to the config file --------------------------------------------------


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The reader's working directory: neither the config's directory nor above it."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_every_relative_path_is_next_to_the_config_file(tmp_path: Path, elsewhere: Path) -> None:
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "config.json").write_text("{}")
    (conf / "venv" / "bin").mkdir(parents=True)
    (conf / "venv" / "bin" / "python").symlink_to(sys.executable)
    (conf / "key").write_text("sk-relative-key\n")
    path = write(
        conf,
        """
        supervisor:
          state_dir: ./state
        engines:
          - name: a
            model: ./model
            port: 8001
            venv: venv
            launcher: module
            api_key_file: key
        """,
    )
    config = load_config(path)
    spec = config.engine("a")
    assert config.supervisor.state_dir == conf / "state"
    assert config.path == path and config.path.is_absolute()
    assert spec.model == str(conf / "model")
    assert spec.command[0] == str(conf / "venv" / "bin" / "python")
    assert spec.api_key_file == str(conf / "key")
    assert not (elsewhere / "state").exists()


def test_a_state_dir_without_dot_or_with_a_home_is_resolved_too(
    tmp_path: Path, elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for written, meant in (
        ("state", tmp_path / "state"),
        ("../up/state", tmp_path.parent / "up" / "state"),
        ("~/state", tmp_path / "home" / "state"),
        ("/srv/state", Path("/srv/state")),
    ):
        path = write(
            tmp_path, f"supervisor: {{state_dir: {written}}}\nengines: [{{name: a, model: m, port: 1}}]\n"
        )
        assert load_config(path, check_paths=False).supervisor.state_dir == meant, written
        # The CLI finds the control socket through it, also from a file broken elsewhere.
        assert state_dir_named_in(path) == meant, written


def test_a_relative_config_path_is_taken_from_where_it_was_named(tmp_path: Path, elsewhere: Path) -> None:
    """``--config run/x.yaml`` is relative to the reader's directory (it names the file); what the
    file holds is relative to the file."""
    (elsewhere / "run").mkdir()
    write(elsewhere / "run", "supervisor: {state_dir: state}\nengines: [{name: a, model: m, port: 1}]\n")
    config = load_config(Path("run/config.yaml"), check_paths=False)
    assert config.path == elsewhere / "run" / "config.yaml"
    assert config.supervisor.state_dir == elsewhere / "run" / "state"
    assert state_dir_named_in(Path("run/config.yaml")) == elsewhere / "run" / "state"


def test_a_home_that_does_not_exist_is_a_problem_of_the_state_dir(tmp_path: Path) -> None:
    path = write(
        tmp_path, "supervisor: {state_dir: ~nosuchuser39/s}\nengines: [{name: a, model: m, port: 1}]\n"
    )
    assert problems(path, check_paths=False) == [
        f"{path}:1: supervisor.state_dir: no user 'nosuchuser39' for '~nosuchuser39/s'"
    ]


# ---- listeners: no two on one address and port ------------------------------------------------

ENGINE = "  - {name: gpu0, model: m, port: 8001, command: [python3, x.py]}\n"


@pytest.mark.parametrize(
    ("listen", "host"),
    [
        ("127.0.0.1:8001", "127.0.0.1"),
        ("0.0.0.0:8001", "127.0.0.1"),  # a wildcard overlaps every address
        ("127.0.0.1:8001", "0.0.0.0"),
        ("[::]:8001", "127.0.0.1"),
        ("localhost:8001", "127.0.0.1"),
        ("[::1]:8001", "::1"),
        ("gpu-host-01:8001", "gpu-host-01"),
    ],
)
def test_http_listen_on_an_engines_port_is_refused_where_the_file_sets_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], listen: str, host: str
) -> None:
    path = write(
        tmp_path,
        f"supervisor:\n  http_listen: '{listen}'\nengines:\n"
        f"  - {{name: gpu0, model: m, port: 8001, host: '{host}', command: [python3, x.py]}}\n",
    )
    expected = (
        f"{path}:2: supervisor.http_listen: {listen} is also engines[0] (gpu0)'s port ({host}:8001): "
        "the daemon and the engine cannot both listen there"
    )
    assert problems(path, check_paths=False) == [expected]
    assert cli.main(["check-config", str(path)]) == EX_CONFIG
    captured = capsys.readouterr()
    assert (captured.err.splitlines(), captured.out) == ([expected], "")


def test_an_engine_on_the_default_http_listen_is_refused_at_its_port(tmp_path: Path) -> None:
    path = write(tmp_path, "engines:\n" + ENGINE.replace("8001", "9400"))
    assert problems(path, check_paths=False) == [
        f"{path}:2: engines[0].port: port 9400 on 127.0.0.1 is the daemon's own listener (http_listen, "
        "by default 127.0.0.1:9400): choose another port, or set supervisor.http_listen"
    ]


def test_an_agent_port_on_http_listen_is_refused_and_the_hosts_default_comes_from_defaults(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        """
        supervisor: {http_listen: "10.0.0.5:9500"}
        defaults: {host: 0.0.0.0}
        engines:
          - {name: gpu0, model: m, port: 8001, agent_port: 9500, command: [python3, x.py]}
        """,
    )
    assert problems(path, check_paths=False) == [
        f"{path}:1: supervisor.http_listen: 10.0.0.5:9500 is also engines[0] (gpu0)'s agent_port "
        "(0.0.0.0:9500): the daemon and the engine cannot both listen there"
    ]


def test_engine_ports_still_clash_by_port_whatever_their_hosts(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        engines:
          - {name: a, model: m, port: 8001, host: 10.0.0.1, command: [python3, x.py]}
          - {name: b, model: m, port: 8002, agent_port: 8001, host: 10.0.0.2, command: [python3, x.py]}
        """,
    )
    assert problems(path, check_paths=False) == [
        f"{path}:3: engines[1].agent_port: port 8001 is already used by engines[0]"
    ]


def test_listeners_on_other_addresses_or_ports_are_fine(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        supervisor: {http_listen: "10.0.0.5:8001"}
        engines:
          - {name: a, model: m, port: 8001, command: [python3, x.py]}
          - {name: b, model: m, port: 8002, agent_port: 9400, command: [python3, x.py]}
        """,
    )
    assert [e.name for e in load_config(path, check_paths=False).engines] == ["a", "b"]


def test_a_broken_http_listen_is_reported_once_not_compared(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "supervisor: {http_listen: nonsense}\nengines:\n" + ENGINE.replace("8001", "9400"),
    )
    assert problems(path, check_paths=False) == [
        f"{path}:1: supervisor.http_listen: must be HOST:PORT, got 'nonsense'"
    ]


def test_addresses_and_overlap() -> None:
    assert addresses("0.0.0.0") is None and addresses("::") is None and addresses("[::]") is None
    assert addresses("localhost") == frozenset({"127.0.0.1", "::1"})
    assert addresses("0:0::1") == frozenset({"::1"})
    assert addresses("GPU-Host") == frozenset({"gpu-host"})
    assert overlap("127.0.0.1", "localhost") and overlap("::", "10.0.0.1")
    assert not overlap("127.0.0.1", "10.0.0.1") and not overlap("::1", "127.0.0.1")


def test_the_daemon_refuses_such_a_config_with_the_same_line(tmp_path: Path) -> None:
    """Not only check-config: the daemon exits 78 before it binds anything."""
    path = write(tmp_path, "engines:\n" + ENGINE.replace("8001", "9400"))
    cwd = os.getcwd()
    assert cli.main(["--config", str(path)]) == EX_CONFIG
    assert os.getcwd() == cwd  # it never moved
