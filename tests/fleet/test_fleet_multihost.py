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

import contextlib
import json
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.lib.daemon import fake_engine, free_port, wait_for
from tests.lib.haproxy import haproxy, server_status
from tests.lib.load import Load
from tests.lib.netns import HostDaemon, Network, require_netns
from tests.lib.prometheus import fast_rules

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


class AlertRecorder:
    """Takes what Prometheus posts to an Alertmanager's /api/v2/alerts, in order."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/api/v2/alerts":
                    with recorder._lock:
                        recorder.posts += json.loads(body)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def latest(self, alertname: str, **labels: str) -> dict[str, Any] | None:
        """The last post of the alert with these labels (Prometheus re-sends; the last wins)."""
        with self._lock:
            matching = [
                a
                for a in self.posts
                if a["labels"].get("alertname") == alertname
                and all(a["labels"].get(k) == v for k, v in labels.items())
            ]
        return matching[-1] if matching else None

    def firing(self, alertname: str, **labels: str) -> bool:
        alert = self.latest(alertname, **labels)
        # A resolved alert is re-posted with endsAt in the past; a firing one has it ahead.
        return alert is not None and _ends_in_future(alert)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
    prometheus_log = (tmp_path / "prometheus.log").open("wb")
    daemons: list[HostDaemon] = []
    recorder = AlertRecorder()
    with Network(hosts=2) as net:
        try:
            for i, (ns, address) in enumerate(zip(net.namespaces, net.addresses, strict=True)):
                engines = [fake_engine("gpu0", 8000, host=address, drain_grace_s=1)]
                if i == 0:
                    engines.append(
                        fake_engine(
                            "bad",
                            8001,
                            host=address,
                            fake_crash_after_s=0.2,
                            fake_exit_code=1,
                            max_failures=2,
                        )
                    )
                host_dir = tmp_path / f"h{i + 1}"
                host_dir.mkdir()
                config = {"supervisor": {"http_listen": "0.0.0.0:9400"}, "engines": engines}
                daemons.append(HostDaemon(host_dir, config, netns=ns))
            for d in daemons:
                d.start()

            rules = tmp_path / "rules.yml"
            fast_rules(rules)
            prometheus_port = free_port()
            prometheus_cfg = tmp_path / "prometheus.yml"
            prometheus_cfg.write_text(
                yaml.safe_dump(
                    {
                        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "rule_files": [str(rules)],
                        "alerting": {
                            "alertmanagers": [
                                {
                                    "api_version": "v2",
                                    "static_configs": [{"targets": [f"127.0.0.1:{recorder.port}"]}],
                                }
                            ]
                        },
                        "scrape_configs": [
                            {
                                "job_name": "llm-supervisor",
                                "scrape_timeout": "1s",
                                "static_configs": [{"targets": [f"{a}:9400" for a in net.addresses]}],
                            }
                        ],
                    }
                )
            )
            procs.append(
                subprocess.Popen(
                    [
                        prometheus_bin,
                        f"--config.file={prometheus_cfg}",
                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prometheus_port}",
                        "--rules.alert.resend-delay=1s",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=prometheus_log,
                )
            )
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
                "prometheus": f"http://127.0.0.1:{prometheus_port}",
                "frontend": f"http://127.0.0.1:{frontend_port}/v1/completions",
                "stats": stats_socket,
            }
        finally:
            for proc in procs:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for d in daemons:
                with contextlib.suppress(Exception):
                    d.signal(signal.SIGTERM)
                    d.wait_exit(timeout_s=30)
                d.cleanup()
            recorder.close()
            prometheus_log.close()


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
