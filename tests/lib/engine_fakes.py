"""Fakes at the runner's seams, for tests on virtual time (tests/lib/virtual_time.py).

``FakeProcesses`` stands for the operating system (engine/processes.py ``Processes``): each spawn
is a ``FakeProcess`` with real output pipes and a scripted reaction to signals, and as many
``FakeChild`` members of its group as asked (vLLM's EngineCore and Worker). ``timeline`` keeps
every signal and stack dump, in order, with its virtual time. ``ScriptedHttp``
stands for one engine's vLLM server (engine/http.py ``EngineHttp``): the test says what /health,
/v1/models, the canary and /metrics answer, and can change it at any time.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.engine.http import PrefixReset
from llmsupervisor.engine.processes import EngineProcess
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.health import HttpCheck, OwnAddresses
from llmsupervisor.probes.host import ProcInfo, ProcSample
from llmsupervisor.probes.vllm_metrics import EngineMetrics, parse_metrics
from llmsupervisor.process import ExitStatus
from llmsupervisor.stacks import StackDump

_pids = itertools.count(50_000)


@dataclass
class FakeChild:
    """A member of an engine's group other than the API server: it exits on SIGTERM (unless
    stopped: a stopped process cannot act on one) and on SIGKILL, stopped or not."""

    pid: int
    alive: bool = True
    stopped: bool = False

    def react(self, sig: int) -> None:
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGKILL or (sig == signal.SIGTERM and not self.stopped):
            self.alive = False


class FakeProcess:
    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        *,
        term_exit_s: float,
        ignores_term: bool,
        children: int = 0,
        timeline: list[tuple[float, str]] | None = None,
    ) -> None:
        self.argv = argv
        self.env = dict(env)
        self.pid = self.pgid = next(_pids)
        self.stdout_fd, self._out_w = os.pipe()
        self.stderr_fd, self._err_w = os.pipe()
        self.exit_status: ExitStatus | None = None
        self._exited: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        self.signals: list[tuple[str, int]] = []
        self.cpus: tuple[int, ...] = ()
        self._term_exit_s = term_exit_s
        self._ignores_term = ignores_term
        self.children = [FakeChild(next(_pids)) for _ in range(children)]
        self._timeline = timeline if timeline is not None else []

    @property
    def returned(self) -> bool:
        return self.exit_status is not None

    async def wait(self) -> ExitStatus:
        return await asyncio.shield(self._exited)

    @property
    def exited(self) -> asyncio.Future[ExitStatus]:
        return self._exited

    def say(self, line: str, *, stderr: bool = False) -> None:
        os.write(self._err_w if stderr else self._out_w, line.encode() + b"\n")

    def exit(self, *, code: int | None = 0, sig: int | None = None) -> None:
        if self.returned:
            return
        self.exit_status = ExitStatus(code=None if sig is not None else code, signal=sig)
        for fd in (self._out_w, self._err_w):
            os.close(fd)
        self._exited.set_result(self.exit_status)

    def signal_main(self, sig: int) -> None:
        self.signals.append(("main", sig))
        self._timeline.append((aio.now(), f"{signal.Signals(sig).name} main"))
        self._react(sig)

    def signal_group(self, sig: int) -> None:
        self.signals.append(("group", sig))
        self._timeline.append((aio.now(), f"{signal.Signals(sig).name} group"))
        for child in self.children:
            child.react(sig)
        self._react(sig)

    def _react(self, sig: int) -> None:
        if self.returned:
            return
        if sig == signal.SIGKILL:
            self.exit(sig=signal.SIGKILL)
        elif sig == signal.SIGTERM and not self._ignores_term:
            asyncio.get_running_loop().call_later(self._term_exit_s, self.exit)


@dataclass
class FakeProcesses:
    """The OS as the runner sees it. ``spawned`` lists every spawn, newest last."""

    state_dir: Path
    term_exit_s: float = 0.5
    ignores_term: bool = False
    exec_error: OSError | None = None
    record_error: OSError | None = None
    held_ports: dict[int, int | None] = field(default_factory=dict)  # port -> foreign holder pid
    spawned: list[FakeProcess] = field(default_factory=list)
    py_spy: bool = True
    children: int = 0  # members of each spawn's group beside the API server
    dumped: list[list[int]] = field(default_factory=list)  # each dump_stacks call's pids
    # Every signal and stack dump, in order: (virtual time, "SIGSTOP 50001" | "SIGKILL main" |
    # "SIGKILL group" | "dump 50001,50002").
    timeline: list[tuple[float, str]] = field(default_factory=list)
    signals_at_dump: list[list[tuple[str, int]]] = field(default_factory=list)  # to live processes

    def spawn(self, argv: list[str], env: Mapping[str, str], cpus: Sequence[int] = ()) -> FakeProcess:
        if self.exec_error is not None:
            raise self.exec_error
        proc = FakeProcess(
            argv,
            env,
            term_exit_s=self.term_exit_s,
            ignores_term=self.ignores_term,
            children=self.children,
            timeline=self.timeline,
        )
        proc.cpus = tuple(cpus)
        self.spawned.append(proc)
        return proc

    def group_members(self, pgid: int) -> list[int]:
        out = []
        for p in self.spawned:
            if p.pgid == pgid:
                out += ([] if p.returned else [p.pid]) + [c.pid for c in p.children if c.alive]
        return out

    def group_gone(self, proc: EngineProcess) -> bool:
        return proc.returned and not self.group_members(proc.pgid)

    def signal_each(self, pids: Sequence[int], sig: int) -> None:
        for pid in pids:
            leaders = [p for p in self.spawned if p.pid == pid]
            for p in leaders:
                p.signal_main(sig)  # its own timeline entry
            if not leaders:
                self.timeline.append((aio.now(), f"{signal.Signals(sig).name} {pid}"))
            for child in (c for p in self.spawned for c in p.children if c.pid == pid):
                child.react(sig)

    async def strays(self, engine: str, *, leader: int) -> list[int]:
        return []

    async def kill_trees(self, pids: Iterable[int], *, timeout_s: float) -> list[int]:
        return []

    async def record_group(self, engine: str, pid: int) -> None:
        if self.record_error is not None:
            raise self.record_error

    def forget_group(self, engine: str) -> None:
        pass

    async def dump_stacks(self, pids: Sequence[int], *, timeout_s: float) -> list[StackDump] | None:
        self.dumped.append(list(pids))
        self.timeline.append((aio.now(), "dump " + ",".join(str(p) for p in pids)))
        self.signals_at_dump.append(
            [sig for proc in self.spawned for sig in proc.signals if not proc.returned]
        )
        if not self.py_spy:
            return None
        return [StackDump(pid, "fake", "S (sleeping)", True, f"Thread {pid}: fake stack\n") for pid in pids]

    async def port_holders(self, port: int, host: str) -> list[int | None]:
        return [self.held_ports[port]] if port in self.held_ports else []

    def leftover_of_ours(self, pid: int) -> str | None:
        return None

    async def earlier_runs(self, engine: str) -> list[int]:
        return []

    def describe(self, pid: int) -> str:
        return f"fake process {pid}"

    @property
    def live(self) -> list[FakeProcess]:
        return [p for p in self.spawned if not p.returned]


def ok(latency_s: float = 0.01) -> HttpCheck:
    return HttpCheck(ok=True, detail="ok", latency_s=latency_s, status_code=200)


def refused() -> HttpCheck:
    return HttpCheck(ok=False, detail="connection refused", latency_s=0.0, failure="connect")


def metrics(running: int = 0, waiting: int = 0, steps: int = 0) -> EngineMetrics:
    body = (
        f"vllm:num_requests_running {running}\n"
        f"vllm:num_requests_waiting {waiting}\n"
        f'vllm:iteration_tokens_total_count{{model_name="m"}} {steps}\n'
    )
    parsed = parse_metrics(body)
    assert isinstance(parsed, EngineMetrics)
    return parsed


@dataclass
class ScriptedHttp:
    """One engine's server as scripted by the test; ``calls`` records (what, base_url)."""

    spec: EngineSpec
    script: ServerScript
    own_addresses: OwnAddresses | None = None

    async def health(self, *, timeout_s: float) -> HttpCheck:
        return await self.script.answer("health", self.spec, timeout_s)

    async def models(self, *, timeout_s: float) -> HttpCheck:
        return await self.script.answer("models", self.spec, timeout_s)

    async def canary(self, *, timeout_s: float) -> HttpCheck:
        return await self.script.answer("canary", self.spec, timeout_s)

    async def metrics(self, *, timeout_s: float) -> EngineMetrics | ProbeFailure:
        self.script.calls.append(("metrics", self.spec.base_url))
        return self.script.metrics

    async def reset_prefix_cache(self) -> PrefixReset:
        self.script.calls.append(("reset_prefix_cache", self.spec.base_url))
        return self.script.prefix_reset


