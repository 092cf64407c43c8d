"""The config's JSON Schema and its field reference, both generated from the tables the
validator runs (``fields.ENGINE_FIELDS``, ``SUPERVISOR_FIELDS``, the metadata of
``DetectorConfig``'s fields) and the defaults of the dataclasses they fill (``EngineSpec``,
``SupervisorSettings``, ``DetectorConfig``).

``llm-supervisor schema`` prints the schema; the package ships the same text as
``config.schema.json`` (a test keeps the two equal), which editors use through the modeline
``# yaml-language-server: $schema=...``. The schema is for typing: it knows each key, its type
and bounds, but not what needs the whole file or the disk (ports and GPUs shared between
engines, parallel sizes against GPUs, model paths, ladder steps going down). ``check-config``
stays the authority.

Draft-07, the newest draft that editors' YAML language servers validate fully.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, fields
from importlib import resources
from typing import Any, Final

from llmsupervisor.config.fields import (
    ENGINE_FIELDS,
    PER_ENGINE_ONLY,
    REQUIRED_ENGINE_FIELDS,
    SUPERVISOR_FIELDS,
)
from llmsupervisor.config.kinds import NO_DEFAULT, Field
from llmsupervisor.config.spec import EngineSpec, SupervisorSettings
from llmsupervisor.detectors import DetectorConfig

SCHEMA_FILE: Final = "config.schema.json"
SCHEMA_ID: Final = "https://github.com/llm-supervisor/llm-supervisor/config.schema.json"


def _json_default(value: Any) -> Any:
    """A dataclass default as JSON, or MISSING when it has none worth showing."""
    if value is None or value is MISSING or value == ():
        return MISSING  # () is "not set" (cpus, command, ladder): shown as [] it reads as a value
    if isinstance(value, tuple | frozenset | set):
        return sorted(value) if isinstance(value, frozenset | set) else list(value)
    if isinstance(value, Mapping):
        return {getattr(k, "value", str(k)): v for k, v in value.items()} or MISSING
    if isinstance(value, str | int | float | bool):
        return value
    return str(value)  # Path


def _defaults(cls: type) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for spec in fields(cls):
        value = spec.default if spec.default is not MISSING else MISSING
        if value is MISSING and spec.default_factory is not MISSING:
            value = spec.default_factory()
        shown = _json_default(value)
        if shown is not MISSING:
            result[spec.name] = shown
    return result


def _detector_defaults() -> dict[str, Any]:
    config = DetectorConfig()
    return {
        spec.name: _json_default(getattr(config, spec.name))
        for spec in fields(DetectorConfig)
        if _json_default(getattr(config, spec.name)) is not MISSING
    }


def _shown_defaults(table: Mapping[str, Field], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The dataclass's defaults, with a field's own ``default`` where it has one."""
    return {**defaults, **{n: f.default for n, f in table.items() if f.default is not NO_DEFAULT}}


def _property(name: str, field: Field, defaults: Mapping[str, Any]) -> dict[str, Any]:
    schema = dict(field.kind.schema)
    schema["description"] = field.doc
    if name == "detectors":
        detector_defaults = _detector_defaults()
        schema["properties"] = {
            key: {**value, "description": DetectorConfig.doc(key)}
            | ({"default": detector_defaults[key]} if key in detector_defaults else {})
            for key, value in schema["properties"].items()
        }
    elif name in defaults and name not in ("args", "env", "command"):
        schema["default"] = defaults[name]
    return schema


def _section(table: Mapping[str, Field], defaults: Mapping[str, Any], description: str) -> dict[str, Any]:
    return {
        "type": ["object", "null"],
        "description": description,
        "properties": {
            name: _property(name, field, _shown_defaults(table, defaults)) for name, field in table.items()
        },
        "additionalProperties": False,
    }


