"""``detect_all`` skips the GPU detectors on a window that never held GPU data (issue 25's
overhead): its findings must be exactly those of running every detector of ``DETECTORS``.

The reference below is ``detect_all`` as it was before the skip: each detector called on its
own. Windows are random engines, with and without GPU samples, GPU probe failures and GPU
events, at every tick.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsupervisor.core.observe import Observation
from llmsupervisor.detectors import (
    DETECTORS,
    GPU_KINDS,
    DetectorConfig,
    Finding,
    FindingKind,
    detect_all,
    gpu_watch,
    new_window,
)
from llmsupervisor.detectors import gpu as gpu_detectors
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.fake_gpu import nominal_sample
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuProcess, GpuSample
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.host import ProcInfo, ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics, parse_metrics
from tests.lib.paths import FIXTURES

K = FindingKind
CFG = DetectorConfig()
ENGINE = "gpu0"
GIB = 1024 * 1024 * 1024
STEP_S = 2.0


def _busy() -> EngineMetrics:
    m = parse_metrics((FIXTURES / "metrics" / "vllm-0.32.0-cpu.txt").read_text())
    assert isinstance(m, EngineMetrics)
    return m


BUSY = _busy()
OK = HttpCheck(ok=True, detail="HTTP 200", latency_s=0.002, status_code=200)
TIMEOUT = HttpCheck(ok=False, detail="timed out (ReadTimeout)", latency_s=5.0, failure="timeout")


def every_detector(window_obs: list[Observation], now: float) -> list[Finding]:
    """The reference: every detector of ``DETECTORS``, none skipped, in FindingKind order."""
    window = new_window(CFG)
    for o in window_obs:
        window.append(o)
    return [f for detector in DETECTORS.values() if (f := detector(window, now, CFG)) is not None]


def gpu_reading(kind: int) -> GpuSample | ProbeFailure:
    if kind == 0:
        return nominal_sample(0)
    if kind == 1:
        return nominal_sample(0, temperature_c=95, processes=(GpuProcess(999, 2 * GIB),))
    if kind == 2:
        return ProbeFailure("nvml", "NVML_ERROR_UNKNOWN")
    return ProbeFailure("gpu_lost", "NVML_ERROR_GPU_IS_LOST")


tick = st.fixed_dictionaries(
    {
        "steps": st.integers(0, 3),  # steps since the previous tick (0: stalled)
        "running": st.integers(0, 8),
        "waiting": st.integers(0, 4),
        "kv": st.sampled_from([0.1, 0.5, 0.95, 0.99]),
        "metrics": st.booleans(),
        "health": st.sampled_from([None, OK, TIMEOUT]),
        "rss_step": st.sampled_from([0, 50_000_000]),
        "gpu": st.sampled_from([None, 0, 1, 2, 3]),  # None: no GPU reading this tick
        "xid": st.sampled_from([None, 13, 48, 79]),
    }
)


def build(ticks: list[dict[str, object]], *, with_gpu: bool) -> list[Observation]:
    out: list[Observation] = []
    steps = 0
    rss = 4 * GIB
    for i, t in enumerate(ticks):
        at_s = i * STEP_S
        steps += int(str(t["steps"]))
        rss += int(str(t["rss_step"]))
        metrics = replace(
            BUSY,
            iterations_total=steps,
            generation_tokens_total=4 * steps,
            requests_running=int(str(t["running"])),
            requests_waiting=int(str(t["waiting"])),
            kv_usage_ratio=float(str(t["kv"])),
        )
        proc = ProcSample(
            pgid=7,
            processes=(
                ProcInfo(
                    pid=7, title="vllm serve", rss_bytes=rss, cpu_seconds=i, status="sleeping", zombie=False
                ),
            ),
            rss_bytes_total=rss,
            cpu_seconds_total=float(i),
            process_count=1,
            zombie_count=0,
        )
        gpus: dict[int, GpuSample | ProbeFailure] = {}
        events: tuple[GpuEvent, ...] = ()
        if with_gpu and t["gpu"] is not None:
            gpus[0] = gpu_reading(int(str(t["gpu"])))
        if with_gpu and t["xid"] is not None:
            events = (GpuEvent(index=0, uuid="GPU-fake-0000", kind="xid", xid=int(str(t["xid"])), at_s=at_s),)
        out.append(
            Observation(
                engine=ENGINE,
                at_s=at_s,
                metrics=metrics if t["metrics"] else None,
                health=t["health"],  # type: ignore[arg-type]
                proc=proc,
                engine_pids=frozenset({7}),
                gpus=gpus,
                gpu_events=events,
            )
        )
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ticks=st.lists(tick, min_size=1, max_size=40), with_gpu=st.booleans())
def test_detect_all_finds_what_every_detector_finds(ticks: list[dict[str, object]], with_gpu: bool) -> None:
    observations = build(ticks, with_gpu=with_gpu)
    window = new_window(CFG)
    for i, o in enumerate(observations):
        window.append(o)
        assert detect_all(window, o.at_s, CFG) == every_detector(observations[: i + 1], o.at_s)
        # And between ticks, and after a gap longer than any freshness rule.
        later = o.at_s + 1.0
        assert detect_all(window, later, CFG) == every_detector(observations[: i + 1], later)
    end_s = observations[-1].at_s + 120.0
    assert detect_all(window, end_s, CFG) == every_detector(observations, end_s)


def test_gpu_kinds_are_the_gpu_module_s_detectors() -> None:
    """A detector added to gpu.py or gpu_watch.py (which read GPU data) is skipped with the
    others, and no other detector is ever skipped."""
    gpu_functions = {
        getattr(module, name)
        for module in (gpu_detectors, gpu_watch)
        for name in module.__all__
        if name.startswith("detect_")
    }
    assert {kind for kind, d in DETECTORS.items() if d in gpu_functions} == GPU_KINDS


def test_window_without_gpu_data_skips_the_gpu_detectors_and_one_reading_brings_them_back() -> None:
    window = new_window(CFG)
    for i in range(10):
        window.append(Observation(engine=ENGINE, at_s=i * STEP_S, metrics=BUSY, health=OK))
    assert not window.gpu_seen
    # One hot GPU reading: THERMAL runs again (its sustain is the tracker's, not the detector's).
    window.append(Observation(engine=ENGINE, at_s=20.0, metrics=BUSY, gpus={0: gpu_reading(1)}))
    assert window.gpu_seen
    assert K.THERMAL in [f.kind for f in detect_all(window, 20.0, CFG)]
    # The latch holds after the reading has left the freshness window: the detectors run (and
    # find nothing), as they did before the skip.
    window.append(Observation(engine=ENGINE, at_s=200.0, metrics=BUSY))
    assert window.gpu_seen


def test_an_event_alone_counts_as_gpu_data() -> None:
    window = new_window(CFG)
    window.append(Observation(engine=ENGINE, at_s=0.0, metrics=BUSY))
    xid = GpuEvent(index=0, uuid="GPU-fake-0000", kind="xid", xid=79, at_s=2.0)
    window.append(Observation(engine=ENGINE, at_s=2.0, metrics=BUSY, gpu_events=(xid,)))
    assert window.gpu_seen
    assert K.GPU_LOST in [f.kind for f in detect_all(window, 2.0, CFG)]
