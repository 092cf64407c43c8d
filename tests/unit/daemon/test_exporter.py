"""The Prometheus exporter, read through its own registry, and the monitoring files built on it.

- every family from a hand-made ``Snapshot`` via ``registry.get_sample_value`` (E11);
- ``promtool check metrics`` on a live scrape of ``HttpApi`` serving ``/metrics``: no lint at all;
- ``promtool check rules`` and ``promtool test rules`` on ``packaging/prometheus/alerts.yml``;
- the Grafana dashboard parses, and its PromQL names only series the exporter emits.

The promtool tests skip when promtool is missing (``apt-get install prometheus`` provides it),
unless ``LLMSUP_REQUIRE_TOOLS=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.node_condition import GPU_UNRECOVERABLE, NodeCondition
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.exporter import (
    GPU_METRICS,
    RELOAD_RESULTS,
    RESTART_REASONS,
    TICK_BUCKETS_S,
    Exporter,
)
from llmsupervisor.daemon.status import DaemonCounters, Snapshot
from llmsupervisor.detectors import Finding, FindingKind, Severity
from llmsupervisor.detectors.load import ServedLoad
from llmsupervisor.engine.status import EngineStatus, Incarnation
from llmsupervisor.http_api import HttpApi, Response
from llmsupervisor.probes.gpu_readings import NvmlHealth
from tests.lib.paths import REPO

ALERTS = REPO / "packaging" / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO / "tests" / "prometheus" / "alerts_test.yml"
DASHBOARD = REPO / "packaging" / "grafana" / "llm-supervisor.json"

# Series the rules use that a later module (the detectors) will export; not the exporter's yet.
FUTURE_SERIES = frozenset({"llmsupervisor_finding_active"})

NOW_S = 10_000.0


def engine(name: str, state: EngineState, gpus: tuple[int, ...], port: int, **changes: Any) -> EngineStatus:
    """A published status as the runner builds it, aged against the snapshot's NOW_S."""
    spec_fields = {k: changes.pop(k) for k in ("start_timeout_s",) if k in changes}
    spec = EngineSpec(name=name, model="m", gpus=gpus, port=port, **spec_fields)
    return EngineStatus(name=name, spec=spec, state=state, **{"state_reason": "", **changes})


def finding(kind: FindingKind, severity: Severity, summary: str) -> Finding:
    return Finding(engine="gpu0", kind=kind, severity=severity, evidence={}, since_s=0.0, summary=summary)


