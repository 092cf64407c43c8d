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
from llmsupervisor.core.node_condition import (
    VERDICT_FIELD_DIAG,
    VERDICT_RESET,
    VERDICT_RESTART,
    VERDICT_UNKNOWN,
    VERDICTS,
)
from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.series import MIB, new_finding, newest_first, upto
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import (
    RECOVERY_NONE,
    XID_IGNORE,
    XID_RECOVERY_ACTION_CHANGED,
    XID_RESET_GPU,
    XID_RESTART_APP,
    XID_RESTART_BM,
    XID_RESTART_VM,
    GpuEvent,
    GpuSample,
    recovery_action_name,
    xid_resolution,
)

K = FindingKind

# NVML clock-event reasons (docs/host-notes.md §1.4; nvml.h nvmlClocksEventReason*).
SW_THERMAL: Final = "sw_thermal"  # Boost holding the GPU (or HBM) at its max operating temperature
HW_THERMAL: Final = "hw_thermal"  # clocks cut by half or more for heat
# hw_slowdown is set for temperature, the power brake, or "power draw is too high and Fast
# Trigger protection" (nvml.h): counted unless the power brake bit says it is the brake.
HW_SLOWDOWN: Final = "hw_slowdown"
POWER_BRAKE: Final = "hw_power_brake"  # the PSU or BMC asserts it
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
# VERDICT_RESTART: restart the engine and count, no condition; anything else is a node condition
# at once, the engines on the GPU stopped: VERDICT_RESET (reset the GPU first), VERDICT_FIELD_DIAG
# (a failed row remap: no reset clears it), VERDICT_UNKNOWN (nobody judged the fault: a look).

# The GPU's own verdict (field 230, read after each event and every sample) decides. For drivers
# without field 230 (before R565: the R535 and R550 long-term branches), NVIDIA's XID catalogue
# (probes/gpu_readings.XID_CATALOGUE, its "Resolution" buckets) and the memory error guide
# (https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/, "Error Recovery and Response Flags"):
# - reset before reuse: RESET_GPU (46, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156,
#   158, ...), RESTART_BM and RESTART_VM (a node restart resets the GPU too), and 48 (double-bit
#   ECC: "reboot the system (or reset GPUs)");
# - restart the application only: RESTART_APP (8, 13, 31, 94 contained ECC, ...);
# - nothing: IGNORE (63, 92, ...): a note;
# - any other bucket (UNEXPECTED_ERR_REPORT_ISSUE, the CHECK_* and WORKFLOW_* ones), and an XID
#   the catalogue does not list: unknown, a look before the GPU serves again.
XID_BUCKET_VERDICTS: Final[Mapping[str, str | None]] = {
    XID_RESET_GPU: VERDICT_RESET,
    XID_RESTART_BM: VERDICT_RESET,
    XID_RESTART_VM: VERDICT_RESET,
    "WORKFLOW_XID_48": VERDICT_RESET,
    XID_RESTART_APP: VERDICT_RESTART,
    XID_IGNORE: None,
}
EVENT_RESET_REQUIRED: Final = frozenset({"double_bit_ecc", "fatal_poison", "dram_retirement_failure"})
EVENT_RESTART_ONLY: Final = frozenset({"non_fatal_poison"})
_VERDICT_ORDER: Final = VERDICTS  # mildest first


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


# A duration counter (fields 269-271, ns) says a sample was held back when at least this share of
# the time since the previous sample was spent so.
HELD_MIN_FRACTION: Final = 0.5
# A counter whose rise between two samples exceeds the time between them by more than this (and
# a second) is no duration counter: on drivers that number the fields otherwise (L2, R575 against
# R580) the same ids carry power-smoothing settings. Then the clock-event bit is read instead.
COUNTER_SLACK: Final = 0.1

DurationField = Callable[[GpuSample], int | None]
Interval = tuple[float, GpuSample] | None  # the GPU's previous known sample, with when


def _counter_share(
    counter: DurationField, sample: GpuSample, at_s: float, previous: Interval
) -> float | None:
    """The share of the interval since ``previous`` that ``counter`` was running; None when the
    counter is unread or does not behave as a duration (it fell, or rose faster than time)."""
    if previous is None:
        return None
    before_s, before = previous
    now_ns, then_ns = counter(sample), counter(before)
    elapsed_s = at_s - before_s
    if now_ns is None or then_ns is None or elapsed_s <= 0:
        return None
    rise_s = (now_ns - then_ns) / 1e9
    if rise_s < 0 or rise_s > elapsed_s * (1 + COUNTER_SLACK) + 1.0:
        return None
    return rise_s / elapsed_s


