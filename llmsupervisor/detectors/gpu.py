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
from dataclasses import dataclass
from typing import Final

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.node_condition import VERDICT_RESET, VERDICT_RESTART, VERDICT_UNKNOWN
from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import MIB, new_finding, newest_first, upto
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import RECOVERY_NONE, GpuEvent, GpuSample, recovery_action_name

K = FindingKind

# NVML clock-event reasons (docs/host-notes.md §1.4) by what they mean here.
THERMAL_REASONS: Final = frozenset({"sw_thermal", "hw_thermal"})
POWER_BRAKE_REASONS: Final = frozenset({"hw_power_brake"})
# hw_slowdown is set for temperature, power brake or overcurrent: thermal unless the power brake
# bit says otherwise.
HW_SLOWDOWN: Final = "hw_slowdown"
POWER_CAP: Final = "sw_power_cap"  # routine at full load: INFO only

# NVML event kinds (probes.gpu_readings.EVENT_KINDS values) that are faults without an XID.
FAULT_EVENT_KINDS: Final = frozenset(
    {"double_bit_ecc", "fatal_poison", "dram_retirement_failure", "non_fatal_poison", "gpu_recovery_action"}
)
LOST_EVENT_KINDS: Final = frozenset({"gpu_unavailable"})
# NVML event kinds that record a repair the GPU made: noted (INFO), not faults.
REPAIR_EVENT_KINDS: Final = frozenset({"dram_retirement", "single_bit_ecc_storm"})
XID_GPU_LOST: Final = 79  # fallen off the bus

# What a GPU fault leads to (the finding's "verdicts" evidence, per GPU; core/node_condition.py):
# VERDICT_RESET: the GPU must be reset before use (node condition at once); VERDICT_RESTART: restart
# the engine and count, no condition; VERDICT_UNKNOWN: a second mark in the window sets it.

# The GPU's own verdict (field 230, read after each event and every sample) decides. For drivers
# without field 230, NVIDIA's XID catalogue (https://docs.nvidia.com/deploy/xid-errors/, the
# "Resolution" column) and the memory error guide
# (https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/, "Error Recovery and Response Flags"):
# - reset before reuse: 48 double-bit ECC ("reboot the system (or reset GPUs)"), 64 row-remap
#   failure, 95 uncontained ECC (RESET_GPU), 119/120 GSP errors (RESET_GPU), 140 unrecovered ECC;
# - restart the application only: 8 (RESTART_APP), 94 contained ECC (the recovery action is NONE:
#   "start a new process"; the remap waits for the next reset).
XID_RESET_REQUIRED: Final = frozenset({48, 64, 95, 119, 120, 140})
XID_RESTART_ONLY: Final = frozenset({8, 94})
EVENT_RESET_REQUIRED: Final = frozenset({"double_bit_ecc", "fatal_poison", "dram_retirement_failure"})
EVENT_RESTART_ONLY: Final = frozenset({"non_fatal_poison"})
_VERDICT_ORDER: Final = (VERDICT_RESTART, VERDICT_UNKNOWN, VERDICT_RESET)


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


# From the throttle-duration counters (fields 269 + 270, ns): a sample is throttled for heat when
# at least this share of the time since the previous sample was spent throttled.
THERMAL_MIN_FRACTION: Final = 0.5


def _thermal_bits(sample: GpuSample) -> bool:
    reasons = _reasons(sample)
    if reasons & THERMAL_REASONS:
        return True
    return HW_SLOWDOWN in reasons and not reasons & POWER_BRAKE_REASONS


def _too_hot(sample: GpuSample, cfg: DetectorConfig) -> bool:
    """At or above the board's own slowdown threshold; ``thermal_temperature_c`` only for a board
    that reports none (0: never). Never a fixed constant: 87 C is an H100 SXM's normal boost
    ceiling (its "GPU Max Operating Temp"), not a fault."""
    if sample.temperature_c is None:
        return False
    limit = sample.slowdown_temperature_c or cfg.thermal_temperature_c
    return bool(limit) and sample.temperature_c >= limit


def _throttled_for_heat(
    sample: GpuSample, at_s: float, previous: tuple[float, GpuSample] | None, cfg: DetectorConfig
) -> bool:
    if _too_hot(sample, cfg):
        return True
    if previous is not None:
        before_s, before = previous
        if (
            sample.thermal_throttle_ns is not None
            and before.thermal_throttle_ns is not None
            and sample.thermal_throttle_ns >= before.thermal_throttle_ns
            and at_s > before_s
        ):
            # The duration counters say how much of the interval was throttled; the clock-event
            # mask only what held at one instant.
            throttled_s = (sample.thermal_throttle_ns - before.thermal_throttle_ns) / 1e9
            return throttled_s >= THERMAL_MIN_FRACTION * (at_s - before_s)
    return _thermal_bits(sample)


