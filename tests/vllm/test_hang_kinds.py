"""Every kind of hang in a real vLLM engine, found and restarted, without SIGSTOP (issue 25).

One daemon and one engine (the tiny model on the CPU build) for the module; each test injects
one hang into the running engine (tests/lib/hang_injection/sitecustomize.py), waits for the
daemon's ``finding hang`` line, then for the engine READY again after a restart, which is where
the next test starts. The step heartbeat (engine/heartbeat.py) is on, as by default.

    deadlock   EngineCore's threads all blocked on the GIL's lock, 0 % CPU: ``frozen``
    spin       EngineCore holds the GIL and loops at 100 % CPU, no step: ``spinning``

each idle (the daemon's canary is the only work) and under streaming load; the same two in the
Worker (a deadlocked Worker leaves EngineCore waiting at no CPU: ``frozen``; a spinning one burns
CPU as a forward does, and its step outlives the bound its tokens give: ``overdue``); and the
same two in the API server, whose event loop is then held (``front``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llmsupervisor.probes.heartbeat import StepBeat, read_heartbeat
from tests.lib.daemon import Daemon, free_port, wait_for
from tests.lib.hangs import INJECTION_DIR, Streams, hang_env, inject, rule_of, wait_hang
from tests.lib.vllm_env import READY_TIMEOUT_S, build_model, vllm_engine, vllm_python

pytestmark = pytest.mark.vllm_cpu


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    python = vllm_python()
    model = build_model(python, "tiny")
    tmp = tmp_path_factory.mktemp("hangs")
    home = tmp / "home"
    home.mkdir()
    port = free_port()
    hangs = tmp / "hang"
    spec = vllm_engine("e1", port, model, home, max_failures=100, backoff_initial_s=0.5, backoff_max_s=2.0)
    spec["env"] = {**spec["env"], **hang_env(hangs), "LLMSUP_HANG_SPIN_S": "60"}
    d = Daemon(tmp, {"supervisor": {"tick_interval_s": 2.0, "shutdown_timeout_s": 120}, "engines": [spec]})
    d.start()
    try:
        d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
        yield {"daemon": d, "port": port, "hangs": hangs}
    finally:
        d.cleanup()


def _found_and_restarted(engine: dict[str, Any], role: str, what: str, *, clients: int) -> str:
    d: Daemon = engine["daemon"]
    before = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    load = Streams(engine["port"], clients) if clients else None
    try:
        if load is not None:
            time.sleep(6)  # the streams are running and the engine steps
        seen = len(d.log().splitlines())
        inject(engine["hangs"], role, what)
        line = wait_hang(d, "e1", seen)
    finally:
        if load is not None:
            load.close()
    d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S, restarts=before["restarts"] + 1)
    return line


def test_the_real_engine_writes_the_step_heartbeat(engine: dict[str, Any]) -> None:
    d: Daemon = engine["daemon"]
    path = d.state_dir / "engines" / "e1" / "step-heartbeat"
    first = wait_for(
        lambda: isinstance(b := read_heartbeat(path), StepBeat) and b, timeout_s=30, what="a heartbeat"
    )
    assert "--scheduler-cls llmsupervisor_step_heartbeat.scheduler" in d.log()
    resp = httpx.post(
        f"http://127.0.0.1:{engine['port']}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    after = read_heartbeat(path)
    # One step per token at least (prefill + decode); the daemon's canaries add their own.
    assert isinstance(after, StepBeat) and after.done >= first.done + 8 and after.pid == first.pid


@pytest.mark.parametrize(
    ("what", "clients", "rules"),
    [
        ("deadlock", 0, {"frozen", "cpu_idle"}),
        ("spin", 0, {"spinning"}),
        ("deadlock", 8, {"frozen"}),
        ("spin", 8, {"spinning"}),
    ],
    ids=["deadlock-idle", "spin-idle", "deadlock-loaded", "spin-loaded"],
)
def test_a_hung_engine_core_is_found_and_restarted(
    engine: dict[str, Any], what: str, clients: int, rules: set[str]
) -> None:
    line = _found_and_restarted(engine, "EngineCore", what, clients=clients)
    assert rule_of(line) in rules, line


@pytest.mark.parametrize(
    ("what", "clients", "rules"),
    [
        # EngineCore waits on the Worker's answer (polling 1 s, then asleep): no step, no CPU.
        ("deadlock", 0, {"frozen", "cpu_idle"}),
        # The Worker burns CPU as a forward does; its step is what outlives its bound.
        ("spin", 0, {"overdue"}),
        ("deadlock", 8, {"frozen"}),
        ("spin", 8, {"overdue"}),
    ],
    ids=["deadlock-idle", "spin-idle", "deadlock-loaded", "spin-loaded"],
)
def test_a_hung_worker_is_found_and_restarted(
    engine: dict[str, Any], what: str, clients: int, rules: set[str]
) -> None:
    line = _found_and_restarted(engine, "Worker", what, clients=clients)
    assert rule_of(line) in rules, line


@pytest.mark.parametrize(
    ("what", "clients"),
    [("deadlock", 0), ("spin", 0), ("deadlock", 8), ("spin", 8)],
    ids=["deadlock-idle", "spin-idle", "deadlock-loaded", "spin-loaded"],
)
def test_a_hung_api_server_is_found_and_restarted(engine: dict[str, Any], what: str, clients: int) -> None:
    # Its event loop held (not stopped): /health goes unanswered while EngineCore steps on.
    line = _found_and_restarted(engine, "APIServer", what, clients=clients)
    assert rule_of(line) == "front", line
    assert ("front deadlocked" if what == "deadlock" else "front spinning") in line, line


def test_the_injection_dir_is_a_plain_folder() -> None:
    # The injector is loaded as `sitecustomize` from this folder, never as a package module.
    assert not (INJECTION_DIR / "__init__.py").exists()
