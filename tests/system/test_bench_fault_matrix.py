"""bench/fault-matrix --smoke runs end to end under all three supervisors and writes a
well-formed result. No timing is asserted (the numbers belong to the machine); what is asserted
is what each supervisor can or cannot see at all, which does not depend on the machine: only
llm-supervisor notices a hang or an XID, and systemd's Restart=on-failure leaves an engine that
exited 0 down."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.lib.paths import REPO

BENCH = REPO / "bench" / "fault-matrix"

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(os.geteuid() != 0, reason="the systemd column needs root (unshare -m)"),
    pytest.mark.skipif(
        not Path("/lib/systemd/systemd").exists() or shutil.which("unshare") is None,
        reason="systemd or unshare missing",
    ),
]


def test_fault_matrix_smoke_writes_a_well_formed_result(tmp_path: Path) -> None:
    if shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists():
        if os.environ.get("LLMSUP_REQUIRE_TOOLS") == "1":
            pytest.fail("haproxy not installed")
        pytest.skip("haproxy not installed")
    done = subprocess.run(
        [str(BENCH), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = tmp_path.glob("fault-matrix-*-smoke.json")
    report = json.loads(result.read_text())
    assert report["errors"] == [], report["errors"]
    assert report["settings"]["smoke"] is True
    rows = {(r["supervisor"], r["fault"]): r for r in report["rows"]}
    supervisors = ("systemd", "supervisord", "llm-supervisor")
    faults = ("api_crash", "exit_zero", "hang", "nvml_xid")
    assert set(rows) == {(s, f) for s in supervisors for f in faults}
    for row in rows.values():
        assert row["engine"] == "fake"
        assert row["requests"] > 0 and 0 <= row["failed"] <= row["requests"]
        assert isinstance(row["leftover_processes"], list)
    # What each can see at all.
    for fault in faults:
        assert rows[("llm-supervisor", fault)]["detected"] is True, rows[("llm-supervisor", fault)]
    for baseline in ("systemd", "supervisord"):
        assert rows[(baseline, "api_crash")]["detected"] is True
        assert rows[(baseline, "hang")]["detected"] is False
        assert rows[(baseline, "nvml_xid")]["detected"] is False
    assert rows[("systemd", "exit_zero")]["detected"] is False  # Restart=on-failure: exit 0 is success
    assert rows[("supervisord", "exit_zero")]["detected"] is True  # autorestart=true
    # llm-supervisor leaves nothing behind where it restarted.
    assert all(not rows[("llm-supervisor", f)]["leftover_processes"] for f in faults)
    table = result.with_suffix(".md").read_text()
    assert table.startswith("| fault (engine) | systemd | supervisord | llm-supervisor |")
