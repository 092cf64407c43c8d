"""bench/overhead --smoke runs end to end and writes a well-formed result (no timing is asserted:
the numbers belong to the machine, the shape belongs to the benchmark)."""

from __future__ import annotations

import json
import numbers
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lib.paths import REPO

BENCH = REPO / "bench" / "overhead"


@pytest.mark.system
def test_overhead_smoke_writes_a_well_formed_result(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--duration", "1", "--warmup", "0.5", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (result,) = tmp_path.glob("overhead-*-smoke.json")
    assert result.with_suffix(".md").read_text().startswith("| engines |")
    report = json.loads(result.read_text())
    assert report["benchmark"] == "overhead"
    assert report["settings"]["smoke"] is True
    assert report["machine"]["cpus"] >= 1
    assert [(r["engines"], r["body_scale"]) for r in report["runs"]] == [(1, 1), (8, 1)]
    for run in report["runs"]:
        assert run["engines_not_ready_at_end"] == []
        assert run["daemon_exit_code"] == 0
        for key in ("cpu_percent_of_one_core", "cpu_seconds", "rss_bytes", "rss_max_bytes", "uss_bytes"):
            assert isinstance(run[key], numbers.Real) and run[key] >= 0, key
        assert run["rss_bytes"] > 0 and run["body_bytes"] > 40_000  # the real capture, not the built-in body
        assert run["engine_tick"]["rounds"] >= 0
        assert run["samples"] and all(len(s) == 4 for s in run["samples"])
    assert set(report["targets"]) == {
        "cpu_at_8_under_1_percent",  # issue 16's
        "cpu_at_8_at_most_half_percent",  # issue 25's
        "rss_at_8_under_60_MB",
    }
    for run in report["runs"]:  # the daemon's CPU by thread, and the fakes' beside it
        for key in ("cpu_main_thread_percent_of_one_core", "cpu_other_threads_percent_of_one_core"):
            assert isinstance(run[key], numbers.Real) and run[key] >= 0, key
        assert run["fake_engines_cpu_percent_of_one_core"] >= 0
    assert "| 8 | 1x" in done.stdout
