"""One ``Observation`` per engine per tick, and the bounded window of them the detectors read.

::

    probes (health, canary, /metrics, NVML, psutil) ──► Observation ──► ObservationWindow.append
                                                                           │ count + age bounds
                                                                           │ pinned baseline span
                                                                           ▼
                                                               detectors (pure; window, now, cfg)

Every probe field is either a sample, a ``ProbeFailure`` (the probe ran and produced nothing) or
``None`` (not run this tick). Detectors read both of the latter as *unknown*, never as a fault;
the one exception is the hang detector, for which a probe that timed out is evidence.

A window belongs to one incarnation of one engine: counters, baselines and RSS trends mean
nothing across a restart, so the loop starts a new window when it respawns.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar, cast

from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.gpu_readings import GpuEvent, GpuSample
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.heartbeat import StepBeat
from llmsupervisor.probes.host import ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics

T = TypeVar("T")

_EMPTY_GPUS: Mapping[int, GpuSample | ProbeFailure] = MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """What the probes saw of one engine in one tick."""

    engine: str
    at_s: float  # monotonic, when the tick's probes were started
    metrics: EngineMetrics | ProbeFailure | None = None
    health: HttpCheck | None = None  # None: not run this tick
    canary: HttpCheck | None = None  # None: not run this tick
    # The engine's GPUs by NVML index; empty without NVML.
    gpus: Mapping[int, GpuSample | ProbeFailure] = field(default_factory=lambda: _EMPTY_GPUS)
    gpu_events: tuple[GpuEvent, ...] = ()  # on the engine's GPUs since the previous tick
    proc: ProcSample | ProbeFailure | None = None  # the sweep taken as the round began
    # A second sweep, taken after a probe of the round missed its deadline (None otherwise): the
    # hang rules read the engine's CPU across the miss without waiting a round.
    proc_after: ProcSample | None = None
    # The engine's process group now: processes on its GPUs outside it are foreign.
    engine_pids: frozenset[int] = frozenset()
    # The engine's step heartbeat, read after the round's other probes (probes/heartbeat.py);
    # None: the engine writes none (an older vLLM, or the operator turned it off).
    heartbeat: StepBeat | ProbeFailure | None = None
    # /health asked again at once after a late answer (None otherwise): a second miss in the
    # same round, sent when the first gave up, is what the ``front`` rule needs
    # (detectors/hang/front.py).
    health_after: HttpCheck | None = None
    # The heartbeat as the round's probes ended, when /health was late and the heartbeat was read
    # again after the second /health (``heartbeat`` is then that later read); None otherwise.
    heartbeat_at_miss: StepBeat | ProbeFailure | None = None

    def __post_init__(self) -> None:
        # A read-only view, so that a frozen Observation cannot be changed through its mapping.
        # Without GPUs, every observation shares one empty view: a window keeps ~1,200 of them.
        if not self.gpus:
            object.__setattr__(self, "gpus", _EMPTY_GPUS)
        elif not isinstance(self.gpus, MappingProxyType):
            object.__setattr__(self, "gpus", MappingProxyType(dict(self.gpus)))


def _check(name: str, check: HttpCheck | None) -> str:
    if check is None:
        return ""
    return f" {name}={'ok' if check.ok else check.failure} {check.latency_s:.3f}s"


def _sweep(name: str, sample: ProcSample | ProbeFailure | None) -> str:
    if not isinstance(sample, ProcSample):
        return "" if sample is None else f" {name}=failed"
    cpu = ",".join(
        f"{p.pid}:{p.cpu_seconds:.2f}"
        + ("" if p.main_thread_cpu_seconds is None else f"/{p.main_thread_cpu_seconds:.2f}")
        + ("" if p.status == "sleeping" else f"({p.status})")
        for p in sample.processes
        if p.cpu_seconds is not None
    )
    return f" {name}@{sample.at_s if sample.at_s is not None else 0:.2f}=[{cpu}]"


def _beat(name: str, beat: StepBeat | ProbeFailure | None) -> str:
    if not isinstance(beat, StepBeat):
        return "" if beat is None else f" {name}=failed"
    return (
        f" {name}=done {beat.done}@{beat.done_s:.2f} scheduled {beat.scheduled}@{beat.scheduled_s:.2f}"
        f" work {beat.work} added {beat.added} bound {beat.expected_step_s:.3f}s"
    )


def describe(obs: Observation) -> str:
    """One line of what a round saw, for the daemon's debug log: each probe's outcome and time,
    each process's CPU seconds (``/main thread``, and its state when not asleep), the heartbeat.
    A hang found late, or not at all, is explained from these lines (docs/operations.md)."""
    metrics = ""
    if obs.metrics is not None:
        metrics = " metrics=ok" if isinstance(obs.metrics, EngineMetrics) else f" metrics={obs.metrics.kind}"
    return (
        f"round@{obs.at_s:.2f}:"
        + _check("health", obs.health)
        + _check("health_again", obs.health_after)
        + _check("canary", obs.canary)
        + metrics
        + _sweep("sweep", obs.proc)
        + _sweep("sweep_after", obs.proc_after)
        + _beat("beat_at_miss", obs.heartbeat_at_miss)
        + _beat("beat", obs.heartbeat)
    )


def check_timed_out(result: HttpCheck | None) -> bool:
    """True when a health or canary check missed its deadline (no complete answer in time).

    A refused connection or an HTTP error is a different failure (the crash path, not a hang),
    and ``None`` (not run) is unknown.
    """
    return result is not None and result.failure == "timeout"


@dataclass(frozen=True, slots=True)
class CanaryLoad:
    """What the supervisor's own canaries asked of an engine over a span: not traffic."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


