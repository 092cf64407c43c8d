"""The detectors' settings: every threshold and time, and the tracker's sustain and clear times.

A leaf of the package: the detector families and the tracker read it, it reads none of them
(``config`` validates an engine's ``detectors:`` overrides against it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Final

from llmsupervisor.core.findings import FindingKind

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


# The largest XID the xid_* lists take: NVIDIA's XIDs are numbered below 200 today.
MAX_XID: Final = 65535


def _setting(
    doc: str,
    default: Any = None,
    *,
    lo: float = 0,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    factory: Any = None,
) -> Any:
    """A DetectorConfig field with its one-line meaning and its bounds (of each item, for the
    XID lists and the per-kind seconds). The config's validator and JSON Schema are made from
    the same bounds, docs/configuration.md shows them, and ``__post_init__`` holds a config built
    any other way to them: every value the validator accepts is one the detectors run with
    (issue 28: ``degradation_baseline_s: 0`` passed check-config and crashed every engine). The
    comments above a field say why."""
    metadata = {"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _outside(value: float, bounds: Mapping[str, Any]) -> bool:
    lo, hi = bounds["lo"], bounds["hi"]
    if value < lo or (bounds["lo_open"] and value == lo):
        return True
    return hi is not None and (value > hi or (bounds["hi_open"] and value == hi))


@dataclass(frozen=True, slots=True, kw_only=True)
class DetectorConfig:
    """Every threshold and time of the detectors. Seconds are monotonic; ratios are 0..1.

    ``sustain_s`` and ``clear_s`` may name only the kinds to change; the rest keep
    ``DEFAULT_SUSTAIN_S`` / ``DEFAULT_CLEAR_S``.
    """

    # A reading older than this (against ``now``) is unknown: per-sample detectors fall back to
    # the newest reading within it, so one failed probe neither raises nor clears a finding.
    stale_after_s: float = _setting(
        "a reading older than this is unknown (one failed probe neither raises nor clears a finding)", 30.0
    )

    # HANG (docs/vllm-notes.md §7): no sign of life (a successful canary, or a step/token counter that
    # moved) for this long, with at least ``hang_min_misses`` deadline misses (canary, /health or
    # /metrics timing out) since the last sign of life.
    # Work was queued at the last reading. vLLM V1 prefills in chunks of max-num-batched-tokens,
    # a step takes well under a second to a few seconds on a GPU, but its token counters move
    # only on steps that emit output: a chunked prefill of a long prompt leaves them still for
    # as many steps as it has chunks (shared/docs/hang-detection.md §2), and an idle engine
    # publishes nothing. The step heartbeat (engine/heartbeat.py) counts every step; without it,
    # 12 s of frozen counters *and* missed canaries is a hang. Raise it for engines that prefill
    # huge prompts in one step (chunked prefill off).
    hang_after_s: float = _setting(
        "hang: no sign of life (canary, a step, moving step/token counters) this long while work was queued",
        12.0,
    )
    # The last reading said nothing was running or waiting: a 1-token canary cannot take long.
    # This is the SIGSTOP case (gauges stale at 0), found within about 2 canary deadlines.
    hang_idle_after_s: float = _setting(
        "hang: the same while the last reading showed no running or waiting request", 10.0
    )
    hang_min_misses: int = _setting(
        "hang: at least this many missed deadlines (canary, /health, /metrics) since the last sign of life",
        2,
        lo=1,
    )
    # Two faster signs of a hang, read from /proc by the process sweep (issue 16). Neither can
    # mistake a busy engine for a dead one: a busy engine runs, and burns CPU.
    # A process of the engine's group stopped by the kernel (SIGSTOP, or held by a tracer) in
    # sweeps at least this far apart, its CPU time unchanged between them: HANG at once.
    hang_stopped_after_s: float = _setting(
        "hang: a process of the engine stopped (SIGSTOP, a tracer) with no CPU time gained this long", 1.0
    )
    # A canary missed its deadline and, between the two process sweeps around it (at least
    # hang_cpu_min_span_s and at most hang_cpu_max_span_s apart), the whole group used less than
    # this share of one core: nothing is computing the request (a deadlocked or frozen core).
    # An engine that spins while hung (an NCCL collective waiting on a lost peer) burns CPU and
    # is left to the deadline rule above.
    hang_cpu_idle_ratio: float = _setting(
        "hang: a missed canary while the engine's processes used under this share of a core",
        0.05,
        hi=1,
        hi_open=True,
    )
    hang_cpu_min_span_s: float = _setting(
        "hang (CPU idle): the CPU reading must span at least this", 1.0, lo_open=True
    )
    hang_cpu_max_span_s: float = _setting(
        "hang (CPU idle): and at most this (older readings say nothing of now)", 10.0, lo_open=True
    )
    # The rules that read the step heartbeat (issue 25, detectors/hang/steps.py: frozen, spinning).
    # A step is overdue when none completed for hang_step_factor x the engine's longest recent
    # step (the heartbeat's own, decaying over a few hundred steps and by half every 2 s idle),
    # and at least hang_spin_after_s for the spinning rule (hang_cpu_min_span_s for the frozen one).
    hang_step_factor: float = _setting(
        "hang (step heartbeat): a step is overdue after this x the engine's longest recent step", 4.0, lo=1
    )
    hang_spin_after_s: float = _setting(
        "hang (spinning): and no step completed for at least this long", 2.0, lo_open=True
    )
    # Spinning: the engine's processes other than the API server used at least this share of a
    # core meanwhile, and the processes that compute (vLLM's Worker, on a host without GPUs)
    # under hang_cpu_idle_ratio: something spins, and it is not the model. A quarter, not a
    # whole core: a spinning EngineCore got 66 % of one on the 2 shared cores of the real-vLLM
    # tests; the Worker's stillness is what tells a spin from a forward, not this.
    hang_spin_busy_ratio: float = _setting(
        "hang (spinning): the engine's processes (API server aside) used this share of a core, "
        "its Worker almost none",
        0.25,
        lo_open=True,
        hi=1,
    )
    # vLLM's Worker polls its shared-memory queue for the next step this long after the last one
    # before it sleeps on a socket (0.32: distributed/device_communicators/shm_broadcast.py,
    # SpinCondition busy_loop_s=1): a core's worth of CPU in that second after the last step is
    # the poll, not a forward, and the rules above allow for it.
    hang_worker_poll_s: float = _setting(
        "hang (step heartbeat): vLLM's Worker polls for its next step this long after the last "
        "(a core's worth of CPU that is not a forward)",
        1.0,
    )
    # The round waits this long for /health (at most health_timeout_s): later is a miss, and the
    # round goes on, so a frozen API server costs a second a round, not the whole deadline.
    hang_probe_late_s: float = _setting(
        "hang: a /health answer later than this is a miss; the round waits no longer for it",
        1.0,
        lo_open=True,
    )
    # The front rule (detectors/hang/front.py): /health missed twice in a row, the first sent this
    # long ago, and the API server asleep at no CPU or burning a core while it hands the
    # scheduler nothing. A live API server answers /health from its loop in milliseconds.
    hang_front_after_s: float = _setting(
        "hang (API server): /health missed twice in a row, the first sent at least this long ago",
        2.0,
        lo_open=True,
    )

    # STALL: running + waiting > 0 in every reading while the counters stood still this long.
    stall_after_s: float = _setting(
        "stall: requests running or waiting in every reading while the counters stood still this long", 60.0
    )

    # KV_PRESSURE: opens at or above the threshold, clears only below clear_ratio x threshold.
    kv_usage_threshold_ratio: float = _setting(
        "KV-cache pressure opens at or above this KV-cache usage (0..1]", 0.88, lo_open=True, hi=1
    )
    kv_usage_clear_ratio: float = _setting(
        "... and clears only below this x the threshold (0..1]", 0.9, lo_open=True, hi=1
    )

    # PREEMPTION_STORM: preemptions per minute over the last preemption_window_s.
    preemptions_per_min_threshold: float = _setting(
        "preemption storm: preemptions per minute over preemption_window_s", 10.0
    )
    preemption_window_s: float = _setting(
        "preemption storm: the window the rate is taken over", 60.0, lo_open=True
    )
    # readings must span at least this to make a rate
    preemption_min_span_s: float = _setting(
        "preemption storm: readings must span at least this to make a rate", 30.0, lo_open=True
    )

    # DEGRADATION_*: the engine against its own baseline (the first degradation_baseline_s of
    # real traffic after start, pinned by the window), over the last degradation_eval_s.
    degradation_baseline_s: float = _setting(
        "degradation: the baseline is the first this-many seconds of traffic", 600.0, lo_open=True
    )
    degradation_eval_s: float = _setting(
        "degradation: compared over the last this-many seconds", 300.0, lo_open=True
    )
    # current TTFT p95 >= factor x baseline
    degradation_ttft_factor: float = _setting("degradation: TTFT p95 at or above this x the baseline", 1.5)
    # tokens/s per running request <= factor x baseline
    degradation_throughput_factor: float = _setting(
        "degradation: tokens/s per running request at or below this x baseline", 0.67
    )
    # prefix-cache hit rate <= factor x baseline
    degradation_prefix_hit_factor: float = _setting(
        "degradation: prefix-cache hit rate at or below this x the baseline", 0.67
    )
    # finished requests (canaries excluded) in each span
    degradation_min_requests: int = _setting(
        "degradation: finished requests (canaries excluded) needed in each span", 20
    )
    # mean running requests in each span
    degradation_min_running: float = _setting("degradation: mean running requests needed in each span", 0.5)
    # A baseline span needs requests running in this share of its readings: "with traffic".
    degradation_min_busy_ratio: float = _setting(
        "degradation: share of a baseline span's readings with requests running", 0.8, hi=1
    )
    # Compare only at similar load: per-request throughput and TTFT move with the batch size.
    degradation_max_load_ratio: float = _setting(
        "degradation: compare only at a load within this factor of the baseline's", 2.0, lo=1
    )
    # prompt tokens looked up, in each span
    degradation_min_prefix_queries: int = _setting(
        "degradation: prompt tokens looked up per span for hit rates to count", 1000
    )
    # a lower baseline hit rate is not compared
    degradation_min_prefix_hit_ratio: float = _setting(
        "degradation: a baseline hit rate below this is not compared", 0.1, hi=1
    )

    # THERMAL: clocks held back for heat (duration counters, else the clock-event bits), or the
    # board's own slowdown temperature reached. This temperature only for a board that reports
    # no slowdown threshold; 0: never by temperature alone (docs/gpu.md).
    thermal_temperature_c: int = _setting(
        "thermal: this GPU temperature or above, only on a board that reports no slowdown"
        " threshold (0: never by temperature alone)",
        0,
    )

    # GPU_FAULT / GPU_LOST: an event stays evidence this long after it happened.
    gpu_fault_lookback_s: float = _setting(
        "GPU fault/lost: an XID or ECC event stays evidence this long", 300.0
    )
    # Application-level XIDs (graphics exception, page fault, stopped, cleanup, video decoder):
    # the engine's fault, not the GPU's (docs/host-notes.md §1.5). INFO.
    # 109 (context switch timeout) joined the device plugin's ignore list; docs/gpu.md.
    xid_engine_level: frozenset[int] = _setting(
        "application-level XIDs (the engine's fault, not the GPU's): INFO, no action",
        frozenset({13, 31, 43, 45, 68, 109}),
        hi=MAX_XID,
    )
    # Recorded, not failed: 63 row remap recorded, 92 high single-bit ECC rate, 144-150 NVLink
    # warnings (the recovery action says when they need more). INFO.
    xid_info_only: frozenset[int] = _setting(
        "XIDs only logged and counted (an INFO finding)",
        frozenset({63, 92, 144, 145, 146, 147, 148, 149, 150}),
        hi=MAX_XID,
    )
    # consecutive gpu_lost probe failures for one GPU
    gpu_lost_min_samples: int = _setting("GPU lost: consecutive 'GPU lost' probe failures needed", 2, lo=1)

    # MEMORY_GROWTH: least-squares slope of the group's RSS over memory_window_s.
    memory_window_s: float = _setting(
        "memory growth: the RSS slope is fitted over this window", 1800.0, lo_open=True
    )
    memory_min_span_s: float = _setting("memory growth: readings must span at least this", 1200.0)
    memory_min_samples: int = _setting("memory growth: readings needed (>= 3)", 10, lo=3)
    memory_growth_mib_per_h: float = _setting(
        "memory growth: the engine's RSS growing at least this fast", 256.0
    )
    # "steadily": the line must explain most of the variance
    memory_min_r2: float = _setting(
        "memory growth: the fitted line must explain this share of the variance", 0.6, hi=1
    )

    # FOREIGN_GPU_MEMORY: a process outside the engine's group holding this much on its GPU.
    foreign_min_mib: float = _setting(
        "foreign GPU memory: a process outside the engine holding this much on its GPU", 256.0
    )

    sustain_s: Mapping[FindingKind, float] = _setting(
        "per finding kind: how long a finding must hold before it opens (the kinds not named "
        "keep their defaults)",
        factory=lambda: DEFAULT_SUSTAIN_S,
    )
    clear_s: Mapping[FindingKind, float] = _setting(
        "per finding kind: how long a finding must be absent before it closes",
        factory=lambda: DEFAULT_CLEAR_S,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "sustain_s", _merged(DEFAULT_SUSTAIN_S, self.sustain_s))
        object.__setattr__(self, "clear_s", _merged(DEFAULT_CLEAR_S, self.clear_s))
        for spec in fields(self):
            value = getattr(self, spec.name)
            values = value.values() if isinstance(value, Mapping) else value
            for item in values if isinstance(values, Iterable) else (value,):
                if (isinstance(item, float) and not math.isfinite(item)) or _outside(item, spec.metadata):
                    raise ValueError(f"{spec.name}: {item!r} is not {_bounds_text(spec.metadata)}")
        if self.hang_cpu_max_span_s < self.hang_cpu_min_span_s:
            raise ValueError("hang_cpu_max_span_s must be at least hang_cpu_min_span_s")

    @staticmethod
    def bounds(name: str) -> Mapping[str, Any]:
        """The bounds of the field ``name`` (of each item, for a list or a mapping): ``lo``,
        ``hi`` (None: none), ``lo_open``, ``hi_open``, and ``integer``."""
        spec = _FIELDS[name]
        integer = spec.type in ("int", "frozenset[int]", int)
        return {k: spec.metadata[k] for k in ("lo", "hi", "lo_open", "hi_open")} | {"integer": integer}

    @staticmethod
    def doc(name: str) -> str:
        """The one-line meaning of the field ``name``."""
        return str(_FIELDS[name].metadata["doc"])

    @property
    def kv_usage_clear_below_ratio(self) -> float:
        return self.kv_usage_threshold_ratio * self.kv_usage_clear_ratio

    @property
    def recent_lookback_s(self) -> float:
        """The longest stretch any detector reads whole observations of: all but the memory
        slope, which reads only the process totals (``ObservationWindow`` thins older ones)."""
        return max(
            self.hang_after_s,
            self.hang_idle_after_s,
            self.hang_cpu_max_span_s,
            self.stall_after_s,
            self.preemption_window_s,
            self.degradation_eval_s,
            self.gpu_fault_lookback_s,
            self.stale_after_s,
        )

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


_FIELDS: Final = {f.name: f for f in fields(DetectorConfig)}


def _bounds_text(bounds: Mapping[str, Any]) -> str:
    low = f"{'>' if bounds['lo_open'] else '>='} {bounds['lo']:g}"
    high = "" if bounds["hi"] is None else f" and {'<' if bounds['hi_open'] else '<='} {bounds['hi']:g}"
    return low + high


__all__ = ["DEFAULT_CLEAR_S", "DEFAULT_SUSTAIN_S", "MAX_XID", "DetectorConfig"]
