"""The engine ledger: the one writer of an engine's state, counters and failure budget."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llmsupervisor.core.restarts import RestartPolicy
from llmsupervisor.core.state import EngineState
from llmsupervisor.engine.ledger import Ledger
from llmsupervisor.errors import IllegalTransition
from llmsupervisor.redact import redact_json

S = EngineState
POLICY = RestartPolicy(max_failures=3, backoff_initial_s=10.0, backoff_jitter_ratio=0.0)


def ready_ledger() -> Ledger:
    ledger = Ledger("e", now=0.0)
    ledger.to(S.STARTING, "start", now=1.0)
    ledger.to(S.READY, "ready", now=2.0)
    return ledger


def test_a_state_change_walks_edges_and_is_counted() -> None:
    ledger = ready_ledger()
    assert (ledger.state, ledger.since_s, ledger.reason) == (S.READY, 2.0, "ready")
    assert ledger.history.state_changes_total == 2
    with pytest.raises(IllegalTransition):
        ledger.to(S.STARTING, "no such edge", now=3.0)
    assert ledger.state is S.READY and ledger.history.state_changes_total == 2


def test_the_history_is_read_only_outside_the_ledger() -> None:
    ledger = ready_ledger()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ledger.history.restarts_total = 5  # type: ignore[misc]


def test_failures_spend_the_budget_with_a_growing_backoff() -> None:
    ledger = ready_ledger()
    first = ledger.failed("crashed", now=10.0, policy=POLICY)
    assert (first.failures, first.give_up, first.backoff_s) == (1, False, 0.0)  # one crash is not a loop
    second = ledger.failed("crashed", now=11.0, policy=POLICY)
    assert (second.failures, second.give_up, second.backoff_s) == (2, False, 10.0)
    third = ledger.failed("crashed", now=12.0, policy=POLICY)
    assert third.give_up and third.budget == "3 failures in a row without becoming ready"
    assert ledger.history.last_failure == "crashed"
    ledger.reset_budget("operator start")
    assert ledger.failures(12.0, POLICY) == 0


def test_counters() -> None:
    ledger = ready_ledger()
    assert ledger.spawned() == 1 and ledger.spawned() == 2
    ledger.restarted("operator")
    ledger.restarted("operator")
    ledger.restarted("crash")
    ledger.exited("exit 1", now=5.0)
    ledger.incident("/state/e/incidents/x.json")
    h = ledger.history
    assert h.restarts_total == 3 and h.restarts_by_reason == {"operator": 2, "crash": 1}
    assert (h.last_exit, h.last_exit_at_s) == ("exit 1", 5.0)
    assert (h.incidents_total, h.last_incident) == (1, "/state/e/incidents/x.json")


def test_a_runner_that_dies_while_serving_goes_to_backoff_by_an_edge() -> None:
    ledger = ready_ledger()
    verdict = ledger.runner_died(RuntimeError("bug"), now=9.0, policy=POLICY)
    assert not verdict.give_up and ledger.state is S.BACKOFF and ledger.since_s == 9.0
    assert ledger.reason == "runner task died: RuntimeError('bug'); replacing the runner"
    assert ledger.history.state_changes_total == 3
    facts = ledger.facts(now=9.0, policy=POLICY)
    assert facts["state"] is S.BACKOFF and facts["failures"] == 1 and facts["state_changes_total"] == 3


@pytest.mark.parametrize("state", [S.STOPPED, S.BACKOFF, S.FATAL])
def test_a_runner_that_dies_where_the_table_has_no_edge_keeps_its_state(state: EngineState) -> None:
    """A STOPPED engine whose runner died is still STOPPED (review 3, E2), not BACKOFF."""
    ledger = Ledger("e", now=0.0)
    path = {S.STOPPED: [], S.BACKOFF: [S.STARTING, S.BACKOFF], S.FATAL: [S.STARTING, S.FATAL]}[state]
    for step in path:
        ledger.to(step, "on the way", now=1.0)
    changes = ledger.history.state_changes_total
    ledger.runner_died(None, now=5.0, policy=POLICY)
    assert ledger.state is state and ledger.history.state_changes_total == changes
    assert ledger.reason.startswith("runner task ended")


def test_a_runner_that_dies_during_shutdown_gives_up() -> None:
    ledger = ready_ledger()
    verdict = ledger.runner_died(RuntimeError("bug"), now=9.0, policy=POLICY, give_up=True)
    assert verdict.give_up and ledger.state is S.FATAL


def test_reasons_are_kept_as_written_and_redacted_where_they_leave() -> None:
    # Redaction is at the sinks only (redact.py; tests/unit/daemon/test_redaction_sinks.py):
    # the facts keep the text, and every way out of the daemon masks it.
    ledger = ready_ledger()
    ledger.failed("spawn failed: --api-key sk-secret-123", now=1.0, policy=POLICY)
    facts = ledger.facts(now=1.0, policy=POLICY)
    assert facts["last_failure"] == "spawn failed: --api-key sk-secret-123"
    assert "sk-secret-123" not in json.dumps(redact_json(facts), default=str)


def test_gave_up_lasts_from_fatal_until_an_operator_start_resets_the_budget() -> None:
    # The runner waits while the ledger says it gave up; a successor reads the same ledger.
    ledger = ready_ledger()
    assert not ledger.gave_up
    ledger.to(S.FATAL, "3 failures in a row", now=3.0)
    assert ledger.gave_up
    ledger.reset_budget("operator start")
    assert not ledger.gave_up and ledger.state is S.FATAL  # the start walks FATAL -> STARTING next
    ledger.to(S.STARTING, "start", now=4.0)
    assert not ledger.gave_up
