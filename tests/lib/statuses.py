"""Engine statuses made by hand for pure tests (reconcile, the CLI's rendering): engine ``eN`` on
GPU N and port 8000+N, READY as incarnation 1 unless told otherwise."""

from __future__ import annotations

import dataclasses
from typing import Any

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.state import EngineState
from llmsupervisor.engine.status import EngineStatus, Incarnation

S = EngineState


def spec(name: str, **overrides: Any) -> EngineSpec:
    return EngineSpec(name=name, model="m", gpus=(int(name[-1]),), port=8000 + int(name[-1]), **overrides)


def status(name: str, state: EngineState = S.READY, *, since_s: float = 0.0, **changes: Any) -> EngineStatus:
    inc = Incarnation(number=1, pid=100, pgid=100, step=0, started_s=since_s, ready_since_s=since_s)
    base = EngineStatus(
        name=name, spec=spec(name), state=state, state_reason="", state_since_s=since_s, incarnation=inc
    )
    return dataclasses.replace(base, **changes)
