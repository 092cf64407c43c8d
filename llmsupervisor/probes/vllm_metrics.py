"""vLLM's ``/metrics`` read into one frozen ``EngineMetrics``, whatever the vLLM version.

vLLM renames families between releases (docs/vllm-notes.md §3.3), so every field is looked up through
``ALIASES``: each row is the 0.32 name first, then the older names, and the first one present
wins. Rules that follow from how vLLM exposes them (docs/vllm-notes.md §3.1):

- every engine metric carries ``engine`` (the DP index; V0 had none): series are summed over it,
  and over any other label except the one a field groups by (``finished_reason``, ``le``). The
  KV usage ratio is the exception: it is the busiest engine's (a maximum, not a sum);
- counters are read by their exposed ``*_total`` name, and ``*_created`` samples are ignored;
- an absent gauge is ``None`` (unknown), never 0: in multi-API-server mode gauges are missing
  until the first request, and ``--disable-log-stats`` removes every ``vllm:`` family. The one
  exception is V0's ``num_requests_swapped``, which later versions dropped because nothing swaps;
- a garbage body is a ``ProbeFailure(kind="parse")``, not an exception; so is a body over
  ``max_body_bytes`` (read as a stream and abandoned at the cap) and one with more than
  ``MAX_SERIES`` samples of the families read (a label that takes a new value on every scrape);
- one absurd histogram (a missing, non-numeric or NaN ``le``, a negative or non-finite count,
  a count past ``MAX_COUNT``, counts that go down as ``le`` goes up, more than ``MAX_BUCKETS``
  bounds) is dropped (``None``), and so is a counter or gauge whose sum is not a finite number
  (``+Inf`` and ``-Inf`` on two engines) or a count past ``MAX_COUNT``; the rest of the scrape is
  kept (before issue 28 a bucket count of 1e30 failed the whole parse), and each drop is logged at
  most once a minute per family. ``finished_reason`` keeps ``MAX_LABEL_VALUES`` values, the
  rest summed under ``"other"``. Every observation window holds ~1,200 scrapes per engine: before
  these caps a hostile body could make one engine's window 812 MB (issue 17).

A body that could be slow to parse is parsed in a thread of its own (``_PARSE_POOL``) under the
same overall deadline as the request: a 50 MB body once took 29 s to parse on the event loop,
which then stood still. A parse past its deadline goes on in its thread, and the next scrape of
that engine is a timeout until it ends, so a hostile engine holds one thread at most. What makes
a parse slow is a large body or series keys not seen before (below); a body of at most
``INLINE_PARSE_MAX_BYTES`` whose keys were all seen before, every scrape of a running vLLM after
its first, is parsed on the loop (``parse_familiar``, 0.18 ms at 50 kB), which gives up for the
thread at the ``INLINE_NEW_KEYS_MAX``-th new key: the hop to the thread and back cost more than
the parse.

prometheus_client's parser reads label values one character at a time: vLLM 0.32's body is ~600
lines, of which this module reads ~90, and parsing all of them was 10 ms a scrape, most of the
daemon's CPU (bench/overhead, docs/benchmarks.md). So each line is split at its value, and only
the series key before it (name and labels) of a name in ``ALIASES`` goes through the parser, once:
what it made of the key is kept, and later scrapes only read the number. Every other line gets a
check of its shape, so a body that is not the text format (an HTML error page, JSON) is still a
parse failure.

::

    GET /metrics ──► line: key | value ──► _KEYS (key seen before) ──► {sample name: [(labels, value)]}
                            │ new key               ▲                         │ ALIASES (first present)
                            ▼                       │                         ▼
                  text_string_to_metric_families ───┘           EngineMetrics (present = rows found)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import re
import sys
import threading
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.probe_http import ProbeHttp, ProbeHttpError, TooLarge

log = logging.getLogger(__name__)

SleepState = Literal["awake", "weights_offloaded", "discard_all"]

# Canonical (0.32) name -> every exposed name, newest first. Scalar rows name exposed samples;
# histogram rows name the base, read as base + _bucket / _sum / _count.
ALIASES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "vllm:num_requests_running": ("vllm:num_requests_running",),
        "vllm:num_requests_waiting": ("vllm:num_requests_waiting",),
        # V0 only (<= 0.10); V1 never swaps, so absent reads as 0.
        "vllm:num_requests_swapped": ("vllm:num_requests_swapped",),
        # A 0-1 fraction under both names despite "perc"; both emitted 0.9.2-0.10, old removed 0.12.
        "vllm:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "vllm:num_preemptions_total": ("vllm:num_preemptions_total",),
        "vllm:prompt_tokens_total": ("vllm:prompt_tokens_total",),
        "vllm:generation_tokens_total": ("vllm:generation_tokens_total",),
        # Engine steps: advances on every step, frozen when idle or stalled (docs/vllm-notes.md §7).
        "vllm:iteration_tokens_total_count": ("vllm:iteration_tokens_total_count",),
        "vllm:prefix_cache_queries_total": (
            "vllm:prefix_cache_queries_total",
            "vllm:gpu_prefix_cache_queries_total",
        ),
        "vllm:prefix_cache_hits_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "vllm:request_success_total": ("vllm:request_success_total",),
        "vllm:engine_sleep_state": ("vllm:engine_sleep_state",),
        "vllm:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
        "vllm:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
        # The old name measured the inter-token gap too; deprecated 0.11, later removed.
        "vllm:inter_token_latency_seconds": (
            "vllm:inter_token_latency_seconds",
            "vllm:time_per_output_token_seconds",
        ),
    }
)
# Rows a vLLM release may lack by design (tests/lib/vllm_surface.py holds every release of the
# support matrix to the rest): V0's swapped count (V1 never swaps; absent reads as 0), and rows
# newer than some supported releases, by the first release that has them (absent reads as unknown).
V0_ONLY_ROWS: Final[frozenset[str]] = frozenset({"vllm:num_requests_swapped"})
ROWS_SINCE: Final[Mapping[str, tuple[int, int]]] = MappingProxyType(
    # vllm#24176, merged after 0.11.0 was cut (0.11.0 lacks it: docs/vllm-notes.md §10).
    {"vllm:engine_sleep_state": (0, 12)}
)
# The label a row's series are grouped by (every other label is summed over).
GROUPED_BY: Final[Mapping[str, str]] = MappingProxyType(
    {"vllm:request_success_total": "finished_reason", "vllm:engine_sleep_state": "sleep_state"}
)
HISTOGRAM_ROWS: Final[frozenset[str]] = frozenset(
    {
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:inter_token_latency_seconds",
    }
)
_HISTOGRAM_SUFFIXES: Final = ("_bucket", "_sum", "_count")

# Caps against a hostile or broken server (issue 17). vLLM 0.32 exposes ~90 samples of the
# families read per engine label (each histogram ~22 bounds); a data-parallel server multiplies
# that by its engines, so MAX_SERIES leaves room for DP 64 and more.
DEFAULT_MAX_BODY_BYTES: Final = 8 * 1024 * 1024  # vLLM 0.32's body: ~60 kB
MAX_SERIES: Final = 20_000  # samples of the families read, per scrape
MAX_BUCKETS: Final = 256  # distinct `le` bounds of one histogram
MAX_LABEL_VALUES: Final = 64  # distinct finished_reason values kept; the rest sum under "other"
# The largest count kept: a histogram's counts are packed as int64 (Histogram), and no engine
# counts past it; a larger one is absurd, and its series is dropped.
MAX_COUNT: Final = 2**63 - 1
DROP_LOG_EVERY_S: Final = 60.0
# A body is parsed on the event loop when it is no larger than this and holds at most
# INLINE_NEW_KEYS_MAX series keys not seen before; any other goes to a parse thread. A body of
# keys seen before (every scrape of a running vLLM after its first) takes 0.18 ms at 50 kB, less
# than the hop to a thread and back (~70 us on the loop, and twice the parse's CPU in the thread:
# docs/benchmarks.md, "Fewer tasks per round"); at this size it stays under ~1.5 ms. New keys are
# what is slow (prometheus_client's parser, ~15 us each: a 64 kB body of new keys took 9 ms), so
# a parse on the loop gives up at the 65th new key, having spent well under a millisecond.
INLINE_PARSE_MAX_BYTES: Final = 256 * 1024
INLINE_NEW_KEYS_MAX: Final = 64
OTHER_LABEL_VALUE: Final = "other"
_SLEEP_STATES: Final[tuple[SleepState, ...]] = ("discard_all", "weights_offloaded", "awake")


def _wanted_names() -> frozenset[str]:
    names: set[str] = set()
    for canonical, aliases in ALIASES.items():
        for name in aliases:
            if canonical in HISTOGRAM_ROWS:
                names.update(name + suffix for suffix in _HISTOGRAM_SUFFIXES)
            else:
                names.add(name)
    return frozenset(names)


_WANTED: Final[frozenset[str]] = _wanted_names()

_Series = list[tuple[Mapping[str, str], float]]


class _BadBody(Exception):
    pass


class _Unfamiliar(Exception):
    """More series keys not read before than a parse on the event loop may read (see
    ``parse_familiar``): the body goes to a parse thread instead."""


_Shareable = TypeVar("_Shareable", tuple[float, ...], frozenset[str])
# Values that repeat across scrapes (bucket layouts, sets of present rows), kept once: every
# engine's window holds ~1,200 observations. vLLM has a handful of each; the cap only guards
# against a server that invents new ones on every scrape.
_SHARED: dict[object, object] = {}
_SHARED_MAX: Final = 512


def _shared(value: _Shareable) -> _Shareable:
    found = _SHARED.get(value)
    if found is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        _SHARED[value] = found = value
    return found  # type: ignore[return-value]  # equal to value, so of its type


@dataclass(frozen=True, slots=True, init=False)
class Histogram:
    """One cumulative Prometheus histogram, summed over engines.

    ``buckets`` are ``(le, cumulative count)`` in ascending ``le``; the last is ``+Inf`` when the
    body had one. ``sum`` is in the family's unit (seconds for the latency families).

    Stored compactly: the bounds as one tuple shared by every histogram of the same layout, the
    counts packed 8 bytes each. Each engine's observation window keeps ~1,200 observations with
    three of these (vLLM 0.32 has ~22 buckets each); as tuples of ``(le, count)`` pairs they were
    6.7 kB of the 9.5 kB of an observation, now about 0.9 kB (docs/benchmarks.md).
    """

    les: tuple[float, ...]
    packed_counts: bytes  # array("q"), native order: this process only
    sum: float
    count: int

    def __init__(self, *, buckets: Iterable[tuple[float, int]], sum: float, count: int) -> None:
        pairs = tuple(buckets)
        object.__setattr__(self, "les", _shared(tuple(le for le, _ in pairs)))
        object.__setattr__(self, "packed_counts", array("q", [c for _, c in pairs]).tobytes())
        object.__setattr__(self, "sum", sum)
        object.__setattr__(self, "count", count)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(memoryview(self.packed_counts).cast("q"))

    @property
    def buckets(self) -> tuple[tuple[float, int], ...]:
        return tuple(zip(self.les, self.counts, strict=True))

    def quantile(self, q: float) -> float | None:
        """Estimate the q-quantile the way PromQL's ``histogram_quantile`` does.

        Linear interpolation inside the bucket that holds the rank; a rank in the ``+Inf`` bucket
        returns the highest finite bound. ``None`` when there are no observations.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q} is outside [0, 1]")
        buckets = self.buckets
        if not buckets:
            return None
        total = buckets[-1][1]
        if total <= 0:
            return None
        rank = q * total
        prev_le, prev_count = 0.0, 0
        for i, (le, cumulative) in enumerate(buckets):
            if cumulative >= rank and cumulative > 0:
                if math.isinf(le):
                    return prev_le if i > 0 else None
                lower = prev_le if i > 0 else min(0.0, le)
                if cumulative == prev_count:
                    return le
                return lower + (le - lower) * (rank - prev_count) / (cumulative - prev_count)
            prev_le, prev_count = le, cumulative
        return prev_le

    def minus(self, older: Histogram | None) -> Histogram:
        """What was observed between ``older`` and this snapshot.

        Returns ``self`` when there is no older snapshot or it cannot be the same series
        (a count went down or the bucket layout changed: the engine restarted in between), the way
        PromQL's ``rate`` treats a counter reset.
        """
        if older is None:
            return self
        if older.les != self.les or older.count > self.count:
            return self
        diffs = [new - old for new, old in zip(self.counts, older.counts, strict=True)]
        if any(d < 0 for d in diffs):
            return self
        return Histogram(
            buckets=zip(self.les, diffs, strict=True),
            sum=self.sum - older.sum,
            count=self.count - older.count,
        )