GPU0 = engine(
    "gpu0",
    EngineState.READY,
    (0,),
    8001,
    state_reason="checks passed",
    state_since_s=NOW_S - 12.5,
    incarnation=Incarnation(number=1, pid=4242, pgid=4242, step=1, started_s=0.0),
    restarts_total=3,
    restarts_by_reason={"crash": 2, "engine_dead": 1},
    state_changes_total=7,
    canary_latency_s=0.125,
    start_timeout_s=900.0,
    canary_requests_total=40,
    served=ServedLoad(
        span_s=58.0,
        requests_per_s=2.5,
        prompt_tokens_per_s=400.0,
        generation_tokens_per_s=120.0,
        canary_requests=20,
    ),
    ladder_step=1,
    ladder_steps=2,
    findings=(finding(FindingKind.KV_PRESSURE, Severity.WARNING, "KV cache 97% full"),),
)
TP2 = engine(
    "tp2",
    EngineState.FATAL,
    (1, 2),
    8002,
    state_reason="crash loop: 5 failures in 300 s",
    state_since_s=NOW_S + 0.5,  # a snapshot taken across a clock step must not export a negative age
    restarts_total=5,
    restarts_by_reason={"start_failed": 4, "cuda_init": 1},
    state_changes_total=11,
    start_timeout_s=600.0,
    down_since_s=NOW_S - 1234.0,
)
HELD = engine(
    "held",
    EngineState.DRAINING,
    (3,),
    8003,
    state_reason="operator drain",
    state_since_s=NOW_S - 30.0,
    incarnation=Incarnation(number=1, pid=4343, pgid=4343, step=0, started_s=0.0),
    held=True,
)
SNAPSHOT = Snapshot(
    engines=(GPU0, TP2, HELD),
    now_s=NOW_S,
    counters=DaemonCounters(
        ticks_total=1234,
        last_tick_duration_s=0.004,
        notify_failures_total=2,
        config_path="/etc/llm-supervisor/config.yaml",
        config_loaded_timestamp_s=1_790_000_000.5,
        reloads_total={"ok": 3, "invalid": 1},
        probe_errors_total={("proc_sweep", "EMFILE"): 4},
        open_fds=120,
        fds_limit=524288,
    ),
    actions_total={"gpu0": {("step_down", "kv_pressure"): 1}},
    last_action_at={"gpu0": {"step_down": 1_790_000_100.0}},
    gpu_faults_marked={1: 2},
    node_conditions=(NodeCondition(GPU_UNRECOVERABLE, 1, "gpu_fault (fault 2): xid 48 on GPU 1"),),
    nvml=NvmlHealth(up=True, since_s=NOW_S - 60, attempts=1, gpus=2),
)
GPU_SAMPLES: Mapping[int, Mapping[str, float]] = {
    0: {
        "temperature_celsius": 71.0,
        "power_watts": 312.5,
        "power_limit_watts": 700.0,
        "sm_clock_hertz": 1.98e9,
        "xid_errors_total": 0,
        "throttle_reason/hw_slowdown": 0,
        "throttle_reason/sw_power_cap": 1,
    },
    1: {"temperature_celsius": 88.0, "throttle_reason/sw_thermal": 1},
}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.fixture
def exporter() -> Exporter:
    return Exporter(lambda: SNAPSHOT, gpu_samples=lambda: GPU_SAMPLES)


# ---- families from a hand-made snapshot ----


@pytest.mark.parametrize("state", list(EngineState), ids=str)
def test_engine_state_has_one_series_per_state(exporter: Exporter, state: EngineState) -> None:
    reg = exporter.registry
    expected_gpu0 = 1.0 if state is EngineState.READY else 0.0
    expected_tp2 = 1.0 if state is EngineState.FATAL else 0.0
    assert value(reg, "llmsupervisor_engine_state", engine="gpu0", state=state.value) == expected_gpu0
    assert value(reg, "llmsupervisor_engine_state", engine="tp2", state=state.value) == expected_tp2


def test_engine_gauges(exporter: Exporter) -> None:
    reg = exporter.registry
    assert value(reg, "llmsupervisor_engine_up", engine="gpu0") == 1.0
    assert value(reg, "llmsupervisor_engine_up", engine="tp2") == 0.0
    assert value(reg, "llmsupervisor_engine_in_rotation", engine="gpu0") == 1.0
    assert value(reg, "llmsupervisor_engine_in_rotation", engine="tp2") == 0.0
    assert value(reg, "llmsupervisor_engine_state_age_seconds", engine="gpu0") == 12.5
    assert value(reg, "llmsupervisor_engine_state_age_seconds", engine="tp2") == 0.0
    assert value(reg, "llmsupervisor_engine_canary_latency_seconds", engine="gpu0") == 0.125
    assert value(reg, "llmsupervisor_engine_canary_latency_seconds", engine="tp2") is None
    gpu0_model = next(e.spec.model_id for e in SNAPSHOT.engines if e.name == "gpu0")
    tp2_model = next(e.spec.model_id for e in SNAPSHOT.engines if e.name == "tp2")
    assert (
        value(reg, "llmsupervisor_engine_info", engine="gpu0", port="8001", gpus="0", model=gpu0_model) == 1.0
    )
    assert (
        value(reg, "llmsupervisor_engine_info", engine="tp2", port="8002", gpus="1,2", model=tp2_model) == 1.0
    )


