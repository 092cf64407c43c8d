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

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lib.daemon import stop_helpers, wait_for
from tests.lib.netns import HostDaemon, Network, crash_loop_hosts, require_netns, stop_hosts
from tests.lib.prometheus import Posts, start_alertmanager, start_prometheus, tool


class WebhookReceiver(Posts):
    """What Alertmanager's webhook_config posts, each notification with the time it arrived."""

    def first_firing(self, alertname: str, **labels: str) -> tuple[float, dict[str, Any]] | None:
        """The first notification carrying a firing alert with these labels, and that alert."""
        for arrived, note in self.bodies():
            for alert in note.get("alerts", []):
                if (
                    alert.get("status") == "firing"
                    and alert["labels"].get("alertname") == alertname
                    and all(alert["labels"].get(k) == v for k, v in labels.items())
                ):
                    return arrived, alert
        return None

    def alerts(self) -> list[dict[str, Any]]:
        return [a for _, note in self.bodies() for a in note.get("alerts", [])]


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
            alertmanager, am_port = start_alertmanager(alertmanager_bin, tmp_path, webhook_port=receiver.port)
            procs.append(alertmanager)
            targets = [f"{a}:9400" for a in net.addresses]
            prometheus, _ = start_prometheus(
                prometheus_bin, tmp_path, targets=targets, alertmanager_port=am_port
            )
            procs.append(prometheus)
            daemons += crash_loop_hosts(net, tmp_path)
            yield {"net": net, "daemons": daemons, "receiver": receiver}
        finally:
            stop_hosts(daemons, timeout_s=60)
            stop_helpers(procs)
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
