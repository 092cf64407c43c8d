"""The /metrics parser against bodies from several vLLM versions, and the fetch around it.

``vllm-0.32.0-cpu*.txt`` and ``vllm-0.11.0-cpu*.txt`` were captured from the real vLLM 0.32.0 and
0.11.0 CPU builds serving the tiny model (see tests/fixtures/metrics/README.md); the others are
hand-written in older namings.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmsupervisor.probes import ProbeFailure, vllm_metrics
from llmsupervisor.probes.probe_http import ProbeHttp
from llmsupervisor.probes.vllm_metrics import (
    ALIASES,
    HISTOGRAM_ROWS,
    EngineMetrics,
    Histogram,
    fetch_metrics,
    parse_metrics,
    window_quantile,
)
from tests.lib.canned_http import Handler, canned_server, reply
from tests.lib.paths import FIXTURES

FIXTURES = FIXTURES / "metrics"


def body(name: str) -> str:
    return (FIXTURES / name).read_text()


def parsed(text: str) -> EngineMetrics:
    result = parse_metrics(text)
    assert isinstance(result, EngineMetrics), result
    return result


def test_real_0_32_busy_engine() -> None:
    # Captured with 8 requests in flight, after 11 finished or aborted ones.
    m = parsed(body("vllm-0.32.0-cpu.txt"))
    assert m.requests_running == 8
    assert m.requests_waiting == 0
    assert m.requests_swapped == 0
    assert m.kv_usage_ratio == pytest.approx(0.0009766817238432424)
    assert m.preemptions_total == 0
    assert m.prompt_tokens_total == 714
    assert m.generation_tokens_total == 1080
    assert m.tokens_total == 1794
    assert m.iterations_total == 306
    assert m.prefix_cache_queries_total == 714
    assert m.prefix_cache_hits_total == 256  # two repeats of a 128-token block-aligned prefix
    assert m.request_success_total_by_reason == {
        "stop": 0,
        "length": 10,
        "abort": 0,
        "error": 0,
        "repetition": 0,
    }
    assert m.requests_finished_total == 10
    assert m.sleep_state == "awake"
    assert m.ttft_seconds is not None and m.e2e_latency_seconds is not None and m.itl_seconds is not None
    # TTFT counts requests that are still running; e2e only finished ones.
    assert (m.ttft_seconds.count, m.e2e_latency_seconds.count) == (19, 10)
    assert m.ttft_seconds.buckets[-1] == (math.inf, 19)
    assert m.e2e_latency_seconds.sum == pytest.approx(1.5776922702789307)
    assert m.present == frozenset(ALIASES) - {"vllm:num_requests_swapped"}


def test_real_0_32_idle_engine_reads_zero_not_unknown() -> None:
    m = parsed(body("vllm-0.32.0-cpu-idle.txt"))
    assert (m.requests_running, m.requests_waiting, m.kv_usage_ratio) == (0, 0, 0.0)
    assert (m.prompt_tokens_total, m.generation_tokens_total, m.iterations_total) == (0, 0, 0)
    assert m.sleep_state == "awake"
    assert m.ttft_seconds is not None
    assert m.ttft_seconds.count == 0
    assert m.ttft_seconds.quantile(0.95) is None


def test_real_0_11_busy_engine() -> None:
    # Captured from vLLM 0.11.0's CPU build with one request in flight, after 7 finished ones
    # (3 with the same ~150-token prompt). Its default body has the new KV and prefix-cache
    # names only (the gpu_* ones are hidden in 0.11), both inter-token families, no sleep state.
    text = body("vllm-0.11.0-cpu.txt")
    assert "vllm:gpu_cache_usage_perc" not in text and "vllm:engine_sleep_state" not in text
    assert "vllm:time_per_output_token_seconds_count" in text
    m = parsed(text)
    assert (m.requests_running, m.requests_waiting, m.requests_swapped) == (1, 0, 0)
    assert m.kv_usage_ratio == pytest.approx(0.0001220852154804053)
    assert m.preemptions_total == 0
    assert (m.prompt_tokens_total, m.generation_tokens_total, m.tokens_total) == (462, 115, 577)
    assert m.iterations_total == 115
    assert m.prefix_cache_queries_total == 462
    assert m.prefix_cache_hits_total == 256  # two repeats of a 128-token block-aligned prefix
    assert m.request_success_total_by_reason == {"stop": 0, "length": 7, "abort": 0}
    assert m.requests_finished_total == 7
    assert m.ttft_seconds is not None and m.e2e_latency_seconds is not None and m.itl_seconds is not None
    assert (m.ttft_seconds.count, m.e2e_latency_seconds.count, m.itl_seconds.count) == (8, 7, 107)
    assert m.ttft_seconds.buckets[-1] == (math.inf, 8)
    assert m.e2e_latency_seconds.sum == pytest.approx(2.61889910697937)
    assert m.sleep_state is None  # the family came later: unknown, not awake
    assert m.present == frozenset(ALIASES) - {"vllm:num_requests_swapped", "vllm:engine_sleep_state"}


def test_real_0_11_inter_token_latency_is_read_from_the_new_name() -> None:
    # 0.11 exposes the deprecated time_per_output_token_seconds beside inter_token_latency_seconds
    # with the same values; give the old one another count: the new one must win.
    old = 'vllm:time_per_output_token_seconds_count{engine="0",model_name="tiny"} '
    text = body("vllm-0.11.0-cpu.txt").replace(old + "107.0", old + "9999.0")
    assert old + "9999.0" in text
    m = parsed(text)
    assert m.itl_seconds is not None and m.itl_seconds.count == 107


def test_real_0_11_with_hidden_metrics_reads_the_gpu_names_alone() -> None:
    # Captured with --show-hidden-metrics-for-version 0.10 and six requests in flight: 0.11 then
    # emits gpu_cache_usage_perc and gpu_prefix_cache_* beside the new names, with equal values.
    text = body("vllm-0.11.0-cpu-hidden.txt")
    both = parsed(text)
    assert (both.requests_running, both.requests_waiting) == (6, 0)
    assert both.kv_usage_ratio == pytest.approx(0.0007325112928824318)
    assert (both.prefix_cache_queries_total, both.prefix_cache_hits_total) == (497, 256)
    # Without the new names (an exporter or relabelling that keeps only the gpu_* ones), the
    # old ones give the same reading.
    new_names = (
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    )
    old_only = "\n".join(line for line in text.splitlines() if not line.startswith(new_names))
    assert "vllm:gpu_cache_usage_perc{" in old_only and "vllm:kv_cache_usage_perc{" not in old_only
    m = parsed(old_only)
    assert m.kv_usage_ratio == both.kv_usage_ratio
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (497, 256)
    assert m.present == both.present


def test_0_9_dual_names_and_two_engines() -> None:
    m = parsed(body("vllm-0.9.2-v1-dp2.txt"))
    assert (m.requests_running, m.requests_waiting) == (5, 1)  # summed over engine="0" and "1"
    assert m.kv_usage_ratio == 0.5  # the busiest engine, not 0.25 + 0.5
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (1500, 500)
    assert (m.preemptions_total, m.prompt_tokens_total, m.generation_tokens_total) == (5, 20000, 5000)
    assert m.iterations_total == 5000
    assert m.request_success_total_by_reason == {"stop": 60, "length": 14, "abort": 1}
    assert m.itl_seconds is not None and m.itl_seconds.count == 4925  # old name
    assert m.ttft_seconds is not None
    assert m.ttft_seconds.buckets == ((0.1, 30), (0.25, 60), (0.5, 72), (1.0, 75), (math.inf, 75))
    assert m.sleep_state is None  # the family did not exist yet: unknown
    assert "vllm:engine_sleep_state" not in m.present


def test_new_name_wins_when_both_are_present() -> None:
    # Give the old names different values: the result must come from the 0.32 names.
    kv = 'vllm:gpu_cache_usage_perc{engine="1",model_name="llama"} '
    hits = 'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="llama"} '
    text = body("vllm-0.9.2-v1-dp2.txt")
    text = text.replace(kv + "0.5", kv + "0.99").replace(hits + "400.0", hits + "7.0")
    assert kv + "0.99" in text and hits + "7.0" in text
    m = parsed(text)
    assert m.kv_usage_ratio == 0.5
    assert m.prefix_cache_hits_total == 500


def test_v0_0_6_naming() -> None:
    m = parsed(body("vllm-0.6-v0.txt"))
    assert (m.requests_running, m.requests_waiting, m.requests_swapped) == (7, 11, 2)
    assert m.kv_usage_ratio == 0.9375  # from vllm:gpu_cache_usage_perc
    assert (m.preemptions_total, m.prompt_tokens_total, m.generation_tokens_total) == (17, 52731, 24402)
    assert m.iterations_total is None  # no step counter in V0: unknown, not frozen at 0
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (None, None)
    assert m.request_success_total_by_reason == {"stop": 61, "length": 39}
    assert m.itl_seconds is not None and m.itl_seconds.count == 24302  # time_per_output_token_seconds
    assert m.sleep_state is None
    assert "vllm:num_requests_swapped" in m.present


def test_later_itl_name_wins_over_the_deprecated_one() -> None:
    text = (
        'vllm:inter_token_latency_seconds_bucket{le="0.1"} 3\n'
        'vllm:inter_token_latency_seconds_bucket{le="+Inf"} 4\n'
        "vllm:inter_token_latency_seconds_count 4\n"
        "vllm:inter_token_latency_seconds_sum 0.5\n"
        'vllm:time_per_output_token_seconds_bucket{le="+Inf"} 99\n'
        "vllm:time_per_output_token_seconds_count 99\n"
    )
    m = parsed(text)
    assert m.itl_seconds == Histogram(buckets=((0.1, 3), (math.inf, 4)), sum=0.5, count=4)


def test_absent_families_are_unknown_and_swapped_defaults_to_zero() -> None:
    # Multi-API-server mode before the first request: counters only, no gauges (docs/vllm-notes.md §3.1).
    m = parsed('vllm:prompt_tokens_total{engine="0",model_name="m"} 12.0\n')
    assert m.prompt_tokens_total == 12
    assert m.requests_running is None
    assert m.requests_waiting is None
    assert m.kv_usage_ratio is None
    assert m.iterations_total is None
    assert m.request_success_total_by_reason is None
    assert m.requests_finished_total is None
    assert m.tokens_total is None
    assert m.ttft_seconds is None
    assert m.requests_swapped == 0
    assert m.present == {"vllm:prompt_tokens_total"}


def test_no_vllm_families_at_all_is_not_a_parse_failure() -> None:
    # --disable-log-stats: only process_* and python_* remain. Unknown everywhere, but readable.
    m = parsed("# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n")
    assert m.present == frozenset()
    assert parsed("").present == frozenset()


def test_created_samples_are_ignored() -> None:
    text = (
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0"} 3.0\n'
        'vllm:num_preemptions_created{engine="0"} 1.7e9\n'
    )
    assert parsed(text).preemptions_total == 3


def test_non_finite_gauge_is_unknown() -> None:
    assert parsed("vllm:kv_cache_usage_perc NaN\n").kv_usage_ratio is None


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ({"awake": 1, "weights_offloaded": 0, "discard_all": 0}, "awake"),
        ({"awake": 0, "weights_offloaded": 1, "discard_all": 0}, "weights_offloaded"),
        ({"awake": 0, "weights_offloaded": 0, "discard_all": 1}, "discard_all"),
        ({"awake": 0, "weights_offloaded": 0, "discard_all": 0}, None),
    ],
)
def test_sleep_state(states: dict[str, int], expected: str | None) -> None:
    text = "".join(
        f'vllm:engine_sleep_state{{engine="0",sleep_state="{s}"}} {v}\n' for s, v in states.items()
    )
    assert parsed(text).sleep_state == expected


def test_one_sleeping_engine_makes_the_server_not_awake() -> None:
    text = (
        'vllm:engine_sleep_state{engine="0",sleep_state="awake"} 1\n'
        'vllm:engine_sleep_state{engine="1",sleep_state="awake"} 0\n'
        'vllm:engine_sleep_state{engine="1",sleep_state="weights_offloaded"} 1\n'
    )
    assert parsed(text).sleep_state == "weights_offloaded"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(body("garbage.txt"), id="fixture"),
        pytest.param("hello world\n", id="words"),
        pytest.param('vllm:num_requests_running{engine="0" 3\n', id="unclosed-labels"),
        pytest.param("\x00\xff\xfe binary", id="binary"),
        pytest.param('{"detail": "Not Found"}', id="json"),
        # A bad or missing `le` drops that histogram only (tests/unit/daemon/test_runtime_hardening.py).
    ],
)
def test_garbage_is_a_parse_failure_not_an_exception(text: str) -> None:
    result = parse_metrics(text)
    assert isinstance(result, ProbeFailure)
    assert result.kind == "parse"
    assert result.detail


def _full_store(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What _collect read before only the wanted lines went through the parser: every line."""
    store: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in vllm_metrics._WANTED:
                store.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return store


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("vllm-*.txt")))
def test_reading_only_the_wanted_lines_changes_nothing(name: str) -> None:
    assert vllm_metrics._collect(body(name)) == _full_store(body(name))