def window_quantile(newer: Histogram | None, older: Histogram | None, q: float = 0.95) -> float | None:
    """The q-quantile of what was observed between two snapshots (p95 over a window).

    ``None`` when the newer snapshot lacks the family or nothing was observed in the window.
    """
    if newer is None:
        return None
    return newer.minus(older).quantile(q)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineMetrics:
    """One scrape of one engine's ``/metrics``. ``None`` means the family was absent (unknown)."""

    requests_running: int | None
    requests_waiting: int | None
    requests_swapped: int  # V0 only; 0 when absent
    kv_usage_ratio: float | None  # 0..1, the busiest engine's
    preemptions_total: int | None
    prompt_tokens_total: int | None
    generation_tokens_total: int | None
    iterations_total: int | None  # engine steps (iteration_tokens_total_count)
    prefix_cache_queries_total: int | None  # in tokens
    prefix_cache_hits_total: int | None  # in tokens
    request_success_total_by_reason: Mapping[str, int] | None  # finished_reason -> count
    ttft_seconds: Histogram | None
    e2e_latency_seconds: Histogram | None
    itl_seconds: Histogram | None
    sleep_state: SleepState | None
    present: frozenset[str]  # canonical ALIASES rows found in the body

    @property
    def requests_finished_total(self) -> int | None:
        """All finished requests, whatever the reason (vLLM counts errors as "success" too)."""
        if self.request_success_total_by_reason is None:
            return None
        return sum(self.request_success_total_by_reason.values())

    @property
    def tokens_total(self) -> int | None:
        if self.prompt_tokens_total is None or self.generation_tokens_total is None:
            return None
        return self.prompt_tokens_total + self.generation_tokens_total


