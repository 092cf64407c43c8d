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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx

from llmsupervisor.probes import PROBE_FAILURE_KINDS, ProbeFailureKind
from llmsupervisor.probes.probe_http import ProbeHttp, ProbeHttpError

# vLLM's /health body is empty; anything long is not vLLM.
HEALTH_MAX_BODY_BYTES = 64 * 1024


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
    # A canary's own load on the engine, from its answer's `usage` (0 when not reported), so
    # the detectors can take it out of the engine's counters: it is not traffic.
    prompt_tokens: int = 0
    generation_tokens: int = 0

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


def _passed(detail: str, started: float, usage: Any = None) -> HttpCheck:
    prompt_tokens, generation_tokens = _usage(usage)
    return HttpCheck(
        ok=True,
        detail=detail,
        latency_s=time.monotonic() - started,
        status_code=200,
        prompt_tokens=prompt_tokens,
        generation_tokens=generation_tokens,
    )


def _usage(usage: Any) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return 0, 0

    def count(key: str) -> int:
        value = usage.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    return count("prompt_tokens"), count("completion_tokens")


Headers = Mapping[str, str] | None

# How long a local address the canary used stays "ours" after its last use. uvicorn closes an
# idle kept-alive connection after 5 s (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and writes a
# request's access line before its answer: the line is read within moments of the request.
OWN_ADDRESS_TTL_S: Final = 30.0


class OwnAddresses:
    """The local ``(ip, port)`` addresses of the canary's connections to one engine, so that the
    engine's access line for a canary can be told from a user's request to the same path: uvicorn
    names the client ``IP:PORT`` (engine/output.py drops those lines). The canary notes an
    address when it connects (before the request is sent: the access line may be read before
    the answer is) and again with each answer on a kept-alive connection; an address not used
    for ``OWN_ADDRESS_TTL_S`` is forgotten, so a user's later connection that happens to get
    the same port is not mistaken for ours. Times are the caller's clock (``now``)."""

    def __init__(self, ttl_s: float = OWN_ADDRESS_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._last_used_s: dict[tuple[str, int], float] = {}

    def note(self, address: object, now: float) -> None:
        if (
            isinstance(address, tuple)
            and len(address) >= 2
            and isinstance(address[0], str)
            and isinstance(address[1], int)
        ):
            self._last_used_s[(address[0], address[1])] = now
            if len(self._last_used_s) > 64:  # bounded whatever happens
                self._forget_old(now)

    def holds(self, ip: str, port: int, now: float) -> bool:
        used_s = self._last_used_s.get((ip, port))
        return used_s is not None and now - used_s <= self._ttl_s

    def _forget_old(self, now: float) -> None:
        for address, used_s in list(self._last_used_s.items()):
            if now - used_s > self._ttl_s:
                del self._last_used_s[address]


def _noting(own: OwnAddresses | None) -> dict[str, Any]:
    """httpx request extensions that note the connection's local address in ``own`` when
    httpcore opens it (its ``trace`` hook: the event carries the new network stream)."""
    if own is None:
        return {}

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            _note_stream(own, info.get("return_value"))

    return {"trace": trace}


def _note_answer(own: OwnAddresses | None, resp: httpx.Response) -> None:
    if own is not None:
        _note_stream(own, resp.extensions.get("network_stream"))


def _note_stream(own: OwnAddresses, stream: Any) -> None:
    """The connection's local address, noted as the canary's. A connection the engine already
    closed (it answered and died) has no address left: getsockname raises EBADF, and the
    canary's answer must not be lost to that (a crash loop read as a dead runner task)."""
    if stream is None:
        return
    try:
        address = stream.get_extra_info("client_addr")
    except OSError:
        return
    own.note(address, time.monotonic())


def auth_headers(api_key: str | None) -> dict[str, str] | None:
    """What every request to an engine with an API key carries."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


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


async def check_health(probe: ProbeHttp, *, timeout_s: float, headers: Headers = None) -> HttpCheck:
    """``GET /health`` through the probes' own client (probes/probe_http.py: it runs every
    round for every engine, so its cost matters), under one overall deadline."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            answer = await probe.get("/health", headers=headers, max_body_bytes=HEALTH_MAX_BODY_BYTES)
    except TimeoutError as exc:
        return _from_exception(exc, started, timeout_s)
    except ProbeHttpError as exc:
        return _failed(exc.kind, str(exc), started)
    if answer.status != 200:
        return _failed("http", f"HTTP {answer.status}", started, answer.status)
    return _passed("HTTP 200", started)


async def check_models(
    client: httpx.AsyncClient,
    base_url: str,
    model_id: str,
    *,
    timeout_s: float,
    headers: Headers = None,
    own: OwnAddresses | None = None,
) -> HttpCheck:
    """``GET /v1/models``. ``own``: as the canary's; the readiness canary that follows reuses the
    connection this one opened, and its access line may be read before its answer is."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.get(
                f"{base_url}/v1/models", timeout=timeout_s, headers=headers, extensions=_noting(own)
            )
        _note_answer(own, resp)
        if resp.status_code != 200:
            return _failed("http", f"HTTP {resp.status_code}", started, resp.status_code)
        ids = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
    except (TimeoutError, httpx.HTTPError, ValueError, AttributeError) as exc:
        return _from_exception(exc, started, timeout_s)
    if model_id not in ids:
        return _failed("http", f"model {model_id!r} not listed (got {ids})", started, 200)
    return _passed("listed", started)


# The canary's request per kind: path, body, and the field a good answer must hold.
def _canary_request(kind: str, model_id: str, prompt: str) -> tuple[str, dict[str, Any], str]:
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {"model": model_id, "messages": messages, "max_tokens": 1}, "choices"
    if kind == "embedding":
        return "/v1/embeddings", {"model": model_id, "input": prompt}, "data"
    body = {"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    return "/v1/completions", body, "choices"


async def canary(
    client: httpx.AsyncClient,
    base_url: str,
    model_id: str,
    *,
    prompt: str,
    timeout_s: float,
    kind: str = "completion",
    headers: Headers = None,
    own: OwnAddresses | None = None,
) -> HttpCheck:
    """One request that runs the model: a one-token completion (``completion``) or chat reply
    (``chat``), or one embedding (``embedding``). Each exercises tokenizer, scheduler and model;
    ``none`` sends nothing and passes. ``own`` collects the local addresses it sent from."""
    started = time.monotonic()
    if kind == "none":
        return _passed("no canary (canary: none)", started)
    path, body, field_name = _canary_request(kind, model_id, prompt)
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.post(
                f"{base_url}{path}", json=body, timeout=timeout_s, headers=headers, extensions=_noting(own)
            )
        _note_answer(own, resp)
        if resp.status_code != 200:
            return _failed("http", f"HTTP {resp.status_code}: {resp.text[:200]}", started, resp.status_code)
        answer = resp.json()
        items = answer.get(field_name)
    except (TimeoutError, httpx.HTTPError, ValueError, AttributeError) as exc:
        return _from_exception(exc, started, timeout_s)
    if not items:
        what = "embedding had no data" if kind == "embedding" else f"{kind} had no choices"
        return _failed("parse", what, started, 200)
    return _passed("embedded" if kind == "embedding" else "completed", started, answer.get("usage"))


__all__ = [
    "OWN_ADDRESS_TTL_S",
    "HttpCheck",
    "OwnAddresses",
    "auth_headers",
    "canary",
    "check_health",
    "check_models",
]