@dataclass(frozen=True, slots=True)
class ClockRule:
    """One reason the clocks are held back, judged per sample: from its duration counter where
    the driver has one that behaves (R580+), else from its clock-event bit at sample time. The
    tracker's sustain time (``sustain_s``) then turns a run of such samples into a finding, so a
    bit seen at one instant opens nothing."""

    name: str
    severity: Severity  # WARNING: NVIDIA's real trouble (THERMAL's step down); INFO: report only
    bit: str | None = None
    counter: DurationField | None = None
    unless: str | None = None  # a bit that names another cause (the brake, for hw_slowdown)

    def holds(self, sample: GpuSample, at_s: float, previous: Interval, cfg: DetectorConfig) -> bool:
        if self.counter is not None:
            share = _counter_share(self.counter, sample, at_s, previous)
            if share is not None:
                return share >= HELD_MIN_FRACTION
        reasons = _reasons(sample)
        return self.bit is not None and self.bit in reasons and not (self.unless and self.unless in reasons)


@dataclass(frozen=True, slots=True)
class _TooHot(ClockRule):
    """At or above the board's own slowdown threshold, where NVML says HW slowdown begins;
    ``thermal_temperature_c`` only for a board that reports none (0: never). Never a fixed
    constant: 87 C is an H100 SXM's normal boost ceiling (its "GPU Max Operating Temp")."""

    def holds(self, sample: GpuSample, at_s: float, previous: Interval, cfg: DetectorConfig) -> bool:
        if sample.temperature_c is None:
            return False
        limit = sample.slowdown_temperature_c or cfg.thermal_temperature_c
        return bool(limit) and sample.temperature_c >= limit


def _sw_thermal_ns(s: GpuSample) -> int | None:
    return s.sw_thermal_ns


def _hw_thermal_ns(s: GpuSample) -> int | None:
    return s.hw_thermal_ns


def _power_brake_ns(s: GpuSample) -> int | None:
    return s.power_brake_ns


# THERMAL, worst first. Only what nvml.h documents as trouble acts (WARNING, a step down the batch
# ladder): HW thermal and HW slowdown ("reducing the core clocks by a factor of 2 or more"), or the
# slowdown temperature reached. SW thermal is Boost holding the GPU at its max operating
# temperature, normal under sustained load (NVSentinel: DCGM_FR_CLOCKS_EVENT_THERMAL is
# CHECK_THERMALS, no action on the workload): INFO, reported, never acted on.
THERMAL_RULES: Final[tuple[ClockRule, ...]] = (
    _TooHot("slowdown_temperature", Severity.WARNING),
    ClockRule(HW_THERMAL, Severity.WARNING, bit=HW_THERMAL, counter=_hw_thermal_ns),
    ClockRule(HW_SLOWDOWN, Severity.WARNING, bit=HW_SLOWDOWN, unless=POWER_BRAKE),
    ClockRule(SW_THERMAL, Severity.INFO, bit=SW_THERMAL, counter=_sw_thermal_ns),
)
# POWER_THROTTLE, worst first; never acted on (core/policy.py): the brake is the PSU's or BMC's
# signal, which a smaller batch does not clear (WARNING, alerted), held for its duration (field
# 271) where the driver has it; the power cap is routine at full load (INFO).
POWER_RULES: Final[tuple[ClockRule, ...]] = (
    ClockRule(POWER_BRAKE, Severity.WARNING, bit=POWER_BRAKE, counter=_power_brake_ns),
    ClockRule(POWER_CAP, Severity.INFO, bit=POWER_CAP),
)


def _rule_runs(
    window: ObservationWindow, now: float, cfg: DetectorConfig, rule: ClockRule
) -> dict[int, tuple[float, GpuSample]]:
    """Per GPU where ``rule`` holds now: when its unbroken run of such samples began, and the
    newest sample. Unknown readings (failures, absent) neither extend nor break a run."""
    previous: dict[int, tuple[float, GpuSample]] = {}
    runs: dict[int, float] = {}
    for obs in reversed(list(newest_first(window, now))):
        for index, sample in obs.gpus.items():
            if not isinstance(sample, GpuSample):
                continue
            if rule.holds(sample, obs.at_s, previous.get(index), cfg):
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


