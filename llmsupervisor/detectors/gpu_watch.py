"""NVML_LOST in full: NVML not answering for the engine's GPUs (``detect_nvml_lost``, gpu.py), or
NVML answering but no longer delivering one of its GPUs' events.

A GPU left out of the event set (a registration failed, probes/nvml.py; docs/gpu.md, "The event
set after a lost GPU") is still sampled: temperature, ECC counts and the recovery action (field
230) are read every tick. What is lost is its XIDs, which only events carry, so an XID-only fault
on it goes unseen. That is worth a WARNING on the engines on that GPU, not an action: nothing is
wrong with the engine, the daemon is half-blind on its GPU.
"""

from __future__ import annotations

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.core.observe import ObservationWindow
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.gpu import detect_nvml_lost
from llmsupervisor.detectors.series import new_finding, newest_first
from llmsupervisor.probes.gpu_readings import GpuSample


def detect_unwatched_gpu(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """One of the engine's GPUs answers samples but its events are not watched (its newest sample
    within ``stale_after_s`` says why)."""
    newest = None
    latest: dict[int, GpuSample] = {}
    for obs in newest_first(window, now):
        if now - obs.at_s > cfg.stale_after_s:
            break
        newest = newest or obs
        for index, sample in obs.gpus.items():
            if isinstance(sample, GpuSample) and index not in latest:
                latest[index] = sample
    unwatched = {i: s.events_unwatched for i, s in latest.items() if s.events_unwatched is not None}
    if newest is None or not unwatched:
        return None
    since: dict[int, float] = {}
    # When it began: the oldest sample of the unbroken run of unwatched samples of those GPUs.
    for index in unwatched:
        since[index] = now
        for obs in newest_first(window, now):
            reading = obs.gpus.get(index)
            if not isinstance(reading, GpuSample):
                continue
            if reading.events_unwatched is None:
                break
            since[index] = obs.at_s
    evidence: dict[str, float | str] = {
        "gpus": ",".join(str(i) for i in sorted(unwatched)),
        "failure": unwatched[min(unwatched)][:200],
    }
    summary = (
        f"XID events on GPU {evidence['gpus']} are not seen (left out of NVML's event set:"
        f" {unwatched[min(unwatched)]}); its samples are still read"
    )
    return new_finding(
        newest, FindingKind.NVML_LOST, Severity.WARNING, min(since.values()), summary, **evidence
    )


def detect_nvml_trouble(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """NVML_LOST: NVML not answering for the engine's GPUs, else a GPU whose events are not watched."""
    return detect_nvml_lost(window, now, cfg) or detect_unwatched_gpu(window, now, cfg)


__all__ = ["detect_nvml_trouble", "detect_unwatched_gpu"]
