"""The daemon's own Prometheus metrics: one custom Collector over the latest ``Snapshot``.

Everything lives in the exporter's own ``CollectorRegistry`` (never the process-global
``REGISTRY``), so two daemons in one test process cannot see each other's series and nothing
a library registers globally leaks into ``/metrics``.

::

    engine statuses ──► Snapshot (immutable) ◄── snapshot() ── _SnapshotCollector ─┐
    latest GPU sample ─► gpu_samples() ─────────────────────────────────┘          │
    loop, per tick ──► Exporter.observe_tick(s) ──► Histogram ──────────────────────┤
    loop, per round seen ► Exporter.observe_engine_round(name, s) ─► Histogram ───────┤
                                                                                     ▼
                                          Exporter.render() = generate_latest(registry)

Families (all prefixed ``llmsupervisor_``):

=====================================  =========  ==========================================
name                                   type       labels
=====================================  =========  ==========================================
engine_state                           gauge      engine, state (one series per EngineState)
engine_up                              gauge      engine
engine_in_rotation                     gauge      engine
engine_state_age_seconds               gauge      engine
engine_restarts_total                  counter    engine, reason
engine_state_changes_total             counter    engine
engine_canary_latency_seconds          gauge      engine (absent until a canary has run)
engine_info                            gauge      engine, port, gpus, model (always 1)
engine_actions_total                   counter    engine, kind, reason (policy actions)
engine_last_action_timestamp_seconds   gauge      engine, kind
engine_batch_step                      gauge      engine (0: the engine's own flags; n: n steps down)
engine_requests_running                gauge      engine (absent while unknown)
engine_requests_waiting                gauge      engine (the queue; absent while unknown)
engine_kv_cache_usage_ratio            gauge      engine (0 to 1; absent while unknown)
engine_ttft_p95_seconds                gauge      engine (last 60 s; absent without requests)
engine_held_by_operator                gauge      engine (1: drained, stopped or disabled on purpose)
engine_start_timeout_seconds           gauge      engine (its start_timeout_s)
engine_down_seconds                    gauge      engine (meant to serve and not serving; 0 while
                                                  READY, SHEDDING or held by an operator)
engine_canary_requests_total           counter    engine (the supervisor's canaries: not traffic)
engine_served_requests_per_second      gauge      engine (last minute, canaries excluded; absent
                                                  until two /metrics readings)
engine_served_generation_tokens_per_second  gauge  engine (likewise)
engine_incidents_total                 counter    engine (hang/stall stacks kept before a kill)
finding_active                         gauge      engine, finding, severity
marked_gpu_faults_total                counter    gpu (faults the policy restarted an engine for)
nvml_up                                gauge      reason (1 open; 0 not: driver_not_loaded, ...)
nvml_open_attempts_total               counter
nvml_event_wait_errors_total           counter    (an NVML error rebuilds the event set)
engines_waiting_for_nvml               gauge      (named by GPU index, waiting at start)
engines_waiting_for_gpu_fabric         gauge      (their GPUs' NVSwitch fabric not registered)
engines_on_gpus                        gauge      (enabled engines configured on GPUs)
nvml_hung_gpu                          gauge      gpu (calls stopped answering: taken as lost)
ticks_total                            counter
notify_failures_total                  counter
config_loaded_timestamp_seconds        gauge      (absent while 0: never loaded)
config_reloads_total                   counter    result
probe_errors_total                     counter    probe, error (probes that raised: EMFILE, ...)
open_fds                               gauge      (absent when it cannot be read)
max_fds                                gauge      (the soft RLIMIT_NOFILE)
state_files_unsaved                    gauge      (state files kept from a failed write: a full disk)
tick_duration_seconds                  histogram
build_info                             gauge      version, python (always 1)
process_*                              see below  (prometheus-client's ProcessCollector)
engine_observation_seconds             histogram  engine
gpu_<name>                             see below  gpu (and ``reason`` for throttle_reason)
=====================================  =========  ==========================================

``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ``process_open_fds``,
``process_max_fds``, ``process_virtual_memory_bytes`` and ``process_start_time_seconds`` are the
daemon's own, read from /proc/self by prometheus-client's ``ProcessCollector`` (absent where there
is no /proc). ``open_fds`` and ``max_fds`` above predate them and stay for existing alerts.

``engine_state`` is a plain gauge with a ``state`` label rather than a ``StateSetMetricFamily``:
the text format renders a state set's label with the family's own name
(``llmsupervisor_engine_state="ready"``), which makes every query longer for no gain.

GPU metrics are the extension point for the NVML probe. ``gpu_samples()`` returns, per GPU index,
a mapping from a name to a value; each becomes ``llmsupervisor_gpu_<name>{gpu="<index>"}``.
The names the probe is expected to supply, with their help text, are in ``GPU_METRICS``. A name
of the form ``throttle_reason/<reason>`` becomes ``llmsupervisor_gpu_throttle_reason{gpu, reason}``
(1 while that throttle reason is active, else 0). Names ending in ``_total`` are exported as
counters. An undocumented but well-formed name is still exported, with a generic help text; a
malformed one is skipped and logged once.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmsupervisor import __version__
from llmsupervisor.core.policy import RESTART_CAUSES
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.status import Snapshot
from llmsupervisor.engine.status import EngineStatus
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import CLOCK_EVENT_REASONS, GpuSample

log = logging.getLogger(__name__)

PREFIX: Final = "llmsupervisor_"

# 1 ms to 5 s: a healthy tick is under 1 ms at 8 engines, 2 ms at 64, an engine's observation
# round 10-100 ms (docs/benchmarks.md); the alert thresholds (1 s, 2.5 s) are bucket edges.
TICK_BUCKETS_S: Final[tuple[float, ...]] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)

# Restart causes exported at 0 before they first happen. A counter series that appears with
# value 1 is invisible to increase()/rate() over that first step, so an alert on "more than N
# restarts" would miss the first one of each cause. Causes not listed here are still exported.
RESTART_REASONS: Final[tuple[str, ...]] = RESTART_CAUSES

# Same reasoning for config reload results.
RELOAD_RESULTS: Final[tuple[str, ...]] = ("ok", "invalid")

GpuSamples = Callable[[], Mapping[int, Mapping[str, float]]]

# Per-engine gauges an autoscaler reads (packaging/kubernetes/autoscaling): the queue, recent
# TTFT p95 and KV-cache pressure, with engine_in_rotation to leave loading engines out.
AUTOSCALING_GAUGES: Final[tuple[str, ...]] = (
    PREFIX + "engine_requests_waiting",
    PREFIX + "engine_requests_running",
    PREFIX + "engine_kv_cache_usage_ratio",
    PREFIX + "engine_ttft_p95_seconds",
    PREFIX + "engine_in_rotation",
)


@dataclass(frozen=True, slots=True)
class GpuMetric:
    help: str
    label: str | None = None  # for "name/<value>" keys: the label the value goes into


# The names a GPU probe (NVML) is expected to supply; exported as llmsupervisor_gpu_<name>.
GPU_METRICS: Final[Mapping[str, GpuMetric]] = {
    "temperature_celsius": GpuMetric("GPU core temperature in degrees Celsius."),
    "memory_temperature_celsius": GpuMetric("GPU memory (HBM) temperature in degrees Celsius."),
    "power_watts": GpuMetric("GPU power draw in watts."),
    "power_limit_watts": GpuMetric("GPU enforced power limit in watts."),
    "energy_joules_total": GpuMetric("GPU energy consumed since the driver loaded, in joules."),
    "sm_clock_hertz": GpuMetric("GPU SM clock in hertz."),
    "memory_clock_hertz": GpuMetric("GPU memory clock in hertz."),
    "max_sm_clock_hertz": GpuMetric("GPU maximum SM clock in hertz."),
    "utilization_ratio": GpuMetric("GPU busy fraction over the driver's sample period, 0 to 1."),
    "memory_used_bytes": GpuMetric("GPU memory in use in bytes."),
    "memory_total_bytes": GpuMetric("GPU memory installed in bytes."),
    "slowdown_temperature_celsius": GpuMetric(
        "The board's own slowdown temperature threshold in degrees Celsius (NVML)."
    ),
    "memory_reserved_bytes": GpuMetric(
        "GPU memory reserved by the driver and firmware in bytes (nvmlMemory_v2); not in memory_used."
    ),
    "events_watched": GpuMetric(
        "1 while the GPU's NVML events (XIDs, ECC, poison) are watched, 0 when it was left out of the"
        " event set after a failed registration (docs/gpu.md)."
    ),
    "recovery_action": GpuMetric(
        "The GPU's recovery action (NVML field 230): 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P,"
        " 4 drain and reset, 6 bus reset, 7 system reboot."
    ),
    "thermal_throttle_seconds_total": GpuMetric(
        "Time the GPU clocks were held back for heat (software and hardware thermal slowdown) since"
        " the driver loaded, in seconds."
    ),
    "power_brake_seconds_total": GpuMetric(
        "Time the GPU clocks were held back by the external power brake since the driver loaded, in seconds."
    ),
    "fabric_ready": GpuMetric(
        "1 while the GPU is registered with its NVSwitch fabric (NVML fabric state COMPLETED with"
        " success), 0 while it is not (Fabric Manager not running, still at it, or failed): CUDA cannot"
        " start there. Absent for a GPU outside an NVSwitch fabric."
    ),
    "fan_speed_ratio": GpuMetric("GPU fan speed as a fraction of its maximum, 0 to 1."),
    "xid_errors_total": GpuMetric("XID error events seen on the GPU since the daemon started."),
    "ecc_uncorrected_errors_total": GpuMetric("Uncorrected ECC errors reported by the GPU."),
    "throttle_reason": GpuMetric(
        "1 while the GPU clocks are held back for this reason (NVML clock event reasons: "
        "gpu_idle, applications_clocks, sw_power_cap, hw_slowdown, sync_boost, sw_thermal, "
        "hw_thermal, hw_power_brake, display_clocks, board_limit, reliability), else 0.",
        label="reason",
    ),
}


def gpu_metric_values(latest: Mapping[int, GpuSample | ProbeFailure]) -> dict[int, dict[str, float]]:
    """The GPU monitor's latest samples under the GPU_METRICS names (failed samples left out)."""
    out: dict[int, dict[str, float]] = {}
    for index, sample in latest.items():
        if not isinstance(sample, GpuSample):
            continue
        values: dict[str, float] = {}
        pairs: tuple[tuple[str, float | int | None, float], ...] = (
            ("temperature_celsius", sample.temperature_c, 1.0),
            ("slowdown_temperature_celsius", sample.slowdown_temperature_c, 1.0),
            ("power_watts", sample.power_w, 1.0),
            ("power_limit_watts", sample.power_limit_w, 1.0),
            ("sm_clock_hertz", sample.sm_clock_mhz, 1e6),
            ("memory_clock_hertz", sample.mem_clock_mhz, 1e6),
            ("utilization_ratio", sample.utilization_gpu_pct, 0.01),
            ("memory_used_bytes", sample.memory_used_bytes, 1.0),
            ("memory_total_bytes", sample.memory_total_bytes, 1.0),
            ("memory_reserved_bytes", sample.memory_reserved_bytes, 1.0),
            ("ecc_uncorrected_errors_total", sample.ecc_uncorrected_volatile, 1.0),
            ("recovery_action", sample.recovery_action, 1.0),
            ("thermal_throttle_seconds_total", sample.thermal_throttle_ns, 1e-9),
            ("power_brake_seconds_total", sample.power_brake_ns, 1e-9),
        )
        for name, value, scale in pairs:
            if value is not None:
                values[name] = float(value) * scale
        values["events_watched"] = 0.0 if sample.events_unwatched is not None else 1.0
        if sample.fabric is not None and sample.fabric.on_nvswitch:
            values["fabric_ready"] = 0.0 if sample.fabric.problem is not None else 1.0
        if sample.clock_event_reasons is not None:
            active = sample.clock_event_reason_names
            for reason in CLOCK_EVENT_REASONS.values():
                values[f"throttle_reason/{reason}"] = 1.0 if reason in active else 0.0
        out[index] = values
    return out


