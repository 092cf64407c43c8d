"""Everything the daemon asks of one engine over HTTP, behind one small interface.

``EngineHttp`` is the seam: the real one speaks to vLLM through the engine's own clients (the
probes' small HTTP/1.1 client for ``/health`` and ``/metrics``, httpx for the rest);
tests script one (tests/lib/engine_fakes.py). A new spec (a port change) gets a new object, so a
drain always talks to the address of the process being drained (defect D4).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from typing import Protocol

import httpx

from llmsupervisor.config import EngineSpec
from llmsupervisor.probes import ProbeFailure, health
from llmsupervisor.probes.health import HttpCheck, OwnAddresses
from llmsupervisor.probes.probe_http import ProbeHttp
from llmsupervisor.probes.vllm_metrics import EngineMetrics, fetch_metrics

log = logging.getLogger("llmsupervisor.engine")

PREFIX_RESET_ATTEMPTS = 5
PREFIX_RESET_RETRY_S = 1.0


class PrefixReset(enum.Enum):
    DONE = "done"
    UNSUPPORTED = "unsupported"  # the route is off (vLLM dev mode): a restart is the repair
    FAILED = "failed"


class EngineHttp(Protocol):
    # The local addresses the canary sent from, for the output forwarder to drop their access
    # lines (engine/output.py); None where there are none (a scripted server).
    own_addresses: OwnAddresses | None

    async def health(self, *, timeout_s: float) -> HttpCheck: ...

    async def models(self, *, timeout_s: float) -> HttpCheck: ...

    async def canary(self, *, timeout_s: float) -> HttpCheck: ...

    async def metrics(self, *, timeout_s: float) -> EngineMetrics | ProbeFailure: ...

    async def reset_prefix_cache(self) -> PrefixReset: ...


class VllmHttp:
    """The real thing: one engine's vLLM server through its own clients."""

    def __init__(self, client: httpx.AsyncClient, spec: EngineSpec, probe: ProbeHttp) -> None:
        self._client = client
        # /health and /metrics, every round: the probes' own cheap client (probes/probe_http.py).
        self._probe = probe
        self._spec = spec
        # An engine with an API key guards /v1/*; the key goes with every request (it is never
        # logged: the log filter masks it, and httpx logs no headers).
        self._headers = health.auth_headers(spec.bearer_key)
        self._canary_kind = spec.canary_kind
        self.own_addresses: OwnAddresses | None = OwnAddresses()

    async def health(self, *, timeout_s: float) -> HttpCheck:
        return await health.check_health(self._probe, timeout_s=timeout_s, headers=self._headers)

    async def models(self, *, timeout_s: float) -> HttpCheck:
        spec = self._spec
        return await health.check_models(
            self._client,
            spec.base_url,
            spec.model_id,
            timeout_s=timeout_s,
            headers=self._headers,
            own=self.own_addresses,
        )

    async def canary(self, *, timeout_s: float) -> HttpCheck:
        spec = self._spec
        return await health.canary(
            self._client,
            spec.base_url,
            spec.model_id,
            prompt=spec.canary_prompt,
            timeout_s=timeout_s,
            kind=self._canary_kind,
            headers=self._headers,
            own=self.own_addresses,
        )

    async def metrics(self, *, timeout_s: float) -> EngineMetrics | ProbeFailure:
        spec = self._spec
        return await fetch_metrics(
            self._probe,
            timeout_s=timeout_s,
            max_body_bytes=spec.metrics_max_body_bytes,
            headers=self._headers,
        )

    async def reset_prefix_cache(self) -> PrefixReset:
        """vLLM's cheapest repair: drop the prefix cache. vLLM answers ``{"success": false}``
        while blocks are held (docs/vllm-notes.md §4): retry a few times, a second apart."""
        spec = self._spec
        url = spec.base_url + "/reset_prefix_cache"
        for _attempt in range(PREFIX_RESET_ATTEMPTS):
            try:
                async with asyncio.timeout(spec.health_timeout_s):
                    response = await self._client.post(
                        url, timeout=spec.health_timeout_s, headers=self._headers
                    )
            except (httpx.HTTPError, TimeoutError) as exc:
                log.warning("reset_prefix_cache: %s", exc or "timed out", extra={"engine": spec.name})
                return PrefixReset.FAILED
            if response.status_code == 404:
                return PrefixReset.UNSUPPORTED
            if response.is_success and _success(response.text):
                return PrefixReset.DONE
            await asyncio.sleep(PREFIX_RESET_RETRY_S)
        return PrefixReset.FAILED


def _success(body: str) -> bool:
    """The route's verdict: the JSON ``success`` field when there is one (a body that merely
    contains the word "false" somewhere is not a refusal: defect D12); an empty or non-JSON
    2xx body, as older vLLM versions send, is a success."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return True
    if isinstance(parsed, dict) and "success" in parsed:
        return parsed["success"] is True
    return True