def test_build_info_and_the_daemons_own_process_metrics(exporter: Exporter) -> None:
    """Issue 26 (11): the version and Python in labels, and the daemon's RSS, CPU and descriptors
    from prometheus-client's ProcessCollector, in the exporter's own registry."""
    import platform

    from llmsupervisor import __version__

    reg = exporter.registry
    labels = {"version": __version__, "python": platform.python_version()}
    assert value(reg, "llmsupervisor_build_info", **labels) == 1.0
    rss = value(reg, "llmsupervisor_process_resident_memory_bytes")
    assert rss is not None and rss > 0
    assert (value(reg, "llmsupervisor_process_cpu_seconds_total") or 0.0) > 0
    assert (value(reg, "llmsupervisor_process_open_fds") or 0.0) > 0
    # A second exporter in the same process registers them again without a clash.
    assert Exporter(lambda: SNAPSHOT).render()


def test_operator_hold_start_allowance_and_down_time(exporter: Exporter) -> None:
    reg = exporter.registry
    assert value(reg, "llmsupervisor_engine_held_by_operator", engine="held") == 1.0
    assert value(reg, "llmsupervisor_engine_held_by_operator", engine="gpu0") == 0.0
    assert value(reg, "llmsupervisor_engine_start_timeout_seconds", engine="gpu0") == 900.0
    assert value(reg, "llmsupervisor_engine_down_seconds", engine="tp2") == 1234.0
    assert value(reg, "llmsupervisor_engine_down_seconds", engine="held") == 0.0
    assert value(reg, "llmsupervisor_engine_down_seconds", engine="gpu0") == 0.0


def test_canaries_and_served_load(exporter: Exporter) -> None:
    reg = exporter.registry
    assert value(reg, "llmsupervisor_engine_canary_requests_total", engine="gpu0") == 40.0
    assert value(reg, "llmsupervisor_engine_canary_requests_total", engine="tp2") == 0.0
    assert value(reg, "llmsupervisor_engine_served_requests_per_second", engine="gpu0") == 2.5
    assert value(reg, "llmsupervisor_engine_served_generation_tokens_per_second", engine="gpu0") == 120.0
    assert value(reg, "llmsupervisor_engine_served_requests_per_second", engine="tp2") is None


def test_engine_counters(exporter: Exporter) -> None:
    reg = exporter.registry
    restarts = "llmsupervisor_engine_restarts_total"
    assert value(reg, restarts, engine="gpu0", reason="crash") == 2.0
    assert value(reg, restarts, engine="gpu0", reason="engine_dead") == 1.0
    assert value(reg, restarts, engine="tp2", reason="start_failed") == 4.0
    assert value(reg, restarts, engine="tp2", reason="cuda_init") == 1.0  # an unlisted cause still shows
    # Known causes are there at 0 before they first happen, so increase() counts the first one.
    for reason in RESTART_REASONS:
        assert value(reg, restarts, engine="gpu0", reason=reason) is not None
    assert value(reg, restarts, engine="gpu0", reason="operator") == 0.0
    assert value(reg, "llmsupervisor_engine_state_changes_total", engine="gpu0") == 7.0
    assert value(reg, "llmsupervisor_engine_state_changes_total", engine="tp2") == 11.0


def test_daemon_families(exporter: Exporter) -> None:
    reg = exporter.registry
    assert value(reg, "llmsupervisor_ticks_total") == 1234.0
    assert value(reg, "llmsupervisor_notify_failures_total") == 2.0
    assert value(reg, "llmsupervisor_config_loaded_timestamp_seconds") == 1_790_000_000.5
    assert value(reg, "llmsupervisor_config_reloads_total", result="ok") == 3.0
    assert value(reg, "llmsupervisor_config_reloads_total", result="invalid") == 1.0
    assert value(reg, "llmsupervisor_marked_gpu_faults_total", gpu="1") == 2.0
    assert value(reg, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="1") == 1.0
    assert value(reg, "llmsupervisor_node_condition", condition="gpu_unrecoverable", gpu="0") is None


def test_an_empty_snapshot_still_has_the_daemon_series_and_seeded_counters() -> None:
    reg = Exporter(lambda: Snapshot(engines=())).registry
    assert value(reg, "llmsupervisor_ticks_total") == 0.0
    for result in RELOAD_RESULTS:
        assert value(reg, "llmsupervisor_config_reloads_total", result=result) == 0.0
    # 0 means "never loaded": no 1970 timestamp for dashboards to subtract from now.
    assert value(reg, "llmsupervisor_config_loaded_timestamp_seconds") is None
    assert value(reg, "llmsupervisor_engine_up", engine="gpu0") is None


