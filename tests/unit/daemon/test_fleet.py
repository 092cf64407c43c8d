"""The fleet: a runner task that dies of a bug, on virtual time with fake processes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import aio
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.fleet import RUNNER_RESTART_DELAY_S, Fleet
from llmsupervisor.engine.commands import Hold, Start, Stop
from llmsupervisor.engine.observer import NoGpus
from tests.lib.engine_fakes import FakeProcesses, FakeSweeper, ServerScript
from tests.lib.runner_harness import spec
from tests.lib.virtual_time import run_virtual

S = EngineState


class BuggyProcesses(FakeProcesses):
    """Spawning raises something no launch code expects: the runner task dies of it."""

    bug = True

    def spawn(self, argv: list[str], env: Any, cpus: Any = ()) -> Any:
        if self.bug:
            raise RuntimeError("a bug in the runner")
        return super().spawn(argv, env, cpus)


def fleet_of(tmp_path: Path, **procs: Any) -> tuple[Fleet, BuggyProcesses]:
    fake = BuggyProcesses(state_dir=tmp_path, **procs)
    server = ServerScript(fake)
    fleet = Fleet(
        procs=fake, tick_interval_s=2.0, gpus=NoGpus(), sweeper=FakeSweeper(), http_for=server.http_for
    )
    return fleet, fake


async def settle(fleet: Fleet, name: str, pred: Any, timeout_s: float = 3600.0) -> Any:
    deadline = aio.now() + timeout_s
    while not pred(fleet.status(name)):
        assert aio.now() < deadline, fleet.status(name)
        seen = fleet.changes.version
        await aio.wait_any(fleet.changes.wait(seen), timeout_s=deadline - aio.now())
    return fleet.status(name)


def test_a_dead_runner_is_out_of_rotation_at_once_keeps_its_history_and_is_replaced(tmp_path: Path) -> None:
    """Defect D6: a runner task that died stayed READY (in rotation) until it was replaced 5 s
    later, the replacement lost its failure history, and repeated deaths never reached FATAL."""

    async def scenario() -> None:
        fleet, _procs = fleet_of(tmp_path)
        fleet.add(spec(max_failures=3))
        died = await settle(fleet, "e", lambda s: s.task_failed is not None)
        assert not died.in_rotation and died.state is S.BACKOFF
        assert "a bug in the runner" in (died.last_failure or "")
        assert died.failures == 1
        # Replaced after the delay, with its history; two more deaths spend the budget.
        final = await settle(fleet, "e", lambda s: s.state is S.FATAL)
        assert final.failures == 3 and final.restarts_by_reason.get("runner_died") == 2
        await asyncio.sleep(10 * RUNNER_RESTART_DELAY_S)
        final = fleet.status("e")
        assert final is not None and final.state is S.FATAL  # not replaced again
        await fleet.aclose()

    run_virtual(scenario())


def test_a_runner_that_dies_during_shutdown_is_not_replaced(tmp_path: Path) -> None:
    async def scenario() -> None:
        fleet, _procs = fleet_of(tmp_path)
        fleet.add(spec())
        await settle(fleet, "e", lambda s: s.task_failed is not None)
        fleet.stop_all()  # the daemon shuts down before the replacement is due
        await asyncio.sleep(10 * RUNNER_RESTART_DELAY_S)
        assert all(task.done() for task in fleet.all_tasks())
        assert len(fleet.tasks) == 1  # never replaced
        await fleet.aclose()

    run_virtual(scenario())


def test_retired_engines_are_awaited_by_shutdown(tmp_path: Path) -> None:
    """Defect D10: shutdown did not wait for engines a reload was removing."""

    async def scenario() -> None:
        fleet, procs = fleet_of(tmp_path)
        procs.bug = False
        fleet.add(spec())
        await settle(fleet, "e", lambda s: s.state is S.READY)
        fleet.retire("e")
        assert len(fleet.all_tasks()) == 1  # still stopping: shutdown waits for it
        fleet.stop_all()
        await asyncio.wait(fleet.all_tasks(), timeout=3600)
        assert not procs.live
        fleet.send("e", Stop())  # a removed engine takes no commands
        await fleet.aclose()

    run_virtual(scenario())


async def replaced(fleet: Fleet, name: str) -> Any:
    """The status once the dead runner's successor has published its own."""
    await settle(fleet, name, lambda s: s.task_failed is not None)
    return await settle(fleet, name, lambda s: s.task_failed is None)


