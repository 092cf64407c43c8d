"""Where a problem is: YAML nodes to plain data with the line of every node, and the collector
that turns (path, message) into ``ConfigProblem`` rendered as ``PATH:LINE: field: message``.

Everything else in the package reports through ``_Collector.add``; nothing raises on bad
content until ``load_config`` has looked at the whole file.
"""

from __future__ import annotations

import bisect
import re
from pathlib import Path
from typing import Any, Final

import yaml

from llmsupervisor.errors import ConfigError, ConfigProblem

Path_ = tuple[str | int, ...]

# Bounds on what a config file may make the loader do (issue 17: a 400-byte file of nested
# aliases expanded for 140 s while holding the reload lock; 500 nested brackets overflowed the
# stack). A real config is a few KiB, 5 levels deep, a few thousand values; these are far above.
MAX_CONFIG_BYTES: Final = 256 * 1024
MAX_DEPTH: Final = 32  # nested mappings and lists, counting through aliases
MAX_NODES: Final = 50_000  # values in the document once every alias is expanded

# libyaml's parser when PyYAML was built with it (Debian's python3-yaml and the wheels are): the
# pure-Python scanner took 4 s for a 256 KiB file, read twice (shape, then nodes). Its composer
# recurses in C, which is why the shape check, with its depth bound, comes first. Its syntax
# errors are terser ("found character that cannot start any token", the tab not named), so a
# file it refuses is read again by the pure-Python parser for the message.
_FAST_LOADER: Final[Any] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# The line breaks an editor shows: \n, \r\n and a lone \r. YAML 1.1 (PyYAML, libyaml) also
# breaks lines at U+0085, U+2028 and U+2029, so its marks' line numbers run ahead of the editor's
# after one (issue 28: a 3-line file reported at line 4); lines are counted from the marks'
# character index instead.
_EDITOR_BREAK: Final = re.compile(r"\r\n|\r|\n")


def editor_line(breaks: list[int], mark: Any) -> int:
    """The 1-based line an editor shows for a YAML mark, given ``line_breaks(text)``."""
    return bisect.bisect_right(breaks, mark.index) + 1


def line_breaks(text: str) -> list[int]:
    """The index just after each line break an editor shows, ascending."""
    return [m.end() for m in _EDITOR_BREAK.finditer(text)]


class _Lines:
    """Line of every node, keyed by its path in the document (1-based lines, as an editor
    counts them)."""

    def __init__(self) -> None:
        self.by_path: dict[Path_, int] = {}
        self.breaks: list[int] = []

    def at(self, mark: Any) -> int:
        return editor_line(self.breaks, mark)

    def of(self, path: Path_) -> int:
        while path:
            if path in self.by_path:
                return self.by_path[path]
            path = path[:-1]
        return self.by_path.get((), 1)


# A key written as is in a field name; any other (empty, spaces, control characters, dots or
# brackets, quotes) is written quoted in brackets, so the problem still reads FILE:LINE: field:
_PLAIN_KEY: Final = re.compile(r"[^\s.\[\]'\":]+")


def _field_name(path: Path_) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part) and part.isprintable():
            out += ("." if out else "") + part
        else:
            out += f"[{part[:40]!r}]"
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
    """Plain data from a composed node. ``_check_shape`` has already bounded the depth and the
    expanded size of the document, so this recursion and the copies of aliased nodes are small."""
    lines.by_path[path] = lines.at(node.start_mark)
    if isinstance(node, yaml.MappingNode):
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                out.add(path, "keys must be plain strings", line=lines.at(key_node.start_mark))
                continue
            key = key_node.value
            if key in result:
                out.add(path + (key,), "duplicate key", line=lines.at(key_node.start_mark))
                continue
            result[key] = _from_node(value_node, path + (key,), lines, out)
            # A field's problems point at its key, not at the first line of a block value.
            lines.by_path[path + (key,)] = lines.at(key_node.start_mark)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_from_node(item, path + (i,), lines, out) for i, item in enumerate(node.value)]
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node)
    except Exception:  # yaml.YAMLError, ValueError, KeyError, AttributeError, by tag
        # An explicit tag (`!foo x`, `!!int abc`) that cannot be constructed: a problem, not a crash.
        out.add(path, f"cannot read {node.value!r} as {node.tag}", line=lines.at(node.start_mark))
        return node.value
    finally:
        loader.dispose()


