"""When a spawned engine is ready: /health 200, then /v1/models lists the model, then one canary
answers (a completion, a chat reply or an embedding: ``EngineSpec.canary_kind``; none for
``canary: none``); all before ``start_timeout_s``, while the process lives. vLLM answers /health
before the model serves (docs/vllm-notes.md §3), hence the canary."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable

from llmsupervisor import aio
from llmsupervisor.config import EngineSpec
from llmsupervisor.engine.http import EngineHttp
from llmsupervisor.engine.processes import EngineProcess

READINESS_POLL_S = 0.25  # /health while loading: a refused connection is cheap; READY sooner


class Readiness(enum.Enum):
    READY = "ready"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # a command asked for something else (stop, restart)


async def await_ready(
    spec: EngineSpec,
    http: EngineHttp,
    proc: EngineProcess,
    *,
    pause: Callable[[float], Awaitable[None]],
    interrupted: Callable[[], bool],
    on_canary: Callable[[], None] = lambda: None,
) -> tuple[Readiness, str, float | None]:
    """(outcome, why, canary latency)."""
    deadline = aio.now() + spec.start_timeout_s
    stage = "waiting for /health"
    while True:
        if interrupted():
            return Readiness.INTERRUPTED, f"interrupted while {stage}", None
        if proc.returned:
            assert proc.exit_status is not None
            return Readiness.FAILED, f"process {proc.exit_status.describe()} during start ({stage})", None
        remaining = deadline - aio.now()
        if remaining <= 0:
            return (
                Readiness.FAILED,
                f"not ready within start_timeout_s={spec.start_timeout_s:g} ({stage})",
                None,
            )
        timeout_s = min(spec.health_timeout_s, remaining)
        if (await http.health(timeout_s=timeout_s)).ok:
            stage = "checking /v1/models"
            models = await http.models(timeout_s=timeout_s)
            if not models.ok:
                return Readiness.FAILED, f"/v1/models: {models.detail}", None
            if spec.canary_kind == "none":
                return Readiness.READY, "/health 200, model listed (canary: none)", None
            stage = f"canary {spec.canary_kind}"
            on_canary()
            canary = await http.canary(timeout_s=min(spec.canary_timeout_s, max(remaining, 0.1)))
            if canary.ok:
                why = f"/health 200, model listed, canary answered in {canary.latency_s * 1000:.0f} ms"
                return Readiness.READY, why, canary.latency_s
            return Readiness.FAILED, f"canary failed: {canary.detail}", None
        await pause(READINESS_POLL_S)
