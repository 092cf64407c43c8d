"""A Hugging Face hub id with HF_HUB_OFFLINE=1 and no cached snapshot: ``check-config`` and
``doctor`` name it (file, line, field, the cache looked in); the daemon's own load does not refuse
it. The cache rules are checked against huggingface_hub itself where the vLLM venv has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmsupervisor import doctor
from llmsupervisor.cli import main as cli
from llmsupervisor.config import EngineSpec, load_config
from llmsupervisor.config.checks import hub_cache_dir, hub_offline, hub_offline_problem, hub_snapshot
from llmsupervisor.doctor import Level
from llmsupervisor.errors import EX_CONFIG, ConfigError
from tests.lib.daemon import free_port
from tests.lib.paths import REPO
from tests.lib.vllm_env import VLLM_VENV

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(cache: Path, model: str, *, ref: str = "main", commit: str = COMMIT) -> Path:
    """A hub cache entry laid out as huggingface_hub writes it."""
    repo = cache / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def spec(model: str = "org/name", **fields: object) -> EngineSpec:
    return EngineSpec(name="e", model=model, gpus=(), port=8000, **fields)  # type: ignore[arg-type]


# ---- the rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "switch"),
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE"),
        ({"HF_HUB_OFFLINE": "true"}, "HF_HUB_OFFLINE"),
        ({"HF_HUB_OFFLINE": "ON"}, "HF_HUB_OFFLINE"),
        ({"HF_HUB_OFFLINE": "0"}, None),
        ({"HF_HUB_OFFLINE": "no", "TRANSFORMERS_OFFLINE": "1"}, None),  # set and false: wins
        ({"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "1"}, "TRANSFORMERS_OFFLINE"),
        ({}, None),
    ],
)
def test_which_values_put_the_hub_offline(env: dict[str, str], switch: str | None) -> None:
    assert hub_offline(env) == switch


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HOME": "/h"}, "/h/.cache/huggingface/hub"),
        ({"HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
        ({"HOME": "/h", "HF_HOME": "~/hf"}, "/h/hf/hub"),
        ({"HOME": "/h", "HF_HOME": "$BASE/hf", "BASE": "/b"}, "/b/hf/hub"),
        ({"HOME": "/h", "HF_HOME": "/hf", "HUGGINGFACE_HUB_CACHE": "/legacy"}, "/legacy"),
        ({"HOME": "/h", "HF_HOME": "/hf", "HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HUB_CACHE": "/c"}, "/c"),
        ({"HOME": "/h", "HF_HUB_CACHE": "${HOME}/c"}, "/h/c"),
    ],
)
def test_where_the_hub_cache_is(env: dict[str, str], expected: str) -> None:
    assert hub_cache_dir(env) == Path(expected)


def test_a_snapshot_is_found_through_refs_or_by_commit(tmp_path: Path) -> None:
    snapshot = cache_model(tmp_path, "org/name")
    assert hub_snapshot("org/name", "main", tmp_path) == snapshot
    assert hub_snapshot("org/name", COMMIT, tmp_path) == snapshot
    assert hub_snapshot("org/name", "v2", tmp_path) is None  # no refs/v2
    assert hub_snapshot("org/other", "main", tmp_path) is None


def test_an_empty_or_dangling_snapshot_is_not_a_copy(tmp_path: Path) -> None:
    snapshot = cache_model(tmp_path, "org/name")
    (snapshot / "config.json").unlink()
    assert hub_snapshot("org/name", "main", tmp_path) is None
    snapshot.rmdir()
    assert hub_snapshot("org/name", "main", tmp_path) is None


def test_the_rules_agree_with_huggingface_hub(tmp_path: Path) -> None:
    """huggingface_hub itself (the vLLM venv's) resolves the same cache dir and finds the same
    snapshots offline; skipped without that venv."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM venv at {VLLM_VENV}")
    cache_model(tmp_path / "xdg" / "huggingface" / "hub", "org/cached")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env["HF_HUB_OFFLINE"] = "1"
    code = textwrap.dedent(
        """
        import json, huggingface_hub
        from huggingface_hub import constants, snapshot_download
        found = {}
        for model in ("org/cached", "org/missing"):
            try:
                found[model] = snapshot_download(model, local_files_only=True, ignore_patterns="*")
            except Exception as exc:
                found[model] = type(exc).__name__
        print(json.dumps({"cache": constants.HF_HUB_CACHE, "found": found}))
        """
    )
    done = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout.splitlines()[-1])
    assert Path(theirs["cache"]) == hub_cache_dir(env)
    ours = hub_snapshot("org/cached", "main", hub_cache_dir(env))
    assert ours is not None and Path(theirs["found"]["org/cached"]) == ours
    assert hub_snapshot("org/missing", "main", hub_cache_dir(env)) is None
    assert theirs["found"]["org/missing"] == "LocalEntryNotFoundError"


# ---- one engine --------------------------------------------------------------------------------