def canary_load(observations: Sequence[Observation], after_s: float, upto_s: float) -> CanaryLoad:
    """The canaries that answered in ``(after_s, upto_s]``: the engine's counters between the
    readings taken at those two times include them. A canary's tokens are those its answer's
    ``usage`` reported. A canary that timed out was aborted by its client, which vLLM does not
    count as finished; one that failed otherwise is not counted either (unknown).

    A canary runs alongside its tick's /metrics scrape, so one that finished just after the
    reading is counted a tick early; over a span of many ticks that is at most one canary."""
    requests = prompt_tokens = generation_tokens = 0
    for obs in observations:
        check = obs.canary
        if check is None or not check.ok or not after_s < obs.at_s <= upto_s:
            continue
        requests += 1
        prompt_tokens += check.prompt_tokens
        generation_tokens += check.generation_tokens
    return CanaryLoad(requests, prompt_tokens, generation_tokens)


BaselineAccept = Callable[[Sequence[Observation]], bool]
BaselineCompute = Callable[[tuple[Observation, ...]], object]


def thin_observation(obs: Observation) -> Observation:
    """What an old observation is kept as: its time and its process group's totals (RSS for the
    memory-growth slope), without the metrics, checks, GPU samples and per-process details that
    only the last few minutes' detectors read. A tenth of the memory (docs/benchmarks.md)."""
    proc = obs.proc
    if isinstance(proc, ProcSample):
        proc = ProcSample(
            pgid=proc.pgid,
            processes=(),
            rss_bytes_total=proc.rss_bytes_total,
            cpu_seconds_total=proc.cpu_seconds_total,
            process_count=proc.process_count,
            zombie_count=proc.zombie_count,
            at_s=proc.at_s,
        )
    return Observation(engine=obs.engine, at_s=obs.at_s, proc=proc)


