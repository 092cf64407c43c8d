"""The three words of intent on an engine's status (issue 35): ``meant_to_serve``,
``held_by_operator`` and ``running``, tabled over what an engine can be; and a dead runner's
status (``died``), made beside ``build_status``."""

from __future__ import annotations

import pytest

from llmsupervisor.core.state import EngineState
from llmsupervisor.detectors import Finding, FindingKind, Severity
from llmsupervisor.engine.ledger import Ledger
from llmsupervisor.engine.status import died, down_since
from tests.lib.statuses import spec, status

S = EngineState

# (enabled in the config, wants_run, held (drained), final, state)
#     -> (meant_to_serve, held_by_operator, running)
WORDS = [
    pytest.param(True, True, False, False, S.READY, (True, False, True), id="enabled-serving"),
    pytest.param(True, True, False, False, S.BACKOFF, (True, False, True), id="enabled-restarting"),
    pytest.param(True, True, False, False, S.FATAL, (True, False, False), id="enabled-gave-up"),
    pytest.param(True, True, True, False, S.DRAINING, (True, True, True), id="enabled-drained"),
    pytest.param(True, False, False, False, S.STOPPED, (True, True, False), id="enabled-stopped"),
    pytest.param(False, False, False, False, S.STOPPED, (False, True, False), id="disabled"),
    # `start` on a disabled engine: meant to serve for this run of the daemon.
    pytest.param(False, True, False, False, S.STARTING, (True, False, True), id="disabled-started"),
    pytest.param(False, True, False, False, S.READY, (True, False, True), id="disabled-started-serving"),
    # An operator's drain holds it again; a stop gives it back to the config's word.
    pytest.param(False, True, True, False, S.DRAINING, (True, True, True), id="disabled-started-drained"),
    pytest.param(False, False, False, False, S.STOPPING, (False, True, False), id="disabled-started-stopped"),
    # Stopped for good (daemon shutdown, removed from the config).
    pytest.param(True, False, False, True, S.STOPPING, (False, True, False), id="final"),
]


@pytest.mark.parametrize(("enabled", "wants_run", "held", "final", "state", "words"), WORDS)
def test_the_three_words(
    enabled: bool, wants_run: bool, held: bool, final: bool, state: EngineState, words: tuple[bool, ...]
) -> None:
    s = status("e0", state, spec=spec("e0", enabled=enabled), wants_run=wants_run, held=held, final=final)
    assert (s.meant_to_serve, s.held_by_operator, s.running) == words


@pytest.mark.parametrize(("enabled", "wants_run", "held", "final", "state", "words"), WORDS)
def test_the_down_clock_runs_for_an_engine_meant_to_serve_not_held_and_not_serving(
    enabled: bool, wants_run: bool, held: bool, final: bool, state: EngineState, words: tuple[bool, ...]
) -> None:
    s = status("e0", state, spec=spec("e0", enabled=enabled), wants_run=wants_run, held=held, final=final)
    meant, held_out, _ = words
    down = meant and not held_out and state not in (S.READY, S.SHEDDING)
    assert down_since(None, s, now=50.0) == (50.0 if down else None)
    assert down_since(10.0, s, now=50.0) == (10.0 if down else None)  # the clock carries on


def test_a_dead_runners_status_is_out_of_rotation_with_its_ledgers_facts() -> None:
    """Review 4, E2 residue: the fleet assembled this status itself with ``replace``."""
    hang = Finding(
        engine="e0", kind=FindingKind.HANG, severity=Severity.CRITICAL, evidence={}, since_s=0.0, summary="!"
    )
    last = status("e0", findings=(hang,), busy=False)
    ledger = Ledger("e0", now=0.0)
    ledger.to(S.STARTING, "start", now=1.0)
    ledger.to(S.READY, "ready", now=2.0)
    ledger.runner_died(RuntimeError("a bug"), now=100.0, policy=last.spec.restart_policy)
    dead = died(last, ledger, now=100.0)
    assert dead.state is S.BACKOFF and dead.state_since_s == 100.0
    assert dead.task_failed is not None and "a bug" in dead.task_failed
    assert not dead.in_rotation and dead.busy
    assert dead.incarnation is None and dead.findings == ()
    assert dead.failures == 1 and dead.down_since_s == 100.0  # meant to serve, and it does not
