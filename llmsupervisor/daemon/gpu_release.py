"""Resetting one GPU while the daemon and the other engines run: `llm-supervisor gpu release N`,
then `nvidia-smi -r`, then `llm-supervisor gpu take-back N` (docs/gpu.md, "Resetting one GPU").

`nvidia-smi -r` refuses a GPU that any process holds, "a monitoring application like another
instance of nvidia-smi" included (nvidia-smi(1), -r), and the daemon holds every GPU through
NVML. nvml.h has no call that lets go of one GPU: ``nvmlShutdown`` releases "all GPU resources
previously allocated with nvmlInit_v2()", and there is no per-device detach. So a release stops
the engines on the GPU and closes NVML altogether, for a bounded window: the other engines keep
serving, unmonitored on purpose meanwhile (their GPUs read ``ProbeFailure("released")``, an INFO
finding; ``nvml`` in `status` says ``released``, not a failure), and NVML opens again at the
take-back or when the window runs out, whichever comes first.

::

    phase        what happens                                           it ends
    ─────────────────────────────────────────────────────────────────────────────────────────────
    stopping     the GPU's engines drain and stop, each held (an        all stopped: NVML closed,
                 operator's stop, tagged with the GPU, daemon/holds.py)  -> released; past its
                                                                          deadline -> failed
    released     NVML closed: the operator resets the GPU               `gpu take-back`, or the
                                                                          window ran out -> taking_back
    taking_back  NVML opened again; the GPU's first sample judged       fit: its condition cleared,
                 (core/node_condition.py ``after_reset``)                 its engines started -> done;
                                                                          not fit, or NVML did not open
                                                                          by the deadline -> failed

A failed release leaves the engines held: `gpu take-back N` tries again, `start NAME` runs one
anyway. One GPU at a time. While a release is under way the engines on that GPU cannot be started
(the reset would fail, or kill them) and reloads wait: a reload places the engines with NVML,
which is closed.

Not automatic on a GPU's condition: the release blinds the daemon on every GPU, not only the one
to reset, and a reset needs root and a person (or the node's remediation) anyway; the condition's
reason names the command instead (daemon/actions.py ``blocked_reason``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.control import ControlError
from llmsupervisor.core.node_condition import after_reset
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.actions import GpuMarks
from llmsupervisor.daemon.fleet import Fleet
from llmsupervisor.daemon.gpu_release_state import (
    DEFAULT_WINDOW_S,
    MAX_WINDOW_S,
    TAKE_BACK_S,
    GpuRelease,
    Phase,
    duration,
    names,
    release_json,
    reset_command,
    stop_deadline_s,
)
from llmsupervisor.daemon.holds import GpuReset, Holds, OperatorHold
from llmsupervisor.daemon.requests import operator_commands
from llmsupervisor.engine.commands import Hold, Start
from llmsupervisor.probes.gpus import GpuMonitor

log = logging.getLogger("llmsupervisor")


class GpuReleaser:
    """The daemon's one writer of GPU releases: the control socket asks (``release``,
    ``take_back``, on the loop's turn), and the loop calls ``turn`` on every pass, which moves a
    release on when its engines have stopped, NVML has opened again, or a deadline passed."""

    def __init__(self, monitor: GpuMonitor, fleet: Fleet, holds: Holds, marks: GpuMarks) -> None:
        self.monitor = monitor
        self.fleet = fleet
        self.holds = holds
        self.marks = marks
        self.current: GpuRelease | None = None  # under way, or the last one
        self._ids = 0
        self._closing: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # ---- what others ask ----

    def blocks(self, gpus: Iterable[int]) -> str | None:
        """Why an engine on ``gpus`` may not start now (a release of one of them is under way)."""
        r = self.current
        if r is None or not r.active or r.gpu not in tuple(gpus):
            return None
        return (
            f"GPU {r.gpu} is released for its reset ({r.phase.value}, by {r.by}): take it back first"
            f" (`llm-supervisor gpu take-back {r.gpu}`), which starts its engines"
        )

    def blocks_reload(self) -> str | None:
        """Why a reload waits: it places the engines with NVML, which a release closes."""
        r = self.current
        if r is None or not r.active:
            return None
        return (
            f"GPU {r.gpu} is released for its reset: take it back first"
            f" (`llm-supervisor gpu take-back {r.gpu}`)"
        )

    def json(self) -> dict[str, Any] | None:
        return release_json(self.current, aio.now())

    def line(self) -> str | None:
        """For STATUS=, while a release is under way (NVML's own line says it is closed)."""
        r = self.current
        if r is None or not r.active:
            return None
        if r.phase is Phase.STOPPING:
            return f"GPU {r.gpu} release: stopping {names(r.engines)}, then NVML is closed"
        if r.phase is Phase.RELEASED:
            return (
                f"GPU {r.gpu} released for its reset: {reset_command(r)},"
                f" then `llm-supervisor gpu take-back {r.gpu}`"
            )
        return f"GPU {r.gpu} being taken back: {r.outcome}"

    def release(self, gpu: int, *, by: str, window_s: float | None = None) -> dict[str, Any]:
        """Begin releasing ``gpu`` (an operator's `gpu release`): its engines are told to stop,
        each held as by `stop`; NVML is closed once they have stopped (``turn``). The reply."""
        r = self.current
        if r is not None and r.active:
            raise ControlError(
                f"GPU {r.gpu} is already released ({r.phase.value}, by {r.by}): one GPU at a time;"
                f" take it back first (`llm-supervisor gpu take-back {r.gpu}`)"
            )
        window = DEFAULT_WINDOW_S if window_s is None else float(window_s)
        if not 0 < window <= MAX_WINDOW_S:
            raise ControlError(f"gpu release: the window must be above 0 and at most {MAX_WINDOW_S:g} s")
        if not self.monitor.reader.is_open:
            health = self.monitor.health()
            raise ControlError(
                f"NVML is not open ({health.reason}): the daemon holds no GPU; stop the engines on GPU"
                f" {gpu} (`llm-supervisor stop NAME`) and reset it"
            )
        gpus = self.monitor.gpus_by_index()
        uuid = gpus.get(gpu)
        if uuid is None:
            listed = ", ".join(str(i) for i in sorted(gpus)) or "none"
            raise ControlError(f"NVML lists no GPU {gpu} (it lists {listed})")
        now, wall = aio.now(), time.time()
        reset = GpuReset(gpu, uuid)
        engines: list[str] = []
        kept: list[str] = []
        drained: list[tuple[str, OperatorHold]] = []
        specs: list[EngineSpec] = []
        for status in self.fleet.statuses():
            if gpu not in status.spec.gpus:
                continue
            name, hold = status.name, self.holds.get(status.name)
            if hold is not None and hold.kind == "stop" and hold.gpu_reset is None:
                kept.append(name)  # stopped by an operator before: theirs, left stopped after
                continue
            if not status.meant_to_serve and not status.running:
                continue  # disabled and never started: nothing to stop, nothing to start after
            if hold is not None and hold.kind == "drain":
                drained.append((name, hold))
            log.info(
                "operator: stop for the reset of GPU %d (by %s)",
                gpu,
                by,
                extra={"engine": name, "event": "operator"},
            )
            commands = operator_commands("stop", status)
            for cmd in commands:
                self.fleet.send(name, cmd)
            self.holds.note(name, commands, by=by, now=wall, gpu_reset=reset)
            engines.append(name)
            specs.append(status.spec)
        self.current = self._new(
            gpu,
            uuid,
            by=by,
            phase=Phase.STOPPING,
            deadline_s=now + stop_deadline_s(specs),
            window_s=window,
            engines=tuple(engines),
            drained=tuple(drained),
            kept=tuple(kept),
            outcome=f"stopping {names(engines)}, then closing NVML",
        )
        log.warning(
            "GPU %d (%s) release for its reset, by %s: stopping %s%s; then NVML is closed: no GPU"
            " telemetry on any GPU until `llm-supervisor gpu take-back %d` (at most %s)",
            gpu,
            uuid,
            by,
            names(engines),
            f" ({', '.join(kept)} already stopped by an operator, left so)" if kept else "",
            gpu,
            duration(window),
            extra={"event": "operator"},
        )
        return {"release": self.json(), "engines": engines}

    def take_back(self, gpu: int, *, by: str) -> dict[str, Any]:
        """An operator's `gpu take-back`: open NVML again (if the release closed it), judge the
        GPU on its first sample, and start its engines if it is fit (``turn``). The reply.

        Also after the release ended without one: a failed release or take-back, or a daemon
        restart (the holds name the GPU, daemon/holds.py)."""
        if self._closing is not None:
            raise ControlError(f"NVML is being closed for GPU {gpu}'s release; take it back in a few seconds")
        r = self.current
        if r is not None and r.active:
            if r.gpu != gpu:
                raise ControlError(
                    f"GPU {r.gpu} is the one released, not GPU {gpu}: `llm-supervisor gpu take-back {r.gpu}`"
                )
            if r.phase is not Phase.TAKING_BACK:
                self._take_back(r, by=by)
            return {"release": self.json()}
        uuid = self.monitor.gpus_by_index().get(gpu)
        held = tuple(self.holds.for_gpu_reset(uuid)) if uuid is not None else ()
        if r is not None and r.gpu == gpu and r.phase is Phase.FAILED:
            engines = tuple(dict.fromkeys((*r.engines, *held)))
            self._take_back(replace(r, engines=engines), by=by)
            return {"release": self.json()}
        if uuid is None or not held:
            raise ControlError(
                f"GPU {gpu} is not released: no engine is held for its reset, nothing to take back"
            )
        # The release ended without a take-back (a daemon restart): its engines are still held.
        found = self._new(gpu, uuid, by=by, phase=Phase.FAILED, deadline_s=None, window_s=0.0, engines=held)
        self._take_back(found, by=by)
        return {"release": self.json()}

    def _new(self, gpu: int, uuid: str, *, by: str, **fields: Any) -> GpuRelease:
        self._ids += 1
        return GpuRelease(
            id=self._ids,
            gpu=gpu,
            uuid=uuid,
            pci_bus_id=self.monitor.pci_bus_id(gpu),
            by=by,
            since_s=aio.now(),
            **fields,
        )

    # ---- the loop's turn ----

    def turn(self) -> None:
        """Move the release on: close NVML once its engines have stopped; take the GPU back when
        its window ran out; judge it once NVML has opened again; fail a phase past its deadline."""
        r = self.current
        if r is None or not r.active or self._closing is not None:
            return
        now = aio.now()
        if r.phase is Phase.STOPPING:
            left = [n for n in r.engines if not self._stopped(n)]
            if not left:
                self._close(r)
            elif r.deadline_s is not None and now >= r.deadline_s:
                self._fail(
                    r,
                    f"{', '.join(left)} did not stop within {duration(now - r.since_s)}: NVML not closed;"
                    f" the engines stay stopped (held); `llm-supervisor gpu take-back {r.gpu}` starts them",
                )
        elif r.phase is Phase.RELEASED:
            if r.deadline_s is not None and now >= r.deadline_s:
                log.warning(
                    "GPU %d: its release window (%s) ran out: taking it back",
                    r.gpu,
                    duration(r.window_s),
                    extra={"event": "action"},
                )
                self._take_back(r, by="the daemon (the release window ran out)")
        elif r.phase is Phase.TAKING_BACK:
            opened = self.monitor.reader.is_open and (
                not r.nvml_closed or self.monitor.opens_total > r.opens_seen
            )
            if opened:
                self._judge(r)
            elif r.deadline_s is not None and now >= r.deadline_s:
                health = self.monitor.health()
                self._fail(
                    r,
                    f"NVML did not open again within {duration(TAKE_BACK_S)} ({health.reason}:"
                    f" {health.detail}); {names(r.engines)} stay stopped (held); the daemon keeps"
                    f" trying: `llm-supervisor gpu take-back {r.gpu}` again once `status` says NVML is up",
                )

    def _stopped(self, name: str) -> bool:
        status = self.fleet.status(name)
        if status is None:
            return True  # removed
        return status.pid is None and status.state in (EngineState.STOPPED, EngineState.FATAL)

    def _close(self, r: GpuRelease) -> None:
        self.current = replace(r, outcome="closing NVML")
        self._closing = asyncio.create_task(self._close_nvml(r), name="gpu-release")

    async def _close_nvml(self, r: GpuRelease) -> None:
        why = (
            f"released by {r.by} for the reset of GPU {r.gpu} ({r.uuid}):"
            f" `llm-supervisor gpu take-back {r.gpu}` opens it again"
        )
        try:
            until_s = aio.now() + r.window_s
            await self.monitor.release(why, until_s=until_s)
            now = aio.now()
            self.current = replace(
                r,
                phase=Phase.RELEASED,
                since_s=now,
                deadline_s=until_s,
                nvml_closed=True,
                outcome=(
                    f"{names(r.engines)} stopped and held; NVML closed: reset the GPU, then take it back"
                ),
            )
            log.warning(
                "GPU %d (%s%s) released: %s stopped and held; NVML closed, no GPU telemetry on any GPU"
                " meanwhile (on purpose). Reset it now, as root: %s; then `llm-supervisor gpu take-back"
                " %d` (taken back by itself in %s)",
                r.gpu,
                r.uuid,
                f", PCI {r.pci_bus_id}" if r.pci_bus_id else "",
                names(r.engines),
                reset_command(r),
                r.gpu,
                duration(r.window_s),
                extra={"event": "action"},
            )
        except Exception as exc:  # a bug here must not leave the release stuck
            log.exception("closing NVML for GPU %d's release failed", r.gpu)
            self._fail(r, f"closing NVML failed: {exc!r}; `llm-supervisor gpu take-back {r.gpu}`")
        finally:
            self._closing = None

    def _take_back(self, r: GpuRelease, *, by: str) -> None:
        closed = r.nvml_closed and not self.monitor.reader.is_open
        opens_seen = self.monitor.opens_total
        if closed or self.monitor.released is not None:
            self.monitor.take_back()
        now = aio.now()
        self.current = replace(
            r,
            phase=Phase.TAKING_BACK,
            since_s=now,
            deadline_s=now + TAKE_BACK_S,
            nvml_closed=closed,
            opens_seen=opens_seen,
            outcome="opening NVML again" if closed else "checking the GPU",
        )
        log.warning(
            "GPU %d take-back (by %s): %s, then its engines start if it is fit",
            r.gpu,
            by,
            "opening NVML again" if closed else "checking the GPU",
            extra={"event": "operator" if not by.startswith("the daemon") else "action"},
        )

    def _judge(self, r: GpuRelease) -> None:
        index = {uuid: i for i, uuid in self.monitor.gpus_by_index().items()}.get(r.uuid)
        sample = self.monitor.latest.get(index) if index is not None else None
        condition = next((c for c in self.marks.conditions if c.uuid == r.uuid), None)
        check = after_reset(condition, sample)
        if not check.fit:
            self._fail(
                r,
                f"GPU {r.gpu} is not fit after the reset: {check.why}; {names(r.engines)} stay stopped"
                f" (held): reset it again (`llm-supervisor gpu release {r.gpu}`), or `llm-supervisor"
                " start NAME` to run one anyway",
            )
            return
        said = check.why
        if check.clears and condition is not None:
            self.marks.clear(r.uuid)
            said += f"; {condition.condition} cleared (its marks keep counting)"
        started = self._start_engines(r)
        self.current = replace(
            r,
            phase=Phase.DONE,
            since_s=aio.now(),
            deadline_s=None,
            nvml_closed=False,
            outcome=f"taken back: {said}; "
            + (f"started {', '.join(started)}" if started else "no engine to start"),
        )
        log.warning(
            "GPU %d (%s) taken back: %s; %s",
            r.gpu,
            r.uuid,
            said,
            f"starting {', '.join(started)}" if started else "no engine to start",
            extra={"event": "action"},
        )

    def _start_engines(self, r: GpuRelease) -> list[str]:
        """Start the engines held for this reset, each as it was before: a drained one starts out
        of rotation, its drain given back. Holds an operator changed since are theirs."""
        before = dict(r.drained)
        started = []
        for name in r.engines:
            hold = self.holds.get(name)
            if self.fleet.status(name) is None or hold is None or hold.gpu_reset is None:
                continue
            if hold.gpu_reset.uuid != r.uuid:
                continue
            self.fleet.send(name, Start())
            drain = before.get(name)
            if drain is not None:
                self.fleet.send(name, Hold(True))
            self.holds.put(name, drain)
            started.append(name)
            self._persist(name)
        return started

    def _fail(self, r: GpuRelease, why: str) -> None:
        self.current = replace(r, phase=Phase.FAILED, since_s=aio.now(), deadline_s=None, outcome=why)
        log.error("GPU %d release: %s", r.gpu, why, extra={"event": "action"})

    def _persist(self, name: str) -> None:
        """The hold file, written off the loop's turn (daemon/holds.py bounds the write)."""
        task = asyncio.create_task(self.holds.persist(name), name=f"hold-{name}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """At shutdown: a close of NVML under way is finished (the monitor closes it anyway)."""
        if self._closing is not None:
            self._closing.cancel()
            await asyncio.gather(self._closing, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


__all__ = ["GpuReleaser"]