def _thermal_runs(
    window: ObservationWindow, now: float, cfg: DetectorConfig
) -> dict[int, tuple[float, GpuSample]]:
    """Per GPU throttled for heat now: when its run of throttled samples began, and the newest."""
    previous: dict[int, tuple[float, GpuSample]] = {}
    runs: dict[int, float] = {}
    for obs in reversed(list(newest_first(window, now))):
        for index, sample in obs.gpus.items():
            if not isinstance(sample, GpuSample):
                continue  # unknown: neither extends nor breaks a run
            if _throttled_for_heat(sample, obs.at_s, previous.get(index), cfg):
                runs.setdefault(index, obs.at_s)
            else:
                runs.pop(index, None)
            previous[index] = (obs.at_s, sample)
    return {
        i: (since_s, previous[i][1])
        for i, since_s in runs.items()
        if now - previous[i][0] <= cfg.stale_after_s
    }


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
    """Clocks held back for heat on any GPU, from the throttle-duration counters where the driver
    has them (else the thermal clock-event bits), or the board's own slowdown temperature
    reached. The sustain time turns that into a duration, not one 2-second mask."""
    latest, _ = _gpu_latest(window, now, cfg)
    runs = _thermal_runs(window, now, cfg)
    if latest is None or not runs:
        return None
    current = {i: sample for i, (_, sample) in runs.items()}
    since_s = min(since for since, _ in runs.values())
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
    """The power brake (WARNING) on any GPU; else the power cap alone (INFO: routine at full load).

    The brake is the PSU's or BMC's signal: it is alerted on, never restarted for (core/policy.py).
    """
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


def _worse(a: str | None, b: str) -> str:
    return b if a is None or _VERDICT_ORDER.index(b) > _VERDICT_ORDER.index(a) else a


def _fallback_verdict(event: GpuEvent) -> str:
    if event.kind == "xid":
        if event.xid in XID_RESET_REQUIRED:
            return VERDICT_RESET
        return VERDICT_RESTART if event.xid in XID_RESTART_ONLY else VERDICT_UNKNOWN
    if event.kind in EVENT_RESET_REQUIRED:
        return VERDICT_RESET
    return VERDICT_RESTART if event.kind in EVENT_RESTART_ONLY else VERDICT_UNKNOWN


def _action_verdict(action: int) -> str:
    return VERDICT_RESTART if action == RECOVERY_NONE else VERDICT_RESET


@dataclass(frozen=True, slots=True)
class FaultMark:
    """One thing a GPU-fault rule found. With a verdict, a fault (CRITICAL) on GPU ``gpu`` (None:
    a device NVML could not name); without one, a note (INFO: the engine's own error, or a repair
    the GPU recorded). ``xid``: the XID it came from, if any."""

    at_s: float
    label: str
    verdict: str | None = None
    gpu: int | None = None
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class _Reads:
    """What the event rules read besides the event: the settings, and the newest recovery action
    each GPU's samples reported in the lookback, with when."""

    cfg: DetectorConfig
    actions: Mapping[int, tuple[float, int]]

    def verdict(self, obs: Observation, event: GpuEvent) -> str:
        """The event's own recovery action; else one a sample read after the fault; else the
        XID catalogue's fallback."""
        if event.recovery_action is not None:
            return _action_verdict(event.recovery_action)
        read = self.actions.get(event.index) if event.index is not None else None
        if read is not None and read[0] >= obs.at_s:  # read after the fault: its verdict
            return _action_verdict(read[1])
        return _fallback_verdict(event)


def _recovery_reads(observations: Sequence[Observation]) -> dict[int, tuple[float, int]]:
    """The newest recovery action each GPU's samples reported, with when."""
    actions: dict[int, tuple[float, int]] = {}
    for obs in observations:
        for index, sample in obs.gpus.items():
            if isinstance(sample, GpuSample) and sample.recovery_action is not None:
                actions[index] = (obs.at_s, sample.recovery_action)
    return actions


def _where(event: GpuEvent) -> str:
    return "?" if event.index is None else str(event.index)


# An event rule: the marks for an event it claims ((): claimed, nothing to report), or None when
# the event is not its kind and the next rule is asked.
EventRule = Callable[[Observation, GpuEvent, _Reads], tuple[FaultMark, ...] | None]


