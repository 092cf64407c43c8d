"""Every numeric engine value check-config accepts builds the runtime objects the runner and the
policy use, and they compute (issue 28 #3): the restart policy and its backoff, the failure
budget, the stop ladder and the policy's rules, at each field's lowest and highest."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from llmsupervisor.config import ENGINE_FIELDS, EngineSpec
from llmsupervisor.core.restarts import FailureHistory, backoff_delay_s, is_crash_loop, should_reset

BASE = EngineSpec(name="a", model="org/m", gpus=(), port=8000)
NOT_SPEC_FIELDS = {"port", "agent_port", "metrics_max_body_bytes"}  # ints the runtime only passes on


def edges(schema: dict[str, Any]) -> list[float]:
    low: Any = schema.get("minimum", schema.get("exclusiveMinimum"))
    high: Any = schema.get("maximum", schema.get("exclusiveMaximum"))
    if schema["type"] == "integer":
        return [low + ("exclusiveMinimum" in schema), high]
    first = math.nextafter(low, math.inf) if "exclusiveMinimum" in schema else low
    return [first, math.nextafter(first, math.inf), high]


CASES = [
    (name, value)
    for name, field in ENGINE_FIELDS.items()
    if field.kind.schema.get("type") in ("number", "integer") and name not in NOT_SPEC_FIELDS
    for value in edges(dict(field.kind.schema))
]


@pytest.mark.parametrize(("name", "value"), CASES, ids=[f"{n}={v:g}" for n, v in CASES])
def test_every_accepted_extreme_builds_runtime_objects_that_compute(name: str, value: float) -> None:
    changes: dict[str, Any] = {name: value}
    spec = replace(BASE, **changes)
    policy = spec.restart_policy
    history = FailureHistory()
    for i in range(12):
        now = i * 1e6
        history = history.record(now, policy)
        for draw in (0.0, 0.5, math.nextafter(1.0, 0.0)):
            delay = backoff_delay_s(history.count(now, policy), policy, draw)
            assert math.isfinite(delay) and delay >= 0.0
        is_crash_loop(history, now, policy)
        should_reset(now - 1.0, now, policy)
    ladder = spec.stop_ladder
    assert all(math.isfinite(x) for x in (ladder.quick().main_term_timeout_s, ladder.kill_timeout_s))
    assert spec.rules.rotation_grace_s >= 0.0
