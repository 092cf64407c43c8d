"""The HAProxy agent's replies (a pure function of an engine's status) and its listeners."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.agent import AgentServers, agent_reply, weight_percent
from llmsupervisor.detectors import Finding, FindingKind, Severity
from llmsupervisor.engine.status import EngineLoad, EngineStatus
from tests.lib.daemon import free_port

S = EngineState


def status(state: EngineState = S.READY, **changes: Any) -> EngineStatus:
    spec = EngineSpec(name="a", model="m", gpus=(0,), port=8000)
    base = EngineStatus(name="a", spec=spec, state=state, state_reason="", state_since_s=0.0)
    return dataclasses.replace(base, **changes)


def finding(kind: FindingKind) -> Finding:
    return Finding(engine="a", kind=kind, severity=Severity.WARNING, evidence={}, since_s=0.0, summary="")


@pytest.mark.parametrize(
    ("engine", "reply"),
    [
        (status(), "ready up 100%"),
        (status(S.SHEDDING), "drain"),
        (status(S.DRAINING), "drain"),
        (status(S.DRAINING, held=True), "drain"),
        (status(S.STOPPED), "maint"),
        (status(S.FATAL), "maint"),
        (status(S.STARTING), "down"),
        (status(S.BACKOFF), "down"),
        (status(S.STOPPING), "down"),
        (status(task_failed="bug"), "down"),
        (None, "down"),
    ],
)
def test_reply_by_state(engine: EngineStatus | None, reply: str) -> None:
    assert agent_reply(engine) == reply


def test_a_hang_suspected_drains_and_a_hang_found_takes_it_down_before_the_kill() -> None:
    """Issue 27: new requests go to the peers from the first missed canary, not after the kill."""
    suspected = status(suspect="a canary got no answer in 1.0 s")
    assert not suspected.in_rotation and agent_reply(suspected) == "drain"
    assert agent_reply(status(findings=(finding(FindingKind.HANG),))) == "down"
    assert agent_reply(status(findings=(finding(FindingKind.STALL),), suspect="x")) == "down"
    # Cleared at the next answer: served again, no operator needed.
    assert agent_reply(status(suspect=None)) == "ready up 100%"


def test_weight_drops_for_an_engine_that_serves_worse() -> None:
    assert weight_percent(status(ladder_step=1, ladder_steps=3)) == 75
    assert weight_percent(status(ladder_step=3, ladder_steps=3)) == 25
    assert weight_percent(status(findings=(finding(FindingKind.THERMAL),))) == 50
    assert weight_percent(status(findings=(finding(FindingKind.DEGRADATION_TTFT),))) == 50
    assert weight_percent(status(load=EngineLoad(kv_usage_ratio=0.95))) == 50
    assert weight_percent(status(load=EngineLoad(kv_usage_ratio=0.5))) == 100
    assert weight_percent(status(busy=True)) == 50
    everything = status(
        ladder_step=3,
        ladder_steps=3,
        busy=True,
        findings=(finding(FindingKind.POWER_THROTTLE), finding(FindingKind.KV_PRESSURE)),
        load=EngineLoad(kv_usage_ratio=1.0),
    )
    assert weight_percent(everything) == 2  # 25 / 16, rounded; never 0 (that would be a drain)
    assert agent_reply(status(ladder_step=1, ladder_steps=1)) == "ready up 50%"


def test_listeners_follow_the_config() -> None:
    async def read(port: int) -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        line = await reader.readline()
        writer.close()
        return line.decode()

    async def main() -> None:
        p1, p2 = free_port(), free_port()
        states = {"a": status(), "b": status(S.STOPPED)}
        agents = AgentServers(states.get)
        spec_a = EngineSpec(name="a", model="m", gpus=(0,), port=8000, agent_port=p1)
        spec_b = EngineSpec(name="b", model="m", gpus=(1,), port=8001, agent_port=p2)
        await agents.sync([spec_a, spec_b, EngineSpec(name="c", model="m", gpus=(2,), port=8002)])
        assert set(agents.addresses()) == {"a", "b"}
        assert await read(p1) == "ready up 100%\n"
        assert await read(p2) == "maint\n"
        # A reload that drops b's agent closes its port; a's stays.
        await agents.sync([spec_a])
        assert set(agents.addresses()) == {"a"}
        with pytest.raises(OSError):
            await read(p2)
        # A port already taken is logged and skipped, not fatal.
        taken = dataclasses.replace(spec_b, agent_port=p1)
        await agents.sync([spec_a, taken])
        assert set(agents.addresses()) == {"a"}
        await agents.close()
        with pytest.raises(OSError):
            await read(p1)

    asyncio.run(main())


def test_agent_port_is_checked_against_every_port(tmp_path) -> None:
    from llmsupervisor.config import load_config
    from llmsupervisor.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text(
        "engines:\n"
        "  - {name: a, model: m, gpus: [0], port: 8000, agent_port: 9500}\n"
        "  - {name: b, model: m, gpus: [1], port: 9500, agent_port: 8000}\n"
        "defaults: {agent_port: 9600}\n"
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path, check_paths=False)
    problems = str(exc.value)
    assert "engines[1].port: port 9500 is already used by engines[0]" in problems
    assert "engines[1].agent_port: port 8000 is already used by engines[0]" in problems
    assert "defaults.agent_port: must be set per engine" in problems
