"""The config's JSON Schema (``llm-supervisor schema``, ``config.schema.json``): generated from the
validator's field tables, shipped equal to what the command prints, valid draft-07, passed by the
example config and failed by broken ones, the same ones ``load_config`` refuses."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from llmsupervisor.cli import main as cli
from llmsupervisor.config import ENGINE_FIELDS, SUPERVISOR_FIELDS, load_config
from llmsupervisor.config.schema import (
    DOCS_BEGIN,
    DOCS_END,
    SCHEMA_FILE,
    config_schema,
    fields_markdown,
    schema_text,
    shipped_schema_text,
    update_docs,
)
from llmsupervisor.detectors import DetectorConfig
from llmsupervisor.errors import ConfigError
from tests.lib.paths import REPO

EXAMPLE_CONFIG = REPO / "etc" / "llm-supervisor" / "config.yaml"
SHIPPED = REPO / "llmsupervisor" / "config" / SCHEMA_FILE
CONFIG_DOC = REPO / "docs" / "configuration.md"
REGENERATE = "llm-supervisor schema > llmsupervisor/config/config.schema.json"


def validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(config_schema())


def schema_errors(document: Any) -> list[str]:
    return [e.message for e in validator().iter_errors(document)]


def test_the_shipped_file_is_the_generated_schema() -> None:
    assert SHIPPED.read_text(encoding="utf-8") == schema_text(), f"stale; regenerate: {REGENERATE}"
    assert shipped_schema_text() == schema_text()  # what the installed package reads


def test_the_schema_command_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schema"]) == 0
    assert capsys.readouterr().out == schema_text()


def test_the_schema_is_package_data() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert f"config/{SCHEMA_FILE}" in pyproject["tool"]["setuptools"]["package-data"]["llmsupervisor"]


def test_it_is_a_valid_draft_07_schema() -> None:
    schema = config_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"


def test_every_field_of_the_tables_is_in_it_with_a_description() -> None:
    props = config_schema()["properties"]
    engine = props["engines"]["items"]["properties"]
    assert set(engine) == set(ENGINE_FIELDS)
    assert set(props["supervisor"]["properties"]) == set(SUPERVISOR_FIELDS)
    assert set(props["defaults"]["properties"]) < set(ENGINE_FIELDS)
    assert all(p["description"] for p in [*engine.values(), *props["supervisor"]["properties"].values()])
    detector_fields = {f.name for f in dataclasses.fields(DetectorConfig)}
    assert all(DetectorConfig.doc(name) for name in detector_fields), "document every DetectorConfig field"
    assert set(engine["detectors"]["properties"]) == detector_fields


def test_defaults_match_the_dataclasses() -> None:
    props = config_schema()["properties"]
    engine = props["engines"]["items"]["properties"]
    assert engine["start_timeout_s"]["default"] == 900.0
    assert engine["host"]["default"] == "127.0.0.1"
    assert props["supervisor"]["properties"]["http_listen"]["default"] == "127.0.0.1:9400"
    assert props["supervisor"]["properties"]["state_dir"]["default"] == "/var/lib/llm-supervisor"
    assert engine["detectors"]["properties"]["hang_after_s"]["default"] == 12.0
    assert engine["detectors"]["properties"]["sustain_s"]["default"]["kv_pressure"] == 60.0


def test_the_example_config_passes() -> None:
    document = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    assert schema_errors(document) == []


def test_the_example_config_names_the_schema_in_its_modeline() -> None:
    first_lines = EXAMPLE_CONFIG.read_text().splitlines()[:3]
    assert any(
        re.fullmatch(r"# yaml-language-server: \$schema=\S+config\.schema\.json", line)
        for line in first_lines
    )


# Each one is refused by load_config too (test_refused_by_both): the schema flags what the daemon refuses.
BROKEN: dict[str, str] = {
    "unknown top-level key": """
        engine:
          - {name: a, model: org/m, port: 8000}
        """,
    "typo in supervisor": """
        supervisor: {tick_intervl_s: 2}
        engines: [{name: a, model: org/m, port: 8000}]
        """,
    "tick out of range": """
        supervisor: {tick_interval_s: 0}
        engines: [{name: a, model: org/m, port: 8000}]
        """,
    "bad log level": """
        supervisor: {log_level: verbose}
        engines: [{name: a, model: org/m, port: 8000}]
        """,
    "http_listen without port": """
        supervisor: {http_listen: localhost}
        engines: [{name: a, model: org/m, port: 8000}]
        """,
    "engine without port": """
        engines: [{name: a, model: org/m}]
        """,
    "port as a string": """
        engines: [{name: a, model: org/m, port: "8000"}]
        """,
    "port too high": """
        engines: [{name: a, model: org/m, port: 70000}]
        """,
    "name with a space": """
        engines: [{name: "a b", model: org/m, port: 8000}]
        """,
    "negative gpu": """
        engines: [{name: a, model: org/m, port: 8000, gpus: [-1]}]
        """,
    "gpu listed twice": """
        engines: [{name: a, model: org/m, port: 8000, gpus: [0, 0]}]
        """,
    "supervisor-owned flag in args": """
        engines: [{name: a, model: org/m, port: 8000, args: {served_model_name: x}}]
        """,
    "forbidden flag in args": """
        defaults: {args: {--disable-log-stats: true}}
        engines: [{name: a, model: org/m, port: 8000}]
        """,
    "reserved env": """
        engines: [{name: a, model: org/m, port: 8000, env: {CUDA_VISIBLE_DEVICES: "0"}}]
        """,
    "marker env": """
        engines: [{name: a, model: org/m, port: 8000, env: {LLMSUPERVISOR_ENGINE: x}}]
        """,
    "boolean env value": """
        engines: [{name: a, model: org/m, port: 8000, env: {HF_HUB_OFFLINE: true}}]
        """,
    "per-engine key in defaults": """
        defaults: {port: 8000}
        engines: [{name: a, model: org/m, port: 8000}]
        """,
    "ladder flag not allowed": """
        engines: [{name: a, model: org/m, port: 8000, ladder: [{max-model-len: 1024}]}]
        """,
    "ladder utilisation above 1": """
        engines: [{name: a, model: org/m, port: 8000, ladder: [{gpu-memory-utilization: 1.5}]}]
        """,
    "restart window not a window": """
        engines: [{name: a, model: org/m, port: 8000, restart_window: "at night"}]
        """,
    "unknown detector setting": """
        engines: [{name: a, model: org/m, port: 8000, detectors: {hang_afer_s: 3}}]
        """,
    "unknown finding kind": """
        engines: [{name: a, model: org/m, port: 8000, detectors: {sustain_s: {kv: 3}}}]
        """,
    "empty command": """
        engines: [{name: a, model: org/m, port: 8000, command: []}]
        """,
    "no engines": """
        supervisor: {}
        """,
    "empty engine list": """
        engines: []
        """,
}


def _document(text: str) -> Any:
    return yaml.safe_load(textwrap.dedent(text))


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_configs_fail_the_schema(case: str) -> None:
    assert schema_errors(_document(BROKEN[case])), case


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_refused_by_both(case: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(BROKEN[case]))
    with pytest.raises(ConfigError):
        load_config(path, check_paths=False)


GOOD: dict[str, str] = {
    "minimal": """
        engines: [{name: a, model: org/m, port: 8000}]
        """,
    "everything spelled the other accepted ways": """
        supervisor:
          log_level: INFO
        defaults:
          command: "python3 -m vllm.entrypoints.openai.api_server"
          args: {max_num_seqs: 8, enforce-eager: true, kv-transfer-config: {a: 1}, lora-modules: [x, y]}
          env: {HF_HUB_OFFLINE: 1, OMP_NUM_THREADS: "2"}
          ladder: [{max_num_seqs: 4}, {--gpu-memory-utilization: 0.8}]
          restart_window: "22:00 - 02:00"
          detectors: {hang_after_s: 20, sustain_s: {thermal: 30}, xid_info_only: [63, 94]}
        engines:
          - {name: gpu0.a_b-c, model: ./m, port: 8000, gpus: 0}
          - {name: b, model: org/m, port: 8001, gpus: [1, 2], enabled: false}
        """,
}


@pytest.mark.parametrize("case", sorted(GOOD))
def test_good_configs_pass_both(case: str, tmp_path: Path) -> None:
    assert schema_errors(_document(GOOD[case])) == []
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(GOOD[case]))
    load_config(path, check_paths=False)


def test_the_field_reference_in_the_docs_is_generated() -> None:
    text = CONFIG_DOC.read_text(encoding="utf-8")
    assert DOCS_BEGIN in text and DOCS_END in text
    assert fields_markdown() in text
    assert update_docs(text) == text, (
        "docs/configuration.md is stale: python -m llmsupervisor.config.schema --docs docs/configuration.md"
    )


def test_schema_text_is_stable_json() -> None:
    assert json.loads(schema_text()) == config_schema()


def _engine_with(key: str, value: Any, *, venv: bool) -> dict[str, Any]:
    engine: dict[str, Any] = {"name": "a", "model": "org/m", "port": 8000, key: value}
    if venv and key != "command":
        engine["venv"] = "/opt/vllm"  # launcher applies to venv engines only
    return engine


def test_every_default_the_schema_shows_is_accepted(tmp_path: Path) -> None:
    """What `llm-supervisor schema` and the field reference give as a key's default, written in
    the file, passes check-config (launcher's default was "command", which it refuses)."""
    sections = config_schema()["properties"]
    engine = sections["engines"]["items"]["properties"]
    supervisor = sections["supervisor"]["properties"]
    path = tmp_path / "config.yaml"
    shown = [("engines", k, p["default"]) for k, p in engine.items() if "default" in p]
    shown += [("supervisor", k, p["default"]) for k, p in supervisor.items() if "default" in p]
    assert ("engines", "launcher", "auto") in shown
    for section, key, default in shown:
        if section == "engines":
            document: dict[str, Any] = {"engines": [_engine_with(key, default, venv=key == "launcher")]}
        else:
            document = {
                "supervisor": {key: default},
                "engines": [_engine_with("host", "127.0.0.1", venv=False)],
            }
        assert schema_errors(document) == [], (key, default)
        path.write_text(json.dumps(document))
        try:
            load_config(path, check_paths=False)
        except ConfigError as exc:
            pytest.fail(f"{section}.{key}: the shown default {default!r} is refused: {exc}")