def test_a_dead_runners_state_change_walks_edges_and_is_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 3 (§2, E3): the fleet fabricated the dead runner's BACKOFF with replace(),
    outside EDGES, without logging it or counting it in the state-change metric."""

    async def scenario() -> None:
        fleet, procs = fleet_of(tmp_path)
        procs.bug = False
        fleet.add(spec())
        ready = await settle(fleet, "e", lambda s: s.state is S.READY)
        with caplog.at_level(logging.INFO, logger="llmsupervisor"):
            fleet.tasks["e"].cancel()  # the runner's task ends without being asked to
            died = await settle(fleet, "e", lambda s: s.task_failed is not None)
        assert died.state is S.BACKOFF and died.state_reason.startswith("runner task ended")
        assert died.state_changes_total == ready.state_changes_total + 1
        assert any(
            getattr(r, "event", None) == "transition"
            and r.getMessage().startswith("READY -> BACKOFF: runner task")
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
        fleet.stop_all()
        await asyncio.wait(fleet.all_tasks(), timeout=3600)
        await fleet.aclose()

    run_virtual(scenario())


def test_a_stopped_engine_whose_runner_dies_stays_stopped(tmp_path: Path) -> None:
    """Review 3, E2: a STOPPED runner that died showed BACKOFF, and its successor started the
    engine again (it got Desired(run=spec.enabled), not the operator's stop)."""

    async def scenario() -> None:
        fleet, procs = fleet_of(tmp_path)
        procs.bug = False
        fleet.add(spec())
        await settle(fleet, "e", lambda s: s.state is S.READY)
        fleet.send("e", Stop())
        await settle(fleet, "e", lambda s: s.state is S.STOPPED)
        fleet.tasks["e"].cancel()
        died = await settle(fleet, "e", lambda s: s.task_failed is not None)
        assert died.state is S.STOPPED and not died.wants_run
        after = await replaced(fleet, "e")
        await asyncio.sleep(10 * RUNNER_RESTART_DELAY_S)
        after = fleet.status("e")
        assert after is not None and after.state is S.STOPPED and not after.wants_run
        assert not procs.live
        await fleet.aclose()

    run_virtual(scenario())


def test_a_drained_engine_whose_runner_dies_stays_drained(tmp_path: Path) -> None:
    """Review 3, E2: the successor undid the operator's drain (back in rotation)."""

    async def scenario() -> None:
        fleet, procs = fleet_of(tmp_path)
        procs.bug = False
        fleet.add(spec())
        await settle(fleet, "e", lambda s: s.state is S.READY)
        fleet.send("e", Hold(True))
        await settle(fleet, "e", lambda s: s.state is S.DRAINING)
        fleet.tasks["e"].cancel()
        await replaced(fleet, "e")
        after = await settle(fleet, "e", lambda s: s.state is S.DRAINING)
        assert after.held and not after.in_rotation and after.incarnation is not None
        await asyncio.sleep(10 * RUNNER_RESTART_DELAY_S)
        after = fleet.status("e")
        assert after is not None and after.state is S.DRAINING
        fleet.stop_all()
        await asyncio.wait(fleet.all_tasks(), timeout=3600)
        await fleet.aclose()

    run_virtual(scenario())


def test_commands_sent_while_a_runner_is_replaced_reach_its_successor(tmp_path: Path) -> None:
    """Review 3, E2: a command sent in the RUNNER_RESTART_DELAY_S gap was dropped, while the
    operator had been told "accepted"."""

    async def scenario() -> None:
        fleet, procs = fleet_of(tmp_path)
        procs.bug = False
        fleet.add(spec())
        await settle(fleet, "e", lambda s: s.state is S.READY)
        fleet.tasks["e"].cancel()
        await settle(fleet, "e", lambda s: s.task_failed is not None)
        fleet.send("e", Stop())  # in the gap
        assert fleet.pending("e")  # the policy leaves it alone meanwhile
        after = await replaced(fleet, "e")
        after = await settle(fleet, "e", lambda s: s.state is S.STOPPED and s.commands_taken == 1)
        assert not after.wants_run and not fleet.pending("e")
        await asyncio.sleep(10 * RUNNER_RESTART_DELAY_S)
        after = fleet.status("e")
        assert after is not None and after.state is S.STOPPED and not procs.live
        await fleet.aclose()

    run_virtual(scenario())


def test_an_operator_start_replaces_a_runner_that_gave_up(tmp_path: Path) -> None:
    """A dead runner past its budget is FATAL; `start` retries it as for any FATAL engine,
    instead of being accepted and dropped."""

    async def scenario() -> None:
        fleet, procs = fleet_of(tmp_path)
        fleet.add(spec(max_failures=2))
        await settle(fleet, "e", lambda s: s.state is S.FATAL and s.task_failed is not None)
        procs.bug = False
        fleet.send("e", Start())
        ready = await settle(fleet, "e", lambda s: s.state is S.READY)
        assert ready.task_failed is None and ready.failures == 0
        fleet.stop_all()
        await asyncio.wait(fleet.all_tasks(), timeout=3600)
        await fleet.aclose()

    run_virtual(scenario())
