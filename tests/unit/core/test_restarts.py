"""Restart policy arithmetic: backoff, jitter, the failure window, crash loops, the stability reset.

The functions take ``now`` and the random draw as arguments, so time is just a number here.
"""

from __future__ import annotations

import pytest

from llmsupervisor.core.restarts import (
    MIN_FAILURE_WINDOW_S,
    FailureHistory,
    RestartPolicy,
    backoff_delay_s,
    is_crash_loop,
    should_reset,
)

NO_JITTER = RestartPolicy(backoff_jitter_ratio=0.0)
MID_DRAW = 0.5  # 2 * 0.5 - 1 == 0: no spread at all


def record_all(times: list[float], policy: RestartPolicy) -> FailureHistory:
    history = FailureHistory()
    for t in times:
        history = history.record(t, policy)
    return history


def test_default_policy() -> None:
    assert RestartPolicy() == RestartPolicy(
        backoff_initial_s=10.0,
        backoff_max_s=300.0,
        backoff_jitter_ratio=0.2,
        max_failures=5,
        failure_window_s=900.0,
        stable_after_s=600.0,
    )


@pytest.mark.parametrize(
    ("failures", "expected_s"),
    [
        (1, 10.0),
        (2, 20.0),
        (3, 40.0),
        (4, 80.0),
        (5, 160.0),
        (6, 300.0),
        (7, 300.0),
        (50, 300.0),
        (10**6, 300.0),
    ],
)
def test_exponential_growth_capped_at_max(failures: int, expected_s: float) -> None:
    assert backoff_delay_s(failures, NO_JITTER, 0.123) == expected_s
    # With jitter, a mid draw lands on the same base.
    assert backoff_delay_s(failures, RestartPolicy(), MID_DRAW) == pytest.approx(expected_s)


@pytest.mark.parametrize("failures", [0, -1])
def test_no_failure_no_delay(failures: int) -> None:
    assert backoff_delay_s(failures, RestartPolicy(), 0.9) == 0.0


def test_custom_initial_and_cap() -> None:
    policy = RestartPolicy(backoff_initial_s=1.5, backoff_max_s=5.0, backoff_jitter_ratio=0.0)
    assert [backoff_delay_s(n, policy, 0.0) for n in range(1, 6)] == [1.5, 3.0, 5.0, 5.0, 5.0]


