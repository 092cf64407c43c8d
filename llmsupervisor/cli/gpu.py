"""``llm-supervisor gpu clear UUID...``: drop a GPU's node condition after the operator reset the
GPU without a reboot (docs/gpu.md, docs/fleet.md).

Run with the daemon stopped, which is also when the GPU can be reset (NVML holds every GPU open
while the daemon runs, and ``nvidia-smi -r`` wants the GPU idle): the command takes the state
dir's lock, so it cannot race a running daemon's own writes to the marks file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmsupervisor.config import load_config
from llmsupervisor.daemon import lock
from llmsupervisor.daemon.actions import GpuMarks
from llmsupervisor.errors import EX_ALREADY_RUNNING, EX_CONFIG, AlreadyRunning, ConfigError

MARKS_FILE = "gpu-faults.json"


def gpu_clear(config_path: Path, uuids: list[str]) -> int:
    """Exit 0: every UUID's condition cleared; 1: some UUID had none on this boot; 75: the
    daemon runs on the state dir; 78: a bad config."""
    try:
        config = load_config(config_path, check_paths=False)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EX_CONFIG
    state_dir = config.supervisor.state_dir.resolve()
    try:
        held = lock.acquire(state_dir)
    except AlreadyRunning as exc:
        who = f"pid {exc.pid}" if exc.pid is not None else "pid unknown"
        print(
            f"llm-supervisor: the daemon ({who}) runs on {state_dir}: stop it, reset the GPU, then clear"
            " the condition and start the daemon (docs/gpu.md)",
            file=sys.stderr,
        )
        return EX_ALREADY_RUNNING
    except OSError as exc:
        print(f"llm-supervisor: {exc.strerror}", file=sys.stderr)
        return 1
    code = 0
    with held:
        marks = GpuMarks(state_dir / MARKS_FILE)
        conditions = marks.held_uuids()
        by_lower = {u.lower(): u for u in conditions}
        for given in uuids:
            uuid = by_lower.get(given.lower())
            if uuid is not None and marks.clear(uuid):
                print(f"{uuid}: condition cleared (was: {conditions[uuid]}); its marks stay for 24 h")
                continue
            code = 1
            listed = ", ".join(sorted(conditions)) or "none"
            print(f"{given}: no GPU condition on this boot (held: {listed})", file=sys.stderr)
    if code == 0:
        print("start the daemon: the engines on the GPU start with it")
    return code