_METRIC_NAME_RE: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")

# What a series key (a sample line up to its value: the name and the labels, as exposed) was read
# as: (sample name, labels) for a sample this module reads, None for one whose name was checked
# and is not read. Only values change between scrapes; vLLM's keys stay the same for the life of
# the server and across engines serving one model, so prometheus_client's parser reads each key
# once per daemon instead of on every scrape (bench/overhead, docs/benchmarks.md). The cap only
# guards against a server that invents new label values on every scrape.
_KeyReading = tuple[str, Mapping[str, str]] | None
_KEYS: dict[str, _KeyReading] = {}
_KEYS_MAX: Final = 16384
_KEY_MEMO_MAX_CHARS: Final = 512  # a longer key is read every time, never kept
# Sample lines of names this module does not read, as they were when checked, value included.
# Most of a body is such lines (about 510 of vLLM 0.32's 600) and most of them read the same on
# every scrape (constant gauges, the buckets of histograms no request has reached): the same text
# has passed the same check, so a line seen before is skipped before it is split (about a third
# of the daemon's CPU at 8 engines went to parsing, docs/benchmarks.md, "Every kind of hang").
# Lines whose name is read are never skipped: their values are the point.
_CHECKED: set[str] = set()
_CHECKED_MAX: Final = 16384


