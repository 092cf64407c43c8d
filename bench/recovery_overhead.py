"""Recovery overhead: from the policy's decision to READY again, minus the engine's own start.

Runs the real daemon over a fake engine (tests/lib/fake_vllm.py, a real process serving real HTTP)
that takes a fixed time to start, and makes it recover N times each way:

    hang       /fake/hang -> the hang finding -> restart without drain (quick stop ladder)
    operator   `llm-supervisor restart` with drain_grace_s 0 and nothing in flight

For each recovery, from the daemon's own log (millisecond timestamps):

    total      decision (the "action restart" line, or the operator line) -> "STARTING -> READY"
    engine     "spawned pid" -> the engine's "Application startup complete" line (its own start)
    overhead   total - engine: stopping the old incarnation, spawning, readiness polling and the
               canary. The target is under 1 s.

    .venv/bin/python bench/recovery_overhead.py [--runs 5]   # prints the table in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.lib.daemon import Daemon, fake_engine, free_port  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
STARTUP_DELAY_S = 2.0


def _when(line: str) -> float:
    match = STAMP.match(line)
    assert match, line
    return dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _first_after(lines: list[str], start: int, needle: str) -> int:
    for i in range(start, len(lines)):
        if needle in lines[i]:
            return i
    raise AssertionError(f"{needle!r} not found after line {start}")


def measure(lines: list[str], decision: str) -> list[tuple[float, float]]:
    """(total, engine) per recovery whose decision line contains ``decision``."""
    out = []
    for i, line in enumerate(lines):
        if decision not in line:
            continue
        spawned = _first_after(lines, i, "spawned pid")
        started = _first_after(lines, spawned, "Application startup complete")
        ready = _first_after(lines, spawned, "STARTING -> READY")
        out.append((_when(lines[ready]) - _when(line), _when(lines[started]) - _when(lines[spawned])))
    return out


def run(runs: int, keep_log: Path | None = None) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        engine = fake_engine(
            "gpu0",
            port,
            fake_startup_delay_s=STARTUP_DELAY_S,
            drain_grace_s=0,
            live_canary_timeout_s=0.5,
            action_cooldown_s=0,
            max_actions_per_hour=1000,
            max_failures=1000,
            detectors={"hang_idle_after_s": 2},
        )
        d = Daemon(Path(tmp), {"supervisor": {"tick_interval_s": 0.5}, "engines": [engine]})
        d.start()
        try:
            for _ in range(runs):
                before = d.wait_state("gpu0", "ready", timeout_s=60)
                httpx.post(f"http://127.0.0.1:{port}/fake/hang", timeout=5)
                d.wait_state("gpu0", "ready", timeout_s=60, restarts=before["restarts"] + 1)
            for _ in range(runs):
                before = d.wait_state("gpu0", "ready", timeout_s=60)
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "llmsupervisor",
                        "--config",
                        str(d.config_path),
                        "restart",
                        "gpu0",
                    ],
                    check=True,
                    capture_output=True,
                )
                d.wait_state("gpu0", "ready", timeout_s=60, restarts=before["restarts"] + 1)
            lines = d.log().splitlines()
            if keep_log is not None:
                keep_log.write_text(d.log())
            results["hang (no drain)"] = measure(lines, "action restart (hang)")
            results["operator restart (drain_grace_s 0, idle)"] = measure(lines, "operator: restart")
        finally:
            d.stop()
            d.cleanup()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep-log", type=Path, help="write the daemon's log here")
    args = parser.parse_args()
    results = run(args.runs, args.keep_log)
    print(
        "| Recovery | runs | decision → READY (median) | engine's own start (median) "
        "| overhead median | overhead max |"
    )
    print("|---|---|---|---|---|---|")
    for name, pairs in results.items():
        totals = [t for t, _ in pairs]
        engines = [e for _, e in pairs]
        overheads = [t - e for t, e in pairs]
        print(
            f"| {name} | {len(pairs)} | {statistics.median(totals):.2f} s "
            f"| {statistics.median(engines):.2f} s "
            f"| {statistics.median(overheads):.2f} s | {max(overheads):.2f} s |"
        )


if __name__ == "__main__":
    main()
