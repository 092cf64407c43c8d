"""Restart policy for crashes: exponential backoff with jitter, a failure budget, a stability reset.

Pure functions over plain numbers; the caller passes ``now`` (monotonic seconds) and a random
draw in [0, 1), so tests need neither a clock nor a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final

# The shortest failure window the budget counts in. A window shorter than one crash cycle
# (restart, load, READY, crash) sees every failure as the first: no backoff (the first failure
# restarts at once) and never FATAL (issue 28: 46 restarts in 45 s with a 1 s window). A floor
# keeps the window's meaning (failures close together) where counting the last max_failures
# failures whatever their spacing would make an engine that fails once a day FATAL in a week.
# A minute covers the quick cycles that make a hot loop; a slower cycle restarts at most once a
# minute, and failures before READY count whatever the window (FailureHistory.unready).
MIN_FAILURE_WINDOW_S: Final = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartPolicy:
    backoff_initial_s: float = 10.0
    backoff_max_s: float = 300.0
    backoff_jitter_ratio: float = 0.2
    max_failures: int = 5
    failure_window_s: float = 900.0  # counted as at least MIN_FAILURE_WINDOW_S (window_s)
    stable_after_s: float = 600.0

    @property
    def window_s(self) -> float:
        """The window failures are counted in: ``failure_window_s``, at least MIN_FAILURE_WINDOW_S
        (the validator refuses less; this holds for a policy built any other way)."""
        return max(self.failure_window_s, MIN_FAILURE_WINDOW_S)


@dataclass(frozen=True, slots=True, kw_only=True)
class StopLadder:
    """How an engine is stopped, as data: SIGTERM to the API server (vLLM drains only then), then
    SIGTERM to the group, then SIGKILL to it, each rung with its own deadline."""

    main_term_timeout_s: float = 45.0
    group_term_timeout_s: float = 5.0
    kill_timeout_s: float = 10.0
    # A hung engine (after its stacks, engine/evidence.py): only the SIGKILL rung. Its processes
    # are SIGSTOPped or blocked, and a stopped process cannot act on a SIGTERM.
    kill_only: bool = False

    def quick(self) -> StopLadder:
        """For a second SIGINT, or an engine that is already dead: no drain, short rungs."""
        return replace(
            self,
            main_term_timeout_s=min(self.main_term_timeout_s, 1.0),
            group_term_timeout_s=min(self.group_term_timeout_s, 1.0),
        )


@dataclass(frozen=True, slots=True)
class FailureHistory:
    """Monotonic times of recent failures, oldest first, and how many failures in a row came
    without the engine reaching READY in between.

    The second number is what makes the budget work for slow loads: an engine whose every start
    fails after 10 minutes never has ``max_failures`` failures inside a 15-minute window, yet it
    is plainly in a crash loop. Failures before READY count regardless of the window."""

    times_s: tuple[float, ...] = field(default=())
    unready: int = 0  # failures since the engine was last READY

    def record(self, now: float, policy: RestartPolicy) -> FailureHistory:
        recent = tuple(t for t in self.times_s if now - t < policy.window_s)
        return replace(self, times_s=(*recent, now), unready=self.unready + 1)

    def reached_ready(self) -> FailureHistory:
        return replace(self, unready=0)

    def count(self, now: float, policy: RestartPolicy) -> int:
        in_window = sum(1 for t in self.times_s if now - t < policy.window_s)
        return max(in_window, self.unready)

    def reset(self) -> FailureHistory:
        return FailureHistory()


def backoff_delay_s(failures: int, policy: RestartPolicy, random_draw: float) -> float:
    """Delay before restart number ``failures`` (1 = first failure).

    initial * 2^(failures-1), capped at max, then spread by +-jitter_ratio so that engines that
    failed together (a shared cause: driver, disk, network) do not all restart in the same second.
    """
    if failures <= 0:
        return 0.0
    base = min(policy.backoff_initial_s * (2.0 ** min(failures - 1, 30)), policy.backoff_max_s)
    spread = policy.backoff_jitter_ratio * (2.0 * random_draw - 1.0)
    return max(0.0, base * (1.0 + spread))


def is_crash_loop(history: FailureHistory, now: float, policy: RestartPolicy) -> bool:
    """True once the budget is spent: the engine goes to FATAL instead of BACKOFF."""
    return history.count(now, policy) >= policy.max_failures


def should_reset(ready_since_s: float | None, now: float, policy: RestartPolicy) -> bool:
    """An engine READY for ``stable_after_s`` has earned a clean slate."""
    return ready_since_s is not None and now - ready_since_s >= policy.stable_after_s