def _read_key(key: str, brace: int) -> _KeyReading:
    name = key[:brace].rstrip() if brace >= 0 else key
    # *_created is a timestamp gauge that the client library adds to every counter and histogram;
    # none of our names end in it, but it is never read all the same.
    if name not in _WANTED or name.endswith("_created"):
        if _METRIC_NAME_RE.match(name) is None:
            raise _BadBody(f"not a metric line: {key[:80]!r}")
        return None
    samples = [s for family in text_string_to_metric_families(f"{key} 0\n") for s in family.samples]
    if len(samples) != 1:
        raise _BadBody(f"not one sample: {key[:80]!r}")
    return samples[0].name, MappingProxyType(dict(samples[0].labels))


def _value(fields: list[str], line: str) -> float:
    """The sample value, as prometheus_client reads it; a timestamp after it is checked, not kept."""
    try:
        if not 1 <= len(fields) <= 2 or "_" in fields[0]:
            raise ValueError
        if len(fields) == 2:
            float(fields[1])
        return float(fields[0])
    except ValueError:
        raise _BadBody(f"not a metric line: {line[:80]!r}") from None


def _collect(body: str, new_keys_max: int | None = None) -> dict[str, _Series]:
    """Every sample of a wanted name, as {sample name: [(labels, value)]}, in body order.

    Every other sample line is still checked: a metric name, then (after the labels, if any) a
    number and at most a timestamp. Its labels are not parsed, which is the point. With
    ``new_keys_max``, more keys than that not read before raise ``_Unfamiliar``.
    """
    store: dict[str, _Series] = defaultdict(list)
    keys = _KEYS
    checked = _CHECKED
    kept = 0
    new_keys = 0
    for raw in body.splitlines():
        if raw in checked:
            continue
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            # Values and timestamps hold no "}", so the last one closes the labels, whatever
            # their values contain.
            close = line.rfind("}")
            if close < brace:
                raise _BadBody(f"not a metric line: {line[:80]!r}")
            key, fields = line[: close + 1], line[close + 1 :].split()
        else:
            key, *fields = line.split()
        try:
            reading = keys[key]
        except KeyError:
            new_keys += 1
            if new_keys_max is not None and new_keys > new_keys_max:
                raise _Unfamiliar from None
            reading = _read_key(key, brace)
            if len(key) <= _KEY_MEMO_MAX_CHARS:
                if len(keys) >= _KEYS_MAX:
                    keys.clear()
                keys[key] = reading
        value = _value(fields, line)
        if reading is None:
            if len(raw) <= _KEY_MEMO_MAX_CHARS:
                if len(checked) >= _CHECKED_MAX:
                    checked.clear()
                checked.add(raw)
            continue
        kept += 1
        if kept > MAX_SERIES:
            raise _BadBody(
                f"more than {MAX_SERIES} series of the vllm: families read (last {reading[0]}):"
                " a label that takes a new value on every scrape?"
            )
        store[reading[0]].append((reading[1], value))
    return store