def test_a_data_parallel_body_reads_the_same_as_a_full_parse() -> None:
    text = body("vllm-0.32.0-cpu.txt")
    grown = "\n".join(
        "\n".join(line.replace('engine="0"', f'engine="{i}"') for i in range(4))
        if 'engine="0"' in line and not line.startswith("#")
        else line
        for line in text.splitlines()
    )
    m = parsed(grown)
    assert vllm_metrics._collect(grown) == _full_store(grown)
    assert m.requests_running == 4 * parsed(text).requests_running  # type: ignore[operator]


def test_other_families_are_checked_but_their_labels_are_not_read() -> None:
    ok = (
        "# HELP python_info Python platform information\n"
        'python_info{implementation="CPython",odd="a } b {"} 1.0\n'
        "  process_open_fds 42.0 1700000000000\n"
        "\t\n"
        'vllm:num_requests_running{engine="0"} 3.0\n'
    )
    assert parsed(ok).requests_running == 3


@pytest.mark.parametrize(
    "line",
    [
        "process_open_fds twelve",
        "process_open_fds",
        "process_open_fds 1 2 3",
        'python_info{implementation="CPython" 1.0',
        "9lives 1.0",
        "<p>502</p>",
    ],
)
def test_a_malformed_line_of_another_family_is_still_a_parse_failure(line: str) -> None:
    result = parse_metrics(f'vllm:num_requests_running{{engine="0"}} 3.0\n{line}\n')
    assert isinstance(result, ProbeFailure)
    assert result.kind == "parse"


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_running{engine="0"} 3.0.0',
        'vllm:num_requests_running{engine="0"} 1_000',
        'vllm:num_requests_running{engine="0"} 3 soon',
        'vllm:num_requests_running{engine="0"}',
    ],
)
def test_a_bad_value_of_a_series_seen_before_is_a_parse_failure(line: str) -> None:
    assert parsed('vllm:num_requests_running{engine="0"} 3.0\n').requests_running == 3
    result = parse_metrics(line + "\n")
    assert isinstance(result, ProbeFailure)
    assert result.kind == "parse"


