"""One EngineRunner driven through commands with fake processes and a scripted server, on virtual
time (tests/lib/virtual_time.py): the harness the runner's unit tests and others share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.state import EngineState
from llmsupervisor.engine.commands import Command, Stop
from llmsupervisor.engine.ledger import Ledger
from llmsupervisor.engine.runner import EngineRunner
from llmsupervisor.engine.status import EngineStatus
from tests.lib.engine_fakes import FakeProcesses, FakeSweeper, ServerScript
from tests.lib.virtual_time import run_virtual

S = EngineState


def spec(**overrides: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "name": "e",
        "model": "m",
        "gpus": (0,),
        "port": 8000,
        "command": ("vllm-fake",),
        "start_timeout_s": 60.0,
        "drain_grace_s": 2.0,
        "drain_timeout_s": 30.0,
        "backoff_initial_s": 10.0,
        "gpu_release_timeout_s": 0.0,
    }
    return EngineSpec(**{**base, **overrides})


class Recorder(aio.Changes):
    """The runner's change signal, keeping every status it published."""

    def __init__(self) -> None:
        super().__init__()
        self.runner: EngineRunner | None = None
        self.published: list[EngineStatus] = []
        self.publishers: list[asyncio.Task[Any] | None] = []  # the task each status came from

    def set(self, name: str | None = None) -> None:
        if self.runner is not None:
            self.published.append(self.runner.status())
            self.publishers.append(asyncio.current_task())
        super().set(name)


class Harness:
    def __init__(
        self,
        tmp_path: Path,
        engine: EngineSpec,
        *,
        gpus: Any = None,
        ledger: Ledger | None = None,
        **procs: Any,
    ) -> None:
        self.procs = FakeProcesses(state_dir=tmp_path, **procs)
        self.server = ServerScript(self.procs)
        self.changes = Recorder()
        self.sweeper = FakeSweeper()
        self.runner = EngineRunner(
            engine,
            procs=self.procs,
            http_for=self.server.http_for,
            tick_interval_s=2.0,
            changed=self.changes,
            gpus=gpus,
            sweeper=self.sweeper,
            ledger=ledger,
        )
        self.changes.runner = self.runner
        self.changes.published.append(self.runner.status())
        self.task = asyncio.create_task(self.runner.run())

    @property
    def status(self) -> EngineStatus:
        return self.runner.status()

    @property
    def states(self) -> list[EngineState]:
        """Every state published, without repeats."""
        out: list[EngineState] = []
        for s in self.changes.published:
            if not out or out[-1] is not s.state:
                out.append(s.state)
        return out

    def send(self, *cmds: Command) -> None:
        for cmd in cmds:
            self.runner.send(cmd)

    async def until(self, pred: Callable[[EngineStatus], bool], timeout_s: float = 7200.0) -> EngineStatus:
        deadline = aio.now() + timeout_s
        while not pred(self.status):
            if self.task.done():
                self.task.result()
                raise AssertionError(f"runner ended in {self.status.state}")
            if aio.now() >= deadline:
                raise AssertionError(f"timed out in {self.status.state}: {self.status.state_reason}")
            seen = self.changes.version
            await aio.wait_any(self.changes.wait(seen), timeout_s=deadline - aio.now())
        return self.status

    async def state(self, state: EngineState, timeout_s: float = 7200.0) -> EngineStatus:
        return await self.until(lambda s: s.state is state, timeout_s)

    async def published(
        self, pred: Callable[[EngineStatus], bool], timeout_s: float = 7200.0
    ) -> EngineStatus:
        """The first status published from now on that matches (a state may be brief)."""
        start = len(self.changes.published)
        found: list[EngineStatus] = []

        def seen(_: EngineStatus) -> bool:
            found.extend(s for s in self.changes.published[start:] if pred(s))
            return bool(found)

        await self.until(seen, timeout_s)
        return found[0]

    async def close(self) -> None:
        self.send(Stop(final=True))
        await asyncio.wait_for(self.task, 3600)


def ready_as(number: int) -> Callable[[EngineStatus], bool]:
    """READY as incarnation ``number``."""
    return lambda s: s.state is S.READY and s.incarnation is not None and s.incarnation.number == number


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    run_virtual(test())
