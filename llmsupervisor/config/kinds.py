"""Value kinds: one ``Kind`` per kind of value, a check taking (value, path, collector) and
returning the checked value or ``_MISSING`` after reporting why, made together with the JSON
Schema of the values it accepts by one factory from the same bounds; ``Field`` pairs a kind with
its one-line meaning. The generic kinds are here (numbers, strings, booleans) and the section
check that runs a table of fields; ``values.py`` has the domain kinds, ``fields.py`` the tables.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from llmsupervisor.config.problems import Path_, _Collector

# Field.default when the dataclass's default is the one to show.
NO_DEFAULT: Final = object()

_Check = Callable[[Any, Path_, _Collector], Any]
JsonSchema = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Kind:
    """A check and the JSON Schema of the values it accepts, built by one factory from the same
    bounds. The schema may be looser than the check where JSON Schema cannot say it (ladder
    steps that must go down), never stricter except where noted at the factory."""

    check: _Check
    schema: JsonSchema

    def __call__(self, value: Any, path: Path_, out: _Collector) -> Any:
        return self.check(value, path, out)


@dataclass(frozen=True, slots=True)
class Field:
    """One key of a section: what it accepts, and what it means (for the schema and the docs).
    ``default`` is the default the schema and the docs show, where the file's default is not the
    dataclass's (``launcher``: the spec holds what ``auto`` chose); unset, the dataclass's."""

    kind: Kind
    doc: str
    default: Any = NO_DEFAULT

    def __call__(self, value: Any, path: Path_, out: _Collector) -> Any:
        return self.kind.check(value, path, out)


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "mapping",
    }.get(type(value), type(value).__name__)


_MISSING: Final = object()

# The largest magnitude any number in the file may have: 1e12 seconds is 30,000 years, and a
# bigger value only overflows later (time.sleep, float(), a thread's wait) in the running daemon.
MAX_MAGNITUDE: Final = 1e12


def _nonfinite(value: Any) -> bool:
    """A NaN or an infinity anywhere in ``value`` (a scalar, list or mapping). NaN passes every
    ``<``/``>`` range check, so it must be refused by name."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list | tuple):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_nonfinite(v) for v in value.values())
    return False


def _has_nul(value: Any) -> bool:
    """A NUL character anywhere in ``value``: no argv, environment or path can carry one."""
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


def _number(
    *,
    lo: float | None = None,
    hi: float | None = None,
    integer: bool = False,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Kind:
    """A number within [lo, hi] (open ends where asked), and never beyond +-MAX_MAGNITUDE. The
    schema says the same bounds, the magnitude included, so an editor flags what check-config
    refuses. An integer may be written 8000.0: JSON Schema's "integer" takes it too."""
    low = -MAX_MAGNITUDE if lo is None else lo
    high = MAX_MAGNITUDE if hi is None else min(hi, MAX_MAGNITUDE)
    low_open = lo_open and lo is not None
    high_open = hi_open and hi is not None
    schema: dict[str, Any] = {"type": "integer" if integer else "number"}
    schema["exclusiveMinimum" if low_open else "minimum"] = int(low) if integer else low
    schema["exclusiveMaximum" if high_open else "maximum"] = int(high) if integer else high

    def check(value: Any, path: Path_, out: _Collector) -> Any:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (integer and isinstance(value, float) and not value.is_integer())
        ):
            out.add(
                path, f"must be {'an integer' if integer else 'a number'}, got {_type_name(value)} {value!r}"
            )
            return _MISSING
        if _nonfinite(value):
            out.add(path, f"must be a finite number, got {value!r}")
            return _MISSING
        # Compared as given: an int and a float compare exactly, float() of 400 digits overflows.
        if value <= low if low_open else value < low:
            out.add(path, f"must be {'>' if low_open else '>='} {low:g}, got {_short(value)}")
            return _MISSING
        if value >= high if high_open else value > high:
            out.add(path, f"must be {'<' if high_open else '<='} {high:g}, got {_short(value)}")
            return _MISSING
        return int(value) if integer else float(value)

    return Kind(check, schema)


def _short(value: Any) -> str:
    """``repr`` of a number, cut short: a 400-digit number in a message helps nobody."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def _any_case(word: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in word)


def _string(*, choices: tuple[str, ...] = (), nonempty: bool = True) -> Kind:
    schema: dict[str, Any] = {"type": "string"}
    if choices:  # the check lower-cases the value first
        schema["pattern"] = f"^({'|'.join(_any_case(c) for c in choices)})$"
    elif nonempty:
        schema["pattern"] = "\\S"  # not empty, not only blanks

    def check(value: Any, path: Path_, out: _Collector) -> Any:
        if not isinstance(value, str):
            out.add(path, f"must be a string, got {_type_name(value)} {value!r}")
            return _MISSING
        if _has_nul(value):
            out.add(path, "must not contain a NUL character")
            return _MISSING
        if nonempty and not value.strip():
            out.add(path, "must not be empty")
            return _MISSING
        if choices and value.lower() not in choices:
            out.add(path, f"must be one of {', '.join(choices)}, got {value!r}")
            return _MISSING
        return value.lower() if choices else value

    return Kind(check, schema)


def _check_boolean(value: Any, path: Path_, out: _Collector) -> Any:
    if not isinstance(value, bool):
        out.add(path, f"must be true or false, got {_type_name(value)} {value!r}")
        return _MISSING
    return value


_boolean: Final = Kind(_check_boolean, {"type": "boolean"})


def _check_section(
    raw: Any, path: Path_, fields: Mapping[str, Field], out: _Collector, *, what: str
) -> dict[str, Any] | None:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        out.add(path, f"must be a mapping ({what}), got {_type_name(raw)}")
        return None
    result: dict[str, Any] = {}
    for key, value in raw.items():
        check = fields.get(key)
        if check is None:
            out.add(path + (key,), f"unknown key{_suggest(key, list(fields))}")
            continue
        checked = check(value, path + (key,), out)
        if checked is not _MISSING:
            result[key] = checked
    return result