def test_a_series_key_is_parsed_once_and_its_new_values_are_read_on_every_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_metrics, "_KEYS", {})
    monkeypatch.setattr(vllm_metrics, "_CHECKED", set())
    text = body("vllm-0.32.0-cpu.txt")
    first = parsed(text)
    keys = dict(vllm_metrics._KEYS)
    wanted = [k for k, reading in keys.items() if reading is not None]
    assert len(wanted) > 50 and len(keys) > len(wanted)  # other families' keys are kept, unread

    # The same series with new values: no new keys, and the values are the new ones.
    busier = "\n".join(
        f"{line.rsplit(' ', 1)[0]} 7.0" if line.startswith("vllm:num_requests_running{") else line
        for line in text.splitlines()
    )
    second = parsed(busier)
    assert keys == vllm_metrics._KEYS
    assert second.requests_running == 7 != first.requests_running
    assert vllm_metrics._collect(busier) == _full_store(busier)


def test_a_key_the_parser_rejects_is_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_metrics, "_KEYS", {})
    bad = 'vllm:time_to_first_token_seconds_bucket{le="0.1",engine=0} 1\n'
    for _ in range(2):
        assert isinstance(parse_metrics(bad), ProbeFailure)
    assert vllm_metrics._KEYS == {}


def test_the_key_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that puts a new label value on every scrape must not grow the daemon forever."""
    monkeypatch.setattr(vllm_metrics, "_KEYS", {})
    monkeypatch.setattr(vllm_metrics, "_KEYS_MAX", 10)
    for request in range(25):
        m = parsed(f'vllm:num_requests_running{{engine="0",request="{request}"}} {request}\n')
        assert m.requests_running == request
        assert len(vllm_metrics._KEYS) <= 10


def test_a_line_not_read_is_checked_once_and_skipped_when_it_comes_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_metrics, "_CHECKED", set())
    text = body("vllm-0.32.0-cpu.txt")
    assert vllm_metrics._collect(text) == _full_store(text)
    checked = set(vllm_metrics._CHECKED)
    # Every sample line of a family not read, none of those read.
    samples = [x for x in text.splitlines() if x.strip() and not x.startswith("#")]
    assert len(samples) / 2 < len(checked) < len(samples)
    assert not any(x.startswith("vllm:num_requests_running{") for x in checked)
    # Again: the same store, from the lines read; a checked line that changes is checked anew.
    assert vllm_metrics._collect(text) == _full_store(text)
    line = next(x for x in checked if x.startswith("vllm:request_prompt_tokens_bucket{"))
    assert isinstance(parse_metrics(text.replace(line, line.rsplit(" ", 1)[0] + " many")), ProbeFailure)


def test_the_checked_lines_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_metrics, "_CHECKED", set())
    monkeypatch.setattr(vllm_metrics, "_CHECKED_MAX", 10)
    for n in range(25):
        assert isinstance(parse_metrics(f'other_family{{request="{n}"}} {n}\n'), EngineMetrics)
        assert len(vllm_metrics._CHECKED) <= 10


def test_alias_table_shape() -> None:
    for canonical, names in ALIASES.items():
        assert names[0] == canonical, "the 0.32 name comes first"
        assert len(set(names)) == len(names)
    assert set(ALIASES) >= HISTOGRAM_ROWS


def hist(*buckets: tuple[float, int], total: float = 0.0) -> Histogram:
    return Histogram(buckets=buckets, sum=total, count=buckets[-1][1])


INF = math.inf


@pytest.mark.parametrize(
    ("h", "q", "expected"),
    [
        (hist((1.0, 10), (2.0, 20), (INF, 20)), 0.5, 1.0),
        (hist((1.0, 10), (2.0, 20), (INF, 20)), 0.75, 1.5),
        (hist((1.0, 10), (2.0, 20), (INF, 20)), 0.25, 0.5),  # first bucket: lower bound 0
        (hist((1.0, 0), (2.0, 10), (INF, 20)), 0.95, 2.0),  # rank in +Inf: highest finite bound
        (hist((1.0, 0), (INF, 0)), 0.95, None),  # nothing observed
        (hist((INF, 5)), 0.5, None),  # only +Inf: nothing to say
    ],
)
def test_quantile(h: Histogram, q: float, expected: float | None) -> None:
    assert h.quantile(q) == (None if expected is None else pytest.approx(expected))


def test_quantile_range_is_checked() -> None:
    with pytest.raises(ValueError):
        hist((1.0, 1), (INF, 1)).quantile(95)


def test_window_quantile_uses_only_what_happened_in_the_window() -> None:
    older = hist((0.1, 100), (1.0, 100), (10.0, 100), (INF, 100), total=5.0)
    # 20 slow requests since the older snapshot; over all time p95 still looks fast.
    newer = hist((0.1, 100), (1.0, 100), (10.0, 120), (INF, 120), total=105.0)
    assert newer.quantile(0.5) == pytest.approx(0.06)
    assert window_quantile(newer, older, 0.95) == pytest.approx(1.0 + 9.0 * 19 / 20)
    delta = newer.minus(older)
    assert (delta.count, delta.sum) == (20, 100.0)


def test_window_quantile_edges() -> None:
    h = hist((1.0, 10), (INF, 10), total=5.0)
    assert window_quantile(None, h) is None  # family absent now
    assert window_quantile(h, None) == h.quantile(0.95)  # no older snapshot: since start
    assert window_quantile(h, h) is None  # nothing observed in the window
    restarted = hist((1.0, 2), (INF, 2), total=1.0)
    assert restarted.minus(h) is restarted  # counts went down: the engine restarted
    relayout = hist((0.5, 10), (INF, 10))
    assert relayout.minus(h) is relayout


def test_histograms_are_stored_compactly_and_read_as_before() -> None:
    # Every window holds ~1,200 observations per engine: the bounds are shared, the counts packed.
    a, b = parsed(body("vllm-0.32.0-cpu.txt")), parsed(body("vllm-0.32.0-cpu.txt"))
    assert a.ttft_seconds is not None and b.ttft_seconds is not None
    assert a.ttft_seconds.les is b.ttft_seconds.les
    assert a.present is b.present
    h = hist((0.1, 3), (1.0, 2**40), (INF, 2**40), total=1.5)
    assert h.buckets == ((0.1, 3), (1.0, 2**40), (INF, 2**40))
    assert h.counts == (3, 2**40, 2**40)
    assert h == hist((0.1, 3), (1.0, 2**40), (INF, 2**40), total=1.5)
    assert h != hist((0.1, 4), (1.0, 2**40), (INF, 2**40), total=1.5)
    assert hash(h) == hash(hist((0.1, 3), (1.0, 2**40), (INF, 2**40), total=1.5))
    assert Histogram(buckets=(), sum=0.0, count=0).quantile(0.5) is None


def test_window_over_two_real_captures() -> None:
    idle = parsed(body("vllm-0.32.0-cpu-idle.txt"))
    busy = parsed(body("vllm-0.32.0-cpu.txt"))
    assert busy.ttft_seconds is not None
    p95 = window_quantile(busy.ttft_seconds, idle.ttft_seconds)
    assert p95 == busy.ttft_seconds.quantile(0.95)
    assert p95 is not None and 0.02 < p95 <= 0.04


def run_fetch(handler: Handler, *, timeout_s: float = 1.0) -> EngineMetrics | ProbeFailure:
    """fetch_metrics through the probes' own client against a real local server."""

    async def go() -> EngineMetrics | ProbeFailure:
        async with canned_server(handler) as server:
            probe = ProbeHttp(server.url + "/")
            try:
                return await fetch_metrics(probe, timeout_s=timeout_s)
            finally:
                probe.close()

    return asyncio.run(go())