def test_a_hub_id_offline_without_a_copy_is_a_problem(tmp_path: Path) -> None:
    problem = hub_offline_problem(spec(), {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert problem is not None
    assert "'org/name' is a Hugging Face hub id, HF_HUB_OFFLINE=1 (from the daemon's environment)" in problem
    assert f"the hub cache {tmp_path} has no snapshot of it at revision 'main'" in problem
    assert "models--org--name/snapshots/" in problem


def test_the_engines_env_counts_and_wins(tmp_path: Path) -> None:
    offline_here = spec(env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    problem = hub_offline_problem(offline_here, {})
    assert problem is not None and "(from the engine's env)" in problem
    online_here = spec(env={"HF_HUB_OFFLINE": "0"})
    assert hub_offline_problem(online_here, {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}) is None


def test_no_problem_when_cached_online_or_a_path(tmp_path: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    cache_model(tmp_path, "org/name")
    assert hub_offline_problem(spec(), env) is None
    assert hub_offline_problem(spec("org/other"), {"HF_HUB_CACHE": str(tmp_path)}) is None  # online
    assert hub_offline_problem(spec("/srv/models/x"), env) is None  # a path: _check_model's business
    assert hub_offline_problem(spec("s3://bucket/model"), env) is None


def test_the_revision_arg_is_the_one_looked_for(tmp_path: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    cache_model(tmp_path, "org/name")
    problem = hub_offline_problem(spec(args={"revision": "v2"}), env)
    assert problem is not None and "at revision 'v2'" in problem
    assert hub_offline_problem(spec(args={"revision": COMMIT}), env) is None


# ---- check-config, doctor, the daemon's load ---------------------------------------------------


def write_config(tmp_path: Path, *, engine_env: str = "") -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            supervisor:
              state_dir: {tmp_path / "state"}
              http_listen: 127.0.0.1:{free_port()}
            engines:
              - name: hub
                model: org/name
                command: [{sys.executable}, -m, http.server]
                port: {free_port()}
            """
        )
        + engine_env
    )
    return path


def test_check_config_fails_with_file_line_and_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert cli.main(["check-config", str(path)]) == EX_CONFIG
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith(
        f"{path}:6: engines[0].model: 'org/name' is a Hugging Face hub id, HF_HUB_OFFLINE=1"
    )
    assert f"hub cache {tmp_path / 'hub'} has no snapshot" in err[0]

    cache_model(tmp_path / "hub", "org/name")
    assert cli.main(["check-config", str(path)]) == 0
    assert "OK, 1 engine(s): hub" in capsys.readouterr().out


def test_check_config_with_offline_in_the_engines_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    path = write_config(tmp_path, engine_env=f"    env: {{HF_HUB_OFFLINE: 1, HF_HOME: {tmp_path / 'hf'}}}\n")
    assert cli.main(["check-config", str(path)]) == EX_CONFIG
    err = capsys.readouterr().err
    assert "(from the engine's env)" in err and f"{tmp_path / 'hf' / 'hub'}" in err


def test_the_daemons_own_load_does_not_refuse_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_config(path).engines[0].model == "org/name"  # what `run` and reload call
    with pytest.raises(ConfigError):
        load_config(path, hub_env=os.environ)


def test_doctor_flags_it_for_the_engines_environment(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    results = doctor.run_checks(path, who=doctor.current_identity(), under_unit=False, hub_env=env)
    flagged = [r for r in results if r.name == "config" and "Hugging Face hub id" in r.detail]
    assert len(flagged) == 1 and flagged[0].level is Level.FAIL
    assert "engines[0].model" in flagged[0].detail
    # The other checks still ran on the config loaded without path checks.
    assert any(r.name.startswith("port ") for r in results)


def test_doctor_command_flags_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if any(p.exists() for p in doctor.UNIT_PATHS) and doctor.user_identity(doctor.SERVICE_USER):
        pytest.skip("an installed unit: doctor as root uses the unit's environment, not ours")
    path = write_config(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert cli.main(["doctor", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  config: {path}:6: engines[0].model: 'org/name' is a Hugging Face hub id" in out


def test_unit_environment_reads_environment_lines_drop_ins_and_files(tmp_path: Path) -> None:
    unit = tmp_path / "llm-supervisor.service"
    unit.write_text(
        "[Service]\n"
        "Environment=HOME=/var/lib/llm-supervisor XDG_CACHE_HOME=/var/cache/llm-supervisor\n"
        'Environment="HF_HOME=/var/cache/llm-supervisor/huggingface" PYTHONUNBUFFERED=1\n'
        f"EnvironmentFile=-{tmp_path / 'default'}\n"
        f"EnvironmentFile=-{tmp_path / 'missing'}\n"
    )
    (tmp_path / "llm-supervisor.service.d").mkdir()
    (tmp_path / "llm-supervisor.service.d" / "offline.conf").write_text(
        "[Service]\nEnvironment=HF_HUB_OFFLINE=1\n"
    )
    (tmp_path / "default").write_text("# site settings\nHF_HUB_CACHE=/srv/hub\n")
    env = doctor.unit_environment([tmp_path / "absent.service", unit], home="/home/svc")
    assert env["HOME"] == "/var/lib/llm-supervisor"
    assert env["HF_HOME"] == "/var/cache/llm-supervisor/huggingface"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_HUB_CACHE"] == "/srv/hub"
    assert hub_cache_dir(env) == Path("/srv/hub")
    assert doctor.unit_environment([tmp_path / "absent.service"], home="/home/svc") == {"HOME": "/home/svc"}


def test_the_shipped_units_environment_points_at_the_package_cache() -> None:
    unit = REPO / "systemd" / "llm-supervisor.service"
    env = doctor.unit_environment([unit], home="/nonexistent")
    assert hub_cache_dir(env) == Path("/var/cache/llm-supervisor/huggingface/hub")