def test_tick_duration_histogram(exporter: Exporter) -> None:
    reg = exporter.registry
    name = "llmsupervisor_tick_duration_seconds"
    assert TICK_BUCKETS_S[0] == 0.001 and TICK_BUCKETS_S[-1] == 5.0
    for seconds in (0.0005, 0.004, 0.3, 1.5, 7.0):
        exporter.observe_tick(seconds)
    assert value(reg, name + "_count") == 5.0
    assert value(reg, name + "_sum") == pytest.approx(8.8045)
    assert value(reg, name + "_bucket", le="0.001") == 1.0
    assert value(reg, name + "_bucket", le="0.005") == 2.0
    assert value(reg, name + "_bucket", le="1.0") == 3.0
    assert value(reg, name + "_bucket", le="5.0") == 4.0
    assert value(reg, name + "_bucket", le="+Inf") == 5.0


def test_engine_observation_histogram(exporter: Exporter) -> None:
    reg = exporter.registry
    name = "llmsupervisor_engine_observation_seconds"
    for seconds in (0.004, 0.02, 3.0):
        exporter.observe_engine_round("gpu0", seconds)
    exporter.observe_engine_round("gpu1", 0.3)
    assert value(reg, name + "_count", engine="gpu0") == 3.0
    assert value(reg, name + "_bucket", engine="gpu0", le="0.025") == 2.0
    assert value(reg, name + "_bucket", engine="gpu0", le="2.5") == 2.0
    assert value(reg, name + "_sum", engine="gpu1") == pytest.approx(0.3)
    exporter.forget_engine("gpu1")
    exporter.forget_engine("never-seen")
    assert value(reg, name + "_count", engine="gpu1") is None
    assert value(reg, name + "_count", engine="gpu0") == 3.0


def test_each_scrape_reads_the_latest_snapshot() -> None:
    current = [SNAPSHOT]
    exporter = Exporter(lambda: current[0])
    assert value(exporter.registry, "llmsupervisor_ticks_total") == 1234.0
    current[0] = Snapshot(engines=(), counters=DaemonCounters(ticks_total=1235))
    assert value(exporter.registry, "llmsupervisor_ticks_total") == 1235.0
    assert b"llmsupervisor_ticks_total 1235.0" in exporter.render()


def test_own_registry_never_the_global_one() -> None:
    first = Exporter(lambda: SNAPSHOT)
    second = Exporter(lambda: Snapshot(engines=(), counters=DaemonCounters(ticks_total=1)))
    assert first.registry is not REGISTRY and first.registry is not second.registry
    assert value(first.registry, "llmsupervisor_ticks_total") == 1234.0
    assert value(second.registry, "llmsupervisor_ticks_total") == 1.0
    assert all(not m.name.startswith("llmsupervisor_") for m in REGISTRY.collect())
    # An injected registry is used as given.
    mine = CollectorRegistry()
    assert Exporter(lambda: SNAPSHOT, registry=mine).registry is mine


def test_render_and_content_type(exporter: Exporter) -> None:
    assert exporter.content_type.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(exporter.render().decode())}
    assert families["llmsupervisor_engine_restarts"].type == "counter"
    assert families["llmsupervisor_tick_duration_seconds"].type == "histogram"
    for name, family in families.items():
        assert name.startswith("llmsupervisor_"), name
        assert family.documentation, name


def test_registering_does_not_call_snapshot() -> None:
    calls = []

    def snapshot() -> Snapshot:
        calls.append(1)
        return SNAPSHOT

    exporter = Exporter(snapshot)
    assert calls == []
    exporter.render()
    assert calls == [1]


# ---- GPU extension point ----


