#!/usr/bin/env python3
"""Fuzz the config loader for a bounded time and count what happens, by class.

Every input is a mutation of the shipped example config (etc/llm-supervisor/config.yaml): of
its data (a value replaced by a tricky one, a key removed or added, then dumped as YAML), of
its text (a YAML token put into a line, a line deleted, doubled, re-indented, the file cut
short), or a generated attack (nesting, alias cycles, alias expansion, huge numbers). Each one
is loaded with ``load_config(check_paths=False)`` under a per-input time limit and sorted into:

- ``rejected``: ConfigError, every problem ``FILE:LINE: field: message`` (what must happen to a
  bad file);
- ``accepted``: a SupervisorConfig holding only finite numbers;
- ``accepted_nonfinite``: a SupervisorConfig holding a NaN or an infinity (a failure);
- ``bad_problem``: ConfigError with a problem not in that shape, or a loader bug turned into a
  problem (INTERNAL_PROBLEM) (a failure);
- ``exception:TYPE``: any other exception (a failure);
- ``slow``: still running after the time limit (a failure).

Usage::

    python bench/fuzz_config.py --seconds 120 [--inputs N] [--seed 1] [--limit-s 5] [--json OUT] [--keep DIR]

The inputs depend only on the seed, so ``--inputs N --seed S`` tries the same N inputs on any
version of the loader (the before/after figures in docs/reliability.md).

Prints a Markdown table for docs/reliability.md; ``--keep`` writes one input per failure class.
Run it under the heavy lock (``flock /tmp/llmsup-heavy.lock``): it keeps one core busy.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import json
import math
import random
import re
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmsupervisor.config import ENGINE_FIELDS, SUPERVISOR_FIELDS, TOP_LEVEL, load_config  # noqa: E402
from llmsupervisor.errors import ConfigError  # noqa: E402

# Absent from the loader before issue 17, which this script also measures (the "before" figures).
INTERNAL_PROBLEM: str = getattr(
    importlib.import_module("llmsupervisor.config.load"), "INTERNAL_PROBLEM", "\0"
)

EXAMPLE = REPO / "etc" / "llm-supervisor" / "config.yaml"
PROBLEM = re.compile(r".+:[1-9][0-9]*: \S.*?: .+", re.DOTALL)

TRICKY_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    2**63,
    10**400,
    -(10**400),
    0.0,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    " ",
    "x" * 300,
    "~nosuchuser/m",
    "~",
    "127.0.0.1:²",
    "127.0.0.1:٣",
    "python3 'unclosed",
    "a\0b",
    "A=B",
    "25:00-26:00",
    "\u0660\u0662:\u0660\u0660-\u0660\u0665:\u0660\u0660"  # Arabic-Indic digits,
    "02:00-02:00",
    "../../..",
    "org/m",
    [],
    {},
    [None],
    {"": None},
    {"\r": 1},
    [[[[[[]]]]]],
]
YAML_TOKENS = [
    ".nan",
    ".inf",
    "-.inf",
    "9" * 400,
    "&a [*a]",
    "&b {x: *b}",
    "*undefined",
    "&c",
    "*c",
    "<<: *c",
    "!!python/object:os.system",
    "!!int abc",
    "!!float x",
    "!!binary ===",
    "!!timestamp 2001-13-45",
    "!custom x",
    "? ",
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
    "0o777",
    "1_000",
    "12:30:00",
    "\ufeff",
    "\x85",
    "\u2028",
    "\0",
    "²",
]
KNOWN_KEYS = sorted({*TOP_LEVEL, *ENGINE_FIELDS, *SUPERVISOR_FIELDS})


class Slow(BaseException):  # BaseException: the loader's own `except Exception` must not eat it
    pass


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise Slow


def _paths(data: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += _paths(value, (*path, i))
    return found


def _set(data: Any, path: tuple[Any, ...], op: str, value: Any, key: str) -> Any:
    if not path:
        return value if op == "replace" else data
    copy: Any = dict(data) if isinstance(data, dict) else list(data)
    head, rest = path[0], path[1:]
    if rest:
        copy[head] = _set(copy[head], rest, op, value, key)
    elif op == "replace":
        copy[head] = value
    elif op == "delete":
        del copy[head]
    elif isinstance(copy[head], dict):
        copy[head] = {**copy[head], key: value}
    elif isinstance(copy[head], list):
        copy[head] = [*copy[head], value]
    return copy


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.6 or depth > 2:
        return rng.choice(TRICKY_VALUES)
    if roll < 0.8:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KNOWN_KEYS): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def data_mutation(rng: random.Random, data: Any) -> str:
    for _ in range(rng.randint(1, 4)):
        path = rng.choice(_paths(data))
        op = rng.choice(["replace", "replace", "delete", "add"])
        data = _set(data, path, op, _random_value(rng), rng.choice(KNOWN_KEYS + ["", "x y", "a.b"]))
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=rng.random() < 0.5)


def text_mutation(rng: random.Random, text: str) -> str:
    lines = text.splitlines(keepends=True)
    for _ in range(rng.randint(1, 4)):
        if not lines:
            break
        i = rng.randrange(len(lines))
        line = lines[i]
        op = rng.choice(["token", "token", "value", "value", "delete", "duplicate", "truncate", "indent"])
        if op == "token":
            cut = rng.randint(0, len(line))
            lines[i] = line[:cut] + rng.choice(YAML_TOKENS) + line[cut:]
        elif op == "value" and ": " in line:
            lines[i] = line[: line.index(": ") + 2] + rng.choice(YAML_TOKENS) + "\n"
        elif op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, line)
        elif op == "truncate":
            lines = lines[:i] + [line[: rng.randint(0, len(line))]]
        else:
            lines[i] = " " * rng.randint(0, 9) + line.lstrip(" ")
    return "".join(lines)


def attack(rng: random.Random) -> str:
    kind = rng.choice(["nest", "laughs", "cycle", "bignum", "nonfinite"])
    if kind == "nest":
        depth = rng.choice([40, 100, 500, 3000])
        opening, closing = rng.choice([("[", "]"), ("{a: ", "}")])
        return "engines: " + opening * depth + "1" + closing * depth + "\n"
    if kind == "laughs":
        width, levels = rng.randint(2, 10), rng.randint(3, 9)
        out = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
        for n in range(1, levels):
            out.append(f"l{n}: &l{n} [" + ", ".join([f"*l{n - 1}"] * width) + "]")
        return "\n".join(out) + "\n"
    if kind == "cycle":
        return rng.choice(["a: &a [*a]\n", "a: &a {b: *a}\n", "engines:\n  - &e\n    name: a\n    x: [*e]\n"])
    example = EXAMPLE.read_text()
    number = rng.choice(["9" * rng.randint(20, 5000), "-" + "9" * 400, "1e400"])
    if kind == "nonfinite":
        number = rng.choice([".nan", ".inf", "-.inf", ".NaN", ".Inf"])
    lines = example.splitlines(keepends=True)
    numeric = [i for i, line in enumerate(lines) if re.search(r": [0-9.]+\s*(#.*)?$", line)]
    i = rng.choice(numeric)
    lines[i] = lines[i][: lines[i].index(": ") + 2] + number + "\n"
    return "".join(lines)


def _nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_nonfinite(getattr(value, f.name)) for f in dataclasses.fields(value))
    if hasattr(value, "items"):
        return any(_nonfinite(v) for v in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(_nonfinite(v) for v in value)
    return False


def classify(path: Path, limit_s: float) -> str:
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        config = load_config(path, check_paths=False)
    except Slow:
        return "slow"
    except ConfigError as exc:
        texts = [str(p) for p in exc.problems]
        if not texts or any(not PROBLEM.fullmatch(t) or INTERNAL_PROBLEM in t for t in texts):
            return "bad_problem"
        return "rejected"
    except RecursionError:
        return "exception:RecursionError"
    except Exception as exc:
        return f"exception:{type(exc).__name__}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if _nonfinite(config.supervisor) or any(_nonfinite(e) for e in config.engines):
        return "accepted_nonfinite"
    return "accepted"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="total time to fuzz")
    parser.add_argument("--inputs", type=int, help="stop after this many inputs (the same ones for a seed)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--limit-s", type=float, default=5.0, help="time limit per input")
    parser.add_argument("--json", type=Path, help="write the counts as JSON here")
    parser.add_argument("--keep", type=Path, help="write one input per failure class here")
    args = parser.parse_args()

    # A loader that expands aliases without bound would take the machine's memory with it.
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    signal.signal(signal.SIGALRM, _on_alarm)
    rng = random.Random(args.seed)
    text = EXAMPLE.read_text()
    data = yaml.safe_load(text)
    counts: collections.Counter[str] = collections.Counter()
    by_source: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    examples: dict[str, str] = {}
    started = time.monotonic()
    slowest_s = 0.0
    with tempfile.TemporaryDirectory(prefix="llmsup-fuzz-") as directory:
        path = Path(directory) / "config.yaml"
        while time.monotonic() - started < args.seconds and (
            args.inputs is None or counts.total() < args.inputs
        ):
            source = rng.choices(["data", "text", "attack"], weights=[45, 45, 10])[0]
            candidate = (
                data_mutation(rng, data)
                if source == "data"
                else text_mutation(rng, text)
                if source == "text"
                else attack(rng)
            )
            path.write_text(candidate, encoding="utf-8", errors="surrogatepass")
            begun = time.monotonic()
            outcome = classify(path, args.limit_s)
            slowest_s = max(slowest_s, time.monotonic() - begun)
            counts[outcome] += 1
            by_source[source][outcome] += 1
            if outcome not in ("rejected", "accepted"):
                examples.setdefault(outcome, candidate)
    elapsed_s = time.monotonic() - started
    total = sum(counts.values())
    failures = {k: v for k, v in counts.items() if k not in ("rejected", "accepted")}
    print(f"{total} inputs in {elapsed_s:.0f} s (seed {args.seed}, limit {args.limit_s:g} s per input)")
    print(f"slowest input: {slowest_s:.2f} s\n")
    print("| outcome | inputs | data | text | attack |")
    print("|---|---:|---:|---:|---:|")
    for outcome, n in counts.most_common():
        cells = " | ".join(str(by_source[s][outcome]) for s in ("data", "text", "attack"))
        print(f"| {outcome} | {n} | {cells} |")
    print(f"\nfailures: {sum(failures.values())}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "inputs": total,
                    "seconds": round(elapsed_s, 1),
                    "seed": args.seed,
                    "limit_s": args.limit_s,
                    "slowest_s": round(slowest_s, 2),
                    "outcomes": dict(counts),
                    "by_source": {k: dict(v) for k, v in by_source.items()},
                },
                indent=2,
            )
            + "\n"
        )
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        for outcome, candidate in examples.items():
            (args.keep / f"{outcome.replace(':', '-')}.yaml").write_text(
                candidate, encoding="utf-8", errors="surrogatepass"
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
