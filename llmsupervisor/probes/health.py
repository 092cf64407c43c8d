"""vLLM's HTTP surface as the supervisor sees it: /health, /v1/models and a canary completion.

``/health`` only says the EngineCore process is alive (docs/vllm-notes.md §4.2) and ``/v1/models`` never
touches the engine, so readiness also needs one real completion: a model the backend cannot run
passes both and dies on its first request. Every call has one overall deadline and returns a
value; none raises for a network or protocol problem.

httpx's own timeout applies to each phase (connect, each read) separately, so a server that
drips its body could outlast it; each whole exchange runs under ``asyncio.timeout``, as
``vllm_metrics.fetch_metrics`` does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from llmsupervisor.probes import PROBE_FAILURE_KINDS, ProbeFailureKind


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpCheck:
    """One HTTP check: ``failure`` says how it failed, and is None exactly when ``ok``.

    ``timeout``  no complete answer within the deadline (the hang detector's evidence)
    ``connect``  refused, reset, or the process is gone (the crash path, not a hang)
    ``http``     an answer that is not the expected one: non-200, a protocol error, a model
                 that is not listed
    ``parse``    a 200 whose body is not what the endpoint promises (not JSON, no choices)
    """

    ok: bool
    detail: str
    latency_s: float
    status_code: int | None = None  # None when no status line was read in time
    failure: ProbeFailureKind | None = None

    def __post_init__(self) -> None:
        if self.ok != (self.failure is None):
            raise ValueError(f"ok={self.ok} with failure={self.failure!r}")
        if self.failure is not None and self.failure not in PROBE_FAILURE_KINDS:
            raise ValueError(f"unknown probe failure kind {self.failure!r}")

    @property
    def engine_dead(self) -> bool:
        # vLLM answers /health with 503 only on EngineDeadError (docs/vllm-notes.md §4.2).
        return self.status_code == 503


def _failed(
    failure: ProbeFailureKind, detail: str, started: float, status_code: int | None = None
) -> HttpCheck:
    return HttpCheck(
        ok=False,
        detail=detail,
        latency_s=time.monotonic() - started,
        status_code=status_code,
        failure=failure,
    )


def _passed(detail: str, started: float) -> HttpCheck:
    return HttpCheck(ok=True, detail=detail, latency_s=time.monotonic() - started, status_code=200)


def _from_exception(exc: Exception, started: float, timeout_s: float) -> HttpCheck:
    if isinstance(exc, TimeoutError):  # the overall deadline
        return _failed("timeout", f"timed out: no complete answer within {timeout_s:g} s", started)
    if isinstance(exc, httpx.TimeoutException):  # one phase's deadline
        return _failed("timeout", f"timed out ({type(exc).__name__})", started)
    if isinstance(exc, httpx.ConnectError):
        return _failed("connect", "connection refused", started)
    if isinstance(exc, httpx.NetworkError):  # reset or closed mid-answer
        return _failed("connect", f"{type(exc).__name__}: {exc}", started)
    if isinstance(exc, httpx.HTTPError):
        return _failed("http", f"{type(exc).__name__}: {exc}", started)
    return _failed("parse", f"unreadable body: {type(exc).__name__}: {exc}", started, 200)


async def check_health(client: httpx.AsyncClient, base_url: str, *, timeout_s: float) -> HttpCheck:
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.get(f"{base_url}/health", timeout=timeout_s)
    except (TimeoutError, httpx.HTTPError) as exc:
        return _from_exception(exc, started, timeout_s)
    if resp.status_code != 200:
        return _failed("http", f"HTTP {resp.status_code}", started, resp.status_code)
    return _passed("HTTP 200", started)


async def check_models(
    client: httpx.AsyncClient, base_url: str, model_id: str, *, timeout_s: float
) -> HttpCheck:
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.get(f"{base_url}/v1/models", timeout=timeout_s)
        if resp.status_code != 200:
            return _failed("http", f"HTTP {resp.status_code}", started, resp.status_code)
        ids = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
    except (TimeoutError, httpx.HTTPError, ValueError, AttributeError) as exc:
        return _from_exception(exc, started, timeout_s)
    if model_id not in ids:
        return _failed("http", f"model {model_id!r} not listed (got {ids})", started, 200)
    return _passed("listed", started)


async def canary(
    client: httpx.AsyncClient, base_url: str, model_id: str, *, prompt: str, timeout_s: float
) -> HttpCheck:
    """One completion of one token: it exercises tokenizer, scheduler, model and detokenizer."""
    started = time.monotonic()
    body: dict[str, Any] = {"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
        if resp.status_code != 200:
            return _failed("http", f"HTTP {resp.status_code}: {resp.text[:200]}", started, resp.status_code)
        choices = resp.json().get("choices")
    except (TimeoutError, httpx.HTTPError, ValueError, AttributeError) as exc:
        return _from_exception(exc, started, timeout_s)
    if not choices:
        return _failed("parse", "completion had no choices", started, 200)
    return _passed("completed", started)


__all__ = ["HttpCheck", "canary", "check_health", "check_models"]
