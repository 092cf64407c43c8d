"""Two hosts, each its own network namespace with a daemon and a fake engine, behind one HAProxy,
scraped by one real Prometheus that evaluates packaging/prometheus/alerts.yml and sends its
alerts to an Alertmanager endpoint.

::

     root namespace                                   netns h15-..-1 (10.215.N.11)
     ┌──────────────────────────────┐   bridge   ┌────────────────────────────────┐
     │ HAProxy :frontend ──────────────────────────► gpu0 :8000   daemon :9400    │
     │ Prometheus ── scrape ───────────────────────► (+ "bad", crash-looping)     │
     │   └── alerts ──► Alertmanager  │          └────────────────────────────────┘
     │       (a recorder, see below)  │            netns h15-..-2 (10.215.N.12)
     └──────────────────────────────┘          ┌────────────────────────────────┐
                                   ───────────────► gpu0 :8000   daemon :9400    │
                                                └────────────────────────────────┘

Both hosts use the same ports and engine names, as real hosts do. Cutting host 2's link (a
network partition: its daemon and engine keep running) must take it out of HAProxy with no
failed request started after HAProxy noticed, fire LlmSupervisorScrapeDown for host 2 only, and
healing the link must bring it back and resolve the alert. Host 1's crash-looping engine must
fire LlmSupervisorEngineFatal with the host's instance label.

The alert expressions are the shipped ones; only their ``for:`` durations are cut to 2 s so the
test takes seconds, not minutes. The Alertmanager is a recorder of what Prometheus posts to
``/api/v2/alerts`` (Alertmanager is not packaged for this test host): Prometheus' side of the
protocol is real. Alertmanager's routing, grouping and webhook delivery are tested against a
real ``prometheus-alertmanager`` in tests/fleet/test_fleet_alertmanager.py.

Needs root (network namespaces), ``ip``, ``prometheus`` and ``haproxy``; skipped otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lib.daemon import free_port, stop_helpers, wait_for
from tests.lib.haproxy import haproxy, server_status
from tests.lib.load import Load
from tests.lib.netns import HostDaemon, Network, crash_loop_hosts, require_netns, stop_hosts
from tests.lib.prometheus import Posts, start_prometheus

pytestmark = pytest.mark.system

HAPROXY_CFG = """\
global
    maxconn 256
    stats socket {stats_socket} level admin
defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 5s
    timeout check 1s
    retries 0                       # no retry may hide a failed request from this test
frontend llm
    bind 127.0.0.1:{frontend_port}
    default_backend engines
backend engines
    balance roundrobin
    option httpchk
    http-check send meth GET uri /engines/gpu0/ready
    default-server inter 300ms fall 2 rise 1
    server h1 {h1}:8000 check addr {h1} port 9400
    server h2 {h2}:8000 check addr {h2} port 9400
"""


class AlertRecorder(Posts):
    """Takes what Prometheus posts to an Alertmanager's /api/v2/alerts, in order."""

    def latest(self, alertname: str, **labels: str) -> dict[str, Any] | None:
        """The last post of the alert with these labels (Prometheus re-sends; the last wins)."""
        matching = [
            a
            for _, alerts in self.bodies("/api/v2/alerts")
            for a in alerts
            if a["labels"].get("alertname") == alertname
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]
        return matching[-1] if matching else None

    def firing(self, alertname: str, **labels: str) -> bool:
        alert = self.latest(alertname, **labels)
        # A resolved alert is re-posted with endsAt in the past; a firing one has it ahead.
        return alert is not None and _ends_in_future(alert)


def _ends_in_future(alert: dict[str, Any]) -> bool:
    from datetime import UTC, datetime

    ends = datetime.fromisoformat(alert["endsAt"].replace("Z", "+00:00"))
    return ends > datetime.now(UTC)


