"""Secrets are masked where text leaves the daemon, whatever produced the text (issue 22, E5):
an engine's reason, exit or failure may quote its command line (``--api-key``) or its output
(an ``HF_TOKEN=``), and none of it may reach `llm-supervisor events`, the status JSON (control
socket, HTTP /status, STATE_DIR/status.json) or sd_notify's STATUS= line."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx

from llmsupervisor import control
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.policy_memory import PolicyMemory
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.endpoints import http_api
from llmsupervisor.daemon.events import EventRing
from llmsupervisor.daemon.status import DaemonCounters, StatusFile, snapshot, status_json, summary
from llmsupervisor.engine.status import EngineStatus
from llmsupervisor.notify import _status_text

API_KEY = "sk-9f8e7d6c5b4a3210"
HF_TOKEN = "hf_AbCdEfGhIjKlMnOpQrSt"
REASON = f"exit code 1: python -m vllm.entrypoints.openai.api_server --api-key {API_KEY} --port 8001"
OUTPUT = f"OSError: HF_TOKEN={HF_TOKEN} is not valid"
SECRETS = (API_KEY, HF_TOKEN)


def leaky_engine() -> EngineStatus:
    """A status carrying raw text, as a source that does not redact would publish it."""
    spec = EngineSpec(name="a", model="m", gpus=(0,), port=8001)
    return EngineStatus(
        name="a",
        spec=spec,
        state=EngineState.BACKOFF,
        state_reason=REASON,
        state_since_s=0.0,
        last_exit=REASON,
        last_failure=OUTPUT,
        last_error_line=OUTPUT,
    )


def whole_status() -> dict[str, Any]:
    return status_json(
        snapshot(
            (leaky_engine(),),
            now=10.0,
            memory=PolicyMemory(),
            gpu_samples=lambda gpus: {},
            gpu_faults_marked={},
            counters=DaemonCounters(),
        )
    )


def assert_clean(text: str) -> None:
    assert text, "nothing to check"
    for secret in SECRETS:
        assert secret not in text


def test_events_never_show_a_secret_from_a_reason() -> None:
    ring = EventRing()
    engine_log = logging.getLogger("llmsupervisor.engine")
    engine_log.addHandler(ring)
    try:
        # As the lifecycle logs a transition: the reason raw, as its source wrote it.
        extra = {"engine": "a", "event": "transition", "to_state": "backoff"}
        engine_log.warning("%s -> %s: %s", "starting", "backoff", REASON, extra=extra)
        engine_log.warning("%s", OUTPUT, extra={"engine": "a", "event": "finding"})
    finally:
        engine_log.removeHandler(ring)
    events = [e.as_json() for e in ring.select()]
    assert len(events) == 2
    assert_clean(json.dumps(events))
    assert "--api-key ***" in events[0]["message"]


def test_the_status_json_never_shows_a_secret_over_the_control_socket(tmp_path: Path) -> None:
    async def handler(request: dict[str, Any]) -> Any:
        return whole_status()

    async def scenario() -> dict[str, Any]:
        server = control.ControlServer(tmp_path / "c.sock", handler)
        await server.start()
        try:
            return await asyncio.to_thread(control.request, tmp_path / "c.sock", {"command": "status"})
        finally:
            await server.close()

    reply = asyncio.run(scenario())
    assert reply["ok"] is True
    assert reply["result"]["engines"]["a"]["reason"].endswith("--api-key *** --port 8001")
    assert_clean(json.dumps(reply))


def test_the_http_endpoints_never_show_a_secret() -> None:
    class NoExporter:
        content_type = "text/plain"

        def render(self) -> bytes:
            return b""

    async def scenario() -> list[str]:
        api = http_api(
            exporter=NoExporter(),  # type: ignore[arg-type]
            statuses=lambda: (leaky_engine(),),
            last_tick_age_s=lambda: 0.5,
            tick_limit_s=lambda: 10.0,
            status=whole_status,
        )
        await api.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api.port}") as client:
                return [(await client.get(path)).text for path in ("/status", "/engines/a/ready")]
        finally:
            await api.close()

    for body in asyncio.run(scenario()):
        assert_clean(body)


def test_the_status_file_never_shows_a_secret(tmp_path: Path) -> None:
    async def scenario() -> None:
        status_file = StatusFile(tmp_path / "status.json")
        status_file.write(whole_status(), now=0.0)
        await status_file.flush()

    asyncio.run(scenario())
    assert_clean((tmp_path / "status.json").read_text())


def test_the_sd_notify_status_line_never_shows_a_secret() -> None:
    assert_clean(_status_text(summary((leaky_engine(),), now=10.0)))
