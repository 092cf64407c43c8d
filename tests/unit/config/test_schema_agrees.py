"""The published schema and check-config agree on every numeric value (issue 28 #6): for each
numeric field, and each item of the numeric lists and mappings, the values at and around its
bounds are accepted by both or refused by both. Both are made from one table (``_number``'s
bounds, ``DetectorConfig``'s field metadata), and this is what holds them together."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from llmsupervisor.config import load_config
from llmsupervisor.config.problems import _field_name
from llmsupervisor.config.schema import config_schema
from llmsupervisor.errors import ConfigError

SCHEMA = config_schema()
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)
ENGINE = {"name": "a", "model": "org/m", "port": 8000}


def _numeric(schema: dict[str, Any]) -> bool:
    return schema.get("type") in ("number", "integer")


def numeric_slots() -> Iterator[tuple[str, tuple[str | int, ...], dict[str, Any]]]:
    """(name, path in the document, schema) of every numeric value a file can hold."""
    sections = SCHEMA["properties"]
    engine = sections["engines"]["items"]["properties"]
    for key, schema in sections["supervisor"]["properties"].items():
        if _numeric(schema):
            yield f"supervisor.{key}", ("supervisor", key), schema
    for key, schema in engine.items():
        if _numeric(schema):
            yield key, ("engines", 0, key), schema
    # gpus: an index or a UUID, or a list of them; the numeric one is the index.
    yield "gpus[]", ("engines", 0, "gpus", 0), engine["gpus"]["anyOf"][2]["items"]["anyOf"][0]
    for pattern, schema in engine["ladder"]["items"]["patternProperties"].items():
        flag = pattern.split("(")[1].rstrip(")$").replace("[-_]", "-")
        yield f"ladder.{flag}", ("engines", 0, "ladder", 0, flag), schema
    for key, schema in engine["detectors"]["properties"].items():
        if _numeric(schema):
            yield f"detectors.{key}", ("engines", 0, "detectors", key), schema
        elif schema["type"] == "array":
            yield f"detectors.{key}[]", ("engines", 0, "detectors", key, 0), schema["items"]
        else:
            one = schema["additionalProperties"]
            yield f"detectors.{key}.hang", ("engines", 0, "detectors", key, "hang"), one


def candidates(schema: dict[str, Any]) -> list[Any]:
    """Values at and just beyond each bound, and the usual suspects."""
    values: list[Any] = [0, -1, 1, 0.5, 1.0, 7.0, 10**400, -(10**400), 1e12, -1e12, 2**63, 1e300]
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key in schema:
            bound = schema[key]
            values += [bound, bound - 1, bound + 1, float(bound)]
            values += [math.nextafter(float(bound), -math.inf), math.nextafter(float(bound), math.inf)]
    return values


def document_with(path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    document: dict[str, Any] = {"engines": [dict(ENGINE)]}
    node: Any = document
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            node = node[part]  # type: ignore[index]
            continue
        if part not in node:
            last = i + 2 == len(path)
            node[part] = ([] if last else [{}]) if isinstance(path[i + 1], int) else {}
        node = node[part]
    if isinstance(node, list):
        node.append(value)
    else:
        node[path[-1]] = value
    return document


def schema_accepts(document: dict[str, Any], path: tuple[str | int, ...]) -> bool:
    """No error at the field or under it (an anyOf, as gpus', reports at the field itself)."""
    key = path[:2] if path[0] == "supervisor" else path[:3]
    return not [e for e in VALIDATOR.iter_errors(document) if tuple(e.absolute_path)[: len(key)] == key]


def check_config_accepts(document: dict[str, Any], path: tuple[str | int, ...], tmp_path: Path) -> bool:
    file = tmp_path / "config.yaml"
    file.write_text(yaml.safe_dump(document))  # 5e-324 as 5.0e-324: PyYAML's YAML 1.1 floats need a dot
    try:
        load_config(file, check_paths=False)
    except ConfigError as exc:
        field = _field_name(path)
        return not [p for p in exc.problems if p.field == field or p.field.startswith(field + "[")]
    return True


SLOTS = list(numeric_slots())


@pytest.mark.parametrize(("path", "schema"), [(p, s) for _, p, s in SLOTS], ids=[n for n, _, _ in SLOTS])
def test_schema_and_check_config_agree_at_the_bounds(
    path: tuple[str | int, ...], schema: dict[str, Any], tmp_path: Path
) -> None:
    assert "maximum" in schema or "exclusiveMaximum" in schema, "every number has an upper bound"
    assert "minimum" in schema or "exclusiveMinimum" in schema, "every number has a lower bound"
    disagree = []
    for value in candidates(schema):
        document = document_with(path, value)
        by_schema = schema_accepts(document, path)
        by_check = check_config_accepts(document, path, tmp_path)
        if by_schema != by_check:
            disagree.append(
                f"{value!r:.30}: schema {'accepts' if by_schema else 'refuses'}, "
                f"check-config {'accepts' if by_check else 'refuses'}"
            )
    assert not disagree, disagree


def test_every_numeric_field_is_covered() -> None:
    names = {n for n, _, _ in SLOTS}
    assert {"port", "supervisor.tick_interval_s", "gpus[]", "detectors.xid_info_only[]"} <= names
    assert "detectors.degradation_baseline_s" in names and "ladder.max-num-seqs" in names
    assert len(SLOTS) > 70
