"""The example fleet configuration shipped in packaging/prometheus/ passes ``promtool check config``
and ``amtool check-config`` (skipped where the tools are missing, failed under
LLMSUP_REQUIRE_TOOLS=1)."""

from __future__ import annotations

import json
import subprocess

from tests.lib.paths import REPO
from tests.lib.prometheus import tool

EXAMPLES = REPO / "packaging" / "prometheus"


def test_the_example_fleet_configs_pass_promtool_and_amtool() -> None:
    promtool = tool("promtool", "prometheus")
    amtool = tool("amtool", "prometheus-alertmanager")
    prom = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"], cwd=EXAMPLES, capture_output=True, text=True
    )
    assert prom.returncode == 0, prom.stdout + prom.stderr
    assert "rules found" in prom.stdout + prom.stderr
    am = subprocess.run(
        [amtool, "check-config", "alertmanager.yml"], cwd=EXAMPLES, capture_output=True, text=True
    )
    assert am.returncode == 0, am.stdout + am.stderr
    # The file_sd targets file is what Prometheus will read: valid JSON, host:port targets.
    groups = json.loads((EXAMPLES / "targets" / "llm-supervisor.json").read_text())
    assert all(t.rsplit(":", 1)[1].isdigit() for g in groups for t in g["targets"])
