"""Pod-level readiness (/readyz all|any), /livez apart from engine health, and JSON-lines logs."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from typing import Any

import pytest

from llmsupervisor import logs
from llmsupervisor.config import EngineSpec
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.endpoints import held_out, pod_ready
from llmsupervisor.engine.status import EngineStatus
from tests.lib.endpoints import serve_endpoints

S = EngineState


def status(name: str, state: EngineState = S.READY, **changes: Any) -> EngineStatus:
    spec = EngineSpec(name=name, model="m", gpus=(0,), port=8000)
    base = EngineStatus(name=name, spec=spec, state=state, state_reason="", state_since_s=0.0)
    return dataclasses.replace(base, **changes)


def test_all_needs_every_engine_meant_to_serve() -> None:
    both = (status("a"), status("b"))
    assert pod_ready(both, requires="all") == (True, ["a", "b"], [])
    one_down = (status("a"), status("b", S.STARTING))
    assert pod_ready(one_down, requires="all") == (False, ["a"], ["b"])
    assert pod_ready(one_down, requires="any")[0] is True
    # FATAL is still meant to serve: the pod is not ready with "all".
    assert pod_ready((status("a"), status("b", S.FATAL)), requires="all")[0] is False


def test_engines_an_operator_took_out_do_not_count() -> None:
    drained = (status("a"), status("b", S.DRAINING, held=True))
    assert pod_ready(drained, requires="all") == (True, ["a"], [])
    stopped = (status("a"), status("b", S.STOPPED, wants_run=False))
    assert pod_ready(stopped, requires="all")[0] is True
    disabled_spec = dataclasses.replace(status("b").spec, enabled=False)
    disabled = status("b", S.STOPPED, spec=disabled_spec, wants_run=False)  # as a runner starts it
    assert pod_ready((status("a"), disabled), requires="all")[0] is True
    # Nothing in rotation is never ready, whatever the reason.
    assert pod_ready((status("a", S.DRAINING, held=True),), requires="all")[0] is False
    assert pod_ready((), requires="any")[0] is False


def test_a_disabled_engine_started_by_hand_is_meant_to_serve() -> None:
    """`start` on an `enabled: false` engine starts it for this run of the daemon: out of
    rotation (hung, restarting), it is missing from /readyz like any other; drained, it is held."""
    disabled_spec = dataclasses.replace(status("b").spec, enabled=False)
    hung = status("b", spec=disabled_spec, suspect="2 canaries missed")
    assert pod_ready((status("a"), hung), requires="all") == (False, ["a"], ["b"])
    drained = status("b", S.DRAINING, spec=disabled_spec, held=True)
    assert pod_ready((status("a"), drained), requires="all") == (True, ["a"], [])
    assert held_out((status("a"), drained)) == ["b"]


def test_livez_ignores_engines_and_readyz_follows_the_mode() -> None:
    # A slow model load: the loop turns, nothing is ready.
    got = serve_endpoints((status("a", S.STARTING),))
    assert got["/livez"][0] == 200 and got["/healthz"][0] == 200
    assert got["/readyz"][0] == 503 and got["/engines/a/ready"][0] == 503
    mixed = (status("a"), status("b", S.BACKOFF))
    assert serve_endpoints(mixed)["/readyz"][0] == 503
    assert serve_endpoints(mixed, readyz_requires=lambda: "any")["/readyz"] == (
        200,
        {
            "ready": True,
            "requires": "any",
            "engines_in_rotation": ["a"],
            "engines_out_of_rotation": ["b"],
            "engines_held": [],
        },
    )


def test_readyz_lists_the_engines_an_operator_holds_out() -> None:
    """Issue 26 (11): a drained, stopped or disabled engine was in neither of /readyz's lists."""
    drained = status("d", S.DRAINING, held=True)
    stopped = status("s", S.STOPPED, wants_run=False)
    engines = (status("a"), drained, stopped)
    code, body = serve_endpoints(engines)["/readyz"]
    assert code == 200  # held engines are not missing: `all` is met by the rest
    assert body["engines_in_rotation"] == ["a"]
    assert body["engines_out_of_rotation"] == []
    assert body["engines_held"] == ["d", "s"]


def test_status_serves_the_whole_status_only_when_given() -> None:
    whole = {"pid": 7, "engines": {"a": {"state": "ready"}}}
    assert serve_endpoints((status("a"),), status=lambda: whole)["/status"] == (200, whole)
    assert serve_endpoints((status("a"),))["/status"][0] == 404


