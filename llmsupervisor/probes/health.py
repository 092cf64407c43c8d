"""vLLM's HTTP surface as the supervisor sees it: /health, /v1/models and a canary completion.

``/health`` only says the EngineCore process is alive (docs/vllm-notes.md §4.2) and ``/v1/models`` never
touches the engine, so readiness also needs one real completion: a model the backend cannot run
passes both and dies on its first request. Every call has a deadline and returns a value; none
raises for a network or protocol problem.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class CheckResult:
    ok: bool
    detail: str
    latency_s: float
    status_code: int | None = None

    @property
    def engine_dead(self) -> bool:
        # vLLM answers /health with 503 only on EngineDeadError (docs/vllm-notes.md §4.2).
        return self.status_code == 503


def _failure(exc: Exception, started: float) -> CheckResult:
    if isinstance(exc, httpx.TimeoutException):
        detail = f"timed out ({type(exc).__name__})"
    elif isinstance(exc, httpx.ConnectError):
        detail = "connection refused"
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return CheckResult(False, detail, time.monotonic() - started)


async def check_health(client: httpx.AsyncClient, base_url: str, *, timeout_s: float) -> CheckResult:
    started = time.monotonic()
    try:
        resp = await client.get(f"{base_url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return _failure(exc, started)
    return CheckResult(
        resp.status_code == 200, f"HTTP {resp.status_code}", time.monotonic() - started, resp.status_code
    )


async def check_models(
    client: httpx.AsyncClient, base_url: str, model_id: str, *, timeout_s: float
) -> CheckResult:
    started = time.monotonic()
    try:
        resp = await client.get(f"{base_url}/v1/models", timeout=timeout_s)
        if resp.status_code != 200:
            return CheckResult(
                False, f"HTTP {resp.status_code}", time.monotonic() - started, resp.status_code
            )
        ids = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return _failure(exc, started)
    if model_id not in ids:
        return CheckResult(
            False, f"model {model_id!r} not listed (got {ids})", time.monotonic() - started, 200
        )
    return CheckResult(True, "listed", time.monotonic() - started, 200)


async def canary(
    client: httpx.AsyncClient, base_url: str, model_id: str, *, prompt: str, timeout_s: float
) -> CheckResult:
    """One completion of one token: it exercises tokenizer, scheduler, model and detokenizer."""
    started = time.monotonic()
    body: dict[str, Any] = {"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    try:
        resp = await client.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
        if resp.status_code != 200:
            return CheckResult(
                False,
                f"HTTP {resp.status_code}: {resp.text[:200]}",
                time.monotonic() - started,
                resp.status_code,
            )
        choices = resp.json().get("choices")
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return _failure(exc, started)
    if not choices:
        return CheckResult(False, "completion had no choices", time.monotonic() - started, 200)
    return CheckResult(True, "completed", time.monotonic() - started, 200)
