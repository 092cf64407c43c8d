"""Where a problem is: YAML nodes to plain data with the line of every node, and the collector
that turns (path, message) into ``ConfigProblem`` rendered as ``PATH:LINE: field: message``.

Everything else in the package reports through ``_Collector.add``; nothing raises on bad
content until ``load_config`` has looked at the whole file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from llmsupervisor.errors import ConfigError, ConfigProblem

Path_ = tuple[str | int, ...]


class _Lines:
    """Line of every node, keyed by its path in the document (1-based lines)."""

    def __init__(self) -> None:
        self.by_path: dict[Path_, int] = {}

    def of(self, path: Path_) -> int:
        while path:
            if path in self.by_path:
                return self.by_path[path]
            path = path[:-1]
        return self.by_path.get((), 1)


def _field_name(path: Path_) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


class _Collector:
    def __init__(self, file: Path, lines: _Lines) -> None:
        self.file = file
        self.lines = lines
        self.problems: list[ConfigProblem] = []
        self.warnings: list[ConfigProblem] = []  # valid, but probably not what was meant

    def add(self, path: Path_, message: str, *, line: int | None = None) -> None:
        self.problems.append(self._at(path, message, line))

    def warn(self, path: Path_, message: str) -> None:
        self.warnings.append(self._at(path, message, None))

    def _at(self, path: Path_, message: str, line: int | None) -> ConfigProblem:
        return ConfigProblem(
            file=str(self.file),
            line=line if line is not None else self.lines.of(path),
            field=_field_name(path),
            message=message,
        )


def _from_node(node: yaml.Node, path: Path_, lines: _Lines, out: _Collector) -> Any:
    lines.by_path[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                out.add(path, "keys must be plain strings", line=key_node.start_mark.line + 1)
                continue
            key = key_node.value
            if key in result:
                out.add(path + (key,), "duplicate key", line=key_node.start_mark.line + 1)
                continue
            result[key] = _from_node(value_node, path + (key,), lines, out)
            # A field's problems point at its key, not at the first line of a block value.
            lines.by_path[path + (key,)] = key_node.start_mark.line + 1
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_from_node(item, path + (i,), lines, out) for i, item in enumerate(node.value)]
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node)
    except Exception:  # yaml.YAMLError, ValueError, KeyError, AttributeError, by tag
        # An explicit tag (`!foo x`, `!!int abc`) that cannot be constructed: a problem, not a crash.
        out.add(path, f"cannot read {node.value!r} as {node.tag}", line=node.start_mark.line + 1)
        return node.value
    finally:
        loader.dispose()


def _parse(file: Path) -> tuple[Any, _Collector]:
    """The document as plain data (``{}`` when empty) and the collector holding its lines and
    the problems found so far; raise ``ConfigError`` when the file cannot be read as YAML."""
    lines = _Lines()
    out = _Collector(file, lines)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        out.add((), f"cannot read config file: {exc.strerror or exc}", line=1)
        raise ConfigError(out.problems) from None
    except UnicodeDecodeError as exc:
        out.add((), f"not UTF-8 text: {exc.reason}", line=1)
        raise ConfigError(out.problems) from None
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        message = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        out.problems.append(
            ConfigProblem(file=str(file), line=line, field="yaml", message=f"syntax error: {message}")
        )
        raise ConfigError(out.problems) from None
    except yaml.YAMLError as exc:
        out.add((), f"YAML error: {exc}", line=1)
        raise ConfigError(out.problems) from None
    raw: Any = {} if root_node is None else _from_node(root_node, (), lines, out)
    return raw, out
