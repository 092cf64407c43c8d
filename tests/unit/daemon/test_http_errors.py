"""Every HTTP error is JSON, and an unknown engine's is a 404 that names the engines (issue 26)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.endpoints import http_api
from llmsupervisor.engine.status import EngineStatus


def status(name: str) -> EngineStatus:
    spec = EngineSpec(name=name, model="m", gpus=(0,), port=8000)
    base = EngineStatus(name=name, spec=spec, state=EngineState.READY, state_reason="", state_since_s=0.0)
    return dataclasses.replace(base)


def get(paths: list[tuple[str, str]]) -> list[httpx.Response]:
    class NoExporter:
        content_type = "text/plain"

        def render(self) -> bytes:
            return b""

    async def main() -> list[httpx.Response]:
        api = http_api(
            exporter=NoExporter(),  # type: ignore[arg-type]
            statuses=lambda: (status("gpu0"), status("gpu1")),
            last_tick_age_s=lambda: 0.5,
            tick_limit_s=lambda: 10.0,
        )
        await api.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api.port}") as client:
                return [await client.request(method, path) for method, path in paths]
        finally:
            await api.close()

    return asyncio.run(main())


def test_an_unknown_engine_is_a_json_404_with_the_engines() -> None:
    (r,) = get([("GET", "/engines/nosuch/ready")])
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    body: dict[str, Any] = r.json()
    assert body == {
        "error": "no engine named 'nosuch'; engines: gpu0, gpu1",
        "status": 404,
        "engines": ["gpu0", "gpu1"],
    }


def test_the_servers_own_errors_are_json_too() -> None:
    got = get([("GET", "/nope"), ("POST", "/livez"), ("GET", "/engines/gpu0/health"), ("GET", "/status")])
    assert [r.status_code for r in got] == [404, 405, 404, 404]
    for r in got:
        assert r.headers["content-type"] == "application/json", r
        assert r.json()["status"] == r.status_code and r.json()["error"], r.text
    assert got[0].json()["error"] == "no such endpoint: /nope"
    assert got[1].json()["error"] == "POST not allowed"
    assert "/engines/NAME/ready" in got[2].json()["error"]
