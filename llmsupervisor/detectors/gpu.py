"""The GPUs under the engine, as NVML reports them: THERMAL and POWER_THROTTLE (clock-event
reasons and temperature), GPU_FAULT and GPU_LOST (XIDs, ECC and unavailability events, probes
that say gpu_lost), NVML_LOST (NVML itself not answering) and FOREIGN_GPU_MEMORY (processes
outside the engine's group holding memory on its GPUs).

Samples are per GPU index; a failed or stale sample of one GPU is unknown, and neither extends
nor breaks a run of another. A discrete event (an XID, a GPU that became unavailable) is not a
sample: it is evidence for ``gpu_fault_lookback_s`` after it happened, and opens at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import MIB, new_finding, newest_first, upto
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.nvml import GpuEvent, GpuSample

K = FindingKind

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


def _gpu_latest(
    window: ObservationWindow, now: float, cfg: DetectorConfig
) -> tuple[Observation | None, dict[int, GpuSample]]:
    """The newest observation, and each GPU's newest known sample within ``stale_after_s``."""
    newest: Observation | None = None
    latest: dict[int, GpuSample] = {}
    for obs in newest_first(window, now):
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
    for obs in newest_first(window, now):
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
    return new_finding(
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
            return new_finding(
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
    observations = upto(window, start_s - cfg.stale_after_s, now)
    recent = [o for o in observations if o.at_s >= start_s]
    critical: list[tuple[float, str]] = []
    info: list[tuple[float, str]] = []
    xids: set[int] = set()
    critical_gpus: set[int] = set()  # the GPUs the critical faults were on, where known
    for obs, event in _events(recent):
        if _is_lost_event(event):
            continue
        where = "?" if event.index is None else str(event.index)
        if event.kind == "xid" and event.xid is not None:
            label = f"xid {event.xid} on GPU {where}"
            xids.add(event.xid)
            benign = event.xid in cfg.xid_engine_level or event.xid in cfg.xid_info_only
            (info if benign else critical).append((obs.at_s, label))
            if not benign and event.index is not None:
                critical_gpus.add(event.index)
        elif event.kind in FAULT_EVENT_KINDS:
            critical.append((obs.at_s, f"{event.kind} on GPU {where}"))
            if event.index is not None:
                critical_gpus.add(event.index)
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
                critical_gpus.add(index)
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
    if critical_gpus:
        evidence["gpus"] = ",".join(str(g) for g in sorted(critical_gpus))
    what = "GPU fault" if critical else "engine-level GPU error (not the GPU's fault)"
    return new_finding(
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
    observations = upto(window, start_s, now)
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
    return new_finding(
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
    newest = next((o for o in reversed(upto(window, now - cfg.stale_after_s, now)) if o.gpus), None)
    if newest is None:
        return None
    failing = {i: s for i, s in newest.gpus.items() if isinstance(s, ProbeFailure) and s.kind != "gpu_lost"}
    if not failing:
        return None

    since_s = newest.at_s
    for obs in newest_first(window, newest.at_s):
        if any(isinstance(obs.gpus.get(i), GpuSample) for i in failing):
            break  # a GPU of the set answered here: the run of failures starts after it
        if obs.gpus:
            since_s = obs.at_s
    gpus = ",".join(str(i) for i in sorted(failing))
    first = failing[min(failing)]
    return new_finding(
        newest,
        K.NVML_LOST,
        Severity.WARNING,
        since_s,
        f"NVML not answering for GPU {gpus}: {first}",
        gpus=gpus,
        failure=str(first)[:200],
    )


def detect_foreign_gpu_memory(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """Processes outside the engine's group holding at least ``foreign_min_mib`` on its GPUs.

    Unknown without the engine's PIDs, a process list, or a process's memory figure.
    """
    latest, samples = _gpu_latest(window, now, cfg)
    if latest is None:
        return None
    pids_obs = next((o for o in newest_first(window, now) if o.engine_pids), None)
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
    return new_finding(
        latest,
        K.FOREIGN_GPU_MEMORY,
        Severity.WARNING,
        since_s,
        f"{used_mib:.0f} MiB on GPU {gpus} held by PIDs outside the engine: {','.join(map(str, pids))}",
        gpus=gpus,
        pids=",".join(str(p) for p in pids),
        used_mib=used_mib,
    )


__all__ = [
    "FAULT_EVENT_KINDS",
    "HW_SLOWDOWN",
    "LOST_EVENT_KINDS",
    "POWER_BRAKE_REASONS",
    "POWER_CAP",
    "THERMAL_REASONS",
    "XID_GPU_LOST",
    "detect_foreign_gpu_memory",
    "detect_gpu_fault",
    "detect_gpu_lost",
    "detect_nvml_lost",
    "detect_power_throttle",
    "detect_thermal",
]
