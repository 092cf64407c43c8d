"""The daemon's HTTP endpoints: /metrics, /healthz, /readyz, /engines/NAME/ready.

Each handler is a function of the latest statuses (and, for /healthz, the loop's last tick), so
a load balancer's check never waits on an engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llmsupervisor.engine.status import EngineStatus
from llmsupervisor.exporter import Exporter
from llmsupervisor.http_api import HttpApi, Response


def _json(status: int, body: dict[str, Any]) -> Response:
    return Response(status=status, body=json.dumps(body).encode() + b"\n", content_type="application/json")


def http_api(
    *,
    exporter: Exporter,
    statuses: Callable[[], tuple[EngineStatus, ...]],
    last_tick_age_s: Callable[[], float],
    tick_limit_s: Callable[[], float],
) -> HttpApi:
    def healthz() -> Response:
        """Alive means the loop is ticking, not merely that the process answers."""
        age_s, limit_s = last_tick_age_s(), tick_limit_s()
        if age_s > limit_s:
            return _json(503, {"ok": False, "reason": f"no loop tick for {age_s:.1f} s"})
        return _json(200, {"ok": True, "last_tick_age_s": round(age_s, 3)})

    def readyz() -> Response:
        ready = [s.name for s in statuses() if s.in_rotation]
        return _json(200 if ready else 503, {"ready": bool(ready), "engines_in_rotation": ready})

    def engine_ready(rest: str) -> Response:
        """``/engines/NAME/ready``: 200 only when NAME should receive traffic (for HAProxy,
        nginx or Kubernetes); 503 with the reason otherwise."""
        name, _, leaf = rest.partition("/")
        status = next((s for s in statuses() if s.name == name), None)
        if leaf != "ready" or status is None:
            return _json(404, {"error": f"no such endpoint: /engines/{rest}"})
        body = {"engine": name, "state": status.state.value, "reason": status.state_reason}
        return _json(200 if status.in_rotation else 503, body)

    return HttpApi(
        {
            "/metrics": lambda: Response(body=exporter.render(), content_type=exporter.content_type),
            "/healthz": healthz,
            "/readyz": readyz,
        },
        {"/engines/": engine_ready},
    )
