"""Engines named by GPU index wait for NVML at the daemon's start (docs/gpu.md, "NVML not there
yet").

``gpus: [3]`` means NVML's GPU 3, and the engine gets ``CUDA_VISIBLE_DEVICES=3`` with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``. While NVML cannot be read, nothing says that CUDA's 3 is that
board (CUDA is not expected to count a board it cannot initialise, and the engine would land on its
neighbour's GPU), nor whether the GPU needs a reset, has MIG on, or is another engine's. So an
engine named by index, enabled and meant to run, does not start while NVML is not open: it stays
STOPPED, its status reason says why, until NVML opens (then it is placed as at a normal start and
started), or until ``nvml_wait_s`` after the daemon's start. Then it starts anyway, with an error in
the journal: by then either the driver is up and only NVML is blind (the start is the best there
is, and the engine's NVML_LOST finding says it runs unmonitored), or it is not, and the engine's
own start fails with CUDA's error, which is what the operator needs to see. Engines named by UUID
never wait: CUDA takes a UUID whatever order it numbers the GPUs in.

Once NVML is open, an engine on a GPU whose NVSwitch fabric is not ready waits too (docs/gpu.md,
"The NVSwitch fabric"): on an HGX box CUDA cannot start on a GPU that Fabric Manager has not
registered with the NVLink fabric (error 802, "system not yet initialized"), so the engine would
only crash-loop to FATAL. It stays STOPPED, its reason ``fabric not ready on GPU 0: fabric manager
not running? ...``, and starts when its GPUs' fabric reads COMPLETED with success. That wait has
no end of its own: the fabric says when the GPU is usable, and a start before that fails (an
operator's ``start`` still starts it at once). Which engines wait and why is in ``status`` and on
``STATUS=``.

``NvmlWait`` and ``FabricWait`` are the bookkeeping (which engine waits until when, or why);
``NvmlGate`` acts on them: the fleet asks it as it adds an engine the config starts (at start, or
added by a reload), and the daemon's loop hands it the config on every tick.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec, SupervisorConfig, SupervisorSettings
from llmsupervisor.core.node_condition import engine_blocked
from llmsupervisor.daemon.actions import GpuMarks
from llmsupervisor.daemon.fleet import Fleet
from llmsupervisor.daemon.holds import Holds
from llmsupervisor.daemon.placement import place_on_host
from llmsupervisor.daemon.status import nvml_line
from llmsupervisor.engine.commands import Hold, Note, Respec, Start
from llmsupervisor.probes.gpu_readings import GpuFabric, NvmlHealth
from llmsupervisor.probes.gpus import GpuMonitor

log = logging.getLogger("llmsupervisor")


def waits_for_nvml(spec: EngineSpec) -> bool:
    """Named by GPU index (not by UUID) and on at least one GPU."""
    return bool(spec.gpus) and not spec.gpu_uuids


@dataclass(slots=True)
class NvmlWait:
    """Which engines wait for NVML, and until when (the daemon's clock)."""

    wait_s: float  # supervisor.nvml_wait_s
    started_s: float  # the daemon's start
    waiting: dict[str, float] = field(default_factory=dict)  # engine -> the end of its wait

    @property
    def until_s(self) -> float:
        return self.started_s + self.wait_s

    def admit(self, spec: EngineSpec, *, nvml_open: bool, now: float) -> str | None:
        """None: the engine starts as the config says; else why it waits (its status reason)."""
        if nvml_open or not waits_for_nvml(spec) or now >= self.until_s:
            return None
        self.waiting[spec.name] = self.until_s
        return (
            f"waiting for NVML before starting on GPU index(es) {list(spec.gpus)}: CUDA may number"
            f" GPUs NVML cannot read differently (at most {self.until_s - now:.0f} s more, nvml_wait_s;"
            " docs/gpu.md)"
        )

    def due(self, *, nvml_open: bool, now: float) -> list[str]:
        """The engines whose wait is over: all of them once NVML opened, else those past their
        end; they leave the wait."""
        done = [n for n, until in self.waiting.items() if nvml_open or now >= until]
        for name in done:
            del self.waiting[name]
        return done


def fabric_wait_reason(spec: EngineSpec, fabrics: Mapping[int, GpuFabric]) -> str | None:
    """Why ``spec`` cannot start yet for its GPUs' NVSwitch fabric (``GpuFabric.problem``, GPUs by
    NVML index); None: nothing in the fabric stops it, or NVML cannot say."""
    on: dict[str, list[str]] = {}  # problem -> the engine's GPUs that have it
    for gpu in spec.gpus:
        problem = fabrics[gpu].problem if gpu in fabrics else None
        if problem is not None:
            on.setdefault(problem, []).append(str(gpu))
    if not on:
        return None
    said = "; ".join(f"fabric not ready on GPU {','.join(gpus)}: {problem}" for problem, gpus in on.items())
    return f"{said}; starts when it completes (CUDA fails with error 802 until then; docs/gpu.md)"


@dataclass(slots=True)
class FabricWait:
    """Which engines wait for their GPUs' NVSwitch fabric, and why now (engine -> reason)."""

    waiting: dict[str, str] = field(default_factory=dict)

    def admit(self, spec: EngineSpec, fabrics: Mapping[int, GpuFabric]) -> str | None:
        """None: the fabric stops nothing; else why the engine waits (its status reason)."""
        why = fabric_wait_reason(spec, fabrics)
        if why is not None:
            self.waiting[spec.name] = why
        return why

    def due(self, specs: Mapping[str, EngineSpec], fabrics: Mapping[int, GpuFabric]) -> list[str]:
        """The engines whose GPUs' fabric is ready now; they leave the wait. An engine the config
        no longer has leaves it too; the others' reasons are brought up to date."""
        done = []
        for name in list(self.waiting):
            spec = specs.get(name)
            why = None if spec is None else fabric_wait_reason(spec, fabrics)
            if why is None:
                del self.waiting[name]
                if spec is not None:
                    done.append(name)
            else:
                self.waiting[name] = why
        return done


class NvmlGate:
    """The daemon's side of NVML at start: the fleet asks it whether an engine waits (``admit``:
    for NVML, or for its GPUs' fabric; set as ``Fleet.admit``), and the loop hands it the config
    once per tick (``turn``), which it returns placed again with NVML once NVML opened late, after
    starting the engines that waited, or after the wait ran out; and starts the engines whose
    GPUs' fabric completed."""

    def __init__(
        self,
        monitor: GpuMonitor,
        fleet: Fleet,
        holds: Holds,
        marks: GpuMarks,
        settings: SupervisorSettings,
        gpus_of: dict[str, str],
    ) -> None:
        self.monitor = monitor
        self.fleet = fleet
        self.holds = holds
        self.marks = marks
        self.gpus_of = gpus_of  # engine -> "0,1", shared with the journal handler
        self.wait = NvmlWait(settings.nvml_wait_s, started_s=aio.now())
        self.fabric = FabricWait()
        self.placed_with_nvml = False  # the engines were placed with NVML open
        fleet.admit = self.admit

    def admit(self, spec: EngineSpec) -> str | None:
        why = self.wait.admit(spec, nvml_open=self.monitor.reader.is_open, now=aio.now())
        return why if why is not None else self._fabric_admit(spec)

    def _fabric_admit(self, spec: EngineSpec) -> str | None:
        why = self.fabric.admit(spec, self.monitor.fabrics())
        if why is not None:
            log.error("engine %s not started yet: %s", spec.name, why)
        return why

    def health(self) -> NvmlHealth:
        """The monitor's, with the engines waiting for NVML or for their GPUs' fabric (those the
        fleet still runs)."""
        waiting = {n: until for n, until in self.wait.waiting.items() if n in self.fleet.runners}
        fabric = {n: why for n, why in self.fabric.waiting.items() if n in self.fleet.runners}
        needed = any(s.spec.enabled and s.spec.gpu_count for s in self.fleet.statuses())
        return replace(self.monitor.health(), waiting=waiting, needed=needed, fabric_waiting=fabric)

    def line(self) -> str | None:
        """For STATUS= while NVML is not open (daemon/status.py ``nvml_line``)."""
        return nvml_line(self.health(), now=aio.now())

    def placed(self, config: SupervisorConfig) -> None:
        """The engines were placed at start (daemon/placement.py): say it if NVML is blind."""
        self.placed_with_nvml = self.monitor.reader.is_open
        if self.placed_with_nvml:
            return
        health = self.monitor.health()
        enabled = [s for s in config.engines if s.enabled and s.gpu_count]
        by_index = [s.name for s in enabled if waits_for_nvml(s)]
        by_uuid = [s.name for s in enabled if s.gpu_uuids]
        waits = by_index and self.wait.wait_s > 0
        log.error(
            "NVML unavailable at start (%s): no GPU telemetry (XIDs, ECC, thermal, lost GPUs) until it"
            " opens; retrying.%s%s",
            health.detail or health.reason,
            f" Engines named by GPU index wait up to {self.wait.wait_s:g} s for it: {', '.join(by_index)}."
            if waits
            else "",
            f" Engines named by UUID start now, unmonitored until it opens: {', '.join(by_uuid)}."
            if by_uuid
            else "",
        )

    async def turn(self, config: SupervisorConfig) -> SupervisorConfig:
        """Once per tick: if NVML opened since the engines were placed, place them again with what
        it says and start those that waited; else start those whose wait ran out, loudly. Then
        start those whose GPUs' fabric is ready now. The config the daemon runs from now on."""
        if not self.placed_with_nvml and self.monitor.opened.is_set():
            self.placed_with_nvml = True
            config = self._take(config, await place_on_host(config, self.monitor))
            self.gpus_of.update({e.name: ",".join(str(g) for g in e.gpus) for e in config.engines})
            self._start(config, self.wait.due(nvml_open=True, now=aio.now()))
        elif due := self.wait.due(nvml_open=False, now=aio.now()):
            health = self.monitor.health()
            log.error(
                "NVML still unavailable %g s after the start (%s): starting %s on GPU indices anyway,"
                " without GPU telemetry; CUDA may number the GPUs differently from NVML (docs/gpu.md)",
                self.wait.wait_s,
                health.detail or health.reason,
                ", ".join(due),
            )
            self._start(config, due)
        self._fabric_turn(config)
        return config

    def _fabric_turn(self, config: SupervisorConfig) -> None:
        """Start the engines whose GPUs' fabric is ready now. One the operator started meanwhile,
        or that is gone, leaves the wait."""
        for name in list(self.fabric.waiting):
            runner = self.fleet.runners.get(name)
            if runner is None or runner.desired.wants_run:
                del self.fabric.waiting[name]
        if not self.fabric.waiting:
            return
        before = dict(self.fabric.waiting)
        due = self.fabric.due({s.name: s for s in config.engines}, self.monitor.fabrics())
        for name, why in self.fabric.waiting.items():
            if before.get(name) != why:
                log.warning("engine %s still waits: %s", name, why)
                self.fleet.send(name, Note(why))
        for name in due:
            log.warning("engine %s: its GPUs' fabric is ready", name)
        self._start(config, due, fabric=False)

    def _take(self, current: SupervisorConfig, placed: SupervisorConfig) -> SupervisorConfig:
        """``placed`` (the config placed with NVML open), for the engines that can take it with no
        restart they did not ask for: one that waited or is stopped gets its spec now; one named by
        UUID that started unresolved is rolled onto its monitored GPUs by the policy (a config
        restart, within max_unavailable); one that runs keeps the spec it runs."""
        before = {s.name: s for s in current.engines}
        engines = []
        for spec in placed.engines:
            old = before.get(spec.name, spec)
            status = self.fleet.status(spec.name)
            if spec == old or status is None or not status.wants_run:
                if spec != old:
                    self.fleet.send(spec.name, Respec(spec))
                engines.append(spec)
            elif old.unresolved_gpus and spec.enabled and not spec.unresolved_gpus:
                log.warning(
                    "NVML opened: engine %s's GPUs are NVML's %s; it is restarted onto them (within"
                    " max_unavailable) so that they are monitored",
                    spec.name,
                    list(spec.gpus),
                )
                engines.append(spec)
            else:
                if not spec.enabled:
                    log.error(
                        "NVML opened: engine %s runs on GPUs NVML refuses for it (above); left running:"
                        " stop it, or fix the config and reload",
                        spec.name,
                    )
                engines.append(old)
        return replace(placed, engines=tuple(engines))

    def _start(self, config: SupervisorConfig, names: list[str], *, fabric: bool = True) -> None:
        """Start the engines that waited, as the config and the operator's holds say now; with
        ``fabric``, one whose GPUs' fabric is not ready (NVML opened late) waits for it instead."""
        specs = {s.name: s for s in config.engines}
        for name in names:
            spec, runner = specs.get(name), self.fleet.runners.get(name)
            if spec is None or runner is None or not spec.enabled or runner.desired.wants_run:
                continue  # removed, disabled (or refused: MIG, a gap), or started by the operator
            hold = self.holds.get(name)
            if (hold is not None and hold.kind == "stop") or engine_blocked(spec.gpus, self.marks.conditions):
                continue
            if fabric and (why := self._fabric_admit(spec)) is not None:
                self.fleet.send(name, Note(why))  # it waited for NVML: now for the fabric
                continue
            log.info("starting after the wait for NVML or the GPU fabric", extra={"engine": name})
            self.fleet.send(name, Start())
            if hold is not None and hold.kind == "drain":
                self.fleet.send(name, Hold(True))
