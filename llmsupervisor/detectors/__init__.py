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

By family, each module owning its detectors and the helpers only they use::

    config       DetectorConfig, DEFAULT_SUSTAIN_S, DEFAULT_CLEAR_S (a leaf)
    series       window walkers, counter helpers and ``new_finding``, shared by the families
    hang/        HANG: the hang rules, in order, over facts gathered once (and a hang suspected)
    stall        STALL
    load         KV_PRESSURE, PREEMPTION_STORM
    degradation  DEGRADATION_THROUGHPUT, _TTFT, _PREFIX_CACHE: span stats against a baseline
    gpu          THERMAL, POWER_THROTTLE, GPU_FAULT, GPU_LOST, NVML_LOST, FOREIGN_GPU_MEMORY
    gpu_watch    NVML_LOST for a GPU whose events are not watched (with gpu's NVML_LOST)
    memory       MEMORY_GROWTH
    tracker      FindingTracker, TrackerUpdate

The findings themselves (FindingKind, Severity, Finding) are ``core.findings``: the policy reads
them without the detectors. This module holds the registry (``DETECTORS``), ``detect_all``,
``new_window``, and re-exports the names callers import from ``llmsupervisor.detectors``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import ObservationWindow
from llmsupervisor.detectors.config import DEFAULT_CLEAR_S, DEFAULT_SUSTAIN_S, DetectorConfig
from llmsupervisor.detectors.degradation import (
    FROM_SPANS,
    SpanStats,
    baseline_has_traffic,
    degradation_spans,
    detect_prefix_cache_degradation,
    detect_throughput_degradation,
    detect_ttft_degradation,
    span_stats,
)
from llmsupervisor.detectors.gpu import (
    detect_foreign_gpu_memory,
    detect_gpu_fault,
    detect_gpu_lost,
    detect_nvml_lost,
    detect_power_throttle,
    detect_thermal,
)
from llmsupervisor.detectors.gpu_watch import detect_nvml_trouble
from llmsupervisor.detectors.hang import detect_hang
from llmsupervisor.detectors.load import detect_kv_pressure, detect_preemption_storm
from llmsupervisor.detectors.memory import detect_memory_growth
from llmsupervisor.detectors.series import counters_progressed
from llmsupervisor.detectors.stall import detect_stall
from llmsupervisor.detectors.tracker import FindingTracker, TrackerUpdate

K = FindingKind

Detector = Callable[[ObservationWindow, float, DetectorConfig], Finding | None]


def new_window(cfg: DetectorConfig, *, max_count: int = 4096) -> ObservationWindow:
    """A window sized for these detectors: the longest lookback plus a margin, and the baseline.

    ``max_count`` must cover ``cfg.lookback_s`` at the loop's tick rate (4096 ticks: 1 h at 1 s).
    Observations older than every detector but the memory slope reads are thinned to their time
    and process totals, and the pinned baseline is kept as its statistics: what the detectors
    read, at a tenth of the memory of whole observations.
    """
    return ObservationWindow(
        max_count=max_count,
        max_age_s=cfg.lookback_s + 2 * cfg.stale_after_s,
        baseline_s=cfg.degradation_baseline_s,
        baseline_accept=lambda obs: baseline_has_traffic(obs, cfg),
        baseline_compute=span_stats,
        thin_after_s=cfg.recent_lookback_s + 2 * cfg.stale_after_s,
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
        K.NVML_LOST: detect_nvml_trouble,
    }
)


# The detectors that read only an observation's ``gpus`` and ``gpu_events`` (gpu.py): with neither
# in the whole window each of them returns None, so ``detect_all`` need not run them.
GPU_KINDS: Final[frozenset[FindingKind]] = frozenset(
    {K.THERMAL, K.POWER_THROTTLE, K.GPU_FAULT, K.GPU_LOST, K.FOREIGN_GPU_MEMORY, K.NVML_LOST}
)


def detect_all(window: ObservationWindow, now: float, cfg: DetectorConfig) -> list[Finding]:
    """Every detector over one engine's window: this tick's raw findings, in FindingKind order.

    The same as calling each of ``DETECTORS``, but the three degradation detectors share one
    reading of the spans they compare: it runs for every engine on every tick. The GPU
    detectors are skipped while the window has never held GPU data (``gpu_seen``): they would
    all return None, and on an engine without a GPU they were ~60 % of this function's time.
    """
    spans = degradation_spans(window, now, cfg)
    skip = frozenset() if window.gpu_seen else GPU_KINDS
    found: list[Finding] = []
    for kind, detector in DETECTORS.items():
        if kind in skip:
            continue
        from_spans = FROM_SPANS.get(kind)
        finding = from_spans(spans, cfg) if from_spans is not None else detector(window, now, cfg)
        if finding is not None:
            found.append(finding)
    return found


__all__ = [
    "DEFAULT_CLEAR_S",
    "DEFAULT_SUSTAIN_S",
    "DETECTORS",
    "GPU_KINDS",
    "Detector",
    "DetectorConfig",
    "Finding",
    "FindingKind",
    "FindingTracker",
    "Severity",
    "SpanStats",
    "TrackerUpdate",
    "baseline_has_traffic",
    "counters_progressed",
    "detect_all",
    "detect_foreign_gpu_memory",
    "detect_gpu_fault",
    "detect_gpu_lost",
    "detect_hang",
    "detect_kv_pressure",
    "detect_memory_growth",
    "detect_nvml_lost",
    "detect_nvml_trouble",
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