def _check_shape(text: str, file: Path, loader: Any) -> ConfigProblem | None:
    """The first problem with the document's shape, read from the event stream (no recursion,
    no expansion): nesting deeper than MAX_DEPTH, an alias inside the node it names (a cycle),
    or more than MAX_NODES values once aliases are expanded. Sizes and depths of anchored nodes
    are kept, so an alias costs what it would expand to without being expanded."""
    # One frame per open collection: [values so far (expanded), deepest child depth, anchor]
    open_frames: list[list[Any]] = [[0, 0, None]]
    breaks = line_breaks(text)
    anchored: dict[str, tuple[int, int]] = {}  # anchor -> (expanded values, depth)

    def problem(event: yaml.Event, message: str) -> ConfigProblem:
        line = editor_line(breaks, event.start_mark) if event.start_mark is not None else 1
        return ConfigProblem(file=str(file), line=line, field="yaml", message=message)

    def add(size: int, depth: int, anchor: str | None) -> None:
        if anchor is not None:
            anchored[anchor] = (size, depth)
        top = open_frames[-1]
        top[0] += size
        top[1] = max(top[1], depth)

    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_frames.append([0, 0, event.anchor])
            if len(open_frames) - 1 > MAX_DEPTH:
                return problem(event, f"nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            size, depth, anchor = open_frames.pop()
            add(size + 1, depth + 1, anchor)
        elif isinstance(event, yaml.ScalarEvent):
            add(1, 0, event.anchor)
        elif isinstance(event, yaml.AliasEvent):
            name = event.anchor or ""
            if any(frame[2] == name for frame in open_frames):
                return problem(event, f"alias *{name} refers to a node that contains it")
            size, depth = anchored.get(name, (1, 0))  # an unknown anchor: compose reports it
            add(size, depth, None)
            if len(open_frames) - 1 + depth > MAX_DEPTH:
                return problem(event, f"nested deeper than {MAX_DEPTH} levels through alias *{name}")
        else:
            continue
        if sum(frame[0] for frame in open_frames) > MAX_NODES:
            return problem(event, f"more than {MAX_NODES} values once aliases are expanded")
    return None


def _shape_and_nodes(text: str, file: Path, loader: Any) -> tuple[ConfigProblem | None, yaml.Node | None]:
    """(the shape's problem, None) or (None, the composed document; None when it is empty)."""
    problem = _check_shape(text, file, loader)
    if problem is not None:
        return problem, None
    return None, yaml.compose(text, Loader=loader)


def _parse(file: Path) -> tuple[Any, _Collector]:
    """The document as plain data (``{}`` when empty) and the collector holding its lines and
    the problems found so far; raise ``ConfigError`` when the file cannot be read as YAML, is
    larger than MAX_CONFIG_BYTES, or is shaped beyond MAX_DEPTH or MAX_NODES."""
    lines = _Lines()
    out = _Collector(file, lines)
    try:
        with file.open("rb") as stream:
            data = stream.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            out.add((), f"the file is larger than {MAX_CONFIG_BYTES} bytes", line=1)
            raise ConfigError(out.problems)
        text = data.decode("utf-8")
        lines.breaks = line_breaks(text)
    except OSError as exc:
        out.add((), f"cannot read config file: {exc.strerror or exc}", line=1)
        raise ConfigError(out.problems) from None
    except UnicodeDecodeError as exc:
        out.add((), f"not UTF-8 text: {exc.reason}", line=1)
        raise ConfigError(out.problems) from None
    try:
        try:
            shape_problem, root_node = _shape_and_nodes(text, file, _FAST_LOADER)
        except yaml.YAMLError:
            if _FAST_LOADER is yaml.SafeLoader:
                raise
            shape_problem, root_node = _shape_and_nodes(text, file, yaml.SafeLoader)
        if shape_problem is not None:
            out.problems.append(shape_problem)
            raise ConfigError(out.problems)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = lines.at(mark) if mark is not None else 1
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
