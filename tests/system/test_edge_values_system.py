"""The real daemon over fake engines configured at the extremes check-config accepts (issue 28 #3:
``detectors: {degradation_baseline_s: 0}`` passed check-config, then every engine task crashed,
was replaced 4 times and ended FATAL). The unit tiers run every extreme of every field through
the runtime objects (tests/unit/detectors/test_detectors.py, tests/unit/config/test_edge_values.py); this runs
a few whole configs: every detector setting at its lowest, every one at its highest."""

from __future__ import annotations

import math
import time
from dataclasses import fields
from typing import Any

import pytest

from llmsupervisor.detectors import DetectorConfig, FindingKind
from tests.lib.daemon import fake_engine, free_port

pytestmark = pytest.mark.system


def detectors_at(end: int) -> dict[str, Any]:
    """Every DetectorConfig setting at its lowest (end=0) or its highest (end=-1) accepted value."""
    out: dict[str, Any] = {}
    for f in fields(DetectorConfig):
        b = DetectorConfig.bounds(f.name)
        lo, hi = b["lo"], b["hi"] if b["hi"] is not None else 1e12
        if b["integer"]:
            value: Any = [lo + 1 if b["lo_open"] else lo, int(hi) - 1 if b["hi_open"] else int(hi)][end]
        else:
            low = math.nextafter(float(lo), math.inf) if b["lo_open"] else float(lo)
            value = [low, math.nextafter(float(hi), -math.inf) if b["hi_open"] else float(hi)][end]
        if f.name in ("sustain_s", "clear_s"):
            value = {k.value: value for k in FindingKind}
        elif f.name.startswith("xid_"):
            value = [value]
        out[f.name] = value
    out["hang_cpu_max_span_s"] = max(out["hang_cpu_max_span_s"], out["hang_cpu_min_span_s"])
    return out


def test_engines_at_the_extremes_run(daemon_factory: Any) -> None:
    low, high = free_port(), free_port()
    d = daemon_factory(
        {
            "engines": [
                fake_engine("low", low, detectors=detectors_at(0), metrics_interval_s=0, action_cooldown_s=0),
                fake_engine(
                    "high",
                    high,
                    detectors=detectors_at(-1),
                    failure_window_s=1e12,
                    stable_after_s=1e12,
                    canary_interval_s=1e12,
                    metrics_interval_s=1e12,
                    max_actions_per_hour=10**12,
                    ladder_calm_s=1e12,
                    restart_every_h=1e12,
                    restart_jitter_s=1e12,
                    repair_verify_s=1e12,
                ),
            ]
        }
    )
    d.start()
    d.wait_state("low", "ready")
    d.wait_state("high", "ready")
    time.sleep(3.0)  # ten ticks of every detector over both windows (no timing is asserted)
    log = d.log()
    assert "Traceback" not in log, log[-3000:]
    assert "must be positive" not in log
    for name in ("low", "high"):
        engine = d.engine(name)
        assert engine["state"] != "fatal", engine
    assert d.engine("high")["restarts"] == 0
    assert d.stop() == 0