def _lost_event(obs: Observation, event: GpuEvent, reads: _Reads) -> tuple[FaultMark, ...] | None:
    """XID 79 or a GPU gone unavailable: GPU_LOST's (detect_gpu_lost), not a fault here."""
    return () if _is_lost_event(event) else None


def _xid_event(obs: Observation, event: GpuEvent, reads: _Reads) -> tuple[FaultMark, ...] | None:
    """An XID: a fault with its verdict, or a note when the engine's own (``xid_engine_level``)
    or informational (``xid_info_only``)."""
    if event.kind != "xid" or event.xid is None:
        return None
    benign = event.xid in reads.cfg.xid_engine_level or event.xid in reads.cfg.xid_info_only
    verdict = None if benign else reads.verdict(obs, event)
    label = f"xid {event.xid} on GPU {_where(event)}"
    return (FaultMark(obs.at_s, label, verdict, event.index, event.xid),)


def _recovery_event(obs: Observation, event: GpuEvent, reads: _Reads) -> tuple[FaultMark, ...] | None:
    """The GPU's recovery action, carried by its event: anything but NONE needs a reset."""
    if event.kind != "gpu_recovery_action" or event.recovery_action is None:
        return None
    if event.recovery_action == RECOVERY_NONE:
        return ()
    label = f"recovery action {recovery_action_name(event.recovery_action)} on GPU {_where(event)}"
    return (FaultMark(obs.at_s, label, VERDICT_RESET, event.index),)


def _fault_event(obs: Observation, event: GpuEvent, reads: _Reads) -> tuple[FaultMark, ...] | None:
    """A fault without an XID (FAULT_EVENT_KINDS: double-bit ECC, poison, a failed retirement, a
    recovery-action event whose action could not be read), with its verdict."""
    if event.kind not in FAULT_EVENT_KINDS:
        return None
    return (
        FaultMark(obs.at_s, f"{event.kind} on GPU {_where(event)}", reads.verdict(obs, event), event.index),
    )


def _repair_event(obs: Observation, event: GpuEvent, reads: _Reads) -> tuple[FaultMark, ...] | None:
    """A repair the GPU recorded (REPAIR_EVENT_KINDS): a note."""
    if event.kind not in REPAIR_EVENT_KINDS:
        return None
    return (FaultMark(obs.at_s, f"{event.kind} on GPU {_where(event)}"),)


# Each event goes to the first rule that claims it; one no rule claims is not a fault.
EVENT_RULES: Final[tuple[EventRule, ...]] = (
    _lost_event,
    _xid_event,
    _recovery_event,
    _fault_event,
    _repair_event,
)


def _event_marks(observations: Sequence[Observation], reads: _Reads) -> list[FaultMark]:
    marks: list[FaultMark] = []
    for obs, event in _events(observations):
        for rule in EVENT_RULES:
            claimed = rule(obs, event, reads)
            if claimed is not None:
                marks.extend(claimed)
                break
    return marks


def _ecc_marks(
    observations: Sequence[Observation], start_s: float, actions: Mapping[int, tuple[float, int]]
) -> list[FaultMark]:
    """Uncorrected ECC counts are volatile (since the driver loaded): any rise from ``start_s``
    on is a new error, a fault whose verdict is the newest recovery action read (else a reset)."""
    marks: list[FaultMark] = []
    last_count: dict[int, int] = {}
    for obs in observations:
        for index, sample in obs.gpus.items():
            if not isinstance(sample, GpuSample) or sample.ecc_uncorrected_volatile is None:
                continue
            count = sample.ecc_uncorrected_volatile
            previous = last_count.get(index)
            if previous is not None and count > previous and obs.at_s >= start_s:
                read = actions.get(index)
                verdict = VERDICT_RESET if read is None else _action_verdict(read[1])
                marks.append(
                    FaultMark(obs.at_s, f"uncorrected ECC {previous}->{count} on GPU {index}", verdict, index)
                )
            last_count[index] = count
    return marks


def _standing_marks(latest: Mapping[int, GpuSample], now: float) -> list[FaultMark]:
    """The GPU's own standing verdict, with or without an event (at start, say): a recovery
    action other than NONE or a failed row remap (faults), a row remap pending (a note)."""
    marks: list[FaultMark] = []
    for index, sample in sorted(latest.items()):
        if sample.recovery_action is not None and sample.recovery_action != RECOVERY_NONE:
            label = f"recovery action {recovery_action_name(sample.recovery_action)} on GPU {index}"
            marks.append(FaultMark(now, label, VERDICT_RESET, index))
        if sample.remap_failed:
            marks.append(FaultMark(now, f"row remap failed on GPU {index}", VERDICT_RESET, index))
        elif sample.remap_pending:
            marks.append(FaultMark(now, f"row remap pending the next reset on GPU {index}"))
    return marks