def test_zero_initial_means_immediate_restarts() -> None:
    policy = RestartPolicy(backoff_initial_s=0.0)
    assert [backoff_delay_s(n, policy, 0.99) for n in (1, 2, 10)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("failures", [1, 3, 6])
def test_jitter_bounds(failures: int) -> None:
    policy = RestartPolicy(backoff_jitter_ratio=0.2)
    base = backoff_delay_s(failures, NO_JITTER, 0.0)
    low = backoff_delay_s(failures, policy, 0.0)
    high = backoff_delay_s(failures, policy, 1.0 - 1e-12)  # draws are in [0, 1)
    assert low == pytest.approx(base * 0.8)
    assert high == pytest.approx(base * 1.2)
    for draw in (0.0, 0.1, 0.25, 0.5, 0.75, 0.999):
        assert low <= backoff_delay_s(failures, policy, draw) <= high
    # The delay grows with the draw.
    delays = [backoff_delay_s(failures, policy, d / 10) for d in range(10)]
    assert delays == sorted(delays)


def test_jitter_applies_after_the_cap() -> None:
    # The cap bounds the base, so a capped delay can reach max * (1 + ratio) but not beyond.
    policy = RestartPolicy(backoff_max_s=300.0, backoff_jitter_ratio=0.5)
    assert backoff_delay_s(20, policy, 1.0 - 1e-12) == pytest.approx(450.0)
    assert backoff_delay_s(20, policy, 0.0) == pytest.approx(150.0)


def test_full_jitter_never_goes_negative() -> None:
    policy = RestartPolicy(backoff_jitter_ratio=1.0)
    assert backoff_delay_s(1, policy, 0.0) == 0.0
    assert backoff_delay_s(1, policy, 1.0 - 1e-12) == pytest.approx(20.0)


def test_history_records_in_order_and_is_immutable() -> None:
    policy = RestartPolicy()
    empty = FailureHistory()
    one = empty.record(100.0, policy)
    two = one.record(150.0, policy)
    assert empty.times_s == ()
    assert one.times_s == (100.0,)
    assert two.times_s == (100.0, 150.0)
    assert two.count(150.0, policy) == 2
    assert two.reset() == FailureHistory()


def test_failures_outside_the_window_are_forgotten() -> None:
    policy = RestartPolicy(failure_window_s=900.0)
    history = record_all([0.0, 100.0, 500.0], policy).reached_ready()  # it served after each
    assert history.count(500.0, policy) == 3
    assert history.count(899.9, policy) == 3
    # At exactly window seconds a failure is out (now - t < window).
    assert history.count(900.0, policy) == 2
    assert history.count(1000.0, policy) == 1
    assert history.count(1400.0, policy) == 0
    # Recording drops what has left the window, so the history stays small.
    later = history.record(1000.0, policy)
    assert later.times_s == (500.0, 1000.0)


def test_failures_without_ready_in_between_count_whatever_the_window() -> None:
    """A slow load that fails every time (10-minute starts) never has max_failures inside the
    window, yet it never serves: those failures count until the engine is READY again."""
    policy = RestartPolicy(failure_window_s=900.0, max_failures=3)
    history = record_all([0.0, 610.0, 1220.0], policy)
    assert history.count(1220.0, policy) == 3
    assert is_crash_loop(history, 1220.0, policy)
    served = history.reached_ready()
    assert served.count(1220.0, policy) == 2 and not is_crash_loop(served, 1220.0, policy)


def test_crash_loop_after_max_failures_within_the_window() -> None:
    policy = RestartPolicy(max_failures=5, failure_window_s=900.0)
    history = FailureHistory()
    verdicts = []
    for t in (0.0, 10.0, 30.0, 70.0, 150.0):
        history = history.record(t, policy)
        verdicts.append(is_crash_loop(history, t, policy))
    assert verdicts == [False, False, False, False, True]


def test_no_crash_loop_when_failures_are_spread_out() -> None:
    policy = RestartPolicy(max_failures=5, failure_window_s=900.0)
    history = FailureHistory()
    for i in range(20):
        now = i * 300.0  # one failure every 5 minutes: at most 3 inside any 15-minute window
        history = history.record(now, policy).reached_ready()  # serving again in between
        assert history.count(now, policy) <= 3
        assert not is_crash_loop(history, now, policy)


def test_old_failures_stop_counting_towards_a_crash_loop() -> None:
    policy = RestartPolicy(max_failures=3, failure_window_s=60.0)
    history = record_all([0.0, 10.0], policy).reached_ready()
    assert not is_crash_loop(history, 20.0, policy)
    assert is_crash_loop(history.record(20.0, policy), 20.0, policy)
    # Same third failure, but the first two are more than a window old.
    assert not is_crash_loop(history.record(75.0, policy), 75.0, policy)


def test_max_failures_one_gives_up_at_once() -> None:
    policy = RestartPolicy(max_failures=1)
    assert not is_crash_loop(FailureHistory(), 0.0, policy)
    assert is_crash_loop(FailureHistory().record(0.0, policy), 0.0, policy)


def test_should_reset_after_stable_after_s() -> None:
    policy = RestartPolicy(stable_after_s=600.0)
    assert not should_reset(None, 10_000.0, policy)  # never ready
    assert not should_reset(1000.0, 1000.0, policy)
    assert not should_reset(1000.0, 1599.9, policy)
    assert should_reset(1000.0, 1600.0, policy)
    assert should_reset(1000.0, 5000.0, policy)


def test_zero_stable_after_resets_as_soon_as_ready() -> None:
    assert should_reset(42.0, 42.0, RestartPolicy(stable_after_s=0.0))


def test_a_tiny_failure_window_still_backs_off_and_gives_up() -> None:
    """Issue 28: with a window shorter than one crash cycle every crash was "failure 1/5,
    restarting in 0.0 s", forever. The window counts as at least MIN_FAILURE_WINDOW_S."""
    policy = RestartPolicy(max_failures=5, failure_window_s=0.001, backoff_jitter_ratio=0.0)
    assert policy.window_s == MIN_FAILURE_WINDOW_S
    history = FailureHistory()
    delays = []
    for i in range(5):
        now = i * 1.0  # crashes a second apart, READY in between (unready never counts them)
        history = history.record(now, policy)
        delays.append(backoff_delay_s(history.count(now, policy), policy, MID_DRAW))
        history = history.reached_ready()
    assert history.count(4.0, policy) == 5
    assert is_crash_loop(history, 4.0, policy)
    assert delays[1:] == sorted(delays[1:]) and delays[-1] > 0.0
    # A window above the floor is used as given.
    assert RestartPolicy(failure_window_s=61.0).window_s == 61.0
