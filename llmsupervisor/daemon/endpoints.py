"""The daemon's HTTP endpoints: /metrics, /livez (and its older name /healthz), /readyz,
/engines/NAME/ready, /status.

Each handler is a function of the latest statuses (and, for /livez, the loop's last turn), so a
load balancer's or kubelet's check never waits on an engine.

Two questions, kept apart on purpose (docs/fleet.md):

- ``/livez``: is the daemon's loop turning? Never tied to an engine's health: a model that takes
  ten minutes to load, or a hung engine the daemon is repairing, must not get the pod killed.
  The kubelet's livenessProbe points here.
- ``/readyz``: should this daemon's host (pod) get traffic? ``readyz_requires: all`` (the
  default) answers 200 only when every engine meant to be serving is in rotation; ``any`` when
  at least one is. Both say 503 while the daemon shuts down and when nothing is in rotation,
  and while a node condition holds (a GPU lost, or marked twice for a critical fault:
  core/node_condition.py), with the condition as the reason, so that node-level remediation
  (NVSentinel, the device plugin, an operator) takes the node from there.

``/status`` is the whole read-only status, the same JSON as `llm-supervisor status --json` over
the control socket, for the fleet view (`llm-supervisor status --host URL ...`). It reveals what
/metrics already does plus the config path, pid, models, last exit texts and findings; it
changes nothing (docs/fleet.md, "The fleet view").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llmsupervisor.core.node_condition import NodeCondition, engine_blocked
from llmsupervisor.core.state import EngineState
from llmsupervisor.daemon.exporter import Exporter
from llmsupervisor.engine.status import EngineStatus
from llmsupervisor.http_api import HttpApi, Response, error
from llmsupervisor.redact import redact_json


def _json(status: int, body: dict[str, Any]) -> Response:
    # Reasons and exit texts may quote an engine's command line: redacted where they leave.
    data = json.dumps(redact_json(body)).encode() + b"\n"
    return Response(status=status, body=data, content_type="application/json")


def pod_ready(statuses: tuple[EngineStatus, ...], *, requires: str) -> tuple[bool, list[str], list[str]]:
    """(ready, engines in rotation, engines meant to serve but out of rotation). An engine held
    by the operator is not missing; a FATAL or restarting one is: it is meant to serve and does
    not."""
    in_rotation = [s.name for s in statuses if s.in_rotation]
    missing = [s.name for s in statuses if s.meant_to_serve and not s.held_by_operator and not s.in_rotation]
    ready = bool(in_rotation) and (requires == "any" or not missing)
    return ready, in_rotation, missing


def held_out(statuses: tuple[EngineStatus, ...]) -> list[str]:
    """Engines an operator holds out of service (drained, stopped, or disabled in the config):
    neither in rotation nor missing, and so in neither of /readyz's other lists."""
    return [s.name for s in statuses if s.held_by_operator and not s.final and not s.in_rotation]


def http_api(
    *,
    exporter: Exporter,
    statuses: Callable[[], tuple[EngineStatus, ...]],
    last_tick_age_s: Callable[[], float],
    tick_limit_s: Callable[[], float],
    readyz_requires: Callable[[], str] = lambda: "all",
    stopping: Callable[[], bool] = lambda: False,
    status: Callable[[], dict[str, Any]] | None = None,
    node_conditions: Callable[[], tuple[NodeCondition, ...]] = lambda: (),
) -> HttpApi:
    def livez() -> Response:
        """Alive means the loop is turning, not merely that the process answers."""
        age_s, limit_s = last_tick_age_s(), tick_limit_s()
        if age_s > limit_s:
            return _json(503, {"ok": False, "reason": f"no loop turn for {age_s:.1f} s"})
        return _json(200, {"ok": True, "last_tick_age_s": round(age_s, 3), "stopping": stopping()})

    def readyz() -> Response:
        requires = readyz_requires()
        engines = statuses()
        ready, in_rotation, missing = pod_ready(engines, requires=requires)
        body: dict[str, Any] = {
            "ready": ready and not stopping(),
            "requires": requires,
            "engines_in_rotation": in_rotation,
            "engines_out_of_rotation": missing,
            "engines_held": held_out(engines),  # by an operator: not counted either way
        }
        conditions = node_conditions()
        if conditions:
            body["ready"] = False
            body["node_conditions"] = [c.as_json() for c in conditions]
        reasons = [c.describe() for c in conditions]
        if stopping():
            reasons.append("the daemon is shutting down")
        if reasons:
            body["reason"] = "; ".join(reasons)
        return _json(200 if body["ready"] else 503, body)

    def engine_ready(rest: str) -> Response:
        """``/engines/NAME/ready``: 200 only when NAME should receive traffic (for HAProxy,
        nginx or Kubernetes); 503 with the reason otherwise."""
        name, _, leaf = rest.partition("/")
        now = statuses()
        status = next((s for s in now if s.name == name), None)
        if leaf != "ready":
            return error(404, f"no such endpoint: /engines/{rest}; /engines/NAME/ready is")
        if status is None:
            names = [s.name for s in now]
            return error(404, f"no engine named {name!r}; engines: {', '.join(names)}", engines=names)
        body = {"engine": name, "state": status.state.value, "reason": status.state_reason}
        if (unresponsive := status.unresponsive) is not None and status.state is EngineState.READY:
            body["reason"] = unresponsive  # READY, yet a hang is suspected or found: out
        blocked = engine_blocked(status.spec.gpus, node_conditions())
        if blocked is not None:
            body["reason"] = blocked.describe()
        return _json(200 if status.in_rotation and blocked is None else 503, body)

    routes: dict[str, Callable[[], Response]] = {
        "/metrics": lambda: Response(body=exporter.render(), content_type=exporter.content_type),
        "/livez": livez,
        "/healthz": livez,
        "/readyz": readyz,
    }
    if status is not None:
        whole_status = status
        routes["/status"] = lambda: _json(200, whole_status())
    return HttpApi(routes, {"/engines/": engine_ready}, probe=is_probe)


PROBE_PATHS = frozenset({"/livez", "/healthz", "/readyz"})


def is_probe(path: str) -> bool:
    """What balancers and kubelets check: answered before any other client when the listener is
    full (http_api.py, issue 38)."""
    return path in PROBE_PATHS or (path.startswith("/engines/") and path.endswith("/ready"))
