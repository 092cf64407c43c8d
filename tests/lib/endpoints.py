"""The daemon's HTTP routes (daemon/endpoints.py) served on a real loopback socket over given
statuses, without a daemon: each route's code and body."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from llmsupervisor.daemon.endpoints import http_api
from llmsupervisor.engine.status import EngineStatus


def serve_endpoints(statuses: tuple[EngineStatus, ...], **kwargs: Any) -> dict[str, tuple[int, Any]]:
    class NoExporter:
        content_type = "text/plain"

        def render(self) -> bytes:
            return b""

    async def main() -> dict[str, tuple[int, Any]]:
        api = http_api(
            exporter=NoExporter(),  # type: ignore[arg-type]
            statuses=lambda: statuses,
            last_tick_age_s=kwargs.pop("age", lambda: 0.5),
            tick_limit_s=lambda: 10.0,
            **kwargs,
        )
        await api.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api.port}") as client:
                out = {}
                for path in ("/livez", "/healthz", "/readyz", "/engines/a/ready", "/status"):
                    r = await client.get(path)
                    json_body = r.headers.get("content-type", "").startswith("application/json")
                    out[path] = (r.status_code, r.json() if json_body else r.text)
                return out
        finally:
            await api.close()

    return asyncio.run(main())