def test_fetch_ok() -> None:
    seen: list[str] = []

    def handler(path: str, headers: dict[str, str]) -> bytes:
        seen.append(path)
        return reply(
            200, body("vllm-0.32.0-cpu.txt").encode(), headers={"Content-Type": "text/plain; charset=utf-8"}
        )

    result = run_fetch(handler)
    assert isinstance(result, EngineMetrics)
    assert result.requests_running == 8
    assert seen == ["/metrics"]


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (reply(503, b"engine dead"), "http"),
        (reply(200, b"<html>oops</html>"), "parse"),
        (None, "connect"),  # closed without an answer
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nbad chunk\r\n", "http"),
    ],
)
def test_fetch_failures_are_values(raw: bytes | None, kind: str) -> None:
    result = run_fetch(lambda p, h: raw)
    assert isinstance(result, ProbeFailure)
    assert result.kind == kind


def test_fetch_refused_is_connect() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def go() -> EngineMetrics | ProbeFailure:
        return await fetch_metrics(ProbeHttp(url), timeout_s=1.0)

    result = asyncio.run(go())
    assert isinstance(result, ProbeFailure) and result.kind == "connect", result


def test_fetch_has_one_overall_deadline() -> None:
    async def stall(path: str, headers: dict[str, str]) -> bytes:
        await asyncio.sleep(5)
        return reply(200)

    started = time.monotonic()
    result = run_fetch(stall, timeout_s=0.05)
    assert time.monotonic() - started < 1.0
    assert isinstance(result, ProbeFailure)
    assert result.kind == "timeout"