def test_gpu_samples_become_per_gpu_series(exporter: Exporter) -> None:
    reg = exporter.registry
    assert value(reg, "llmsupervisor_gpu_temperature_celsius", gpu="0") == 71.0
    assert value(reg, "llmsupervisor_gpu_temperature_celsius", gpu="1") == 88.0
    assert value(reg, "llmsupervisor_gpu_power_watts", gpu="0") == 312.5
    assert value(reg, "llmsupervisor_gpu_power_limit_watts", gpu="0") == 700.0
    assert value(reg, "llmsupervisor_gpu_sm_clock_hertz", gpu="0") == 1.98e9
    assert value(reg, "llmsupervisor_gpu_power_watts", gpu="1") is None
    throttle = "llmsupervisor_gpu_throttle_reason"
    assert value(reg, throttle, gpu="0", reason="hw_slowdown") == 0.0
    assert value(reg, throttle, gpu="0", reason="sw_power_cap") == 1.0
    assert value(reg, throttle, gpu="1", reason="sw_thermal") == 1.0
    families = {f.name: f for f in reg.collect()}
    assert families["llmsupervisor_gpu_xid_errors"].type == "counter"
    assert families["llmsupervisor_gpu_temperature_celsius"].type == "gauge"


def test_gpu_names_are_checked_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    samples = {
        0: {
            "future_reading_ratio": 0.5,  # undocumented but well formed: exported
            "Bad-Name": 1.0,
            "temperature_celsius/extra": 1.0,  # a label value for an unlabelled family
            "throttle_reason": 1.0,  # a labelled family without its label value
            "throttle_reason/bad value": 1.0,
        }
    }
    exporter = Exporter(lambda: SNAPSHOT, gpu_samples=lambda: samples)
    with caplog.at_level(logging.WARNING, logger="llmsupervisor.daemon.exporter"):
        exporter.render()
        exporter.render()
    reg = exporter.registry
    assert value(reg, "llmsupervisor_gpu_future_reading_ratio", gpu="0") == 0.5
    names = {s.name for m in reg.collect() for s in m.samples if s.name.startswith("llmsupervisor_gpu_")}
    assert names == {"llmsupervisor_gpu_future_reading_ratio"}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 4, warned  # one per bad name, not one per scrape


