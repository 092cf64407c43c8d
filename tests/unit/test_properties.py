"""Property tests (Hypothesis): the config loader and the vLLM metrics parser on inputs nobody
wrote by hand.

- any YAML document, any mutation of the example config (of its data or of its text), any text
  and any bytes either load into a config holding only finite numbers, or raise ``ConfigError``
  whose every problem reads ``FILE:LINE: field: message``; never another exception, never a
  loader bug turned into a problem (``INTERNAL_PROBLEM``), never slow (the profile's deadline);
- any text body gives ``EngineMetrics`` with only finite numbers, or a ``ProbeFailure``.

Hypothesis shrinks a failure to a small input and replays it from its database (.hypothesis/)
on the next run. The run is bounded for CI by the profile: ``ci`` (the default) is derandomized
(the same examples every run, so CI does not flake on a new one) with a deadline per example
and a count of examples per test; ``HYPOTHESIS_PROFILE=long`` explores more, with new random
examples, for a local hunt. bench/fuzz_config.py is the fuzzer that produced issue 17's figures.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsupervisor.config import ENGINE_FIELDS, SUPERVISOR_FIELDS, TOP_LEVEL, SupervisorConfig, load_config
from llmsupervisor.config.load import INTERNAL_PROBLEM
from llmsupervisor.detectors import DetectorConfig
from llmsupervisor.errors import ConfigError
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.vllm_metrics import ALIASES, EngineMetrics, parse_metrics
from tests.lib.paths import REPO

pytestmark = pytest.mark.property

settings.register_profile(
    "ci",
    max_examples=400,
    # A load of the example takes ~15 ms; a hang or an expansion takes seconds. Generous, so a
    # busy 2-core CI machine does not fail on noise.
    deadline=timedelta(seconds=2),
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "long",
    max_examples=5000,
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

EXAMPLE_TEXT = (REPO / "etc" / "llm-supervisor" / "config.yaml").read_text()
EXAMPLE_DATA = yaml.safe_load(EXAMPLE_TEXT)


@pytest.fixture(scope="module")
def config_file() -> Iterator[Path]:
    # Module-scoped: Hypothesis runs many examples in one test call, and tmp_path would be
    # shared by all of them anyway.
    with tempfile.TemporaryDirectory(prefix="llmsup-prop-") as directory:
        yield Path(directory) / "config.yaml"


# ---- strategies --------------------------------------------------------------------------------

KNOWN_KEYS = sorted(
    {*TOP_LEVEL, *ENGINE_FIELDS, *SUPERVISOR_FIELDS, *(f.name for f in dataclasses.fields(DetectorConfig))}
)
TRICKY_STRINGS = [
    "~nosuchuser/m",
    "~",
    "~/m",
    "127.0.0.1:²",
    "127.0.0.1:٣",
    ":",
    "[::1]:9400",
    "python3 'unclosed",
    'a "b',
    "a\\",
    "a\0b",
    "A=B",
    "02:00-05:00",
    "25:00-26:00",
    "\u0660\u0662:\u0660\u0660-\u0660\u0665:\u0660\u0660"  # Arabic-Indic digits,
    "",
    " ",
    "/",
    "./m",
    "../../../etc",
    "org/m",
    "-1",
    "1e400",
    ".nan",
    "0x10",
]
# Raw YAML put into the text: what a hand-written (or fuzzed) file holds that safe_dump never writes.
YAML_TOKENS = [
    ".nan",
    ".inf",
    "-.inf",
    ".NaN",
    "9" * 400,
    "&a [*a]",
    "&b {x: *b}",
    "*undefined",
    "&c",
    "*c",
    "<<: *c",
    "[" * 60 + "]" * 60,
    "{a: " * 40 + "1" + "}" * 40,
    "!!python/object:os.system",
    "!!int abc",
    "!!float x",
    "!!binary ===",
    "!!timestamp 2001-13-45",
    "!custom x",
    "? complex",
    "%YAML 1.1",
    "---",
    "...",
    "|",
    ">-",
    "'",
    '"',
    "\t",
    "- ",
    ": ",
    "#",
    "~",
    "null",
    "yes",
    "0o777",
    "0b101",
    "1_000",
    "12:30:00",
    "2001-12-14",
    "\ufeff",
    "\x85",
    "\u2028",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**500), max_value=10**500),
    st.floats(),  # NaN and infinities included
    st.text(max_size=20),
    st.sampled_from(TRICKY_STRINGS),
)
keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=12))
values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=5)),
    max_leaves=25,
)


def _paths(data: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _paths(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _paths(value, (*path, i))


EXAMPLE_PATHS = list(_paths(EXAMPLE_DATA))


def _mutate(data: Any, path: tuple[Any, ...], op: str, value: Any, key: str) -> Any:
    """A copy of ``data`` with the node at ``path`` replaced, removed, or given a new key."""
    if not path:
        return value if op == "replace" else data
    copy: Any = dict(data) if isinstance(data, dict) else list(data)
    head, rest = path[0], path[1:]
    if rest:
        copy[head] = _mutate(copy[head], rest, op, value, key)
    elif op == "replace":
        copy[head] = value
    elif op == "delete":
        del copy[head]
    elif isinstance(copy[head], dict):
        copy[head] = {**copy[head], key: value}
    elif isinstance(copy[head], list):
        copy[head] = [*copy[head], value]
    else:
        copy[head] = value
    return copy


@st.composite
def data_mutations(draw: st.DrawFn) -> str:
    data = EXAMPLE_DATA
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        paths = list(_paths(data))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "delete", "add"]))
        data = _mutate(data, path, op, draw(values), draw(keys))
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=draw(st.booleans()))


@st.composite
def text_mutations(draw: st.DrawFn) -> str:
    lines = EXAMPLE_TEXT.splitlines(keepends=True)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        i = draw(st.integers(min_value=0, max_value=len(lines) - 1))
        op = draw(st.sampled_from(["token", "token", "value", "delete", "duplicate", "truncate", "indent"]))
        line = lines[i]
        if op in ("token", "value"):
            cut = draw(st.integers(min_value=0, max_value=len(line)))
            if op == "value" and ": " in line:
                cut = line.index(": ") + 2
                line = line[:cut] + "\n"
            token = draw(st.sampled_from(YAML_TOKENS))
            lines[i] = line[:cut] + token + line[cut:]
        elif op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, line)
        elif op == "truncate":
            lines = lines[:i]
        else:
            lines[i] = " " * draw(st.integers(min_value=0, max_value=9)) + line.lstrip(" ")
        if not lines:
            break
    return "".join(lines)


# ---- the config loader -------------------------------------------------------------------------

PROBLEM = re.compile(r"(?P<file>.+):(?P<line>[1-9][0-9]*): (?P<field>\S.*?): (?P<message>.+)", re.DOTALL)


def _nonfinite_in(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_nonfinite_in(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, dict) or hasattr(value, "items"):
        return any(_nonfinite_in(v) for v in value.values())
    if isinstance(value, list | tuple | frozenset | set):
        return any(_nonfinite_in(v) for v in value)
    return False


def check_loads_or_rejects(path: Path) -> SupervisorConfig | None:
    """The property: a config of finite numbers, or a ConfigError of FILE:LINE problems."""
    try:
        config = load_config(path, check_paths=False)
    except ConfigError as exc:
        assert exc.problems
        for problem in exc.problems:
            text = str(problem)
            match = PROBLEM.fullmatch(text)
            assert match is not None, text
            assert match["file"] == str(path), text
            assert INTERNAL_PROBLEM not in text, text
        return None
    assert not _nonfinite_in(config.supervisor), config.supervisor
    for engine in config.engines:
        assert not _nonfinite_in(engine), engine
        assert all("\0" not in part for part in engine.argv())
    return config


@given(document=values)
def test_any_yaml_document(config_file: Path, document: Any) -> None:
    config_file.write_text(yaml.safe_dump(document), encoding="utf-8")
    check_loads_or_rejects(config_file)


@given(text=data_mutations())
def test_any_mutation_of_the_example_data(config_file: Path, text: str) -> None:
    config_file.write_text(text, encoding="utf-8")
    check_loads_or_rejects(config_file)


@given(text=text_mutations())
def test_any_mutation_of_the_example_text(config_file: Path, text: str) -> None:
    config_file.write_text(text, encoding="utf-8")
    check_loads_or_rejects(config_file)


@given(
    raw=st.one_of(st.binary(max_size=400), st.text(max_size=400).map(lambda t: t.encode("utf-8", "replace")))
)
def test_any_bytes(config_file: Path, raw: bytes) -> None:
    config_file.write_bytes(raw)
    check_loads_or_rejects(config_file)


def test_the_example_itself_loads(config_file: Path) -> None:
    config_file.write_text(EXAMPLE_TEXT)
    assert check_loads_or_rejects(config_file) is not None


# ---- the vLLM metrics parser -------------------------------------------------------------------

METRIC_NAMES = sorted(
    {
        name + suffix
        for names in ALIASES.values()
        for name in names
        for suffix in ("", "_bucket", "_sum", "_count")
    }
)
metric_values = st.one_of(
    st.floats().map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "0x1", "1_0", "", "abc", "1 2 3"]),
)
label_values = st.one_of(st.text(max_size=8), st.sampled_from(["+Inf", "NaN", "0.1", "stop", "awake", "-1"]))
label_names = st.sampled_from(["engine", "le", "finished_reason", "sleep_state", "model_name", "x"])


@st.composite
def metric_lines(draw: st.DrawFn) -> str:
    name = draw(st.one_of(st.sampled_from(METRIC_NAMES), st.text(max_size=15)))
    labels = draw(st.dictionaries(label_names, label_values, max_size=3))
    rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
    braces: bool = draw(st.booleans())
    key = f"{name}{{{rendered}}}" if labels or braces else name
    line = f"{key} {draw(metric_values)}"
    if draw(st.booleans()):
        line += f" {draw(metric_values)}"
    return line


bodies = st.one_of(
    st.text(max_size=300),
    st.lists(
        st.one_of(metric_lines(), st.sampled_from(["# HELP x y", "# TYPE vllm:x counter", "", "{", "}"])),
        max_size=40,
    ).map("\n".join),
)


def _check_metrics(result: EngineMetrics | ProbeFailure) -> None:
    assert isinstance(result, EngineMetrics | ProbeFailure)
    if isinstance(result, ProbeFailure):
        assert result.kind == "parse"
        return
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        if isinstance(value, float):
            assert math.isfinite(value), (field.name, value)
    for histogram in (result.ttft_seconds, result.e2e_latency_seconds, result.itl_seconds):
        if histogram is not None:
            assert math.isfinite(histogram.sum)
            assert list(histogram.les) == sorted(histogram.les)
            for q in (0.0, 0.5, 0.95, 1.0):
                quantile = histogram.quantile(q)
                assert quantile is None or not math.isnan(quantile)


@given(body=bodies)
def test_any_metrics_body(body: str) -> None:
    _check_metrics(parse_metrics(body))


# Well-formed lines of the families read, with any number as the value: absurd numbers (1e30,
# +Inf and -Inf on two engines of one counter, 1e308 twice) drop their series, never the scrape.
absurd_numbers = st.one_of(
    st.floats().map(repr),
    st.sampled_from(["1e30", "-1e30", "1e308", "+Inf", "-Inf", "NaN", "9223372036854775808", "0", "1"]),
)
safe_label_values = st.one_of(
    st.sampled_from(["+Inf", "-Inf", "NaN", "0.1", "1", "stop", "awake", "0", "1e30"]),
    st.floats(allow_nan=False).map(repr),
)


@st.composite
def well_formed_lines(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(METRIC_NAMES))
    labels = draw(st.dictionaries(label_names, safe_label_values, max_size=3))
    rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{rendered}}} {draw(absurd_numbers)}" if labels else f"{name} {draw(absurd_numbers)}"


@given(lines=st.lists(well_formed_lines(), max_size=40))
def test_a_well_formed_body_with_absurd_numbers_is_never_a_parse_failure(lines: list[str]) -> None:
    result = parse_metrics("\n".join(lines) + "\nvllm:num_requests_running 3\n")
    assert isinstance(result, EngineMetrics), (result, lines)
    _check_metrics(result)