_NAME_RE: Final = re.compile(r"[a-z][a-z0-9_]*\Z")
_LABEL_VALUE_RE: Final = re.compile(r"[A-Za-z0-9_.:-]+\Z")


def _name(suffix: str) -> str:
    return PREFIX + suffix


class Exporter:
    """The daemon's Prometheus exporter.

    ``snapshot`` is called on every scrape and builds an immutable ``Snapshot`` from the engines'
    published statuses (daemon/status.py), so a scrape is self-consistent. ``gpu_samples`` is
    optional and may raise; a failure drops the GPU families from that scrape and is logged, the
    rest of the scrape still works.
    The loop calls ``observe_tick(seconds)`` once per completed tick, and
    ``observe_engine_round(name, seconds)`` once per engine observation round it sees published.
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        *,
        gpu_samples: GpuSamples | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = _SnapshotCollector(snapshot, gpu_samples)
        self.registry.register(self._collector)
        # The daemon's own RSS, CPU seconds, descriptors and start time, from /proc/self
        # (llmsupervisor_process_*); in this registry, not the global one.
        ProcessCollector(namespace=PREFIX.rstrip("_"), registry=self.registry)
        Info(
            _name("build"),
            "The daemon's version and the Python that runs it; always 1.",
            registry=self.registry,
        ).info({"version": __version__, "python": platform.python_version()})
        self._tick_duration = Histogram(
            _name("tick_duration_seconds"),
            # Engines are probed in their own tasks, not in this tick (bench/overhead measures their
            # rounds from outside): what this times is the loop's own housekeeping.
            "Wall time of the supervisor's own tick (engine task checks, status file, sd_notify), "
            "in seconds; engine probes run in each engine's task and are not included.",
            buckets=TICK_BUCKETS_S,
            registry=self.registry,
        )

        self._engine_round = Histogram(
            _name("engine_observation_seconds"),
            # What an engine's tick costs, as bench/overhead measures it from outside: the gap
            # between two /metrics scrapes of one engine, less tick_interval_s.
            "Wall time of one engine's observation round (probes, parsing, detectors), waits for "
            "the event loop that every engine shares included, in seconds.",
            ["engine"],
            buckets=TICK_BUCKETS_S,
            registry=self.registry,
        )

    @property
    def content_type(self) -> str:
        # The 0.0.4 text format: what generate_latest() writes, and what every Prometheus parses.
        return CONTENT_TYPE_PLAIN_0_0_4

    def observe_tick(self, seconds: float) -> None:
        self._tick_duration.observe(seconds)

    def observe_engine_round(self, engine: str, seconds: float) -> None:
        self._engine_round.labels(engine=engine).observe(seconds)

    def forget_engine(self, engine: str) -> None:
        """Drop a removed engine's round histogram (its other series go with the snapshot)."""
        with contextlib.suppress(KeyError):
            self._engine_round.remove(engine)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The per-engine families with one value each (absent where the value is None): name, type, help,
