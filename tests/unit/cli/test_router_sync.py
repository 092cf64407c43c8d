"""`router-sync`: the daemon's rotation kept in a vLLM router's worker list (cli/router_sync.py).

The router side is the worker-management API of vllm-router 0.1.17 (``POST /add_worker?url=``,
``POST /remove_worker?url=``, ``GET /list_workers`` -> ``{"urls": [...]}``), as the installed
router answers it (tests/vllm/test_lossless_vllm.py drives the real one)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from llmsupervisor.cli.main import main
from llmsupervisor.cli.router_sync import Plan, RouterSync, parse_workers, plan, workers_of

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def status(**in_rotation: bool) -> dict[str, Any]:
    ports = {"a": 8001, "b": 8002, "c": 8003}
    return {"engines": {n: {"port": ports[n], "in_rotation": r} for n, r in in_rotation.items()}}


def test_the_router_gets_exactly_the_engines_in_rotation() -> None:
    workers = {"a": A, "b": B}
    assert plan(status(a=True, b=False), workers, frozenset({A, B})) == Plan(add=(), remove=(B,))
    assert plan(status(a=True, b=True), workers, frozenset({A})) == Plan(add=(B,), remove=())
    # Workers the sidecar does not manage are left alone; an engine gone from the config is out.
    other = "http://10.0.0.9:8000"
    assert plan(status(a=True), workers, frozenset({A, B, other})) == Plan(add=(), remove=(B,))


def test_workers_default_to_every_engine_by_its_port() -> None:
    assert workers_of(status(a=True, b=False), {}, "127.0.0.1") == {"a": A, "b": B}
    assert workers_of(status(a=True), {"a": "http://h:1"}, "127.0.0.1") == {"a": "http://h:1"}
    assert parse_workers(["a=http://h:1/"]) == {"a": "http://h:1"}
    with pytest.raises(ValueError, match="NAME=URL"):
        parse_workers(["a:http://h:1"])


class FakeRouter:
    """The daemon's /status and vllm-router's worker API, over httpx's mock transport."""

    def __init__(self, engines: dict[str, Any], urls: set[str]) -> None:
        self.engines, self.urls, self.calls = engines, urls, list[str]()
        self.daemon_up = True

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.url.host == "daemon":
            if not self.daemon_up:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, json=self.engines)
        url = request.url.params.get("url", "")
        self.calls.append(f"{path} {url}".strip())
        if path == "/list_workers":
            return httpx.Response(200, json={"urls": sorted(self.urls)})
        if path == "/add_worker":
            self.urls.add(url)
            return httpx.Response(200, text=f"Successfully added worker: {url}")
        if path == "/remove_worker":
            self.urls.discard(url)
            return httpx.Response(200, text=f"Successfully removed worker: {url}")
        return httpx.Response(404)


def test_one_pass_removes_and_adds_and_an_unreadable_daemon_changes_nothing() -> None:
    fake = FakeRouter(status(a=True, b=False), {A, B})
    sync = RouterSync(
        "http://daemon:9400", "http://router:30000", client=httpx.Client(transport=httpx.MockTransport(fake))
    )
    assert sync.once() == Plan(add=(), remove=(B,))
    assert fake.urls == {A}
    fake.engines = status(a=True, b=True)
    assert sync.once() == Plan(add=(B,), remove=())
    assert fake.urls == {A, B}
    fake.daemon_up = False  # a daemon restarting: its engines may well be serving
    fake.calls.clear()
    assert sync.once() is None
    assert fake.urls == {A, B} and fake.calls == []


def test_the_command_rejects_a_bad_worker(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["router-sync", "--daemon", "http://d", "--router", "http://r", "--worker", "x"])
    assert code == 2 and "NAME=URL" in capsys.readouterr().err