def _tools() -> tuple[str, str]:
    require_netns()
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    return prometheus, haproxy()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    prometheus_bin, haproxy_bin = _tools()
    procs: list[subprocess.Popen[bytes]] = []
    daemons: list[HostDaemon] = []
    recorder = AlertRecorder()
    with Network(hosts=2) as net:
        try:
            daemons += crash_loop_hosts(net, tmp_path, drain_grace_s=1)
            for d in daemons:
                d.start()
            targets = [f"{a}:9400" for a in net.addresses]
            prometheus, prometheus_url = start_prometheus(
                prometheus_bin, tmp_path, targets=targets, alertmanager_port=recorder.port
            )
            procs.append(prometheus)
            stats_socket = tmp_path / "haproxy.sock"
            frontend_port = free_port()
            haproxy_cfg = tmp_path / "haproxy.cfg"
            haproxy_cfg.write_text(
                HAPROXY_CFG.format(
                    stats_socket=stats_socket,
                    frontend_port=frontend_port,
                    h1=net.addresses[0],
                    h2=net.addresses[1],
                )
            )
            procs.append(
                subprocess.Popen(
                    [haproxy_bin, "-f", str(haproxy_cfg), "-db"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            yield {
                "net": net,
                "daemons": daemons,
                "recorder": recorder,
                "prometheus": prometheus_url,
                "frontend": f"http://127.0.0.1:{frontend_port}/v1/completions",
                "stats": stats_socket,
            }
        finally:
            stop_helpers(procs)
            stop_hosts(daemons)
            recorder.close()


def _up(prometheus: str) -> dict[str, float]:
    """Prometheus' own `up` per instance."""
    try:
        body = httpx.get(prometheus + "/api/v1/query", params={"query": "up"}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {r["metric"]["instance"]: float(r["value"][1]) for r in body.get("data", {}).get("result", [])}


def test_a_partitioned_host_leaves_haproxy_and_fires_scrape_down(fleet: dict[str, Any]) -> None:
    net, recorder, stats = fleet["net"], fleet["recorder"], fleet["stats"]
    h1, h2 = (f"{a}:9400" for a in net.addresses)
    for d in fleet["daemons"]:
        d.wait_state("gpu0", "ready")
    wait_for(lambda: _up(fleet["prometheus"]) == {h1: 1.0, h2: 1.0}, timeout_s=30, what="both scraped")
    # Host 1's crash-looping engine: FATAL, and the alert carries the host and the engine.
    fleet["daemons"][0].wait_state("bad", "fatal")
    wait_for(
        lambda: recorder.firing("LlmSupervisorEngineFatal", instance=h1, engine="bad"),
        timeout_s=30,
        what="EngineFatal for host 1's bad engine",
    )
    assert not recorder.firing("LlmSupervisorEngineFatal", instance=h2)
    wait_for(
        lambda: server_status(stats, "h1") == server_status(stats, "h2") == "UP", timeout_s=20, what="UP"
    )

    with Load(fleet["frontend"], workers=3, pause_s=0.05) as load:
        wait_for(lambda: load.since(0).count("ok") >= 10, timeout_s=20, what="traffic on both hosts")
        net.cut(1, up=False)
        wait_for(lambda: server_status(stats, "h2") == "DOWN", timeout_s=20, what="h2 DOWN in HAProxy")
        noticed = time.monotonic()
        wait_for(lambda: load.since(noticed).count("ok") >= 20, timeout_s=30, what="traffic on host 1 alone")
        # Requests in flight to host 2 when the link went are lost (a partition is not a drain);
        # none started after HAProxy marked host 2 down is.
        assert set(load.since(noticed)) == {"ok"}, Counter(load.since(noticed))

        wait_for(
            lambda: recorder.firing("LlmSupervisorScrapeDown", instance=h2),
            timeout_s=30,
            what="ScrapeDown for host 2",
        )
        assert not recorder.firing("LlmSupervisorScrapeDown", instance=h1)
        # The partitioned host's daemon and engine never noticed: they kept running.
        assert fleet["daemons"][1].engine("gpu0")["state"] == "ready"

        net.cut(1, up=True)
        wait_for(lambda: server_status(stats, "h2") == "UP", timeout_s=20, what="h2 UP again")
        wait_for(
            lambda: (
                (a := recorder.latest("LlmSupervisorScrapeDown", instance=h2)) is not None
                and not _ends_in_future(a)
            ),
            timeout_s=30,
            what="ScrapeDown for host 2 resolved",
        )
    assert _up(fleet["prometheus"]) == {h1: 1.0, h2: 1.0}
    for d in fleet["daemons"]:
        assert d.stop() == 0