def _fault_finding(newest: Observation, marks: Sequence[FaultMark]) -> Finding:
    """One finding for every mark: CRITICAL with any fault, the worst verdict per GPU."""
    critical = [m for m in marks if m.verdict is not None]
    info = [m for m in marks if m.verdict is None]
    verdicts: dict[int, str] = {}  # per GPU with a critical fault, the worst verdict
    for m in critical:
        if m.gpu is not None and m.verdict is not None:
            verdicts[m.gpu] = _worse(verdicts.get(m.gpu), m.verdict)
    xids = {m.xid for m in marks if m.xid is not None}
    # The worst first: the summary names it.
    labels = sorted({m.label for m in critical}) + sorted({m.label for m in info})
    evidence: dict[str, float | str] = {"faults": "; ".join(labels), "count": len(marks)}
    if xids:
        evidence["xids"] = ",".join(str(x) for x in sorted(xids))
    if verdicts:
        evidence["gpus"] = ",".join(str(g) for g in sorted(verdicts))
        evidence["verdicts"] = ",".join(f"{g}={v}" for g, v in sorted(verdicts.items()))
    if any(m.gpu is None for m in critical):  # a critical fault on a device NVML could not name
        evidence["verdict_unknown_gpu"] = "an event's device could not be matched"
    what = "GPU fault" if critical else "engine-level GPU error (not the GPU's fault)"
    if VERDICT_RESET in verdicts.values():
        what = "GPU fault that needs a GPU reset"
    return new_finding(
        newest,
        K.GPU_FAULT,
        Severity.CRITICAL if critical else Severity.INFO,
        min(m.at_s for m in marks),
        f"{what}: {labels[0]}" + (f" and {len(labels) - 1} more" if len(labels) > 1 else ""),
        **evidence,
    )


def detect_gpu_fault(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """XIDs, fatal ECC/poison events, rising uncorrected ECC counts and the GPU's own recovery
    action in the lookback (docs/gpu.md, "What each fault leads to").

    Application-level XIDs (13, 31, 43, 45, 68, 109) and informational ones (63, 92, the NVLink
    warnings) alone give INFO: the engine faulted, or the GPU recorded a repair, but the GPU is
    not to blame. XID 79 is GPU_LOST's. A critical fault carries a verdict per GPU in its
    ``verdicts`` evidence ("0=reset,1=restart"): the recovery action read after the fault (field
    230; NONE is "restart", anything else "reset"), else the XID catalogue's fallback table. A
    recovery action other than NONE, or a failed row remap, is a fault by itself.

    Three sources of marks, then one finding: the events (EVENT_RULES), the ECC counts, and the
    GPUs' standing verdict.
    """
    start_s = now - cfg.gpu_fault_lookback_s
    # A little before the lookback, so that a count that rose at its start has a predecessor.
    observations = upto(window, start_s - cfg.stale_after_s, now)
    recent = [o for o in observations if o.at_s >= start_s]
    reads = _Reads(cfg, _recovery_reads(recent))
    _, latest = _gpu_latest(window, now, cfg)
    marks = [
        *_event_marks(recent, reads),
        *_ecc_marks(observations, start_s, reads.actions),
        *_standing_marks(latest, now),
    ]
    if not marks or not observations:
        return None
    return _fault_finding(observations[-1], marks)


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

    Unknown without the engine's PIDs, a process list, or a process's memory figure; and unknown
    in a container with its own PID namespace (``pids_visible`` False): NVML reports host PIDs
    (NVIDIA/nvidia-docker#1483), which match nothing the daemon sees, and every process on a GPU
    given to this pod is the pod's own.
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
        if not sample.pids_visible:
            return []
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
    "EVENT_RULES",
    "FAULT_EVENT_KINDS",
    "HW_SLOWDOWN",
    "LOST_EVENT_KINDS",
    "POWER_BRAKE_REASONS",
    "POWER_CAP",
    "REPAIR_EVENT_KINDS",
    "THERMAL_REASONS",
    "VERDICT_RESET",
    "VERDICT_RESTART",
    "VERDICT_UNKNOWN",
    "XID_GPU_LOST",
    "XID_RESET_REQUIRED",
    "XID_RESTART_ONLY",
    "FaultMark",
    "detect_foreign_gpu_memory",
    "detect_gpu_fault",
    "detect_gpu_lost",
    "detect_nvml_lost",
    "detect_power_throttle",
    "detect_thermal",
]
