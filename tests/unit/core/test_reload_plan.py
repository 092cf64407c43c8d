"""The reload plan: a pure diff of two validated configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from llmsupervisor.config import EngineSpec, SupervisorConfig, SupervisorSettings
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


def test_added_removed_and_unchanged() -> None:
    plan = plan_reload(
        config(spec("e0"), spec("e1")), config(spec("e1"), spec("e2")), {"e0": True, "e1": True}
    )
    assert [s.name for s in plan.added] == ["e2"]
    assert plan.removed == ("e0",)
    assert plan.restart == () and plan.respec == () and plan.changed == ()


def test_a_changed_running_engine_is_restarted() -> None:
    new = spec("e0", port=9000)
    plan = plan_reload(config(spec("e0")), config(new), {"e0": True})
    assert plan.restart == (new,) and plan.respec == ()


def test_a_changed_stopped_engine_gets_its_spec_and_stays_stopped() -> None:
    """Defect D5: the reload started an engine the operator had stopped."""
    new = spec("e0", port=9000)
    plan = plan_reload(config(spec("e0")), config(new), {"e0": False})
    assert plan.restart == () and plan.respec == (new,) and plan.enable == ()


def test_enabled_flips_are_a_stop_or_a_start() -> None:
    off = spec("e0", enabled=False)
    plan = plan_reload(config(spec("e0")), config(off), {"e0": True})
    assert plan.disable == ("e0",) and plan.respec == (off,) and plan.restart == ()
    plan = plan_reload(config(off), config(spec("e0")), {"e0": False})
    assert plan.enable == ("e0",) and plan.respec == (spec("e0"),)


def test_settings_that_need_a_restart_of_the_daemon_are_listed() -> None:
    """Defect D9: tick_interval_s, http_listen and state_dir were applied partly and silently."""
    plan = plan_reload(
        config(spec("e0")),
        config(
            spec("e0"), tick_interval_s=5.0, http_listen="0.0.0.0:9400", log_level="debug", max_unavailable=2
        ),
        {"e0": True},
    )
    assert plan.next_start_only == ("supervisor.tick_interval_s", "supervisor.http_listen")