@dataclass
class ServerScript:
    """What the engine's server answers. ``ready_after_s`` counts from the latest spawn."""

    procs: FakeProcesses
    ready_after_s: float = 1.0
    canary_hangs: bool = False
    canary_delay_s: float = 0.0  # a canary that takes this long to answer (still running meanwhile)
    health_status: int = 200
    metrics: EngineMetrics | ProbeFailure = field(default_factory=metrics)
    prefix_reset: PrefixReset = PrefixReset.DONE
    calls: list[tuple[str, str]] = field(default_factory=list)
    _spawned_at: dict[int, float] = field(default_factory=dict)

    def http_for(self, spec: EngineSpec) -> ScriptedHttp:
        return ScriptedHttp(spec, self)

    async def answer(self, what: str, spec: EngineSpec, timeout_s: float) -> HttpCheck:
        self.calls.append((what, spec.base_url))
        live = self.procs.live
        if not live:
            return refused()
        proc = live[-1]
        started = self._spawned_at.setdefault(proc.pid, aio.now())
        if aio.now() - started < self.ready_after_s:
            return refused()
        if what == "health" and self.health_status != 200:
            return HttpCheck(
                ok=False,
                detail=f"HTTP {self.health_status}",
                latency_s=0.0,
                status_code=self.health_status,
                failure="http",
            )
        if what == "canary" and self.canary_hangs:
            await asyncio.sleep(timeout_s)
            return HttpCheck(
                ok=False, detail=f"timed out after {timeout_s:g} s", latency_s=timeout_s, failure="timeout"
            )
        if what == "canary" and self.canary_delay_s:
            await asyncio.sleep(self.canary_delay_s)
        return ok()


@dataclass
class FakeSweeper:
    """One process per engine group, read at ``aio.now()``: its CPU time advances at
    ``cpu_per_s`` of a core (0: idle or deadlocked), and not at all while ``stopped``."""

    cpu_per_s: float = 0.0
    stopped: bool = False
    _cpu_s: float = 1.0
    _last_s: float | None = None

    async def sample(
        self, pgid: int, *, timeout_s: float, fresh_after_s: float | None = None
    ) -> ProcSample | ProbeFailure:
        now = aio.now()
        if self._last_s is not None and not self.stopped:
            self._cpu_s += self.cpu_per_s * (now - self._last_s)
        self._last_s = now
        return ProcSample(
            pgid=pgid,
            processes=(
                ProcInfo(
                    pid=pgid,
                    title="vllm",
                    rss_bytes=1 << 20,
                    cpu_seconds=self._cpu_s,
                    status="stopped" if self.stopped else "sleeping",
                    zombie=False,
                ),
            ),
            rss_bytes_total=1 << 20,
            cpu_seconds_total=self._cpu_s,
            process_count=1,
            zombie_count=0,
            at_s=now,
        )