def _clock_finding(
    window: ObservationWindow,
    now: float,
    cfg: DetectorConfig,
    kind: FindingKind,
    rules: Sequence[ClockRule],
    summary: Callable[[Severity, Mapping[str, float | str]], str],
) -> Finding | None:
    """One finding for the worst severity among ``rules`` that hold on some GPU now, naming the
    GPUs and the rules that hold at that severity."""
    latest, _ = _gpu_latest(window, now, cfg)
    if latest is None:
        return None
    for severity in (Severity.WARNING, Severity.INFO):
        names: list[str] = []
        runs: dict[int, tuple[float, GpuSample]] = {}
        for rule in (r for r in rules if r.severity is severity):
            for index, (since_s, sample) in _rule_runs(window, now, cfg, rule).items():
                names += [rule.name] if rule.name not in names else []
                earlier = runs.get(index)
                runs[index] = (min(since_s, earlier[0]) if earlier else since_s, sample)
        if runs:
            evidence = _gpu_evidence({i: sample for i, (_, sample) in runs.items()})
            evidence["rules"] = ",".join(names)
            since_s = min(since for since, _ in runs.values())
            return new_finding(latest, kind, severity, since_s, summary(severity, evidence), **evidence)
    return None


def _thermal_summary(severity: Severity, evidence: Mapping[str, float | str]) -> str:
    where = f"GPU {evidence['gpus']} ({evidence['rules']}, {evidence.get('temperature_c', '?')} C)"
    if severity is Severity.WARNING:
        return f"thermal slowdown on {where}"
    return (
        f"{where} held at its max operating temperature (GPU or memory) by the clock governor:"
        " normal under sustained load, no action"
    )