# and how to read it from an engine's status in the snapshot. One table, filled in the collector's
# one loop over engines.
_ENGINE_SCALARS: Final[
    tuple[
        tuple[
            str,
            type[GaugeMetricFamily | CounterMetricFamily],
            str,
            Callable[[Snapshot, EngineStatus], float | None],
        ],
        ...,
    ]
] = (
    (
        "engine_requests_running",
        GaugeMetricFamily,
        "Requests the engine is running now.",
        lambda _, e: e.load.requests_running if e.load else None,
    ),
    (
        "engine_requests_waiting",
        GaugeMetricFamily,
        "Requests queued in the engine now.",
        lambda _, e: e.load.requests_waiting if e.load else None,
    ),
    (
        "engine_kv_cache_usage_ratio",
        GaugeMetricFamily,
        "Fraction of the engine's KV cache in use, 0 to 1.",
        lambda _, e: e.load.kv_usage_ratio if e.load else None,
    ),
    (
        "engine_ttft_p95_seconds",
        GaugeMetricFamily,
        "95th percentile time to first token over the last 60 seconds, in seconds.",
        lambda _, e: e.load.ttft_p95_s if e.load else None,
    ),
    (
        "engine_held_by_operator",
        GaugeMetricFamily,
        "1 while an operator holds the engine out of service (drained, stopped or disabled), else 0.",
        lambda _, e: float(e.held_by_operator),
    ),
    (
        "engine_start_timeout_seconds",
        GaugeMetricFamily,
        "The engine's start_timeout_s: a start younger than this is not an engine down.",
        lambda _, e: e.spec.start_timeout_s,
    ),
    (
        "engine_down_seconds",
        GaugeMetricFamily,
        "Seconds the engine has been meant to serve and not serving (starting, restarting, "
        "backoff, fatal); 0 while it serves (READY, SHEDDING) or an operator holds it out.",
        lambda snap, e: snap.down_s(e),
    ),
    (
        "engine_canary_requests",
        CounterMetricFamily,
        "Canary requests the supervisor sent that the engine answered; vLLM counts them as "
        "requests, so subtract them from its request counters to get client traffic.",
        lambda _, e: e.canary_requests_total,
    ),
    (
        "engine_served_requests_per_second",
        GaugeMetricFamily,
        "Requests the engine finished per second over the last minute, the supervisor's canaries excluded.",
        lambda _, e: e.served.requests_per_s if e.served is not None else None,
    ),
    (
        "engine_served_generation_tokens_per_second",
        GaugeMetricFamily,
        "Tokens the engine generated per second over the last minute, the supervisor's canaries excluded.",
        lambda _, e: e.served.generation_tokens_per_s if e.served is not None else None,
    ),
    (
        "engine_incidents",
        CounterMetricFamily,
        "Hang or stall incidents whose process stacks were kept before the kill "
        "(STATE_DIR/engines/NAME/incidents).",
        lambda _, e: e.incidents_total,
    ),
)