def test_a_failing_gpu_probe_drops_only_the_gpu_series(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Mapping[int, Mapping[str, float]]:
        raise OSError("NVML went away")

    exporter = Exporter(lambda: SNAPSHOT, gpu_samples=broken)
    with caplog.at_level(logging.WARNING, logger="llmsupervisor.daemon.exporter"):
        text = exporter.render().decode()
    assert "llmsupervisor_ticks_total 1234.0" in text
    assert "llmsupervisor_gpu_" not in text
    assert any("GPU samples unavailable" in r.getMessage() for r in caplog.records)


def test_gpu_metric_names_are_documented_with_units() -> None:
    for name, metric in GPU_METRICS.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert metric.help.endswith("."), name
    assert GPU_METRICS["throttle_reason"].label == "reason"


# ---- the monitoring files ----


def emitted_series() -> set[str]:
    """Every sample name the exporter can emit (all GPU names fed, one tick and one engine round
    observed)."""
    gpu = {name if m.label is None else f"{name}/hw_slowdown": 1.0 for name, m in GPU_METRICS.items()}
    exporter = Exporter(lambda: SNAPSHOT, gpu_samples=lambda: {0: gpu})
    exporter.observe_tick(0.01)
    exporter.observe_engine_round("gpu0", 0.02)
    return {s.name for m in exporter.registry.collect() for s in m.samples}


PROMQL_NAME = re.compile(r"\bllmsupervisor_[a-z0-9_]+")


def dashboard_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, item in node.items():
            if key in ("expr", "definition") and isinstance(item, str):
                yield item
            elif key == "query" and isinstance(item, str) and "(" in item:
                yield item  # a variable's label_values(...) query
            else:
                yield from dashboard_exprs(item)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_exprs(item)


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_dashboard_parses_and_uses_the_datasource_variable() -> None:
    dash = load_dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in (
        "state",
        "restart",
        "canary",
        "tick",
        "observation",
        "gpu temperature",
        "gpu power",
        "gpu memory",
        "shedding",
        "findings by kind",
        "actions by kind and reason",
        "batch step",
        "served load",
    ):
        assert topic in titles, topic
    timeline = next(p for p in panels if p["type"] == "state-timeline")
    shown = {m["text"] for m in timeline["fieldConfig"]["defaults"]["mappings"][0]["options"].values()}
    assert shown == {s.name for s in EngineState}, "the state timeline must map every state"


def test_dashboard_queries_only_series_the_exporter_emits() -> None:
    emitted = emitted_series()
    exprs = list(dashboard_exprs(load_dashboard()))
    assert len(exprs) >= 15
    for expr in exprs:
        names = PROMQL_NAME.findall(expr)
        assert names, f"no llmsupervisor_ series in {expr!r}"
        unknown = set(names) - emitted
        assert not unknown, f"{expr!r} uses {unknown}, which the exporter does not emit"


def test_alert_rules_use_only_emitted_or_announced_series() -> None:
    emitted = emitted_series() | FUTURE_SERIES
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == 17
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        unknown = set(PROMQL_NAME.findall(rule["expr"])) - emitted
        assert not unknown, f"{rule['alert']} uses {unknown}"


# ---- promtool ----


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("LLMSUP_REQUIRE_TOOLS") == "1":
            pytest.fail("promtool is required (LLMSUP_REQUIRE_TOOLS=1): apt-get install -y prometheus")
        pytest.skip("promtool not installed (apt-get install -y prometheus)")
    return path


def run_promtool(promtool: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def scrape(exporter: Exporter) -> httpx.Response:
    api = HttpApi(
        {"/metrics": lambda: Response(body=exporter.render(), content_type=exporter.content_type)}, {}
    )
    await api.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return await client.get(f"http://127.0.0.1:{api.port}/metrics")
    finally:
        await api.close()


@pytest.mark.parametrize(
    "snapshot",
    [SNAPSHOT, Snapshot(engines=())],
    ids=["full", "empty"],
)
def test_promtool_check_metrics_on_a_live_scrape_is_clean(promtool: str, snapshot: Snapshot) -> None:
    gpu = {name if m.label is None else f"{name}/hw_thermal": 1.0 for name, m in GPU_METRICS.items()}
    exporter = Exporter(lambda: snapshot, gpu_samples=lambda: {0: gpu, 1: gpu})
    exporter.observe_tick(0.02)
    response = asyncio.run(scrape(exporter))
    assert response.status_code == 200
    assert response.headers["content-type"] == exporter.content_type
    assert b"llmsupervisor_gpu_throttle_reason" in response.content
    result = run_promtool(promtool, "check", "metrics", stdin=response.content)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_promtool_check_rules(promtool: str) -> None:
    result = run_promtool(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 17 rules found" in result.stdout


def test_dashboard_promql_parses(promtool: str, tmp_path: Path) -> None:
    # Grafana's variables replaced by what they expand to; each expr checked as a recording rule.
    substitutions = {"$__rate_interval": "5m", "$instance": ".*", "$engine": ".*"}
    rules = []
    for i, expr in enumerate(dashboard_exprs(load_dashboard())):
        if expr.startswith("label_values("):
            continue
        for var, replacement in substitutions.items():
            expr = expr.replace(var, replacement)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_rule_has_a_firing_and_a_quiet_case() -> None:
    rules = {
        rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    }
    cases = [
        case for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"] for case in test["alert_rule_test"]
    ]
    firing = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert firing == rules, f"rules without a firing case: {rules - firing}"
    assert quiet == rules, f"rules without a quiet case: {rules - quiet}"


def test_promtool_alert_rules(promtool: str, tmp_path: Path) -> None:
    """tests/prometheus/alerts_test.yml through `promtool test rules`, against a copy of the rules
    without annotations: promtool compares annotations exactly, and the expressions, `for` and
    labels are what is under test."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations")
    spec = yaml.safe_load(ALERTS_TEST.read_text())
    (rule_file,) = spec["rule_files"]
    (tmp_path / rule_file).write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    result = run_promtool(promtool, "test", "rules", str(tmp_path / ALERTS_TEST.name))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout
