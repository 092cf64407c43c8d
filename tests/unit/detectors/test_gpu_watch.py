"""NVML_LOST for a GPU whose events are not watched (detectors/gpu_watch.py; issue 36, L8)."""

from __future__ import annotations

from typing import Any

from llmsupervisor.core.findings import FindingKind, Severity
from llmsupervisor.core.observe import Observation
from llmsupervisor.detectors import DETECTORS, DetectorConfig, new_window
from llmsupervisor.detectors.gpu_watch import detect_nvml_trouble, detect_unwatched_gpu
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.fake_gpu import nominal_sample

CFG = DetectorConfig()
LEFT_OUT = "registering xid failed: NVMLError_Unknown: Unknown Error"


def window(*observations: tuple[float, dict[int, Any]]) -> Any:
    w = new_window(CFG)
    for t, gpus in observations:
        w.append(Observation(engine="e", at_s=t, gpus=gpus))
    return w


def test_a_gpu_left_out_of_the_event_set_is_a_warning_since_it_was_left_out() -> None:
    w = window(
        (0, {0: nominal_sample(0), 1: nominal_sample(1)}),
        (2, {0: nominal_sample(0), 1: nominal_sample(1, events_unwatched=LEFT_OUT)}),
        (4, {0: nominal_sample(0), 1: nominal_sample(1, events_unwatched=LEFT_OUT)}),
    )
    finding = detect_unwatched_gpu(w, 4, CFG)
    assert finding is not None
    assert (finding.kind, finding.severity, finding.since_s) == (FindingKind.NVML_LOST, Severity.WARNING, 2)
    assert finding.evidence["gpus"] == "1"
    assert "XID events on GPU 1 are not seen" in finding.summary and "NVMLError_Unknown" in finding.summary
    assert DETECTORS[FindingKind.NVML_LOST] is detect_nvml_trouble


def test_watched_gpus_and_stale_samples_say_nothing() -> None:
    assert detect_unwatched_gpu(window((0, {0: nominal_sample(0)})), 0, CFG) is None
    stale = window((0, {0: nominal_sample(0, events_unwatched=LEFT_OUT)}))
    assert detect_unwatched_gpu(stale, CFG.stale_after_s + 1, CFG) is None


def test_nvml_not_answering_comes_first() -> None:
    w = window(
        (0, {0: nominal_sample(0, events_unwatched=LEFT_OUT)}),
        (2, {0: ProbeFailure("nvml", "NVML unavailable (driver_not_loaded): not loaded")}),
    )
    finding = detect_nvml_trouble(w, 2, CFG)
    assert finding is not None and "NVML not answering" in finding.summary
