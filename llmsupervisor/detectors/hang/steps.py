"""The hang rules that read the step heartbeat (issue 25): the stuck engine (``find_stuck``), the
tests of the ``frozen``, ``spinning`` and ``overdue`` rules, and when an idle engine should be
asked at once. The rules (detectors/hang/rules.py) apply these tests, in their order, to the
stuck engine their facts hold (``HangFacts.stuck``).

The heartbeat (probes/heartbeat.py) says when the engine last completed a step and what it held.
An engine that holds work and completes no step for a few of its own longest steps is stuck;
what its processes do meanwhile says how: nothing (``frozen``), burning CPU outside the process
that computes (``spinning``), or computing one step far longer than its size allows
(``overdue``). Each rule says why a busy engine cannot trip it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsupervisor.core.observe import Observation, ObservationWindow, check_timed_out
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.hang.sweeps import cpu_used_s, sweeps_in
from llmsupervisor.detectors.series import newest_first
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcInfo, ProcSample

WORKER_TITLE = "VLLM::Worker"
# A round's first sweep is taken as its canary is sent, a few milliseconds apart: a sweep this
# much before the canary was sent still counts as taken while it waited.
SAME_ROUND_S = 0.5
DISK_SLEEP = "disk-sleep"  # psutil.STATUS_DISK_SLEEP: waiting on I/O (a LoRA load from NFS)


def is_worker(p: ProcInfo) -> bool:
    return p.title.startswith(WORKER_TITLE)


@dataclass(frozen=True, slots=True)
class Stuck:
    """The engine held work and completed no step since ``since_s`` (the last step, or when
    the canary it had not picked up was sent); ``obs`` holds the heartbeat that says so."""

    obs: Observation
    beat: StepBeat
    since_s: float
    idle: bool  # nothing held at the last step: only the canary waits


def canary_sent_s(obs: Observation) -> float | None:
    """When a canary that missed its deadline was sent (the round's probes start together)."""
    if not check_timed_out(obs.canary):
        return None
    assert obs.canary is not None
    return obs.at_s - obs.canary.latency_s


def newest_beat(window: ObservationWindow, now: float) -> Observation | None:
    """The newest observation (at or before ``now``) that carries a heartbeat reading. None at
    once when no observation ever did (the engine has no heartbeat: the plugin did not load,
    or an engine other than vLLM), rather than after walking the whole window: the rules ask
    for it on every round, three times."""
    if not window.beat_seen:
        return None
    return next((o for o in newest_first(window, now) if o.heartbeat is not None), None)


def find_stuck(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Stuck | None:
    """The newest heartbeat, read after its round's probes, if the engine held work and did not
    step: requests held at its last step (or one in flight), or, on an idle engine, a canary
    that missed its deadline without a step even being scheduled for it (an idle vLLM picks a
    request up within milliseconds)."""
    obs = newest_beat(window, now)
    if obs is None or not isinstance(obs.heartbeat, StepBeat) or now - obs.at_s > cfg.stale_after_s:
        return None
    beat = obs.heartbeat
    if beat.pending:  # a step under way since it was scheduled (or the last one came back)
        return Stuck(obs, beat, max(beat.done_s, beat.scheduled_s), idle=False)
    if beat.work > 0:  # requests held: the next step follows the last at once
        return Stuck(obs, beat, beat.done_s, idle=False)
    sent_s = canary_sent_s(obs)
    if sent_s is not None and beat.scheduled_s < sent_s:
        return Stuck(obs, beat, sent_s, idle=True)
    return None


def span_in(
    window: ObservationWindow, now: float, cfg: DetectorConfig, since_s: float
) -> tuple[ProcSample, ProcSample] | None:
    """The newest sweep and the newest one at least ``hang_cpu_min_span_s`` before it, if that
    one was taken while the engine was stuck (from ``since_s``, less ``SAME_ROUND_S``): the
    engine's CPU between them is its CPU while stuck."""
    newest = next(sweeps_in(window, now, now - cfg.hang_cpu_max_span_s), None)
    if newest is None or newest.at_s is None:
        return None
    for older in sweeps_in(window, now, now - cfg.hang_cpu_max_span_s):
        assert older.at_s is not None
        span_s = newest.at_s - older.at_s
        if span_s > cfg.hang_cpu_max_span_s:
            return None
        if span_s >= cfg.hang_cpu_min_span_s:
            return (older, newest) if older.at_s >= since_s - SAME_ROUND_S else None
    return None


def stuck_span(
    window: ObservationWindow, now: float, cfg: DetectorConfig, stuck: Stuck, *, defer_on_io: bool
) -> tuple[ProcSample, ProcSample, float] | None:
    """``span_in`` for a stuck engine: (older, newer, seconds between them); None without one,
    or, with ``defer_on_io``, while a process waits on I/O (state D, a LoRA load from a network
    disk): that is left to the deadline rule."""
    span = span_in(window, now, cfg, stuck.since_s)
    if span is None:
        return None
    older, newer = span
    assert older.at_s is not None and newer.at_s is not None
    if defer_on_io and any(p.status == DISK_SLEEP for p in newer.processes):
        return None
    return older, newer, newer.at_s - older.at_s


def step_bound_s(beat: StepBeat, floor_s: float, cfg: DetectorConfig) -> float:
    """How long a step may take before it is overdue: ``hang_step_factor`` x the engine's own
    bound of the step under way (its tokens x its slowest recent time per token, or its longest
    recent step: ``StepBeat.expected_step_s``), and at least ``floor_s``."""
    return max(floor_s, cfg.hang_step_factor * beat.expected_step_s)


def frozen_engine(
    window: ObservationWindow, now: float, cfg: DetectorConfig, stuck: Stuck | None
) -> tuple[Stuck, float, float] | None:
    """Work held, no step for the learned bound, and the engine's processes other than the API
    server at (almost) no CPU while stuck: (stuck, CPU share, span). ``stuck``: ``find_stuck``'s.

    Why a busy engine cannot trip it: a working engine completes a step within a few of its own
    longest steps, and computes meanwhile (CUDA spin-waits on a GPU, OpenMP on the CPU build;
    an engine whose CUDA context was made to block rather than spin would need the bound raised).
    A process waiting on I/O (state D, a LoRA load from a network disk) defers it to the
    deadline rule."""
    if stuck is None:
        return None
    bound_s = step_bound_s(stuck.beat, cfg.hang_cpu_min_span_s, cfg)
    if now - stuck.since_s < (cfg.hang_cpu_min_span_s if stuck.idle else bound_s):
        return None
    span = stuck_span(window, now, cfg, stuck, defer_on_io=True)
    if span is None:
        return None
    older, newer, span_s = span
    # The API server is left out: it accepts and holds requests, answers /health and renders
    # /metrics while the core is stuck.
    used_s = cpu_used_s(older, newer, lambda p: p.pid != newer.pgid)
    if used_s is None or used_s > cfg.hang_cpu_idle_ratio * span_s + poll_s(stuck, older, cfg):
        return None
    # But a canary that never reached the core of a busy API server (its event loop held up) is
    # the API server's slowness, not a frozen engine.
    api_s = cpu_used_s(older, newer, lambda p: p.pid == newer.pgid)
    if stuck.idle and api_s is not None and api_s >= cfg.hang_spin_busy_ratio * span_s:
        return None
    return stuck, used_s / span_s, span_s


def poll_s(stuck: Stuck, older: ProcSample, cfg: DetectorConfig) -> float:
    """The Worker's CPU that is its poll for the next step (``hang_worker_poll_s`` after the
    last step came back), within the span from ``older``: one core for the overlap. Nothing on
    an idle engine, whose Worker has long been asleep on its socket. Counted from the last step
    done, not from one scheduled since: a Worker handed a step computes it, and that CPU is a
    forward's (or a spin's: the overdue rule's), not a poll's."""
    assert older.at_s is not None
    if stuck.idle:
        return 0.0
    return max(0.0, stuck.beat.done_s + cfg.hang_worker_poll_s - older.at_s)


def spinning_engine(
    window: ObservationWindow, now: float, cfg: DetectorConfig, stuck: Stuck | None
) -> tuple[Stuck, float, float, float] | None:
    """Work held, no step for the learned bound (``hang_spin_after_s`` at least), the engine's
    processes other than the API server busy, and its Worker idle: (stuck, CPU share, Worker
    share, span). ``stuck``: ``find_stuck``'s.

    Why a busy engine cannot trip it: its steps complete within a few of its own longest
    steps; and a step, however long, is computed by the Worker, which then burns CPU. That last
    test holds only where the Worker's CPU is the compute (the CPU build): on a GPU host a hung
    kernel and a long prefill both spin the Worker on the GPU's completion, so a GPU engine, or
    one without a Worker process, is left to the deadline rule (and a future power/GPM oracle,
    shared/docs/hang-detection.md §4)."""
    if stuck is None or stuck.obs.gpus:
        return None
    bound_s = step_bound_s(stuck.beat, cfg.hang_spin_after_s, cfg)
    # An idle engine has no step under way that could be long: the canary's miss is the bound.
    if not stuck.idle and now - stuck.since_s < bound_s:
        return None
    span = stuck_span(window, now, cfg, stuck, defer_on_io=False)
    if span is None:
        return None
    older, newer, span_s = span
    used_s = cpu_used_s(older, newer, lambda p: p.pid != newer.pgid and not is_worker(p))
    worker_s = cpu_used_s(older, newer, is_worker)
    if used_s is None or worker_s is None:
        return None  # no Worker process: nothing tells a spin from a forward
    if used_s < cfg.hang_spin_busy_ratio * span_s:
        return None
    if worker_s > cfg.hang_cpu_idle_ratio * span_s + poll_s(stuck, older, cfg):
        return None
    return stuck, used_s / span_s, worker_s / span_s, span_s


def overdue_step(
    window: ObservationWindow, now: float, cfg: DetectorConfig, stuck: Stuck | None
) -> tuple[Stuck, float, float, float] | None:
    """A step under way past its bound, scaled by the step's own tokens (``hang_spin_after_s``
    at least), while the Worker computes: (stuck, bound, Worker share, span). ``stuck``:
    ``find_stuck``'s.

    The spinning rule's other half: a Worker that spins (a loop holding its GIL, a collective
    busy-polling a lost peer) burns CPU as a forward does, so /proc cannot tell them apart; the
    step's time can. vLLM caps the tokens of a step (chunked prefill, max-num-batched-tokens),
    and a step takes about a + b x its tokens, so the engine's slowest recent time per token
    times the tokens under way bounds it from above (``StepBeat.expected_step_s``).

    Why a busy engine cannot trip it: the bound is ``hang_step_factor`` x that, from the
    engine's own steps on this host under its load now, so a long prefill gets a long bound and
    a slower host a slower one; a step is only overdue when nothing like it has been that slow.
    Engines with GPUs are left out: a Worker there can spend seconds of CPU in a step that is
    not hung (Triton compiling a kernel for a shape it meets first), which only the GPU can
    tell apart (a future power/GPM oracle, shared/docs/hang-detection.md §4). A step whose
    size the heartbeat does not give (an older plugin) is left to the deadline rule."""
    if stuck is None or stuck.obs.gpus or stuck.idle or not stuck.beat.pending:
        return None
    if stuck.beat.tokens_pending <= 0 or stuck.beat.per_token_s <= 0:
        return None
    bound_s = step_bound_s(stuck.beat, cfg.hang_spin_after_s, cfg)
    if now - stuck.since_s < bound_s:
        return None
    span = stuck_span(window, now, cfg, stuck, defer_on_io=True)
    if span is None:
        return None
    older, newer, span_s = span
    worker_s = cpu_used_s(older, newer, is_worker)
    if worker_s is None or worker_s < cfg.hang_spin_busy_ratio * span_s:
        return None  # no Worker, or one at rest: the frozen and spinning rules' case
    return stuck, bound_s, worker_s / span_s, span_s


def beat_idle(beat: StepBeat) -> bool:
    """The engine holds nothing and has no step under way."""
    return beat.work == 0 and not beat.pending


def idle_by_heartbeat(window: ObservationWindow, now: float) -> bool:
    """The newest heartbeat in the window says the engine holds nothing and has no step under way."""
    obs = newest_beat(window, now)
    if obs is None or not isinstance(obs.heartbeat, StepBeat):
        return False
    return beat_idle(obs.heartbeat)


def idle_but_busy(
    window: ObservationWindow,
    now: float,
    cfg: DetectorConfig,
    fresh: ProcSample | None = None,
    beat: StepBeat | None = None,
) -> bool:
    """The heartbeat (``beat``, read as the round began, else the window's newest) says the
    engine holds nothing, yet its processes other than the API server used at least
    ``hang_spin_busy_ratio`` of a core over the last two sweeps (``fresh``, this round's, and the
    window's newest; else the window's two newest): an idle EngineCore blocks at ~0 %, and so
    does an idle Worker once its poll is over, so something spins. The observer sends its canary
    now rather than at ``canary_interval_s``: the spinning and overdue rules need a request the
    engine fails to step."""
    if not (beat_idle(beat) if beat is not None else idle_by_heartbeat(window, now)):
        return False
    sweeps = sweeps_in(window, now, now - cfg.hang_cpu_max_span_s)
    newer = fresh if fresh is not None and fresh.at_s is not None else next(sweeps, None)
    older = next(sweeps, None)
    if newer is None or older is None or newer.at_s is None or older.at_s is None:
        return False
    span_s = newer.at_s - older.at_s
    used_s = cpu_used_s(older, newer, lambda p: p.pid != newer.pgid)
    return span_s > 0 and used_s is not None and used_s >= cfg.hang_spin_busy_ratio * span_s


def beat_progressed(older: Observation, newer: Observation) -> bool:
    """The heartbeat shows a step completed between two observations (same writer)."""
    a, b = older.heartbeat, newer.heartbeat
    return isinstance(a, StepBeat) and isinstance(b, StepBeat) and a.pid == b.pid and b.done > a.done


__all__ = [
    "Stuck",
    "beat_idle",
    "beat_progressed",
    "find_stuck",
    "frozen_engine",
    "idle_but_busy",
    "idle_by_heartbeat",
    "overdue_step",
    "spinning_engine",
    "step_bound_s",
]