def config_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07) of a config file."""
    engine_defaults = _defaults(EngineSpec)
    engine = _section(ENGINE_FIELDS, engine_defaults, "one vLLM engine")
    engine["type"] = "object"
    engine["required"] = list(REQUIRED_ENGINE_FIELDS)
    defaults = _section(
        {k: v for k, v in ENGINE_FIELDS.items() if k not in PER_ENGINE_ONLY},
        engine_defaults,
        "any engine key except " + ", ".join(sorted(PER_ENGINE_ONLY)) + ", applied to every engine; "
        "env, args and detectors are merged key by key, the engine's value winning",
    )
    supervisor = _section(SUPERVISOR_FIELDS, _defaults(SupervisorSettings), "the daemon's own settings")
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": SCHEMA_ID,
        "title": "llm-supervisor config.yaml",
        "description": "Generated by `llm-supervisor schema` from the validator's field tables. "
        "It checks each key; `llm-supervisor check-config` also checks the file as a whole.",
        "type": "object",
        "properties": {
            "supervisor": supervisor,
            "defaults": defaults,
            "engines": {"type": "array", "minItems": 1, "items": engine, "description": "the engines"},
        },
        "required": ["engines"],
        "additionalProperties": False,
    }


def schema_text() -> str:
    """The schema as the shipped file holds it: sorted keys, two-space indent, final newline."""
    return json.dumps(config_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def shipped_schema_text() -> str:
    """The ``config.schema.json`` installed with the package."""
    return resources.files("llmsupervisor.config").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")


def _cell(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False).replace("|", "\\|") if value is not MISSING else ""


def _kind_text(schema: Mapping[str, Any]) -> str:
    kind = schema.get("type")
    if "const" in schema:
        return json.dumps(schema["const"])
    if "anyOf" in schema:
        return " or ".join(_kind_text(s) for s in schema["anyOf"])
    if isinstance(kind, list):
        return " or ".join(kind)
    text = {"object": "mapping", "array": "list"}.get(str(kind), str(kind))
    bounds = []
    if "minimum" in schema:
        bounds.append(f">= {schema['minimum']}")
    if "exclusiveMinimum" in schema:
        bounds.append(f"> {schema['exclusiveMinimum']}")
    if "maximum" in schema:
        bounds.append(f"<= {schema['maximum']}")
    return f"{text} {', '.join(bounds)}".strip()


def _table(table: Mapping[str, Field], defaults: Mapping[str, Any], *, required: tuple[str, ...] = ()) -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    defaults = _shown_defaults(table, defaults)
    for name, field in table.items():
        default = "required" if name in required else _cell(defaults.get(name, MISSING))
        doc = field.doc.replace("|", "\\|")
        rows.append(f"| `{name}` | {_kind_text(field.kind.schema)} | {default} | {doc} |")
    return "\n".join(rows)


def fields_markdown() -> str:
    """The field reference of docs/configuration.md (between its generated-section markers)."""
    engine_defaults = _defaults(EngineSpec)
    engine_defaults.pop("detectors", None)  # they get their own table
    detector_defaults = _detector_defaults()
    detector_rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for spec in fields(DetectorConfig):
        schema = ENGINE_FIELDS["detectors"].kind.schema["properties"][spec.name]
        detector_rows.append(
            f"| `{spec.name}` | {_kind_text(schema)} | {_cell(detector_defaults.get(spec.name, MISSING))} "
            f"| {DetectorConfig.doc(spec.name)} |"
        )
    per_engine = ", ".join(f"`{n}`" for n in sorted(PER_ENGINE_ONLY))
    return "\n".join(
        [
            "### `supervisor:`",
            "",
            _table(SUPERVISOR_FIELDS, _defaults(SupervisorSettings)),
            "",
            "### `engines:` (each) and `defaults:`",
            "",
            f"`defaults:` takes every key below except {per_engine}.",
            "",
            _table(ENGINE_FIELDS, engine_defaults, required=REQUIRED_ENGINE_FIELDS),
            "",
            "### `detectors:`",
            "",
            "\n".join(detector_rows),
            "",
        ]
    )


DOCS_BEGIN: Final = "<!-- fields: begin (generated: python -m llmsupervisor.config.schema --docs FILE) -->"
DOCS_END: Final = "<!-- fields: end -->"


def update_docs(text: str) -> str:
    """``text`` (docs/configuration.md) with the part between the markers regenerated."""
    start = text.index("\n", text.index(DOCS_BEGIN.split(" (")[0])) + 1
    end = text.index(DOCS_END)
    return text[:start] + fields_markdown() + text[end:]


def main(argv: list[str] | None = None) -> int:
    """``python -m llmsupervisor.config.schema [--docs FILE]``: print the schema, or regenerate
    the field reference inside FILE."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m llmsupervisor.config.schema")
    parser.add_argument("--docs", type=Path, help="rewrite the field reference between the markers in FILE")
    args = parser.parse_args(argv)
    if args.docs is None:
        print(schema_text(), end="")
        return 0
    args.docs.write_text(update_docs(args.docs.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "SCHEMA_FILE",
    "config_schema",
    "fields_markdown",
    "schema_text",
    "shipped_schema_text",
    "update_docs",
]
