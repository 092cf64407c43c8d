"""A real Alertmanager between Prometheus and a receiver: a crash-looping engine on one of two
hosts (each its own network namespace with a daemon) is delivered to a webhook as one
notification whose labels name the host (``instance``) and the engine.

::

    netns h15-..-1: daemon :9400, gpu0 + "bad" (crash-loops to FATAL)
    netns h15-..-2: daemon :9400, gpu0
    root namespace: Prometheus (shipped alerts.yml, ``for:`` cut to 2 s)
                      └── alerts ──► prometheus-alertmanager (group_wait 1 s)
                                          └── webhook ──► a small HTTP server in this test

The example fleet configuration shipped in packaging/prometheus/ is checked with ``promtool
check config`` and ``amtool check-config`` in tests/unit/test_monitoring_examples.py.

The time from the fault to the delivered notification is printed (run with ``-s``) and written
down in docs/fleet.md; it is a measurement, never asserted.

Needs root (network namespaces), ``ip``, ``prometheus`` and ``prometheus-alertmanager``
(Debian packages); skipped otherwise, failed under LLMSUP_REQUIRE_TOOLS=1.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.lib.daemon import fake_engine, free_port, wait_for
from tests.lib.netns import HostDaemon, Network, require_netns
from tests.lib.prometheus import fast_rules, tool


class WebhookReceiver:
    """What Alertmanager's webhook_config posts, each notification with the time it arrived."""

    def __init__(self) -> None:
        self.notifications: list[tuple[float, dict[str, Any]]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.notifications.append((time.monotonic(), json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def first_firing(self, alertname: str, **labels: str) -> tuple[float, dict[str, Any]] | None:
        """The first notification carrying a firing alert with these labels, and that alert."""
        with self._lock:
            for arrived, note in self.notifications:
                for alert in note.get("alerts", []):
                    if (
                        alert.get("status") == "firing"
                        and alert["labels"].get("alertname") == alertname
                        and all(alert["labels"].get(k) == v for k, v in labels.items())
                    ):
                        return arrived, alert
        return None

    def alerts(self) -> list[dict[str, Any]]:
        with self._lock:
            return [a for _, note in self.notifications for a in note.get("alerts", [])]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _alertmanager_config(receiver_port: int) -> dict[str, Any]:
    return {
        "route": {
            "receiver": "test",
            "group_by": ["alertname", "instance", "engine"],
            "group_wait": "1s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [
            {
                "name": "test",
                "webhook_configs": [{"url": f"http://127.0.0.1:{receiver_port}/hook", "send_resolved": True}],
            }
        ],
    }


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    require_netns()
    prometheus_bin = tool("prometheus", "prometheus")
    alertmanager_bin = tool("prometheus-alertmanager", "prometheus-alertmanager")
    receiver = WebhookReceiver()
    procs: list[subprocess.Popen[bytes]] = []
    daemons: list[HostDaemon] = []
    with Network(hosts=2) as net:
        try:
            am_port = free_port()
            am_cfg = tmp_path / "alertmanager.yml"
            am_cfg.write_text(yaml.safe_dump(_alertmanager_config(receiver.port)))
            procs.append(
                _start(
                    [
                        alertmanager_bin,
                        f"--config.file={am_cfg}",
                        f"--storage.path={tmp_path / 'am-data'}",
                        f"--web.listen-address=127.0.0.1:{am_port}",
                        "--cluster.listen-address=",  # a single Alertmanager: no gossip mesh
                    ],
                    tmp_path / "alertmanager.log",
                )
            )
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
                                    "static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}],
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
                _start(
                    [
                        prometheus_bin,
                        f"--config.file={prometheus_cfg}",
                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prometheus_port}",
                        "--rules.alert.resend-delay=1s",
                    ],
                    tmp_path / "prometheus.log",
                )
            )
            for i, (ns, address) in enumerate(zip(net.namespaces, net.addresses, strict=True)):
                engines = [fake_engine("gpu0", 8000, host=address)]
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
            yield {"net": net, "daemons": daemons, "receiver": receiver}
        finally:
            for d in daemons:
                with contextlib.suppress(Exception):
                    d.stop()
                d.cleanup()
            for proc in procs:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            receiver.close()


@pytest.mark.system
def test_a_crash_looping_engine_reaches_the_webhook_naming_host_and_engine(fleet: dict[str, Any]) -> None:
    net, receiver = fleet["net"], fleet["receiver"]
    h1, h2 = fleet["daemons"]
    # Host 2 first, so that host 1's fault starts when its daemon does: the "bad" engine's first
    # crash is 0.2 s after its spawn.
    h2.start()
    h2.wait_state("gpu0", "ready")
    fault_at = time.monotonic()
    h1.start()
    h1.wait_state("bad", "fatal")
    fatal_at = time.monotonic()
    instance = f"{net.addresses[0]}:9400"
    wait_for(
        lambda: (
            receiver.first_firing("LlmSupervisorEngineFatal", instance=instance, engine="bad") is not None
        ),
        timeout_s=60,
        what="EngineFatal delivered to the webhook",
    )
    found = receiver.first_firing("LlmSupervisorEngineFatal", instance=instance, engine="bad")
    assert found is not None
    delivered_at, alert = found
    assert alert["labels"]["severity"] == "critical"
    # Only host 1's engine: nothing about host 2 or host 1's healthy engine was delivered.
    fatal = [a for a in receiver.alerts() if a["labels"].get("alertname") == "LlmSupervisorEngineFatal"]
    assert {(a["labels"]["instance"], a["labels"]["engine"]) for a in fatal} == {(instance, "bad")}
    print(
        f"\nfault -> FATAL {fatal_at - fault_at:.1f} s; FATAL -> webhook {delivered_at - fatal_at:.1f} s; "
        f"fault -> webhook {delivered_at - fault_at:.1f} s"
    )
    assert h1.engine("gpu0")["state"] == "ready"
    for d in (h1, h2):
        assert d.stop() == 0