def test_a_stalled_loop_fails_livez_and_shutdown_fails_readyz() -> None:
    assert serve_endpoints((status("a"),), age=lambda: 30.0)["/livez"][0] == 503
    got = serve_endpoints((status("a"),), stopping=lambda: True)
    assert got["/livez"] == (200, {"ok": True, "last_tick_age_s": 0.5, "stopping": True})
    assert got["/readyz"][0] == 503 and got["/readyz"][1]["reason"] == "the daemon is shutting down"


def test_json_lines_carry_time_level_engine_and_message() -> None:
    out = io.StringIO()
    logs.setup("debug", stream=out, gpus_of={"gpu0": "0"}, log_format="json")
    try:
        log = logging.getLogger("llmsupervisor")
        log.info("ready in %d s", 42, extra={"engine": "gpu0"})
        log.warning("two\nlines")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        logs.setup("info", log_format="text")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # one object per record, a traceback included
    first, second, third = (json.loads(line) for line in lines)
    assert first["level"] == "info" and first["engine"] == "gpu0" and first["gpu"] == "0"
    assert first["message"] == "ready in 42 s" and first["time"].endswith("Z")
    assert second["message"] == "two\nlines" and "engine" not in second
    assert "ValueError: boom" in third["exception"]


@pytest.mark.parametrize(
    ("env", "requested", "expected"),
    [
        ({}, None, "text"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None, "json"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "text", "text"),
        ({"LLMSUP_LOG_FORMAT": "json"}, None, "json"),
        ({"LLMSUP_LOG_FORMAT": "json"}, "text", "text"),
        ({"LLMSUP_LOG_FORMAT": "nonsense"}, None, "text"),
    ],
)
def test_auto_picks_json_in_a_pod(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], requested: str | None, expected: str
) -> None:
    for key in ("KUBERNETES_SERVICE_HOST", "LLMSUP_LOG_FORMAT", "JOURNAL_STREAM"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert logs.resolve_format(requested, stream=io.StringIO()) == expected


def test_load_gauges_are_exported_while_known() -> None:
    from llmsupervisor.config import EngineSpec
    from llmsupervisor.daemon.exporter import Exporter
    from llmsupervisor.daemon.status import Snapshot
    from llmsupervisor.engine.status import EngineLoad, EngineStatus

    def engine(name: str, load: EngineLoad | None = None) -> EngineStatus:
        spec = EngineSpec(name=name, model="m", gpus=(0,), port=8000)
        return EngineStatus(
            name=name, spec=spec, state=S.READY, state_reason="", state_since_s=0.0, load=load
        )

    load = EngineLoad(requests_running=2, requests_waiting=5, kv_usage_ratio=0.75, ttft_p95_s=0.25)
    loaded = engine("a", load)
    text = Exporter(lambda: Snapshot(engines=(loaded, engine("b")), now_s=1.0)).render().decode()
    assert 'llmsupervisor_engine_requests_waiting{engine="a"} 5.0' in text
    assert 'llmsupervisor_engine_requests_running{engine="a"} 2.0' in text
    assert 'llmsupervisor_engine_kv_cache_usage_ratio{engine="a"} 0.75' in text
    assert 'llmsupervisor_engine_ttft_p95_seconds{engine="a"} 0.25' in text
    assert 'engine="b"} 1.0' in text  # b is exported, but no load series for it:
    assert 'llmsupervisor_engine_requests_waiting{engine="b"}' not in text


def test_a_ready_engine_with_a_hang_suspected_or_found_is_out_at_once() -> None:
    """Before the stacks and the kill (issue 27): the balancer stops sending from the first sign."""
    from llmsupervisor.detectors import Finding, FindingKind, Severity

    suspected = status("a", suspect="a canary got no answer in 1.0 s")
    got = serve_endpoints((suspected,))
    assert got["/engines/a/ready"] == (
        503,
        {"engine": "a", "state": "ready", "reason": "hang suspected: a canary got no answer in 1.0 s"},
    )
    hang = Finding(
        engine="a",
        kind=FindingKind.HANG,
        severity=Severity.CRITICAL,
        evidence={},
        since_s=0.0,
        summary="hung",
    )
    assert serve_endpoints((status("a", findings=(hang,)),))["/engines/a/ready"][1]["reason"] == "hang: hung"
    assert serve_endpoints((status("a"),))["/engines/a/ready"][0] == 200
