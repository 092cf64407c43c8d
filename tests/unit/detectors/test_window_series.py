"""The window's own series that spare the rules a walk of every observation on every round
(issue 25's overhead): the RSS series the memory slope reads, and the heartbeat latch the step
rules read. Each must give exactly what the walk it replaced gave.

The references below are the code as it was: ``memory_growth_by_walk`` walks the observations
newest first (and fits with ``sum`` over generators), ``newest_beat_by_walk`` walks until an
observation with a heartbeat reading. Windows are random: gaps and repeated times, sweeps that
failed or are missing, a process group that changes, RSS that rises or not, and windows small
enough that observations are thinned and dropped while the rules read them; ``now`` before, at
and after the newest observation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsupervisor.core.observe import Observation, ObservationWindow
from llmsupervisor.detectors import DetectorConfig, Finding, FindingKind, Severity
from llmsupervisor.detectors.hang.steps import newest_beat
from llmsupervisor.detectors.memory import detect_memory_growth
from llmsupervisor.detectors.series import MIB, new_finding, newest_first
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcSample

ENGINE = "gpu0"
# The memory rule scaled down so that random windows of a few dozen rounds reach findings.
CFG = replace(
    DetectorConfig(),
    memory_window_s=60.0,
    memory_min_span_s=10.0,
    memory_min_samples=4,
    memory_growth_mib_per_h=1.0,
    memory_min_r2=0.5,
    stale_after_s=6.0,
)


def _least_squares_by_sums(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
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


def memory_growth_by_walk(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """detect_memory_growth before the window kept its RSS series (be15b72)."""
    start_s = now - cfg.memory_window_s
    samples: list[tuple[Observation, ProcSample]] = []
    pgid: int | None = None
    for o in newest_first(window, now):
        if o.at_s < start_s:
            break
        if not isinstance(o.proc, ProcSample):
            continue
        if pgid is None:
            if now - o.at_s > cfg.stale_after_s:
                return None
            pgid = o.proc.pgid
        if o.proc.pgid == pgid:
            samples.append((o, o.proc))
    samples.reverse()
    if len(samples) < cfg.memory_min_samples:
        return None
    span_s = samples[-1][0].at_s - samples[0][0].at_s
    if span_s < cfg.memory_min_span_s:
        return None
    origin = samples[0][0].at_s
    stride = -(-len(samples) // 256)
    points = [(o.at_s - origin, p.rss_bytes_total / MIB) for o, p in samples[::stride]]
    slope_mib_per_s, r2 = _least_squares_by_sums(points)
    slope_mib_per_h = slope_mib_per_s * 3600.0
    if slope_mib_per_h < cfg.memory_growth_mib_per_h or r2 < cfg.memory_min_r2:
        return None
    rss_mib = samples[-1][1].rss_bytes_total / MIB
    return new_finding(
        samples[-1][0],
        FindingKind.MEMORY_GROWTH,
        Severity.WARNING,
        samples[0][0].at_s,
        f"RSS growing {slope_mib_per_h:.0f} MiB/h over {span_s / 60:.0f} min (now {rss_mib:.0f} MiB)",
        slope_mib_per_h=slope_mib_per_h,
        r2=r2,
        rss_mib=rss_mib,
        samples=len(samples),
        span_s=span_s,
    )


def newest_beat_by_walk(window: ObservationWindow, now: float) -> Observation | None:
    return next((o for o in newest_first(window, now) if o.heartbeat is not None), None)


BEAT = StepBeat(pid=7, scheduled=3, done=3, scheduled_s=1.0, done_s=1.0, work=0, longest_step_s=0.01)

round_ = st.fixed_dictionaries(
    {
        "gap_s": st.sampled_from([0.0, 1.0, 2.0, 2.0, 2.0, 7.0]),  # 0: the same time again
        "proc": st.sampled_from(["sweep", "sweep", "sweep", "failed", "none"]),
        "pgid": st.sampled_from([100, 100, 100, 200]),
        "rss_step": st.sampled_from([0, 1_000_000, 5_000_000]),
        "beat": st.sampled_from([None, None, "beat", "failed"]),
    }
)


def _observations(rounds: list[dict[str, object]], *, beats: bool) -> list[Observation]:
    out: list[Observation] = []
    at_s, rss = 1000.0, 2_000_000_000
    for r in rounds:
        at_s += float(r["gap_s"])  # type: ignore[arg-type]
        rss += int(r["rss_step"])  # type: ignore[call-overload]
        proc: ProcSample | ProbeFailure | None = None
        if r["proc"] == "sweep":
            pgid = int(r["pgid"])  # type: ignore[call-overload]
            proc = ProcSample(
                pgid=pgid,
                processes=(),
                rss_bytes_total=rss,
                cpu_seconds_total=1.0,
                process_count=1,
                zombie_count=0,
                at_s=at_s,
            )
        elif r["proc"] == "failed":
            proc = ProbeFailure("timeout", "process sweep took over 5 s")
        beat: StepBeat | ProbeFailure | None = None
        if beats and r["beat"] == "beat":
            beat = BEAT
        elif beats and r["beat"] == "failed":
            beat = ProbeFailure("parse", "step-heartbeat: no complete heartbeat record")
        out.append(Observation(engine=ENGINE, at_s=at_s, proc=proc, heartbeat=beat))
    return out


def _window(max_count: int) -> ObservationWindow:
    # Small enough that old observations are thinned, and dropped by count or by age.
    return ObservationWindow(max_count=max_count, max_age_s=80.0, thin_after_s=12.0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rounds=st.lists(round_, min_size=1, max_size=70),
    max_count=st.integers(1, 60),
    now_offsets=st.lists(st.sampled_from([-3.0, 0.0, 0.0, 0.5, 5.0, 9.0]), min_size=1, max_size=3),
)
def test_memory_growth_reads_the_series_as_the_walk_read_the_observations(
    rounds: list[dict[str, object]], max_count: int, now_offsets: list[float]
) -> None:
    window = _window(max_count)
    for obs in _observations(rounds, beats=False):
        window.append(obs)
        kept = [
            (o.at_s, o.proc.pgid, o.proc.rss_bytes_total) for o in window if isinstance(o.proc, ProcSample)
        ]
        assert list(window.rss_series) == kept
        run_start = window.rss_run_start
        assert {group for _, group, _ in kept[run_start:]} <= {kept[-1][1]} if kept else run_start == 0
        assert run_start == 0 or kept[run_start - 1][1] != kept[-1][1]
        for offset in now_offsets:
            now = obs.at_s + offset
            assert detect_memory_growth(window, now, CFG) == memory_growth_by_walk(window, now, CFG)


def test_a_steady_rise_is_found_by_both() -> None:
    """The property above is not vacuous: a window where the rule finds growth."""
    rounds: list[dict[str, object]] = [
        {"gap_s": 2.0, "proc": "sweep", "pgid": 100, "rss_step": 5_000_000, "beat": None}
    ] * 30
    window = _window(60)
    for obs in _observations(rounds, beats=False):
        window.append(obs)
    now = window.latest().at_s  # type: ignore[union-attr]
    found = detect_memory_growth(window, now, CFG)
    assert found is not None and found.kind is FindingKind.MEMORY_GROWTH
    assert found == memory_growth_by_walk(window, now, CFG)


def test_a_rise_across_a_restart_fits_only_the_newest_group_by_both() -> None:
    """The span holds two groups: the rule looks at each entry's group (not the newest run's
    shortcut), and fits the newest group's points only."""
    sweep: dict[str, object] = {
        "gap_s": 2.0,
        "proc": "sweep",
        "pgid": 100,
        "rss_step": 5_000_000,
        "beat": None,
    }
    rounds = [sweep] * 10 + [{**sweep, "pgid": 200}] * 20
    window = _window(60)
    for obs in _observations(rounds, beats=False):
        window.append(obs)
    assert window.rss_run_start == 10 - (30 - len(window.rss_series))
    now = window.latest().at_s  # type: ignore[union-attr]
    found = detect_memory_growth(window, now, CFG)
    assert found is not None and found.evidence["samples"] == 20
    assert found == memory_growth_by_walk(window, now, CFG)


@settings(max_examples=200, deadline=None)
@given(
    rounds=st.lists(round_, min_size=1, max_size=50),
    beats=st.booleans(),
    max_count=st.integers(1, 40),
    offset_s=st.sampled_from([-3.0, 0.0, 5.0]),
)
def test_the_newest_heartbeat_is_the_walks(
    rounds: list[dict[str, object]], beats: bool, max_count: int, offset_s: float
) -> None:
    window = _window(max_count)
    for obs in _observations(rounds, beats=beats):
        window.append(obs)
        now = obs.at_s + offset_s
        assert newest_beat(window, now) is newest_beat_by_walk(window, now)
    assert window.beat_seen is (beats and any(r["beat"] is not None for r in rounds))