def _first(store: Mapping[str, _Series], canonical: str, present: set[str]) -> _Series | None:
    for name in ALIASES[canonical]:
        series = store.get(name)
        if series:
            present.add(canonical)
            return series
    return None


# family -> when its last drop was logged (time.monotonic); written from the parse threads.
_DROPS_LOGGED_S: dict[str, float] = {}
_DROPS_LOCK: Final = threading.Lock()
DROPPED_SERIES: Counter[str] = Counter()  # family -> series dropped as absurd, since start


def _dropped(family: str, why: str) -> None:
    """Count a dropped series, and log it at most once per ``DROP_LOG_EVERY_S`` per family:
    a broken engine sends the same absurd value on every scrape."""
    now = time.monotonic()
    with _DROPS_LOCK:
        DROPPED_SERIES[family] += 1
        last = _DROPS_LOGGED_S.get(family)
        loud = last is None or now - last >= DROP_LOG_EVERY_S
        if loud:
            _DROPS_LOGGED_S[family] = now
    if loud:
        log.warning("/metrics: dropped %s (%s); the rest of the scrape is kept", family, why)


def _total(series: _Series | None, family: str = "") -> float | None:
    if series is None:
        return None
    try:
        total = math.fsum(value for _, value in series)
    except (ValueError, OverflowError):  # +Inf and -Inf together; or finite values that overflow
        total = math.nan
    if not math.isfinite(total):
        if family:
            _dropped(family, "its sum is not a finite number")
        return None
    return total


def _worst(series: _Series | None) -> float | None:
    # A ratio per engine does not add up: two DP engines at 0.5 are not at 1.0. The busiest
    # engine is the one that preempts first, so report the maximum.
    if series is None:
        return None
    values = [value for _, value in series if math.isfinite(value)]
    return max(values) if values else None


def _count(series: _Series | None, family: str = "") -> int | None:
    total = _total(series, family)
    if total is None:
        return None
    if abs(total) > MAX_COUNT:
        _dropped(family, f"a count of {total:g}")
        return None
    return round(total)


def _count_of(store: Mapping[str, _Series], canonical: str, present: set[str]) -> int | None:
    return _count(_first(store, canonical, present), canonical)


def _by_label(series: _Series | None, label: str) -> dict[str, float] | None:
    if series is None:
        return None
    sums: dict[str, float] = defaultdict(float)
    for labels, value in series:
        key = labels.get(label, "")
        if key not in sums and len(sums) >= MAX_LABEL_VALUES:
            key = OTHER_LABEL_VALUE  # every observation keeps this mapping: bound it
        # Interned: the same few values ("stop", "length", ...) are kept by every observation.
        sums[sys.intern(key)] += value
    return dict(sums)


