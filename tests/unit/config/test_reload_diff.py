"""What a reload means per engine (config/reload_diff.py): the table that `reload --dry-run` and
the real reload's reply print (issue 26: "restarting gpu1" said what, not why)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from llmsupervisor.cli import render
from llmsupervisor.config import EngineSpec, SupervisorConfig, SupervisorSettings
from llmsupervisor.config.reload_diff import (
    NEXT_START,
    NOTHING,
    REMOVE,
    RESTART,
    START,
    STOP,
    describe,
    engine_changes,
    field_changes,
    setting_changes,
)
from llmsupervisor.config.reload_plan import plan_reload


def config(*engines: EngineSpec, **settings: object) -> SupervisorConfig:
    return SupervisorConfig(
        path=Path("/etc/llm-supervisor/config.yaml"),
        supervisor=dataclasses.replace(SupervisorSettings(), **settings),  # type: ignore[arg-type]
        engines=engines,
    )


def spec(name: str, **changes: object) -> EngineSpec:
    base = EngineSpec(name=name, model="m", gpus=(int(name[-1]),), port=8000 + int(name[-1]))
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# (old spec, new spec or None for removed, running now, action, model reload, the line)
CASES = [
    pytest.param(
        spec("e1"), spec("e1", port=9001), True, RESTART, False, "e1: restart: port: 8001 -> 9001", id="port"
    ),
    pytest.param(
        spec("e1"),
        spec("e1", model="llama-70b", port=9001),
        True,
        RESTART,
        True,
        "e1: restart (model reload): model: m -> llama-70b; port: 8001 -> 9001",
        id="model",
    ),
    pytest.param(
        spec("e1", args={"max-num-seqs": 256}),
        spec("e1", args={"max-num-seqs": 128, "quantization": "fp8"}),
        True,
        RESTART,
        True,
        "e1: restart (model reload): args.max-num-seqs: 256 -> 128; args.quantization: - -> fp8",
        id="args",
    ),
    pytest.param(
        spec("e1"),
        spec("e1", enabled=False),
        True,
        STOP,
        False,
        "e1: stop (disabled): enabled: true -> false",
        id="disabled: a stop, not a restart",
    ),
    pytest.param(
        spec("e1", enabled=False),
        spec("e1"),
        False,
        START,
        False,
        "e1: start (enabled): enabled: false -> true",
        id="enabled",
    ),
    pytest.param(
        spec("e1"),
        spec("e1", port=9001),
        False,
        NEXT_START,
        False,
        "e1: new spec, applied at its next start (not running now): port: 8001 -> 9001",
        id="stopped",
    ),
    pytest.param(spec("e1"), spec("e1"), True, NOTHING, False, "e1: nothing (unchanged)", id="unchanged"),
    pytest.param(None, spec("e1"), False, START, False, "e1: start (added)", id="added"),
    pytest.param(spec("e1"), None, True, STOP, False, "e1: stop (removed)", id="removed"),
    pytest.param(
        spec("e1", env={"HF_TOKEN": "hf_old_secret", "A": "1"}),
        spec("e1", env={"HF_TOKEN": "hf_new_secret", "A": "2"}, api_key="sk-new-key-123"),
        True,
        RESTART,
        False,
        "e1: restart: env.HF_TOKEN: *** -> *** (changed); env.A: 1 -> 2",
        id="secrets masked",
    ),
    pytest.param(
        spec("e1", command=("vllm", "serve", "--api-key", "sk-old-key-123")),
        spec("e1", command=("vllm", "serve", "--api-key=sk-new-key-456")),
        True,
        RESTART,
        False,
        "e1: restart: command: vllm serve --api-key *** -> vllm serve --api-key=***",
        id="secret in the command",
    ),
]


@pytest.mark.parametrize(("old", "new", "running", "action", "model_reload", "line"), CASES)
def test_each_engine_says_what_changed_and_what_happens(
    old: EngineSpec | None,
    new: EngineSpec | None,
    running: bool,
    action: str,
    model_reload: bool,
    line: str,
) -> None:
    before = config(*([old] if old else []))
    after = config(*([new] if new else []))
    plan = plan_reload(before, after, {"e1": running})
    (row,) = engine_changes(before, after, plan)
    assert (row.action, row.model_reload) == (action, model_reload)
    assert describe(row) == line
    assert "secret" not in str(row.as_json()) and "key-" not in str(row.as_json())


def test_an_engine_an_earlier_roll_did_not_reach_is_a_restart() -> None:
    both = config(spec("e1"))
    (row,) = engine_changes(both, both, plan_reload(both, both, {"e1": True}), rolling=["e1"])
    assert describe(row) == "e1: restart (an earlier roll did not reach it)"


def test_settings_say_when_they_apply() -> None:
    changes = setting_changes(
        config(max_unavailable=1), config(max_unavailable=2, tick_interval_s=2.5, state_dir=Path("/srv/s"))
    )
    shown = {c.change.field: (str(c.change), c.live) for c in changes}
    assert shown["supervisor.max_unavailable"] == ("supervisor.max_unavailable: 1 -> 2", True)
    assert shown["supervisor.tick_interval_s"][1] is False
    assert shown["supervisor.state_dir"][0].endswith("-> /srv/s")


def test_nested_detector_fields_are_named_by_path() -> None:
    old = spec("e1")
    new = dataclasses.replace(old, detectors=dataclasses.replace(old.detectors, stale_after_s=60.0))
    assert [str(c) for c in field_changes(old, new)] == ["detectors.stale_after_s: 30 -> 60"]


def test_a_dry_run_does_not_stop_an_engine_that_is_already_stopped() -> None:
    """Issue 39 (3): a dry run said it would stop an engine an operator had stopped already."""
    old = config(spec("e1"), spec("e2"), spec("e3"))
    new = config(spec("e1"), spec("e2", enabled=False))
    running = {"e1": True, "e2": False, "e3": False}  # e2 and e3 stopped by an operator
    rows = {c.engine: c for c in engine_changes(old, new, plan_reload(old, new, running))}
    assert (rows["e2"].action, describe(rows["e2"])) == (
        NOTHING,
        "e2: nothing (disabled, not running): enabled: true -> false",
    )
    assert (rows["e3"].action, describe(rows["e3"])) == (REMOVE, "e3: remove (not running)")
    reply = {"engines": [c.as_json() for c in rows.values()], "lines": [describe(c) for c in rows.values()]}
    lines = render.reload_lines(reply, dry_run=True)
    assert lines[0] == "dry run, nothing applied; a reload would be: removing e3"
    running = {"e1": True, "e2": True, "e3": True}
    rows = {c.engine: c for c in engine_changes(old, new, plan_reload(old, new, running))}
    assert rows["e2"].action == STOP and rows["e3"].action == STOP
