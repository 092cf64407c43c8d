"""`router-sync`: the daemon's view of which engines should get traffic, kept in a vLLM router.

The vLLM project's router (``vllm-router`` on PyPI, a Rust server) learns its workers from its
command line (``--worker-urls``), from Kubernetes service discovery, or at run time through its
worker-management API: ``POST /add_worker?url=URL``, ``POST /remove_worker?url=URL`` and
``GET /list_workers`` (``{"urls": [...]}``). Its own health check polls each worker's
``/health`` (``--health-check-endpoint``, on the worker's own port), which a vLLM API server
answers 200 while its EngineCore hangs, drains or is about to be stopped: it cannot ask the
daemon. So this sidecar does the asking: every ``interval_s`` it reads the daemon's ``/status``
and the router's worker list, removes every managed worker whose engine is not in rotation and
adds back every one that is (READY, no hang suspected or found: engine/status.py
``in_rotation``).

- A drain or restart: the engine leaves rotation when DRAINING starts, ``drain_grace_s`` (5 s by
  default) before the stop, and is removed within one interval.
- A crash, or a hang suspected: out of rotation as the daemon sees it, removed within one
  interval.
- READY again: added back within one interval.

Only the URLs given (``--worker NAME=URL``, or every engine of the status at
``http://ENGINE_HOST:PORT``) are managed; other workers of the router are left alone. While the
daemon cannot be read the router is left as it is (the engines may well be serving): the
sidecar never empties a router because the daemon is restarting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TextIO

import httpx

log = logging.getLogger("llmsupervisor.router_sync")

READ_DEADLINE_S: Final = 2.0
# add_worker waits until the worker answers the router's health check: READY engines do at once.
ADD_DEADLINE_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Plan:
    add: tuple[str, ...]
    remove: tuple[str, ...]


def workers_of(status: Mapping[str, Any], named: Mapping[str, str], engine_host: str) -> dict[str, str]:
    """Engine name -> worker URL: the ones named, else every engine of the status by its port."""
    if named:
        return dict(named)
    engines = status.get("engines", {})
    return {
        name: f"http://{engine_host}:{engine['port']}"
        for name, engine in engines.items()
        if isinstance(engine, dict) and isinstance(engine.get("port"), int)
    }


def plan(status: Mapping[str, Any], workers: Mapping[str, str], listed: frozenset[str]) -> Plan:
    """What to change in the router so that its managed workers are exactly the engines in
    rotation. An engine the status does not name is taken out (removed from the config)."""
    engines = status.get("engines", {})
    wanted = {url for name, url in workers.items() if engines.get(name, {}).get("in_rotation") is True}
    managed = set(workers.values())
    return Plan(add=tuple(sorted(wanted - listed)), remove=tuple(sorted((listed & managed) - wanted)))


def parse_workers(values: list[str]) -> dict[str, str]:
    """``NAME=URL`` pairs; ValueError names the bad one."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or "://" not in url:
            raise ValueError(f"--worker {value!r}: expected NAME=URL (e.g. gpu0=http://10.0.0.5:8000)")
        out[name] = url.rstrip("/")
    return out


class RouterSync:
    """One pass: read the daemon and the router, apply the plan. Every call has a deadline."""

    def __init__(
        self,
        daemon_url: str,
        router_url: str,
        *,
        workers: Mapping[str, str] | None = None,
        engine_host: str = "127.0.0.1",
        client: httpx.Client | None = None,
    ) -> None:
        self.daemon_url = daemon_url.rstrip("/")
        self.router_url = router_url.rstrip("/")
        self.workers = dict(workers or {})
        self.engine_host = engine_host
        self._client = client or httpx.Client()

    def once(self) -> Plan | None:
        """The plan applied, or None when the daemon or the router could not be read."""
        try:
            resp = self._client.get(self.daemon_url + "/status", timeout=READ_DEADLINE_S)
            resp.raise_for_status()
            status = resp.json()
            resp = self._client.get(self.router_url + "/list_workers", timeout=READ_DEADLINE_S)
            resp.raise_for_status()
            listed = frozenset(u.rstrip("/") for u in resp.json().get("urls", []))
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.warning("cannot read the daemon or the router, leaving the router as it is: %s", exc)
            return None
        todo = plan(status, workers_of(status, self.workers, self.engine_host), listed)
        for url in todo.remove:
            self._post("/remove_worker", url, READ_DEADLINE_S)
        for url in todo.add:
            self._post("/add_worker", url, ADD_DEADLINE_S)
        return todo

    def _post(self, path: str, url: str, deadline_s: float) -> None:
        try:
            resp = self._client.post(self.router_url + path, params={"url": url}, timeout=deadline_s)
            outcome = f"HTTP {resp.status_code} {resp.text.strip()[:120]}"
        except httpx.HTTPError as exc:
            outcome = str(exc) or type(exc).__name__
        log.info("%s %s: %s", path.lstrip("/"), url, outcome)


def run(
    sync: RouterSync,
    *,
    interval_s: float,
    err: TextIO,
    passes: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Sync every ``interval_s`` until interrupted (or for ``passes`` passes: tests)."""
    logging.basicConfig(stream=err, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    done = 0
    while passes is None or done < passes:
        sync.once()
        done += 1
        sleep(interval_s)
    return 0