def _histogram(store: Mapping[str, _Series], canonical: str, present: set[str]) -> Histogram | None:
    for base in ALIASES[canonical]:
        buckets = store.get(base + "_bucket")
        counts = store.get(base + "_count")
        if not buckets and not counts:
            continue
        present.add(canonical)
        ordered = _buckets(buckets or [])
        count = _count(counts, base + "_count")
        if ordered is None or (count is not None and count < 0) or (counts and count is None):
            if ordered is None:
                _dropped(base, "an absurd bucket")
            return None  # one absurd histogram: drop it, keep the rest of the scrape
        if count is None:
            count = ordered[-1][1] if ordered else 0
        total = _total(store.get(base + "_sum"), base + "_sum")
        return Histogram(buckets=ordered, sum=0.0 if total is None else total, count=count)
    return None


def _buckets(series: _Series) -> tuple[tuple[float, int], ...] | None:
    """Cumulative (le, count) in ascending ``le``, summed over engines; None if any is absurd."""
    by_le: dict[float, float] = defaultdict(float)
    for labels, value in series:
        try:
            le = float(labels["le"])
        except (KeyError, ValueError):
            return None
        if math.isnan(le) or not math.isfinite(value) or value < 0:
            return None
        by_le[le] += value
        if by_le[le] > MAX_COUNT:
            return None  # it would not fit the packed counts (an OverflowError failed the scrape)
        if len(by_le) > MAX_BUCKETS:
            return None
    ordered = tuple((le, round(v)) for le, v in sorted(by_le.items()))
    if any(later < earlier for (_, earlier), (_, later) in itertools.pairwise(ordered)):
        return None  # cumulative counts never go down
    return ordered


def _sleep_state(series: _Series | None) -> SleepState | None:
    # One 0/1 series per state and engine. If any engine sleeps, the server is not fully
    # serving, so the deepest sleep wins over "awake".
    sums = _by_label(series, GROUPED_BY["vllm:engine_sleep_state"])
    if sums is None:
        return None
    for state in _SLEEP_STATES:
        if sums.get(state, 0.0) > 0:
            return state
    return None


def parse_metrics(body: str) -> EngineMetrics | ProbeFailure:
    """Read a ``/metrics`` body; never raises for what the body contains."""
    parsed = _parse(body, None)
    assert parsed is not None  # only a parse with new_keys_max gives up
    return parsed


def parse_familiar(body: str) -> EngineMetrics | ProbeFailure | None:
    """``parse_metrics`` for the event loop: None, having read little, when ``body`` is larger
    than ``INLINE_PARSE_MAX_BYTES`` or holds more than ``INLINE_NEW_KEYS_MAX`` series keys that
    no body held before (a first scrape, a server that invents label values), which is what makes
    a parse slow; then it goes to a parse thread (``fetch_metrics``)."""
    if len(body) > INLINE_PARSE_MAX_BYTES:
        return None
    return _parse(body, INLINE_NEW_KEYS_MAX)


def _parse(body: str, new_keys_max: int | None) -> EngineMetrics | ProbeFailure | None:
    try:
        store = _collect(body, new_keys_max)
        present: set[str] = set()
        success = "vllm:request_success_total"
        reasons = _by_label(_first(store, success, present), GROUPED_BY[success])
        return EngineMetrics(
            requests_running=_count_of(store, "vllm:num_requests_running", present),
            requests_waiting=_count_of(store, "vllm:num_requests_waiting", present),
            requests_swapped=_count_of(store, "vllm:num_requests_swapped", present) or 0,
            kv_usage_ratio=_worst(_first(store, "vllm:kv_cache_usage_perc", present)),
            preemptions_total=_count_of(store, "vllm:num_preemptions_total", present),
            prompt_tokens_total=_count_of(store, "vllm:prompt_tokens_total", present),
            generation_tokens_total=_count_of(store, "vllm:generation_tokens_total", present),
            iterations_total=_count_of(store, "vllm:iteration_tokens_total_count", present),
            prefix_cache_queries_total=_count_of(store, "vllm:prefix_cache_queries_total", present),
            prefix_cache_hits_total=_count_of(store, "vllm:prefix_cache_hits_total", present),
            request_success_total_by_reason=None
            if reasons is None
            else MappingProxyType(
                {k: round(v) for k, v in reasons.items() if math.isfinite(v) and abs(v) <= MAX_COUNT}
            ),
            ttft_seconds=_histogram(store, "vllm:time_to_first_token_seconds", present),
            e2e_latency_seconds=_histogram(store, "vllm:e2e_request_latency_seconds", present),
            itl_seconds=_histogram(store, "vllm:inter_token_latency_seconds", present),
            sleep_state=_sleep_state(_first(store, "vllm:engine_sleep_state", present)),
            present=_shared(frozenset(present)),
        )
    except _Unfamiliar:
        return None
    except _BadBody as exc:
        return ProbeFailure("parse", str(exc))
    except Exception as exc:  # the parser raises ValueError, but garbage may find other paths
        return ProbeFailure("parse", f"unreadable /metrics body: {type(exc).__name__}: {exc}"[:300])


