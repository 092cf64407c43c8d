"""Detectors: pure functions from a window of observations to a ``Finding``, and the tracker
that turns their per-tick verdicts into findings that open once and close once.

::

    ObservationWindow ──► detect_*(window, now, cfg) ──► raw findings (this tick's verdicts)
                            (one per FindingKind)              │
                                                               ▼
                          FindingTracker.update(raw, now) ──► TrackerUpdate(opened, closed, active)
                            sustain_s: held that long before it opens
                            clear_s:   absent that long before it closes

Rules every detector keeps:

- time is the ``now`` argument, never a clock; only observations at or before ``now`` are read;
- absent data (``None``, ``ProbeFailure``, a family the vLLM version lacks, a reading older than
  ``stale_after_s``) is *unknown*: it neither raises a finding nor proves health. The exception is
  the hang detector, for which a canary, ``/health`` or ``/metrics`` that timed out is evidence;
- busy is not dead (docs/vllm-notes.md §7): a slow canary while the token or step counters advance is
  load, not a hang;
- a single periodic sample never opens a finding: either the detector needs several readings
  (hang, stall, rates, slopes, baselines) or the tracker's ``sustain_s`` holds it back. A
  discrete NVML *event* (an XID, a GPU that became unavailable) is not a sample and opens at once.

A finding is keyed by (engine, kind, severity): a POWER_THROTTLE that goes from INFO (power cap)
to WARNING (power brake) opens the WARNING one and later closes the INFO one.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from llmsupervisor.core.observe import Observation, ObservationWindow, check_timed_out
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.host import ProcSample
from llmsupervisor.probes.nvml import GpuEvent, GpuSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics, window_quantile

MIB: Final = 1024 * 1024


class FindingKind(enum.Enum):
    HANG = "hang"
    STALL = "stall"
    KV_PRESSURE = "kv_pressure"
    PREEMPTION_STORM = "preemption_storm"
    DEGRADATION_THROUGHPUT = "degradation_throughput"
    DEGRADATION_TTFT = "degradation_ttft"
    DEGRADATION_PREFIX_CACHE = "degradation_prefix_cache"
    THERMAL = "thermal"
    POWER_THROTTLE = "power_throttle"
    GPU_FAULT = "gpu_fault"
    GPU_LOST = "gpu_lost"
    MEMORY_GROWTH = "memory_growth"
    FOREIGN_GPU_MEMORY = "foreign_gpu_memory"
    NVML_LOST = "nvml_lost"

    def __str__(self) -> str:
        return self.name


class Severity(enum.Enum):
    INFO = "info"  # worth a log line; no action
    WARNING = "warning"  # degraded; the policy may drain or reconfigure
    CRITICAL = "critical"  # broken; the policy restarts or quarantines

    def __str__(self) -> str:
        return self.name


K = FindingKind

# How long a raw finding must hold before it opens. Zero where the detector itself already
# needs several readings over time (hang, stall) or where the input is a discrete event.
DEFAULT_SUSTAIN_S: Final[Mapping[FindingKind, float]] = MappingProxyType(
    {
        K.HANG: 0.0,  # >= hang_min_misses misses and counters frozen hang_*after_s
        K.STALL: 0.0,  # counters frozen stall_after_s with work queued
        K.KV_PRESSURE: 60.0,
        K.PREEMPTION_STORM: 60.0,
        K.DEGRADATION_THROUGHPUT: 600.0,  # "sustained 10 min"
        K.DEGRADATION_TTFT: 600.0,
        K.DEGRADATION_PREFIX_CACHE: 600.0,
        K.THERMAL: 60.0,
        K.POWER_THROTTLE: 60.0,
        K.GPU_FAULT: 0.0,  # an XID or ECC event is a fact, not a noisy sample
        K.GPU_LOST: 0.0,  # XID 79 / GPU-unavailable event, or gpu_lost twice in a row
        K.MEMORY_GROWTH: 300.0,  # the slope already spans memory_window_s
        K.FOREIGN_GPU_MEMORY: 60.0,  # a killed incarnation's memory takes seconds to free
        K.NVML_LOST: 30.0,
    }
)
# How long a raw finding must be absent before it closes.
DEFAULT_CLEAR_S: Final[Mapping[FindingKind, float]] = MappingProxyType(
    {
        K.HANG: 30.0,
        K.STALL: 30.0,
        K.KV_PRESSURE: 120.0,  # on top of the value hysteresis (clears below 0.9 x threshold)
        K.PREEMPTION_STORM: 120.0,
        K.DEGRADATION_THROUGHPUT: 300.0,
        K.DEGRADATION_TTFT: 300.0,
        K.DEGRADATION_PREFIX_CACHE: 300.0,
        K.THERMAL: 120.0,
        K.POWER_THROTTLE: 120.0,
        K.GPU_FAULT: 0.0,  # the detector holds an event for gpu_fault_lookback_s already
        K.GPU_LOST: 60.0,
        K.MEMORY_GROWTH: 900.0,
        K.FOREIGN_GPU_MEMORY: 60.0,
        K.NVML_LOST: 60.0,
    }
)

# NVML clock-event reasons (docs/host-notes.md §1.4) by what they mean here.
THERMAL_REASONS: Final = frozenset({"sw_thermal", "hw_thermal"})
POWER_BRAKE_REASONS: Final = frozenset({"hw_power_brake"})
# hw_slowdown is set for temperature, power brake or overcurrent: thermal unless the power brake
# bit says otherwise.
HW_SLOWDOWN: Final = "hw_slowdown"
POWER_CAP: Final = "sw_power_cap"  # routine at full load: INFO only

# NVML event kinds (probes.nvml.EVENT_KINDS values) that are faults without an XID.
FAULT_EVENT_KINDS: Final = frozenset({"double_bit_ecc", "fatal_poison", "dram_retirement_failure"})
LOST_EVENT_KINDS: Final = frozenset({"gpu_unavailable"})
XID_GPU_LOST: Final = 79  # fallen off the bus


def _merged(
    defaults: Mapping[FindingKind, float], given: Mapping[FindingKind, float]
) -> Mapping[FindingKind, float]:
    merged = {**defaults, **given}
    for kind, value in merged.items():
        if not isinstance(kind, FindingKind):
            raise ValueError(f"{kind!r} is not a FindingKind")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{kind}: {value} is not a duration in seconds")
    return MappingProxyType(merged)


@dataclass(frozen=True, slots=True, kw_only=True)
class DetectorConfig:
    """Every threshold and time of the detectors. Seconds are monotonic; ratios are 0..1.

    ``sustain_s`` and ``clear_s`` may name only the kinds to change; the rest keep
    ``DEFAULT_SUSTAIN_S`` / ``DEFAULT_CLEAR_S``.
    """

    # A reading older than this (against ``now``) is unknown: per-sample detectors fall back to
    # the newest reading within it, so one failed probe neither raises nor clears a finding.
    stale_after_s: float = 30.0

    # HANG (docs/vllm-notes.md §7): no sign of life (a successful canary, or a step/token counter that
    # moved) for this long, with at least ``hang_min_misses`` deadline misses (canary, /health or
    # /metrics timing out) since the last sign of life.
    # Work was queued at the last reading. vLLM V1 prefills in chunks of max-num-batched-tokens,
    # and its step and token counters move at every step, which takes well under a second to a
    # few seconds on a GPU: 12 s of frozen counters *and* missed canaries is a hang. Raise it for
    # engines that prefill huge prompts in one step (chunked prefill off).
    hang_after_s: float = 12.0
    # The last reading said nothing was running or waiting: a 1-token canary cannot take long.
    # This is the SIGSTOP case (gauges stale at 0), found within about 2 canary deadlines.
    hang_idle_after_s: float = 10.0
    hang_min_misses: int = 2

    # STALL: running + waiting > 0 in every reading while the counters stood still this long.
    stall_after_s: float = 60.0

    # KV_PRESSURE: opens at or above the threshold, clears only below clear_ratio x threshold.
    kv_usage_threshold_ratio: float = 0.88
    kv_usage_clear_ratio: float = 0.9

    # PREEMPTION_STORM: preemptions per minute over the last preemption_window_s.
    preemptions_per_min_threshold: float = 10.0
    preemption_window_s: float = 60.0
    preemption_min_span_s: float = 30.0  # readings must span at least this to make a rate

    # DEGRADATION_*: the engine against its own baseline (the first degradation_baseline_s of
    # real traffic after start, pinned by the window), over the last degradation_eval_s.
    degradation_baseline_s: float = 600.0
    degradation_eval_s: float = 300.0
    degradation_ttft_factor: float = 1.5  # current TTFT p95 >= factor x baseline
    degradation_throughput_factor: float = 0.67  # tokens/s per running request <= factor x baseline
    degradation_prefix_hit_factor: float = 0.67  # prefix-cache hit rate <= factor x baseline
    degradation_min_requests: int = 20  # finished requests (canaries excluded) in each span
    degradation_min_running: float = 0.5  # mean running requests in each span
    # A baseline span needs requests running in this share of its readings: "with traffic".
    degradation_min_busy_ratio: float = 0.8
    # Compare only at similar load: per-request throughput and TTFT move with the batch size.
    degradation_max_load_ratio: float = 2.0
    degradation_min_prefix_queries: int = 1000  # prompt tokens looked up, in each span
    degradation_min_prefix_hit_ratio: float = 0.1  # a lower baseline hit rate is not compared

    # THERMAL: a thermal clock-event reason, or this temperature or above.
    thermal_temperature_c: int = 87

    # GPU_FAULT / GPU_LOST: an event stays evidence this long after it happened.
    gpu_fault_lookback_s: float = 300.0
    # Application-level XIDs (graphics exception, page fault, stopped, cleanup, video decoder):
    # the engine's fault, not the GPU's (docs/host-notes.md §1.5). INFO.
    xid_engine_level: frozenset[int] = frozenset({13, 31, 43, 45, 68})
    xid_info_only: frozenset[int] = frozenset({63})  # row remap recorded: log and count. INFO.
    gpu_lost_min_samples: int = 2  # consecutive gpu_lost probe failures for one GPU

    # MEMORY_GROWTH: least-squares slope of the group's RSS over memory_window_s.
    memory_window_s: float = 1800.0
    memory_min_span_s: float = 1200.0
    memory_min_samples: int = 10
    memory_growth_mib_per_h: float = 256.0
    memory_min_r2: float = 0.6  # "steadily": the line must explain most of the variance

    # FOREIGN_GPU_MEMORY: a process outside the engine's group holding this much on its GPU.
    foreign_min_mib: float = 256.0

    sustain_s: Mapping[FindingKind, float] = field(default_factory=lambda: DEFAULT_SUSTAIN_S)
    clear_s: Mapping[FindingKind, float] = field(default_factory=lambda: DEFAULT_CLEAR_S)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sustain_s", _merged(DEFAULT_SUSTAIN_S, self.sustain_s))
        object.__setattr__(self, "clear_s", _merged(DEFAULT_CLEAR_S, self.clear_s))
        if not 0 < self.kv_usage_threshold_ratio <= 1:
            raise ValueError("kv_usage_threshold_ratio must be in (0, 1]")
        if not 0 < self.kv_usage_clear_ratio <= 1:
            raise ValueError("kv_usage_clear_ratio must be in (0, 1]")
        if self.hang_min_misses < 1 or self.gpu_lost_min_samples < 1 or self.memory_min_samples < 3:
            raise ValueError("hang_min_misses, gpu_lost_min_samples >= 1 and memory_min_samples >= 3")

    @property
    def kv_usage_clear_below_ratio(self) -> float:
        return self.kv_usage_threshold_ratio * self.kv_usage_clear_ratio

    @property
    def lookback_s(self) -> float:
        """The longest stretch of history any detector reads (size the window's ring with it)."""
        return max(
            self.hang_after_s,
            self.stall_after_s,
            self.preemption_window_s,
            self.degradation_eval_s,
            self.gpu_fault_lookback_s,
            self.memory_window_s,
            self.stale_after_s,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One detected condition of one engine, with the values that show it."""

    engine: str
    kind: FindingKind
    severity: Severity
    evidence: Mapping[str, float | str]
    since_s: float  # monotonic: when the condition began, as far as the window shows
    summary: str

    def __post_init__(self) -> None:
        if not isinstance(self.evidence, MappingProxyType):
            object.__setattr__(self, "evidence", MappingProxyType(dict(self.evidence)))

    @property
    def key(self) -> tuple[str, FindingKind, Severity]:
        return (self.engine, self.kind, self.severity)


Detector = Callable[[ObservationWindow, float, DetectorConfig], Finding | None]


def _finding(
    obs: Observation,
    kind: FindingKind,
    severity: Severity,
    since_s: float,
    summary: str,
    **evidence: float | str,
) -> Finding:
    return Finding(
        engine=obs.engine, kind=kind, severity=severity, evidence=evidence, since_s=since_s, summary=summary
    )


def _upto(window: ObservationWindow, start_s: float, now: float) -> tuple[Observation, ...]:
    """Observations in [start_s, now]: an observation stamped after ``now`` is not seen yet."""
    since = window.since(start_s)
    if not since or since[-1].at_s <= now:  # the loop's case: nothing newer than now to drop
        return since
    return tuple(o for o in since if o.at_s <= now)


def _back(window: ObservationWindow, now: float) -> Iterator[Observation]:
    """Newest first, from ``now`` back; detectors stop as soon as they know, to stay cheap."""
    for obs in reversed(window):
        if obs.at_s <= now:
            yield obs


def _readings(observations: Sequence[Observation]) -> list[tuple[Observation, EngineMetrics]]:
    return [(o, o.metrics) for o in observations if isinstance(o.metrics, EngineMetrics)]


def _counters(m: EngineMetrics) -> tuple[int | None, ...]:
    # Steps advance on every engine step; tokens cover versions without the step histogram (V0).
    return (m.iterations_total, m.generation_tokens_total, m.prompt_tokens_total)


def counters_progressed(older: EngineMetrics, newer: EngineMetrics) -> bool | None:
    """True if any counter known in both moved (a decrease is a restart: also not frozen);
    False if all comparable ones stood still; None if none can be compared."""
    pairs = [
        (a, b)
        for a, b in zip(_counters(older), _counters(newer), strict=True)
        if a is not None and b is not None
    ]
    if not pairs:
        return None
    return any(a != b for a, b in pairs)


def _work(m: EngineMetrics) -> int | None:
    if m.requests_running is None or m.requests_waiting is None:
        return None
    return m.requests_running + m.requests_waiting + m.requests_swapped


def _metrics_timed_out(obs: Observation) -> bool:
    return isinstance(obs.metrics, ProbeFailure) and obs.metrics.kind == "timeout"


def _unresponsive(obs: Observation) -> bool:
    # Only deadline misses: a refused connection or a 503 is the crash path, not a hang.
    return check_timed_out(obs.canary) or check_timed_out(obs.health) or _metrics_timed_out(obs)


def _miss_detail(obs: Observation) -> str:
    parts = []
    if check_timed_out(obs.canary):
        parts.append("canary")
    if check_timed_out(obs.health):
        parts.append("/health")
    if _metrics_timed_out(obs):
        parts.append("/metrics")
    return "+".join(parts)


def detect_hang(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """No sign of life for ``hang_*after_s`` and at least ``hang_min_misses`` deadline misses.

    Signs of life: a canary that answered, or a step/token counter that moved between two
    readings (busy, not dead, even if the canary was slow). A deadline miss: the canary,
    ``/health`` or ``/metrics`` timing out. ``/health`` 200 proves nothing (docs/vllm-notes.md §7).
    """
    newest: Observation | None = None
    oldest: Observation | None = None
    last_life_s: float | None = None
    missed: list[Observation] = []
    newer: tuple[Observation, EngineMetrics] | None = None  # the next newer reading
    last_reading: EngineMetrics | None = None
    for obs in _back(window, now):  # back to the last sign of life
        newest = newest or obs
        oldest = obs
        if isinstance(obs.metrics, EngineMetrics):
            last_reading = last_reading or obs.metrics
            if newer is not None and counters_progressed(obs.metrics, newer[1]):
                last_life_s = newer[0].at_s  # the counters moved by the newer reading
                break
            newer = (obs, obs.metrics)
        if obs.canary is not None and obs.canary.ok:
            last_life_s = obs.at_s
            break
        if _unresponsive(obs):
            missed.append(obs)
    if newest is None or oldest is None:
        return None
    # The observation whose reading showed progress was alive, whatever else timed out in it.
    missed = [o for o in missed if last_life_s is None or o.at_s > last_life_s]
    misses = len(missed)
    last_miss = missed[0] if missed else None
    if misses < cfg.hang_min_misses or last_miss is None:
        return None
    # Without any sign of life in the window, count from the first observation: the window
    # shows nothing earlier.
    frozen_since = last_life_s if last_life_s is not None else oldest.at_s
    work = None if last_reading is None else _work(last_reading)
    idle = work == 0
    limit_s = cfg.hang_idle_after_s if idle else cfg.hang_after_s
    frozen_s = now - frozen_since
    if frozen_s < limit_s:
        return None
    latest = newest
    evidence: dict[str, float | str] = {
        "frozen_s": frozen_s,
        "misses": misses,
        "last_miss": _miss_detail(last_miss),
        "limit_s": limit_s,
    }
    if last_reading is not None:
        if work is not None:
            evidence["requests_in_flight"] = work
        if last_reading.iterations_total is not None:
            evidence["iterations_total"] = last_reading.iterations_total
        if last_reading.generation_tokens_total is not None:
            evidence["generation_tokens_total"] = last_reading.generation_tokens_total
    if last_miss.canary is not None:
        evidence["canary_latency_s"] = last_miss.canary.latency_s
    state = "idle by its gauges" if idle else "with work queued or unknown"
    return _finding(
        latest,
        K.HANG,
        Severity.CRITICAL,
        frozen_since,
        f"hung: no progress and no canary answer for {frozen_s:.0f} s ({misses} deadline misses, {state})",
        **evidence,
    )


def detect_stall(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """Requests running or waiting in every reading, and the counters still, for ``stall_after_s``.

    Covers the KV livelock too (waiting > 0, running = 0; docs/vllm-notes.md §9 #5). Readings only:
    failed scrapes neither extend nor break the stretch, and stale gauges reading 0 (the SIGSTOP
    case) are the hang detector's.
    """
    readings = ((o, o.metrics) for o in _back(window, now) if isinstance(o.metrics, EngineMetrics))
    newest = next(readings, None)
    if newest is None:
        return None
    latest_obs, latest = newest
    if now - latest_obs.at_s > cfg.stale_after_s:
        return None
    work = _work(latest)
    if not work:
        return None
    frozen_since = latest_obs.at_s
    newer = latest
    for obs, m in readings:
        if counters_progressed(m, newer) is not False or not _work(m):
            break
        frozen_since = obs.at_s
        newer = m
    frozen_s = latest_obs.at_s - frozen_since
    if frozen_s < cfg.stall_after_s:
        return None
    evidence: dict[str, float | str] = {"frozen_s": frozen_s, "requests_in_flight": work}
    if latest.requests_running is not None:
        evidence["requests_running"] = latest.requests_running
    if latest.requests_waiting is not None:
        evidence["requests_waiting"] = latest.requests_waiting
    if latest.kv_usage_ratio is not None:
        evidence["kv_usage_ratio"] = latest.kv_usage_ratio
    return _finding(
        latest_obs,
        K.STALL,
        Severity.WARNING,
        frozen_since,
        f"stalled: {work} requests in flight and no step or token progress for {frozen_s:.0f} s",
        **evidence,
    )


def detect_kv_pressure(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """KV usage at or above the threshold, with value hysteresis read from the window.

    Between ``clear_below`` and the threshold the verdict is that of the last reading outside
    the band, so usage hovering at the threshold does not flap.
    """
    readings = (
        (o, o.metrics.kv_usage_ratio)
        for o in _back(window, now)
        if isinstance(o.metrics, EngineMetrics) and o.metrics.kv_usage_ratio is not None
    )
    newest = next(readings, None)
    if newest is None or now - newest[0].at_s > cfg.stale_after_s:
        return None
    high = cfg.kv_usage_threshold_ratio
    low = cfg.kv_usage_clear_below_ratio
    # Back to the last reading below `low`: pressure iff some reading since then reached `high`,
    # and it began at the earliest of those.
    since_s: float | None = None
    run: list[tuple[float, float]] = []
    for obs, usage in itertools.chain([newest], readings):
        if usage < low:
            break
        run.append((obs.at_s, usage))
        if usage >= high:
            since_s = obs.at_s
    if since_s is None:
        return None
    latest_obs, usage = newest
    peak = max(u for t, u in run if t >= since_s)
    return _finding(
        latest_obs,
        K.KV_PRESSURE,
        Severity.WARNING,
        since_s,
        f"KV cache {usage:.0%} full (threshold {high:.0%}, clears below {low:.0%})",
        kv_usage_ratio=usage,
        kv_usage_peak_ratio=peak,
        threshold_ratio=high,
    )


def detect_preemption_storm(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """Preemptions per minute over the last ``preemption_window_s`` at or above the threshold."""
    readings = [
        (o, m.preemptions_total)
        for o, m in _readings(_upto(window, now - cfg.preemption_window_s - cfg.stale_after_s, now))
        if m.preemptions_total is not None
    ]
    if not readings:
        return None
    latest_obs, latest = readings[-1]
    if now - latest_obs.at_s > cfg.stale_after_s:
        return None
    start = latest_obs.at_s - cfg.preemption_window_s
    first_obs, first = next((o, p) for o, p in readings if o.at_s >= start)
    span_s = latest_obs.at_s - first_obs.at_s
    delta = latest - first
    if span_s < cfg.preemption_min_span_s or delta < 0:  # too short for a rate, or a restart
        return None
    per_min = delta / span_s * 60.0
    if per_min < cfg.preemptions_per_min_threshold:
        return None
    evidence: dict[str, float | str] = {
        "preemptions_per_min": per_min,
        "preemptions": delta,
        "span_s": span_s,
    }
    kv = latest_obs.metrics.kv_usage_ratio if isinstance(latest_obs.metrics, EngineMetrics) else None
    if kv is not None:
        evidence["kv_usage_ratio"] = kv
    return _finding(
        latest_obs,
        K.PREEMPTION_STORM,
        Severity.WARNING,
        first_obs.at_s,
        f"preemption storm: {per_min:.1f} preemptions/min (threshold {cfg.preemptions_per_min_threshold:g})",
        **evidence,
    )


@dataclass(frozen=True, slots=True)
class SpanStats:
    """What an engine did over a span of readings (first to last), for baselines and comparisons."""

    start_s: float
    duration_s: float
    requests: int | None  # finished, canaries excluded
    mean_running: float | None
    busy_ratio: float | None  # share of readings with requests running
    tokens_per_s_per_running: float | None
    ttft_p95_s: float | None
    ttft_count: int
    prefix_queries: int | None
    prefix_hit_ratio: float | None


def _delta(older: int | None, newer: int | None) -> int | None:
    if older is None or newer is None or newer < older:
        return None
    return newer - older


def span_stats(observations: Sequence[Observation]) -> SpanStats | None:
    """Rates and quantiles between the first and last readings of ``observations``."""
    readings = _readings(observations)
    if len(readings) < 2:
        return None
    (first_obs, first), (last_obs, last) = readings[0], readings[-1]
    duration_s = last_obs.at_s - first_obs.at_s
    if duration_s <= 0:
        return None
    running = [m.requests_running for _, m in readings if m.requests_running is not None]
    mean_running = sum(running) / len(running) if running else None
    busy_ratio = sum(1 for r in running if r > 0) / len(running) if running else None
    finished = _delta(first.requests_finished_total, last.requests_finished_total)
    # The canaries' own completions are not traffic. Those of the first observation's tick
    # finished before its reading, as far as we can tell, so they are not in the delta.
    # A canary that timed out was aborted by its client, which vLLM does not count as finished.
    canaries = sum(
        1
        for o in observations
        if o.canary is not None and o.canary.ok and first_obs.at_s < o.at_s <= last_obs.at_s
    )
    requests = None if finished is None else max(0, finished - canaries)
    generated = _delta(first.generation_tokens_total, last.generation_tokens_total)
    tokens_per_s_per_running = (
        generated / duration_s / mean_running
        if generated is not None and mean_running is not None and mean_running > 0
        else None
    )
    ttft = None if last.ttft_seconds is None else last.ttft_seconds.minus(first.ttft_seconds)
    queries = _delta(first.prefix_cache_queries_total, last.prefix_cache_queries_total)
    hits = _delta(first.prefix_cache_hits_total, last.prefix_cache_hits_total)
    return SpanStats(
        start_s=first_obs.at_s,
        duration_s=duration_s,
        requests=requests,
        mean_running=mean_running,
        busy_ratio=busy_ratio,
        tokens_per_s_per_running=tokens_per_s_per_running,
        ttft_p95_s=window_quantile(last.ttft_seconds, first.ttft_seconds, 0.95),
        ttft_count=0 if ttft is None else ttft.count,
        prefix_queries=queries,
        prefix_hit_ratio=hits / queries if hits is not None and queries else None,
    )


def baseline_has_traffic(observations: Sequence[Observation], cfg: DetectorConfig) -> bool:
    """The window's rule for pinning a baseline span: enough real requests, running most of the
    time, and enough load on average."""
    stats = span_stats(observations)
    return (
        stats is not None
        and stats.requests is not None
        and stats.requests >= cfg.degradation_min_requests
        and stats.mean_running is not None
        and stats.mean_running >= cfg.degradation_min_running
        and stats.busy_ratio is not None
        and stats.busy_ratio >= cfg.degradation_min_busy_ratio
    )


def new_window(cfg: DetectorConfig, *, max_count: int = 4096) -> ObservationWindow:
    """A window sized for these detectors: the longest lookback plus a margin, and the baseline.

    ``max_count`` must cover ``cfg.lookback_s`` at the loop's tick rate (4096 ticks: 1 h at 1 s).
    """
    return ObservationWindow(
        max_count=max_count,
        max_age_s=cfg.lookback_s + 2 * cfg.stale_after_s,
        baseline_s=cfg.degradation_baseline_s,
        baseline_accept=lambda obs: baseline_has_traffic(obs, cfg),
    )


# The pinned baseline's span_stats, by engine: a pinned baseline (~300 observations, a tuple)
# never changes, yet the degradation detectors would read it again on every tick. A hit needs the
# very same tuple, so it is the answer span_stats would give; one entry per engine bounds it.
_BASELINE_STATS: dict[str, tuple[tuple[Observation, ...], SpanStats | None]] = {}


def _baseline_stats(baseline: tuple[Observation, ...]) -> SpanStats | None:
    engine = baseline[0].engine
    hit = _BASELINE_STATS.get(engine)
    if hit is not None and hit[0] is baseline:
        return hit[1]
    stats = span_stats(baseline)
    _BASELINE_STATS[engine] = (baseline, stats)
    return stats


# The baseline's stats, the current span's stats, and the newest observation of the current span.
Spans = tuple[SpanStats, SpanStats, Observation]


def _degradation_spans(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Spans | None:
    """The baseline and the last ``degradation_eval_s``, if both can be compared at all; the
    three degradation detectors share it (``detect_all`` computes it once per tick)."""
    baseline_obs = window.baseline
    if not baseline_obs:
        return None
    recent = _upto(window, now - cfg.degradation_eval_s, now)
    # The current span must not overlap the baseline, and must be nearly the full eval span.
    recent = tuple(o for o in recent if o.at_s > baseline_obs[-1].at_s)
    if not recent or now - recent[-1].at_s > cfg.stale_after_s:
        return None
    base, current = _baseline_stats(baseline_obs), span_stats(recent)
    if base is None or current is None or current.duration_s < 0.8 * cfg.degradation_eval_s:
        return None
    return base, current, recent[-1]


def _at_similar_load(spans: Spans | None, cfg: DetectorConfig) -> Spans | None:
    """``spans`` if both carried enough load, and similar load; else None."""
    if spans is None:
        return None
    base, current, _ = spans
    if base.mean_running is None or current.mean_running is None:
        return None
    if base.mean_running < cfg.degradation_min_running or current.mean_running < cfg.degradation_min_running:
        return None
    load_ratio = current.mean_running / base.mean_running
    if not 1 / cfg.degradation_max_load_ratio <= load_ratio <= cfg.degradation_max_load_ratio:
        return None
    return spans


def detect_throughput_degradation(
    window: ObservationWindow, now: float, cfg: DetectorConfig
) -> Finding | None:
    """Generated tokens/s per running request at or below factor x the baseline, at similar load."""
    return _throughput_degradation(_degradation_spans(window, now, cfg), cfg)


def _throughput_degradation(all_spans: Spans | None, cfg: DetectorConfig) -> Finding | None:
    spans = _at_similar_load(all_spans, cfg)
    if spans is None:
        return None
    base, current, latest = spans
    if base.tokens_per_s_per_running is None or current.tokens_per_s_per_running is None:
        return None
    if base.tokens_per_s_per_running <= 0:
        return None
    ratio = current.tokens_per_s_per_running / base.tokens_per_s_per_running
    if ratio > cfg.degradation_throughput_factor:
        return None
    return _finding(
        latest,
        K.DEGRADATION_THROUGHPUT,
        Severity.WARNING,
        current.start_s,
        f"throughput per running request at {ratio:.0%} of its baseline",
        tokens_per_s_per_running=current.tokens_per_s_per_running,
        baseline_tokens_per_s_per_running=base.tokens_per_s_per_running,
        ratio=ratio,
        mean_running=current.mean_running or 0.0,
    )


def detect_ttft_degradation(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """TTFT p95 at or above factor x the baseline's, at similar load, with enough requests."""
    return _ttft_degradation(_degradation_spans(window, now, cfg), cfg)


def _ttft_degradation(all_spans: Spans | None, cfg: DetectorConfig) -> Finding | None:
    spans = _at_similar_load(all_spans, cfg)
    if spans is None:
        return None
    base, current, latest = spans
    if min(base.ttft_count, current.ttft_count) < cfg.degradation_min_requests:
        return None
    if base.ttft_p95_s is None or current.ttft_p95_s is None or base.ttft_p95_s <= 0:
        return None
    ratio = current.ttft_p95_s / base.ttft_p95_s
    if ratio < cfg.degradation_ttft_factor:
        return None
    return _finding(
        latest,
        K.DEGRADATION_TTFT,
        Severity.WARNING,
        current.start_s,
        f"TTFT p95 {current.ttft_p95_s * 1000:.0f} ms, {ratio:.1f}x its baseline",
        ttft_p95_s=current.ttft_p95_s,
        baseline_ttft_p95_s=base.ttft_p95_s,
        ratio=ratio,
        requests=current.ttft_count,
    )


def detect_prefix_cache_degradation(
    window: ObservationWindow, now: float, cfg: DetectorConfig
) -> Finding | None:
    """Prefix-cache hit rate at or below factor x the baseline's (a baseline worth comparing)."""
    return _prefix_cache_degradation(_degradation_spans(window, now, cfg), cfg)


def _prefix_cache_degradation(spans: Spans | None, cfg: DetectorConfig) -> Finding | None:
    if spans is None:
        return None
    base, current, latest = spans
    if base.prefix_hit_ratio is None or current.prefix_hit_ratio is None:
        return None
    if min(base.prefix_queries or 0, current.prefix_queries or 0) < cfg.degradation_min_prefix_queries:
        return None
    if base.prefix_hit_ratio < cfg.degradation_min_prefix_hit_ratio:
        return None
    ratio = current.prefix_hit_ratio / base.prefix_hit_ratio
    if ratio > cfg.degradation_prefix_hit_factor:
        return None
    return _finding(
        latest,
        K.DEGRADATION_PREFIX_CACHE,
        Severity.WARNING,
        current.start_s,
        f"prefix-cache hit rate {current.prefix_hit_ratio:.0%}, baseline {base.prefix_hit_ratio:.0%}",
        prefix_hit_ratio=current.prefix_hit_ratio,
        baseline_prefix_hit_ratio=base.prefix_hit_ratio,
        ratio=ratio,
    )


def _gpu_latest(
    window: ObservationWindow, now: float, cfg: DetectorConfig
) -> tuple[Observation | None, dict[int, GpuSample]]:
    """The newest observation, and each GPU's newest known sample within ``stale_after_s``."""
    newest: Observation | None = None
    latest: dict[int, GpuSample] = {}
    for obs in _back(window, now):
        newest = newest or obs
        if now - obs.at_s > cfg.stale_after_s:
            break
        for index, sample in obs.gpus.items():
            if isinstance(sample, GpuSample) and index not in latest:
                latest[index] = sample
    return newest, latest


def _run_start(window: ObservationWindow, now: float, index: int, pred: Callable[[GpuSample], bool]) -> float:
    """When GPU ``index``'s unbroken run of known samples satisfying ``pred`` began; unknown
    readings (failures, absent) neither extend nor break it."""
    since_s = now
    for obs in _back(window, now):
        sample = obs.gpus.get(index)
        if not isinstance(sample, GpuSample):
            continue
        if not pred(sample):
            break
        since_s = obs.at_s
    return since_s


def _reasons(sample: GpuSample) -> frozenset[str]:
    return sample.clock_event_reason_names


def _thermal(cfg: DetectorConfig) -> Callable[[GpuSample], bool]:
    def hot(sample: GpuSample) -> bool:
        reasons = _reasons(sample)
        if reasons & THERMAL_REASONS:
            return True
        if HW_SLOWDOWN in reasons and not reasons & POWER_BRAKE_REASONS:
            return True
        return sample.temperature_c is not None and sample.temperature_c >= cfg.thermal_temperature_c

    return hot


def _gpu_evidence(samples: Mapping[int, GpuSample]) -> dict[str, float | str]:
    evidence: dict[str, float | str] = {"gpus": ",".join(str(i) for i in sorted(samples))}
    temps = [s.temperature_c for s in samples.values() if s.temperature_c is not None]
    if temps:
        evidence["temperature_c"] = max(temps)
    clocks = [s.sm_clock_mhz for s in samples.values() if s.sm_clock_mhz is not None]
    if clocks:
        evidence["sm_clock_mhz"] = min(clocks)
    powers = [s.power_w for s in samples.values() if s.power_w is not None]
    if powers:
        evidence["power_w"] = max(powers)
    reasons = sorted(set().union(*(_reasons(s) for s in samples.values())))
    evidence["clock_event_reasons"] = ",".join(reasons) or "none"
    return evidence


def detect_thermal(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """A thermal clock-event reason (or an unexplained hw_slowdown), or too hot, on any GPU."""
    latest, samples = _gpu_latest(window, now, cfg)
    hot = _thermal(cfg)
    current = {i: s for i, s in samples.items() if hot(s)}
    if latest is None or not current:
        return None
    since_s = min(_run_start(window, now, i, hot) for i in current)
    evidence = _gpu_evidence(current)
    return _finding(
        latest,
        K.THERMAL,
        Severity.WARNING,
        since_s,
        f"thermal slowdown on GPU {evidence['gpus']} ({evidence['clock_event_reasons']},"
        f" {evidence.get('temperature_c', '?')} C)",
        **evidence,
    )


def detect_power_throttle(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """The power brake (WARNING) on any GPU; else the power cap alone (INFO: routine at full load)."""
    latest, samples = _gpu_latest(window, now, cfg)
    if latest is None:
        return None

    def brake(s: GpuSample) -> bool:
        return bool(_reasons(s) & POWER_BRAKE_REASONS)

    def cap(s: GpuSample) -> bool:
        return POWER_CAP in _reasons(s)

    for pred, severity, what in ((brake, Severity.WARNING, "power brake"), (cap, Severity.INFO, "power cap")):
        current = {i: s for i, s in samples.items() if pred(s)}
        if current:
            evidence = _gpu_evidence(current)
            return _finding(
                latest,
                K.POWER_THROTTLE,
                severity,
                min(_run_start(window, now, i, pred) for i in current),
                f"{what} on GPU {evidence['gpus']}",
                **evidence,
            )
    return None


def _events(observations: Sequence[Observation]) -> list[tuple[Observation, GpuEvent]]:
    return [(o, e) for o in observations for e in o.gpu_events]


def _is_lost_event(event: GpuEvent) -> bool:
    return event.kind in LOST_EVENT_KINDS or (event.kind == "xid" and event.xid == XID_GPU_LOST)


def detect_gpu_fault(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """XIDs, fatal ECC/poison events and rising uncorrected ECC counts in the lookback.

    Application-level XIDs (13, 31, 43, 45, 68) and XID 63 alone give INFO: the engine faulted,
    or the GPU recorded a repair, but the GPU is not to blame. XID 79 is GPU_LOST's.
    """
    start_s = now - cfg.gpu_fault_lookback_s
    # A little before the lookback, so that a count that rose at its start has a predecessor.
    observations = _upto(window, start_s - cfg.stale_after_s, now)
    recent = [o for o in observations if o.at_s >= start_s]
    critical: list[tuple[float, str]] = []
    info: list[tuple[float, str]] = []
    xids: set[int] = set()
    for obs, event in _events(recent):
        if _is_lost_event(event):
            continue
        where = "?" if event.index is None else str(event.index)
        if event.kind == "xid" and event.xid is not None:
            label = f"xid {event.xid} on GPU {where}"
            xids.add(event.xid)
            benign = event.xid in cfg.xid_engine_level or event.xid in cfg.xid_info_only
            (info if benign else critical).append((obs.at_s, label))
        elif event.kind in FAULT_EVENT_KINDS:
            critical.append((obs.at_s, f"{event.kind} on GPU {where}"))
    # Uncorrected ECC counts are volatile (since the driver loaded): any rise is a new error.
    last_count: dict[int, int] = {}
    for obs in observations:
        for index, sample in obs.gpus.items():
            if not isinstance(sample, GpuSample) or sample.ecc_uncorrected_volatile is None:
                continue
            count = sample.ecc_uncorrected_volatile
            previous = last_count.get(index)
            if previous is not None and count > previous and obs.at_s >= start_s:
                critical.append((obs.at_s, f"uncorrected ECC {previous}->{count} on GPU {index}"))
            last_count[index] = count
    found = critical + info
    if not found or not observations:
        return None
    severity = Severity.CRITICAL if critical else Severity.INFO
    # The worst first: the summary names it.
    labels = sorted({label for _, label in critical}) + sorted({label for _, label in info})
    evidence: dict[str, float | str] = {"faults": "; ".join(labels), "count": len(found)}
    if xids:
        evidence["xids"] = ",".join(str(x) for x in sorted(xids))
    what = "GPU fault" if critical else "engine-level GPU error (not the GPU's fault)"
    return _finding(
        observations[-1],
        K.GPU_FAULT,
        severity,
        min(t for t, _ in found),
        f"{what}: {labels[0]}" + (f" and {len(labels) - 1} more" if len(labels) > 1 else ""),
        **evidence,
    )


def detect_gpu_lost(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """XID 79 or a GPU-unavailable event in the lookback, or a GPU whose probe says gpu_lost in
    its last ``gpu_lost_min_samples`` readings."""
    start_s = now - cfg.gpu_fault_lookback_s
    observations = _upto(window, start_s, now)
    if not observations:
        return None
    lost: dict[str, float] = {}
    for obs, event in _events(observations):
        if _is_lost_event(event):
            where = "?" if event.index is None else str(event.index)
            lost.setdefault(where, obs.at_s)
    # Per GPU, the run of consecutive gpu_lost readings that ends at its newest reading.
    runs: dict[int, list[float]] = {}
    for obs in observations:
        for index, sample in obs.gpus.items():
            if isinstance(sample, ProbeFailure) and sample.kind == "gpu_lost":
                runs.setdefault(index, []).append(obs.at_s)
            else:
                runs.pop(index, None)
    for index, times in runs.items():
        if len(times) >= cfg.gpu_lost_min_samples and now - times[-1] <= cfg.stale_after_s:
            lost.setdefault(str(index), times[0])
    if not lost:
        return None
    gpus = ",".join(sorted(lost))
    return _finding(
        observations[-1],
        K.GPU_LOST,
        Severity.CRITICAL,
        min(lost.values()),
        f"GPU {gpus} lost (fell off the bus or unavailable)",
        gpus=gpus,
    )


def detect_nvml_lost(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """NVML stopped answering for the engine's GPUs (failed or timed-out calls; not gpu_lost).

    A host without NVML gives an empty ``gpus`` and no finding: that is reported once at start.
    """
    newest = next((o for o in reversed(_upto(window, now - cfg.stale_after_s, now)) if o.gpus), None)
    if newest is None:
        return None
    failing = {i: s for i, s in newest.gpus.items() if isinstance(s, ProbeFailure) and s.kind != "gpu_lost"}
    if not failing:
        return None

    since_s = newest.at_s
    for obs in _back(window, newest.at_s):
        if any(isinstance(obs.gpus.get(i), GpuSample) for i in failing):
            break  # a GPU of the set answered here: the run of failures starts after it
        if obs.gpus:
            since_s = obs.at_s
    gpus = ",".join(str(i) for i in sorted(failing))
    first = failing[min(failing)]
    return _finding(
        newest,
        K.NVML_LOST,
        Severity.WARNING,
        since_s,
        f"NVML not answering for GPU {gpus}: {first}",
        gpus=gpus,
        failure=str(first)[:200],
    )


_MAX_FIT_POINTS: Final = 256


def _least_squares(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Slope and r^2 of y on x; r^2 is 0 for a flat line."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    syy = sum((y - mean_y) ** 2 for _, y in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    if sxx == 0:
        return 0.0, 0.0
    slope = sxy / sxx
    r2 = 0.0 if syy == 0 else (sxy * sxy) / (sxx * syy)
    return slope, r2


def detect_memory_growth(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """The group's RSS rising along a line steeper than ``memory_growth_mib_per_h``."""
    # One pass from the newest back over up to memory_window_s of observations (900 at 2 s).
    start_s = now - cfg.memory_window_s
    samples: list[tuple[Observation, ProcSample]] = []
    pgid: int | None = None
    for o in _back(window, now):
        if o.at_s < start_s:
            break
        if not isinstance(o.proc, ProcSample):
            continue
        if pgid is None:
            if now - o.at_s > cfg.stale_after_s:
                return None
            pgid = o.proc.pgid
        if o.proc.pgid == pgid:  # one incarnation only
            samples.append((o, o.proc))
    samples.reverse()
    if len(samples) < cfg.memory_min_samples:
        return None
    span_s = samples[-1][0].at_s - samples[0][0].at_s
    if span_s < cfg.memory_min_span_s:
        return None
    origin = samples[0][0].at_s
    # An evenly thinned series has the same trend; a few hundred points keep the fit cheap.
    stride = -(-len(samples) // _MAX_FIT_POINTS)
    points = [(o.at_s - origin, p.rss_bytes_total / MIB) for o, p in samples[::stride]]
    slope_mib_per_s, r2 = _least_squares(points)
    slope_mib_per_h = slope_mib_per_s * 3600.0
    if slope_mib_per_h < cfg.memory_growth_mib_per_h or r2 < cfg.memory_min_r2:
        return None
    rss_mib = samples[-1][1].rss_bytes_total / MIB
    return _finding(
        samples[-1][0],
        K.MEMORY_GROWTH,
        Severity.WARNING,
        samples[0][0].at_s,
        f"RSS growing {slope_mib_per_h:.0f} MiB/h over {span_s / 60:.0f} min (now {rss_mib:.0f} MiB)",
        slope_mib_per_h=slope_mib_per_h,
        r2=r2,
        rss_mib=rss_mib,
        samples=len(samples),
        span_s=span_s,
    )


def detect_foreign_gpu_memory(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """Processes outside the engine's group holding at least ``foreign_min_mib`` on its GPUs.

    Unknown without the engine's PIDs, a process list, or a process's memory figure.
    """
    latest, samples = _gpu_latest(window, now, cfg)
    if latest is None:
        return None
    pids_obs = next((o for o in _back(window, now) if o.engine_pids), None)
    if pids_obs is None or now - pids_obs.at_s > cfg.stale_after_s:
        return None
    own = pids_obs.engine_pids
    threshold = cfg.foreign_min_mib * MIB

    def foreign(sample: GpuSample) -> list[tuple[int, int]]:
        return [
            (p.pid, p.used_bytes)
            for p in sample.processes or ()
            if p.pid not in own and p.used_bytes is not None and p.used_bytes >= threshold
        ]

    current = {i: f for i, f in ((i, foreign(s)) for i, s in samples.items()) if f}
    if not current:
        return None
    since_s = min(_run_start(window, now, i, lambda s: bool(foreign(s))) for i in current)
    pids = sorted({pid for f in current.values() for pid, _ in f})
    used_mib = sum(used for f in current.values() for _, used in f) / MIB
    gpus = ",".join(str(i) for i in sorted(current))
    return _finding(
        latest,
        K.FOREIGN_GPU_MEMORY,
        Severity.WARNING,
        since_s,
        f"{used_mib:.0f} MiB on GPU {gpus} held by PIDs outside the engine: {','.join(map(str, pids))}",
        gpus=gpus,
        pids=",".join(str(p) for p in pids),
        used_mib=used_mib,
    )


DETECTORS: Final[Mapping[FindingKind, Detector]] = MappingProxyType(
    {
        K.HANG: detect_hang,
        K.STALL: detect_stall,
        K.KV_PRESSURE: detect_kv_pressure,
        K.PREEMPTION_STORM: detect_preemption_storm,
        K.DEGRADATION_THROUGHPUT: detect_throughput_degradation,
        K.DEGRADATION_TTFT: detect_ttft_degradation,
        K.DEGRADATION_PREFIX_CACHE: detect_prefix_cache_degradation,
        K.THERMAL: detect_thermal,
        K.POWER_THROTTLE: detect_power_throttle,
        K.GPU_FAULT: detect_gpu_fault,
        K.GPU_LOST: detect_gpu_lost,
        K.MEMORY_GROWTH: detect_memory_growth,
        K.FOREIGN_GPU_MEMORY: detect_foreign_gpu_memory,
        K.NVML_LOST: detect_nvml_lost,
    }
)


# The degradation detectors on spans computed once for the three of them.
_DEGRADATION_FROM_SPANS: Final[
    Mapping[FindingKind, Callable[[Spans | None, DetectorConfig], Finding | None]]
] = MappingProxyType(
    {
        K.DEGRADATION_THROUGHPUT: _throughput_degradation,
        K.DEGRADATION_TTFT: _ttft_degradation,
        K.DEGRADATION_PREFIX_CACHE: _prefix_cache_degradation,
    }
)


def detect_all(window: ObservationWindow, now: float, cfg: DetectorConfig) -> list[Finding]:
    """Every detector over one engine's window: this tick's raw findings, in FindingKind order.

    The same as calling each of ``DETECTORS``, but the three degradation detectors share one
    reading of the spans they compare: it runs for every engine on every tick.
    """
    spans = _degradation_spans(window, now, cfg)
    found: list[Finding] = []
    for kind, detector in DETECTORS.items():
        from_spans = _DEGRADATION_FROM_SPANS.get(kind)
        finding = from_spans(spans, cfg) if from_spans is not None else detector(window, now, cfg)
        if finding is not None:
            found.append(finding)
    return found


@dataclass(frozen=True, slots=True)
class TrackerUpdate:
    opened: list[Finding]  # held for sustain_s: log once, hand to the policy
    closed: list[Finding]  # absent for clear_s: log once (the finding as last seen)
    active: list[Finding]  # open now, with this tick's evidence


@dataclass(slots=True)
class _Track:
    first_seen_s: float  # when the raw finding appeared, this unbroken run
    latest: Finding
    open: bool = False
    absent_since_s: float | None = None


class FindingTracker:
    """Sustain and hysteresis over raw findings, so each finding opens once and closes once.

    Pure apart from its own state: time is the ``now`` argument. Feed it *every* raw finding of
    the engines it tracks on every tick (one tracker per engine is simplest): a key missing from
    ``raw`` counts as absent. A raw finding opens after it has been present on every update for
    ``cfg.sustain_s[kind]`` (so one noisy tick cannot open it; zero opens at once); an open one
    closes after it has been absent on every update for ``cfg.clear_s[kind]``. An open finding
    keeps the ``since_s`` it opened with and takes each tick's evidence.
    """

    def __init__(self, cfg: DetectorConfig) -> None:
        self._cfg = cfg
        self._tracks: dict[tuple[str, FindingKind, Severity], _Track] = {}

    @property
    def active(self) -> list[Finding]:
        return [t.latest for t in self._tracks.values() if t.open]

    def update(self, raw: list[Finding], now: float) -> TrackerUpdate:
        opened: list[Finding] = []
        closed: list[Finding] = []
        present: dict[tuple[str, FindingKind, Severity], Finding] = {}
        for finding in raw:
            present.setdefault(finding.key, finding)  # a duplicate key: the first one stands
        for key, finding in present.items():
            track = self._tracks.get(key)
            if track is None:
                track = self._tracks[key] = _Track(first_seen_s=now, latest=finding)
            elif track.open:
                # Keep the opening since_s, so the cleared log line spans the whole episode.
                track.latest = _with_since(finding, track.latest.since_s)
            else:
                track.latest = finding
            track.absent_since_s = None
            if not track.open and now - track.first_seen_s >= self._cfg.sustain_s[finding.kind]:
                track.open = True
                track.latest = _with_since(finding, min(finding.since_s, track.first_seen_s))
                opened.append(track.latest)
        for key, track in list(self._tracks.items()):
            if key in present:
                continue
            if not track.open:
                del self._tracks[key]  # broken before it held for sustain_s: start over next time
                continue
            if track.absent_since_s is None:
                track.absent_since_s = now
            if now - track.absent_since_s >= self._cfg.clear_s[track.latest.kind]:
                del self._tracks[key]
                closed.append(track.latest)
        return TrackerUpdate(opened=opened, closed=closed, active=self.active)


def _with_since(finding: Finding, since_s: float) -> Finding:
    return finding if finding.since_s == since_s else dataclasses.replace(finding, since_s=since_s)


__all__ = [
    "DEFAULT_CLEAR_S",
    "DEFAULT_SUSTAIN_S",
    "DETECTORS",
    "Detector",
    "DetectorConfig",
    "Finding",
    "FindingKind",
    "FindingTracker",
    "Severity",
    "SpanStats",
    "TrackerUpdate",
    "baseline_has_traffic",
    "detect_all",
    "detect_foreign_gpu_memory",
    "detect_gpu_fault",
    "detect_gpu_lost",
    "detect_hang",
    "detect_kv_pressure",
    "detect_memory_growth",
    "detect_nvml_lost",
    "detect_power_throttle",
    "detect_preemption_storm",
    "detect_prefix_cache_degradation",
    "detect_stall",
    "detect_thermal",
    "detect_throughput_degradation",
    "detect_ttft_degradation",
    "new_window",
    "span_stats",
]