# ---- one absurd value drops its series, never the scrape (issue 28, point 5) ----

_REST = (
    'vllm:time_to_first_token_seconds_bucket{le="0.1"} 1\n'
    'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 4\n'
    "vllm:time_to_first_token_seconds_count 4\n"
    "vllm:time_to_first_token_seconds_sum 2.5\n"
    "vllm:num_requests_running 3\n"
    'vllm:prompt_tokens_total{engine="0"} 10\n'
)


@pytest.mark.parametrize(
    ("bad", "dropped"),
    [
        # round(1e30) does not fit the histogram's int64 array: OverflowError failed the parse.
        pytest.param('vllm:e2e_request_latency_seconds_bucket{le="1.0"} 1e30\n', "e2e", id="bucket-1e30"),
        pytest.param("vllm:e2e_request_latency_seconds_count 1e30\n", "e2e", id="count-1e30"),
        # fsum raises ValueError on +Inf and -Inf together (OverflowError on a finite overflow).
        pytest.param(
            'vllm:generation_tokens_total{engine="0"} +Inf\nvllm:generation_tokens_total{engine="1"} -Inf\n',
            "generation",
            id="counter-plus-and-minus-inf",
        ),
        pytest.param(
            'vllm:generation_tokens_total{engine="0"} 1e308\n'
            'vllm:generation_tokens_total{engine="1"} 1e308\n',
            "generation",
            id="counter-fsum-overflow",
        ),
        pytest.param(
            'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 1\n'
            'vllm:e2e_request_latency_seconds_sum{engine="0"} +Inf\n'
            'vllm:e2e_request_latency_seconds_sum{engine="1"} -Inf\n',
            "e2e-sum",
            id="histogram-sum-plus-and-minus-inf",
        ),
    ],
)
def test_one_absurd_value_drops_its_series_and_keeps_the_scrape(bad: str, dropped: str) -> None:
    before = sum(vllm_metrics.DROPPED_SERIES.values())
    result = parse_metrics(bad + _REST)
    assert isinstance(result, EngineMetrics), result
    assert sum(vllm_metrics.DROPPED_SERIES.values()) > before  # counted (and logged once a minute)
    assert result.requests_running == 3
    assert result.prompt_tokens_total == 10
    assert result.ttft_seconds is not None and result.ttft_seconds.count == 4
    if dropped == "e2e":
        assert result.e2e_latency_seconds is None
    elif dropped == "generation":
        assert result.generation_tokens_total is None
    else:  # a histogram with an unreadable sum keeps its buckets, its sum unknown (0.0)
        assert result.e2e_latency_seconds is not None and result.e2e_latency_seconds.sum == 0.0