_PARSE_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_PARSE_THREADS: Final = 2
# base URL -> the parse of its last body, while it runs past its deadline (see the docstring).
_PARSING: dict[str, asyncio.Future[EngineMetrics | ProbeFailure]] = {}


def _parse_pool() -> concurrent.futures.ThreadPoolExecutor:
    # Its own threads: a slow parse must not hold up the /proc sweep in asyncio's default pool.
    global _PARSE_POOL
    if _PARSE_POOL is None:
        _PARSE_POOL = concurrent.futures.ThreadPoolExecutor(
            _PARSE_THREADS, thread_name_prefix="metrics-parse"
        )
    return _PARSE_POOL


async def fetch_metrics(
    probe: ProbeHttp,
    *,
    timeout_s: float,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    headers: Mapping[str, str] | None = None,
) -> EngineMetrics | ProbeFailure:
    """GET ``/metrics`` through the probes' own client (probes/probe_http.py) and parse it, all
    under one overall deadline of ``timeout_s``. A body over ``max_body_bytes`` is abandoned
    as soon as that is known; it is parsed in a thread (see the module docstring)."""
    url = f"{probe.base_url}/metrics"
    running = _PARSING.get(url)
    if running is not None and not running.done():
        return ProbeFailure("timeout", f"GET {url}: the previous body is still being parsed")
    try:
        async with asyncio.timeout(timeout_s):
            answer = await probe.get("/metrics", headers=headers, max_body_bytes=max_body_bytes)
            if answer.status != 200:
                head = answer.body[:200].decode("utf-8", "replace")
                return ProbeFailure("http", f"GET {url}: HTTP {answer.status}: {head}")
            # The Prometheus text format is UTF-8 (vLLM serves it as such).
            body = answer.body.decode("utf-8", "replace")
            quick = parse_familiar(body)
            if quick is not None:
                return quick
            parsing = _PARSING[url] = asyncio.get_running_loop().run_in_executor(
                _parse_pool(), parse_metrics, body
            )
            # Shielded: at the deadline the parse goes on in its thread; _PARSING remembers it.
            return await asyncio.shield(parsing)
    except TimeoutError:
        return ProbeFailure("timeout", f"GET {url}: no answer within {timeout_s} s")
    except TooLarge:
        return ProbeFailure("parse", f"GET {url}: body over {max_body_bytes} bytes (metrics_max_body_bytes)")
    except ProbeHttpError as exc:
        return ProbeFailure(exc.kind, f"GET {url}: {exc}")
    finally:
        done = _PARSING.get(url)
        if done is not None and done.done():
            del _PARSING[url]


__all__ = [
    "ALIASES",
    "DEFAULT_MAX_BODY_BYTES",
    "DROPPED_SERIES",
    "GROUPED_BY",
    "HISTOGRAM_ROWS",
    "INLINE_NEW_KEYS_MAX",
    "INLINE_PARSE_MAX_BYTES",
    "MAX_BUCKETS",
    "MAX_COUNT",
    "MAX_LABEL_VALUES",
    "MAX_SERIES",
    "ROWS_SINCE",
    "V0_ONLY_ROWS",
    "EngineMetrics",
    "Histogram",
    "SleepState",
    "fetch_metrics",
    "parse_familiar",
    "parse_metrics",
    "window_quantile",
]