def detect_thermal(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """THERMAL_RULES on any GPU: WARNING (a ladder step down, core/policy.py) for HW thermal or
    HW slowdown held, or the board's slowdown temperature reached; else INFO for SW thermal alone
    (Boost at the max operating temperature: reported, never acted on)."""
    return _clock_finding(window, now, cfg, K.THERMAL, THERMAL_RULES, _thermal_summary)


def _power_summary(severity: Severity, evidence: Mapping[str, float | str]) -> str:
    return f"{'power brake' if severity is Severity.WARNING else 'power cap'} on GPU {evidence['gpus']}"


def detect_power_throttle(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """The power brake held (WARNING) on any GPU; else the power cap alone (INFO: routine at full
    load). Both are reported only: the brake is the PSU's or BMC's signal, alerted on, never
    restarted for (core/policy.py)."""
    return _clock_finding(window, now, cfg, K.POWER_THROTTLE, POWER_RULES, _power_summary)


def _events(observations: Sequence[Observation]) -> list[tuple[Observation, GpuEvent]]:
    return [(o, e) for o in observations for e in o.gpu_events]


def _is_lost_event(event: GpuEvent) -> bool:
    return event.kind in LOST_EVENT_KINDS or (event.kind == "xid" and event.xid == XID_GPU_LOST)


def _worse(a: str | None, b: str) -> str:
    return b if a is None or _VERDICT_ORDER.index(b) > _VERDICT_ORDER.index(a) else a


def catalogue_verdict(xid: int) -> str | None:
    """What NVIDIA's XID catalogue makes of ``xid`` where the driver gives no recovery action:
    XID_BUCKET_VERDICTS for its resolution bucket (None: IGNORE, a note); unknown for any other
    bucket and for an XID the catalogue does not list."""
    bucket = xid_resolution(xid)
    if bucket is not None and bucket in XID_BUCKET_VERDICTS:
        return XID_BUCKET_VERDICTS[bucket]
    return VERDICT_UNKNOWN


def _fallback_verdict(event: GpuEvent) -> str:
    """A fault event's verdict without the GPU's own (no field 230): by its kind."""
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

    def action_after(self, obs: Observation, event: GpuEvent) -> int | None:
        """The GPU's recovery action on this fault: the one read with the event, else one a
        sample read after it; None where field 230 could not be read (a driver before R565)."""
        if event.recovery_action is not None:
            return event.recovery_action
        read = self.actions.get(event.index) if event.index is not None else None
        return read[1] if read is not None and read[0] >= obs.at_s else None

    def verdict(self, obs: Observation, event: GpuEvent) -> str:
        """A fault event's verdict: the GPU's recovery action, else its kind's (no field 230)."""
        action = self.action_after(obs, event)
        return _fallback_verdict(event) if action is None else _action_verdict(action)


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


def _recovery_changed_xid(obs: Observation, event: GpuEvent, reads: _Reads) -> tuple[FaultMark, ...] | None:
    """XID 154, "GPU recovery action changed": no action of its own (the catalogue: "follow
    guidance as it applies to another Xid"). The action read says: NONE, a note; anything else,
    a reset; unreadable, a look."""
    if event.kind != "xid" or event.xid != XID_RECOVERY_ACTION_CHANGED:
        return None
    action = reads.action_after(obs, event)
    label = f"xid {event.xid} (recovery action changed) on GPU {_where(event)}"
    if action is None:
        return (FaultMark(obs.at_s, f"{label}, action unread", VERDICT_UNKNOWN, event.index, event.xid),)
    verdict = None if action == RECOVERY_NONE else VERDICT_RESET
    label += f": {recovery_action_name(action)}"
    return (FaultMark(obs.at_s, label, verdict, event.index, event.xid),)


def _xid_event(obs: Observation, event: GpuEvent, reads: _Reads) -> tuple[FaultMark, ...] | None:
    """An XID: a fault with the GPU's verdict (field 230), or without one NVIDIA's catalogue's
    (``catalogue_verdict``); a note when the engine's own (``xid_engine_level``), informational
    (``xid_info_only``) or IGNORE in the catalogue. Without the GPU's verdict, a listed XID that
    the catalogue resolves with a reset is not waved through: it needs a look (109, which the
    device plugin calls the application's and the catalogue RESET_GPU)."""
    if event.kind != "xid" or event.xid is None:
        return None
    action = reads.action_after(obs, event)
    listed = event.xid in reads.cfg.xid_engine_level or event.xid in reads.cfg.xid_info_only
    verdict: str | None
    if listed:
        verdict = (
            VERDICT_UNKNOWN if action is None and catalogue_verdict(event.xid) == VERDICT_RESET else None
        )
    else:
        verdict = catalogue_verdict(event.xid) if action is None else _action_verdict(action)
    label = f"xid {event.xid} on GPU {_where(event)}"
    if action is None and verdict is not None:  # the catalogue's verdict: say which bucket
        label += f" (no recovery action; NVIDIA's XID catalogue: {xid_resolution(event.xid) or 'not listed'})"
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
    _recovery_changed_xid,
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
            # Permanent: nvml.h, failureOccurred is set "if a row remapping ever failed".
            label = f"row remap failed on GPU {index} (permanent: field diagnostic, RMA)"
            marks.append(FaultMark(now, label, VERDICT_FIELD_DIAG, index))
        elif sample.remap_pending:
            marks.append(FaultMark(now, f"row remap pending the next reset on GPU {index}"))
    return marks


# The finding's summary by its worst verdict.
_FAULT_WHAT: Final[Mapping[str | None, str]] = {
    VERDICT_UNKNOWN: "GPU fault with no verdict (the GPU needs a look)",
    VERDICT_RESET: "GPU fault that needs a GPU reset",
    VERDICT_FIELD_DIAG: "GPU fault that no reset clears (field diagnostic, RMA)",
}


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
    worst = max(verdicts.values(), key=_VERDICT_ORDER.index, default=None)
    what = _FAULT_WHAT.get(worst, "GPU fault") if critical else "engine-level GPU error (not the GPU's fault)"
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
    230; NONE is "restart", anything else "reset"), else NVIDIA's XID catalogue
    (``catalogue_verdict``: "unknown" where it gives no fix). A recovery action other than NONE
    is a fault by itself, and so is a failed row remap ("field_diag").

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
    severity, summary = Severity.WARNING, f"NVML not answering for GPU {gpus}: {first}"
    if all(f.kind == "released" for f in failing.values()):
        # An operator's `gpu release` closed NVML for a GPU reset: blind on purpose, for a
        # bounded time (daemon/gpu_release.py); said, not alerted on.
        severity, summary = Severity.INFO, f"no GPU telemetry for GPU {gpus} on purpose: {first.detail}"
    return new_finding(newest, K.NVML_LOST, severity, since_s, summary, gpus=gpus, failure=str(first)[:200])


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
    "HW_THERMAL",
    "LOST_EVENT_KINDS",
    "POWER_BRAKE",
    "POWER_CAP",
    "POWER_RULES",
    "REPAIR_EVENT_KINDS",
    "SW_THERMAL",
    "THERMAL_RULES",
    "VERDICT_FIELD_DIAG",
    "VERDICT_RESET",
    "VERDICT_RESTART",
    "VERDICT_UNKNOWN",
    "XID_BUCKET_VERDICTS",
    "XID_GPU_LOST",
    "ClockRule",
    "FaultMark",
    "catalogue_verdict",
    "detect_foreign_gpu_memory",
    "detect_gpu_fault",
    "detect_gpu_lost",
    "detect_nvml_lost",
    "detect_power_throttle",
    "detect_thermal",
]
