"""The engines the daemon runs: one runner and one task each, their HTTP clients, their statuses.

The fleet is the only place runners are created, replaced and retired. A runner task that dies
of a bug is out of rotation at once (its status, made by ``died`` in engine/status.py, says so
the moment the task ends); its ledger records the death (``Ledger.runner_died``: a failure, and a
state change along EDGES, logged and counted like any other). Its successor, after
``RUNNER_RESTART_DELAY_S``, carries on the same ledger and the same desired state, so an
operator's stop or drain stays (review 3, E2), and the commands sent meanwhile are queued for
it, not dropped. A runner is never replaced while the daemon shuts down; repeated deaths spend
the budget and end in FATAL like any other crash loop (defect D6), where an operator's
``start`` replaces it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Final

import httpx

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.engine.commands import Command, Desired, Escalate, Start, Stop
from llmsupervisor.engine.http import EngineHttp, VllmHttp
from llmsupervisor.engine.ledger import Ledger
from llmsupervisor.engine.observer import GpuSource, GroupSampler
from llmsupervisor.engine.processes import Processes
from llmsupervisor.engine.runner import EngineRunner
from llmsupervisor.engine.status import EngineStatus, died
from llmsupervisor.probes.probe_http import ProbeHttp

log = logging.getLogger("llmsupervisor")

RUNNER_RESTART_DELAY_S: Final = 5.0
# Per engine: its probes (/health, /metrics, a canary) and the odd drain or cache reset at once.
ENGINE_HTTP_LIMITS: Final = httpx.Limits(max_connections=8, max_keepalive_connections=4)


class Fleet:
    def __init__(
        self,
        *,
        procs: Processes,
        tick_interval_s: float,
        gpus: GpuSource,
        sweeper: GroupSampler,
        http_for: Callable[[EngineSpec], EngineHttp] | None = None,
    ) -> None:
        self.changes = aio.Changes()
        self._procs = procs
        self._tick_s = tick_interval_s
        self._gpus = gpus
        self._sweeper = sweeper
        self._http_for = http_for or self._vllm_http
        self.runners: dict[str, EngineRunner] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._retiring: dict[str, tuple[EngineRunner, asyncio.Task[None]]] = {}
        self._dead: dict[str, EngineStatus] = {}  # engines whose runner task died, until replaced
        # The dead runner's ledger and desired state, and the commands sent since, for its successor.
        self._successor: dict[str, tuple[EngineSpec, Ledger, Desired, list[Command]]] = {}
        self._replacing: set[str] = set()  # a successor is due after RUNNER_RESTART_DELAY_S
        self._respawns: set[asyncio.Task[None]] = set()
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._probes: dict[str, ProbeHttp] = {}
        self._sent: dict[str, int] = {}  # commands sent per engine (this runner's)
        self._tls: ssl.SSLContext | None = None
        self.shutting_down = False
        # Set by the daemon: why an engine the config starts must not start yet (NVML not open,
        # daemon/nvml_wait.py), or None. Asked only for engines added without a ledger: at the
        # daemon's start and by a reload, never for a runner's successor.
        self.admit: Callable[[EngineSpec], str | None] | None = None

    # ---- HTTP clients ----

    def _vllm_http(self, spec: EngineSpec) -> EngineHttp:
        """The engine's own HTTP client. With one pool for every engine, httpcore scans all of
        its connections on each request (encode/httpcore#1035), and at 64 engines its keep-alive
        limit closed and reopened connections every tick (docs/benchmarks.md)."""
        client = self._clients.get(spec.name)
        if client is None or client.is_closed:
            # Engines speak plain http, yet every httpx client builds a TLS context (~0.7 MB
            # with the CA bundle): one, shared by all of them.
            self._tls = self._tls or ssl.create_default_context()
            client = httpx.AsyncClient(limits=ENGINE_HTTP_LIMITS, trust_env=False, verify=self._tls)
            self._clients[spec.name] = client
        probe = self._probes.get(spec.name)
        if probe is None or probe.base_url != spec.base_url:
            # A new address (a port change): the runner asks for it only once the process on
            # the old one has stopped, so the old connections go.
            if probe is not None:
                probe.close()
            probe = self._probes[spec.name] = ProbeHttp(spec.base_url)
        return VllmHttp(client, spec, probe)

    async def aclose(self) -> None:
        for client in list(self._clients.values()):
            await client.aclose()
        self._clients.clear()
        for probe in self._probes.values():
            probe.close()
        self._probes.clear()

    # ---- runners ----

    def add(self, spec: EngineSpec, *, desired: Desired | None = None, ledger: Ledger | None = None) -> None:
        """A runner for ``spec``; ``desired``: what the operator asked of it before (holds kept
        across a daemon restart, daemon/holds.py), else what the config says."""
        wanted = desired if desired is not None else Desired(run=spec.enabled)
        if ledger is None and self.admit is not None and wanted.wants_run:
            why = self.admit(spec)
            if why is not None:  # it stays STOPPED, saying why, until the daemon starts it
                desired, ledger = replace(wanted, run=False), Ledger(spec.name, now=aio.now(), reason=why)
        runner = EngineRunner(
            spec,
            procs=self._procs,
            http_for=self._http_for,
            tick_interval_s=self._tick_s,
            changed=self.changes,
            gpus=self._gpus,
            sweeper=self._sweeper,
            ledger=ledger,
            desired=desired,
        )
        self.runners[spec.name] = runner
        self._sent[spec.name] = 0
        self._dead.pop(spec.name, None)
        self._successor.pop(spec.name, None)
        self._replacing.discard(spec.name)
        task = asyncio.create_task(runner.run(), name=f"engine:{spec.name}")
        task.add_done_callback(functools.partial(self._task_ended, spec.name))
        self.tasks[spec.name] = task
        self.changes.set()

    def send(self, name: str, cmd: Command) -> None:
        runner = self.runners.get(name)
        if runner is None:
            return
        self._sent[name] = self._sent.get(name, 0) + 1
        successor = self._successor.get(name)
        if successor is None:
            runner.send(cmd)
            return
        # The runner died: the command waits for its successor, which takes it first thing.
        successor[3].append(cmd)
        if name not in self._replacing and isinstance(cmd, Start) and not self.shutting_down:
            # Given up (FATAL): an operator's start tries again, as for any FATAL engine.
            log.info("start of an engine whose runner gave up: replacing it now", extra={"engine": name})
            self._add_successor(name)

    def pending(self, name: str) -> bool:
        """Commands sent that the runner has not taken yet: the policy must not act on this
        engine again before its status shows them (one action in flight per engine)."""
        status = self.status(name)
        return status is not None and self._sent.get(name, 0) > status.commands_taken

    def statuses(self) -> tuple[EngineStatus, ...]:
        """Every engine's latest status, in config order; a dead runner's as the fleet wrote it."""
        return tuple(self._dead.get(name) or runner.status() for name, runner in self.runners.items())

    def status(self, name: str) -> EngineStatus | None:
        runner = self.runners.get(name)
        return None if runner is None else self._dead.get(name) or runner.status()

    def gpus_of(self, name: str) -> tuple[int, ...]:
        """The engine's GPUs as its runner was given them (NVML indices); () for no such engine."""
        status = self.status(name)
        return status.spec.gpus if status is not None else ()

    def retire(self, name: str) -> None:
        """An engine removed from the config: stop it for good; shutdown still waits for it."""
        runner = self.runners.pop(name)
        task = self.tasks.pop(name)
        self._dead.pop(name, None)
        self._successor.pop(name, None)
        self._replacing.discard(name)
        log.info("engine removed from the config: stopping it", extra={"engine": name})
        runner.send(Stop(final=True))
        self._retiring[name] = (runner, task)

        def retired(_: object) -> None:
            if name in self._retiring and self._retiring[name][1] is task:
                del self._retiring[name]
            if name not in self.runners:
                client = self._clients.pop(name, None)
                if client is not None:
                    closing = asyncio.create_task(client.aclose(), name=f"close-http:{name}")
                    self._respawns.add(closing)
                    closing.add_done_callback(self._respawns.discard)

        task.add_done_callback(retired)

    def _task_ended(self, name: str, task: asyncio.Task[None]) -> None:
        if self.tasks.get(name) is not task:
            return  # retired, or already replaced
        runner = self.runners[name]
        exc = None if task.cancelled() else task.exception()
        if exc is None and (runner.status().final or self.shutting_down):
            return  # a runner that was told to stop for good
        status, ledger = runner.status(), runner.ledger
        now = aio.now()
        # The state it leaves walks EDGES, logged and counted, in the ledger (the one writer).
        verdict = ledger.runner_died(
            exc, now=now, policy=status.spec.restart_policy, give_up=self.shutting_down
        )
        log.error(
            "engine task ended unexpectedly%s; %s",
            f": {exc!r}" if exc else "",
            "not replacing it" if verdict.give_up else f"replacing it in {RUNNER_RESTART_DELAY_S:g} s",
            extra={"engine": name},
            exc_info=exc,
        )
        self._dead[name] = died(status, ledger, now=now)
        self._successor[name] = (status.spec, ledger, runner.desired, [])
        self.changes.set()
        if not verdict.give_up:
            self._replacing.add(name)
            respawn = asyncio.create_task(self._replace(name), name=f"respawn:{name}")
            self._respawns.add(respawn)
            respawn.add_done_callback(self._respawns.discard)

    async def _replace(self, name: str) -> None:
        await aio.wait_any(timeout_s=RUNNER_RESTART_DELAY_S)
        if self.shutting_down or name not in self._successor or name not in self.runners:
            return
        self._add_successor(name)

    def _add_successor(self, name: str) -> None:
        spec, ledger, desired, queued = self._successor[name]
        ledger.restarted("runner_died")
        self.add(spec, desired=desired, ledger=ledger)
        for cmd in queued:
            self.send(name, cmd)

    # ---- shutdown ----

    def all_tasks(self) -> set[asyncio.Task[None]]:
        return {*self.tasks.values(), *(task for _runner, task in self._retiring.values())}

    def stop_all(self) -> None:
        """Every engine, retiring ones included (defect D10), told to stop for good."""
        self.shutting_down = True
        for name in self.runners:
            self.send(name, Stop(final=True))

    def escalate_all(self) -> None:
        for runner in [*self.runners.values(), *(runner for runner, _task in self._retiring.values())]:
            runner.send(Escalate())

    async def cancel(self, tasks: Iterable[asyncio.Task[None]], *, timeout_s: float) -> None:
        tasks = list(tasks)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait(tasks, timeout=timeout_s)