class _SnapshotCollector:
    """Builds every family from one snapshot per scrape, so a scrape is self-consistent."""

    def __init__(self, snapshot: Callable[[], Snapshot], gpu_samples: GpuSamples | None) -> None:
        self._snapshot = snapshot
        self._gpu_samples = gpu_samples
        self._warned_names: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        # Returning nothing keeps register() from calling collect() (and so snapshot()) early.
        return ()

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from self._engine_families(snap)
        yield from self._daemon_families(snap)
        if self._gpu_samples is not None:
            yield from self._gpu_families(self._gpu_samples)

    def _engine_families(self, snap: Snapshot) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            _name("engine_state"),
            "1 for the engine's current state, 0 for every other state.",
            labels=["engine", "state"],
        )
        up = GaugeMetricFamily(_name("engine_up"), "1 if the engine is READY, else 0.", labels=["engine"])
        in_rotation = GaugeMetricFamily(
            _name("engine_in_rotation"),
            "1 if a load balancer should send the engine traffic, else 0.",
            labels=["engine"],
        )
        age = GaugeMetricFamily(
            _name("engine_state_age_seconds"),
            "Seconds the engine has been in its current state.",
            labels=["engine"],
        )
        restarts = CounterMetricFamily(
            _name("engine_restarts"),
            "Engine restarts since the daemon started, by cause.",
            labels=["engine", "reason"],
        )
        changes = CounterMetricFamily(
            _name("engine_state_changes"),
            "Engine state changes since the daemon started.",
            labels=["engine"],
        )
        canary = GaugeMetricFamily(
            _name("engine_canary_latency_seconds"),
            "Latency of the engine's last successful canary completion, in seconds.",
            labels=["engine"],
        )
        finding = GaugeMetricFamily(
            _name("finding_active"),
            "1 while a detector finding is open for the engine, by kind and severity.",
            labels=["engine", "finding", "severity"],
        )
        info = GaugeMetricFamily(
            _name("engine_info"),
            "Static facts about the engine in labels; always 1.",
            labels=["engine", "port", "gpus", "model"],
        )
        actions = CounterMetricFamily(
            _name("engine_actions"),
            "Automatic actions taken on the engine, by kind and the cause that led to them.",
            labels=["engine", "kind", "reason"],
        )
        last_action = GaugeMetricFamily(
            _name("engine_last_action_timestamp_seconds"),
            "Unix time of the engine's last automatic action of each kind.",
            labels=["engine", "kind"],
        )
        step = GaugeMetricFamily(
            _name("engine_batch_step"),
            "Batch-size ladder step the engine runs at: 0 is its own flags, n is n steps down.",
            labels=["engine"],
        )
        scalars = [
            (kind(_name(name), text, labels=["engine"]), read) for name, kind, text, read in _ENGINE_SCALARS
        ]
        for e in snap.engines:
            for family, read in scalars:
                value = read(snap, e)
                if value is not None:
                    family.add_metric([e.name], float(value))
            for (kind, reason), count in sorted(snap.actions_total.get(e.name, {}).items()):
                actions.add_metric([e.name, kind, reason], float(count))
            for kind, at in sorted(snap.last_action_at.get(e.name, {}).items()):
                last_action.add_metric([e.name, kind], at)
            step.add_metric([e.name], float(e.ladder_step))
            for s in EngineState:
                state.add_metric([e.name, s.value], 1.0 if e.state is s else 0.0)
            up.add_metric([e.name], 1.0 if e.state is EngineState.READY else 0.0)
            in_rotation.add_metric([e.name], 1.0 if e.in_rotation else 0.0)
            age.add_metric([e.name], max(0.0, snap.state_age_s(e)))
            by_reason = {reason: 0 for reason in RESTART_REASONS}
            by_reason.update(e.restarts_by_reason)
            for reason, count in sorted(by_reason.items()):
                restarts.add_metric([e.name, reason], float(count))
            changes.add_metric([e.name], float(e.state_changes_total))
            if e.canary_latency_s is not None:
                canary.add_metric([e.name], e.canary_latency_s)
            gpus = ",".join(str(g) for g in e.spec.gpus)
            info.add_metric([e.name, str(e.spec.port), gpus, e.spec.model_id], 1.0)
            for f in e.findings:
                finding.add_metric([e.name, f.kind.value, f.severity.value], 1.0)
        yield from (state, up, in_rotation, age, restarts, changes, canary, finding, info)
        yield from (actions, last_action, step)
        yield from (family for family, _ in scalars)

    def _daemon_families(self, snap: Snapshot) -> Iterator[Metric]:
        counters = snap.counters
        yield CounterMetricFamily(
            _name("ticks"), "Supervisor ticks completed since the daemon started.", value=counters.ticks_total
        )
        yield CounterMetricFamily(
            _name("notify_failures"),
            "sd_notify messages that could not be sent since the daemon started.",
            value=counters.notify_failures_total,
        )
        loaded = GaugeMetricFamily(
            _name("config_loaded_timestamp_seconds"),
            "Unix time at which the running configuration was loaded.",
        )
        if counters.config_loaded_timestamp_s > 0:
            loaded.add_metric([], counters.config_loaded_timestamp_s)
        yield loaded
        reloads = CounterMetricFamily(
            _name("config_reloads"),
            "Configuration reloads since the daemon started, by result (ok, invalid).",
            labels=["result"],
        )
        by_result = {result: 0 for result in RELOAD_RESULTS}
        by_result.update(counters.reloads_total)
        for result, count in sorted(by_result.items()):
            reloads.add_metric([result], float(count))
        yield reloads
        probe_errors = CounterMetricFamily(
            _name("probe_errors"),
            "Probes that raised instead of answering (EMFILE: out of file descriptors), by probe"
            " and error; engines are kept.",
            labels=["probe", "error"],
        )
        for (probe, error), count in sorted(counters.probe_errors_total.items()):
            probe_errors.add_metric([probe, error], float(count))
        yield probe_errors
        open_fds = GaugeMetricFamily(_name("open_fds"), "File descriptors the daemon has open.")
        if counters.open_fds is not None:
            open_fds.add_metric([], float(counters.open_fds))
        yield open_fds
        max_fds = GaugeMetricFamily(_name("max_fds"), "The daemon's soft file descriptor limit.")
        if counters.fds_limit is not None:
            max_fds.add_metric([], float(counters.fds_limit))
        yield max_fds
        yield GaugeMetricFamily(
            _name("state_files_unsaved"),
            "State files (holds, ladder steps, GPU marks, status.json) whose newest content is not on"
            " disk: a write failed (a full disk, above all) and is tried again until it lands.",
            value=float(len(snap.unsaved_files)),
        )
        marked = CounterMetricFamily(
            _name("marked_gpu_faults"),
            "GPU faults (XID, ECC, lost) the policy restarted an engine for, by GPU; kept in the state dir.",
            labels=["gpu"],
        )
        for gpu, count in sorted(snap.gpu_faults_marked.items()):
            marked.add_metric([str(gpu)], float(count))
        yield marked
        conditions = GaugeMetricFamily(
            _name("node_condition"),
            "1 while a node condition holds: gpu_unrecoverable is a GPU lost, or a critical fault"
            " whose verdict is not a restart; the pod is not ready and node-level remediation takes it"
            " from there.",
            labels=["condition", "gpu"],
        )
        for condition in snap.node_conditions:
            conditions.add_metric([condition.condition, str(condition.gpu)], 1.0)
        yield conditions
        yield from self._nvml_families(snap)

    def _nvml_families(self, snap: Snapshot) -> Iterator[Metric]:
        health = snap.nvml
        if health is None:
            return
        up = GaugeMetricFamily(
            _name("nvml_up"),
            "1 while NVML is open (GPU telemetry, XIDs, lost GPUs), 0 while it cannot be opened; the"
            " reason label says why (driver_not_loaded, reboot_pending, init_timeout, ...; empty when up).",
            labels=["reason"],
        )
        up.add_metric(["" if health.up else str(health.reason)], 1.0 if health.up else 0.0)
        yield up
        yield CounterMetricFamily(
            _name("nvml_open_attempts"),
            "Tries to open NVML since the daemon started (more than 1: it was not there at first).",
            value=float(health.attempts),
        )
        yield GaugeMetricFamily(
            _name("engines_waiting_for_nvml"),
            "Engines named by GPU index that wait for NVML to open before they start (nvml_wait_s).",
            value=float(len(health.waiting)),
        )
        yield GaugeMetricFamily(
            _name("engines_waiting_for_gpu_fabric"),
            "Engines that wait to start because their GPUs' NVSwitch fabric is not registered (Fabric"
            " Manager not running, or still at it; docs/gpu.md).",
            value=float(len(health.fabric_waiting)),
        )
        yield GaugeMetricFamily(
            _name("engines_on_gpus"),
            "Enabled engines configured on GPUs (by index or UUID): with nvml_up 0, they run or wait blind.",
            value=float(sum(1 for e in snap.engines if e.spec.enabled and e.spec.gpu_count)),
        )
        yield CounterMetricFamily(
            _name("nvml_event_wait_errors"),
            "NVML event waits that failed (an NVML error, which rebuilds the event set) or outlived"
            " their deadline, since the daemon started.",
            value=float(health.event_wait_errors),
        )
        hung = GaugeMetricFamily(
            _name("nvml_hung_gpu"),
            "1 for a GPU taken as lost because its NVML calls stopped answering while the others answer.",
            labels=["gpu"],
        )
        for gpu in health.hung:
            hung.add_metric([str(gpu)], 1.0)
        yield hung

    def _gpu_families(self, gpu_samples: GpuSamples) -> Iterator[Metric]:
        try:
            samples = gpu_samples()
        except Exception:
            # A broken GPU probe must not take the daemon's own metrics down with it.
            log.warning("GPU samples unavailable for this scrape", exc_info=True)
            return
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for gpu, values in sorted(samples.items()):
            for key, value in values.items():
                name, _, label_value = key.partition("/")
                doc = GPU_METRICS.get(name)
                if not self._well_formed(key, name, label_value, doc):
                    continue
                family = families.get(name)
                if family is None:
                    family = families[name] = _gpu_family(name, doc)
                labels = [str(gpu)] if not label_value else [str(gpu), label_value]
                family.add_metric(labels, float(value))
        yield from (families[name] for name in sorted(families))

    def _well_formed(self, key: str, name: str, label_value: str, doc: GpuMetric | None) -> bool:
        labelled = doc is not None and doc.label is not None
        ok = (
            _NAME_RE.match(name) is not None
            and bool(label_value) == labelled
            and (not label_value or _LABEL_VALUE_RE.match(label_value) is not None)
        )
        if not ok and key not in self._warned_names:
            self._warned_names.add(key)
            log.warning("GPU sample %r is not a valid metric name; not exported", key)
        return ok


def _gpu_family(name: str, doc: GpuMetric | None) -> GaugeMetricFamily | CounterMetricFamily:
    help_text = doc.help if doc is not None else f"GPU reading {name!r} from the GPU probe."
    labels = ["gpu"] if doc is None or doc.label is None else ["gpu", doc.label]
    if name.endswith("_total"):
        return CounterMetricFamily(_name("gpu_" + name), help_text, labels=labels)
    return GaugeMetricFamily(_name("gpu_" + name), help_text, labels=labels)