class ObservationWindow:
    """The recent observations of one engine incarnation, oldest first; bounded and cheap.

    ``max_count`` and ``max_age_s`` bound the ring (the age against the newest observation, so
    no clock is read). With ``thin_after_s``, observations older than that (against the newest)
    are kept only as ``thin(obs)`` (``thin_observation``: time and process totals), for the
    detectors that read that far back.

    Separately, when ``baseline_s`` is set, the window keeps the engine's *baseline*: the first
    span of ``baseline_s`` seconds that ``baseline_accept`` approves (the detectors' "enough real
    traffic" rule). Until a span is approved the candidate slides forward; once approved it is
    pinned for the life of the window, even after the ring has dropped those observations.
    ``baseline_stats`` keeps what is computed from it. Given ``baseline_compute``, the window
    computes that when it pins the span and keeps only the answer and the span's ends
    (``baseline_span``), not the ~300 observations (``baseline`` is then None).
    """

    __slots__ = (
        "_baseline",
        "_baseline_accept",
        "_baseline_compute",
        "_baseline_memo",
        "_baseline_s",
        "_baseline_span",
        "_beat_seen",
        "_candidate",
        "_engine",
        "_gpu_seen",
        "_items",
        "_max_age_s",
        "_max_count",
        "_old",
        "_rss",
        "_rss_appended",
        "_rss_run_from",
        "_thin",
        "_thin_after_s",
    )

    def __init__(
        self,
        *,
        max_count: int = 4096,
        max_age_s: float = 3600.0,
        baseline_s: float | None = None,
        baseline_accept: BaselineAccept | None = None,
        baseline_compute: BaselineCompute | None = None,
        thin_after_s: float | None = None,
        thin: Callable[[Observation], Observation] = thin_observation,
    ) -> None:
        if max_count < 1:
            raise ValueError(f"max_count must be at least 1, not {max_count}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, not {max_age_s}")
        if baseline_s is not None and baseline_s <= 0:
            raise ValueError(f"baseline_s must be positive, not {baseline_s}")
        if thin_after_s is not None and thin_after_s <= 0:
            raise ValueError(f"thin_after_s must be positive, not {thin_after_s}")
        self._max_count = max_count
        self._max_age_s = max_age_s
        self._baseline_s = baseline_s
        self._baseline_accept = baseline_accept
        self._baseline_compute = baseline_compute
        self._thin_after_s = thin_after_s
        self._thin = thin
        self._items: deque[Observation] = deque()  # whole, newer than thin_after_s
        self._old: deque[Observation] = deque()  # thinned, older
        # (at_s, pgid, rss_bytes_total) of each kept observation with a process sweep, oldest
        # first: what the memory slope reads over 30 minutes (~900 observations) on every tick,
        # without walking the observations themselves (thinning keeps these totals).
        self._rss: deque[tuple[float, int, int]] = deque()
        # Entries ever appended to it, and the number (counted the same way) of the first entry
        # of the newest run of one process group: the span the memory slope fits is almost
        # always inside that run, and then needs no look at each entry's group.
        self._rss_appended = 0
        self._rss_run_from = 0
        self._candidate: deque[Observation] = deque(maxlen=max_count)
        self._baseline: tuple[Observation, ...] | None = None
        self._baseline_span: tuple[float, float] | None = None
        # compute -> compute(baseline), for the pinned baseline only (see baseline_stats).
        self._baseline_memo: tuple[Callable[[tuple[Observation, ...]], object], object] | None = None
        self._engine: str | None = None
        self._gpu_seen = False
        self._beat_seen = False

    @property
    def max_count(self) -> int:
        return self._max_count

    @property
    def max_age_s(self) -> float:
        return self._max_age_s

    @property
    def baseline(self) -> tuple[Observation, ...] | None:
        """The approved baseline span, oldest first; None until one has been approved, and when
        the window kept only its ``baseline_compute`` answer."""
        return self._baseline

    @property
    def baseline_span(self) -> tuple[float, float] | None:
        """The first and last observation times of the approved baseline; None until then."""
        return self._baseline_span

    @property
    def gpu_seen(self) -> bool:
        """Whether any observation appended so far carried a GPU sample, a GPU probe failure or a
        GPU event. A latch, never cleared: the GPU detectors read nothing else, so while it is
        False they have nothing to find (``detect_all`` skips them, on every CPU engine)."""
        return self._gpu_seen

    @property
    def beat_seen(self) -> bool:
        """Whether any observation appended so far carried a step heartbeat reading (a beat or
        a failed read). A latch, like ``gpu_seen``: an engine without the heartbeat has none in
        any observation, and the rules that look for the newest one need not walk the window."""
        return self._beat_seen

    @property
    def rss_series(self) -> deque[tuple[float, int, int]]:
        """``(at_s, pgid, rss_bytes_total)`` of every kept observation that has a process sweep,
        oldest first (read it, never change it)."""
        return self._rss

    @property
    def rss_run_start(self) -> int:
        """The index in ``rss_series`` from which every entry has the newest entry's process
        group (0 when they all have; ``len(rss_series)`` when it is empty)."""
        return max(0, self._rss_run_from - (self._rss_appended - len(self._rss)))

    def baseline_stats(self, compute: Callable[[tuple[Observation, ...]], T]) -> T | None:
        """``compute(baseline)``, computed once per pinned baseline; None until one is pinned.

        A pinned baseline (~300 observations) never changes, yet the degradation detectors read
        it on every tick: the window that owns it keeps the answer. One answer is kept, that of
        the last ``compute``, so pass the same function (not a new lambda) on every call. A
        window that kept only its ``baseline_compute`` answer has no other: None.
        """
        memo = self._baseline_memo
        if memo is not None and memo[0] is compute:
            return cast(T, memo[1])
        if self._baseline is None:
            return None
        value = compute(self._baseline)
        self._baseline_memo = (compute, value)
        return value

    def append(self, obs: Observation) -> None:
        """Add the newest observation; older ones beyond the bounds fall off the front."""
        if self._engine is None:
            self._engine = obs.engine
        elif obs.engine != self._engine:
            raise ValueError(f"observation of {obs.engine!r} in the window of {self._engine!r}")
        newest = self.latest()
        if newest is not None and obs.at_s < newest.at_s:
            raise ValueError(f"observation at {obs.at_s} is older than the newest ({newest.at_s})")
        if obs.gpus or obs.gpu_events:
            self._gpu_seen = True
        if obs.heartbeat is not None:
            self._beat_seen = True
        items, old, rss = self._items, self._old, self._rss
        items.append(obs)
        if isinstance(obs.proc, ProcSample):
            if not rss or rss[-1][1] != obs.proc.pgid:
                self._rss_run_from = self._rss_appended
            rss.append((obs.at_s, obs.proc.pgid, obs.proc.rss_bytes_total))
            self._rss_appended += 1
        horizon = obs.at_s - self._max_age_s
        # Both loops drop the oldest kept observation (old ones before any whole one), so the
        # RSS series drops its oldest entry with each one that had a sweep.
        while old and (old[0].at_s < horizon or len(old) + len(items) > self._max_count):
            if isinstance(old.popleft().proc, ProcSample):
                rss.popleft()
        while items[0].at_s < horizon or (not old and len(items) > self._max_count):
            if isinstance(items.popleft().proc, ProcSample):
                rss.popleft()
        if self._thin_after_s is not None:
            thin_before = obs.at_s - self._thin_after_s
            while items[0].at_s < thin_before:
                old.append(self._thin(items.popleft()))
        self._grow_baseline(obs)

    def _grow_baseline(self, obs: Observation) -> None:
        if self._baseline_span is not None or self._baseline_s is None:
            return
        self._candidate.append(obs)
        # Slide: the first span of baseline_s that the rule approves becomes the baseline.
        while self._candidate and obs.at_s - self._candidate[0].at_s >= self._baseline_s:
            if self._baseline_accept is None or self._baseline_accept(self._candidate):
                baseline = tuple(self._candidate)
                self._baseline_span = (baseline[0].at_s, baseline[-1].at_s)
                self._candidate.clear()
                if self._baseline_compute is not None:
                    self._baseline_memo = (self._baseline_compute, self._baseline_compute(baseline))
                else:
                    self._baseline = baseline
                    self._baseline_memo = None  # computed from another baseline, if any
                return
            self._candidate.popleft()

    def latest(self) -> Observation | None:
        if self._items:
            return self._items[-1]
        return self._old[-1] if self._old else None

    def since(self, t: float) -> tuple[Observation, ...]:
        """The observations at or after ``t``, oldest first (scans from the newest end)."""
        out: list[Observation] = []
        for obs in reversed(self):
            if obs.at_s < t:
                break
            out.append(obs)
        out.reverse()
        return tuple(out)

    def __iter__(self) -> Iterator[Observation]:
        return itertools.chain(self._old, self._items)

    def __reversed__(self) -> Iterator[Observation]:
        return itertools.chain(reversed(self._items), reversed(self._old))

    def __len__(self) -> int:
        return len(self._old) + len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items) or bool(self._old)


__all__ = [
    "BaselineAccept",
    "BaselineCompute",
    "CanaryLoad",
    "Observation",
    "ObservationWindow",
    "canary_load",
    "check_timed_out",
    "thin_observation",
]
