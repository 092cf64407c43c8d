"""``llm-supervisor gpu``: resetting a GPU (docs/gpu.md, "Resetting one GPU").

``gpu release N`` and ``gpu take-back N`` reset one GPU while the daemon and the other engines run
(daemon/gpu_release.py): the release stops the GPU's engines (drained, held as by `stop`) and
closes NVML, then prints the `nvidia-smi -r` to run; the take-back opens NVML again, checks the
GPU, clears its condition if the reset cleared what it was set for, and starts its engines. Each
waits for the daemon to get there (each step has the daemon's own deadline) and exits 0 when it
did, 1 when it failed (why on stderr).

``gpu clear UUID...`` drops a GPU's node condition after a reset with the daemon stopped: it
takes the state dir's lock, so it cannot race a running daemon's own writes to the marks file.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, TextIO

from llmsupervisor.cli import render
from llmsupervisor.cli.client import (
    EX_FAILED,
    EX_INTERRUPTED,
    EX_OK,
    Client,
    Refused,
    Unreachable,
    unreachable,
)
from llmsupervisor.config import load_config
from llmsupervisor.daemon import lock
from llmsupervisor.daemon.actions import GpuMarks
from llmsupervisor.errors import EX_ALREADY_RUNNING, EX_CONFIG, AlreadyRunning, ConfigError

MARKS_FILE = "gpu-faults.json"
POLL_S: Final = 0.5
# The phases a command waits through: a release waits until NVML is closed (or it failed), a
# take-back until the GPU was judged (daemon/gpu_release.py Phase).
RELEASE_PENDING: Final = frozenset({"stopping"})
TAKE_BACK_PENDING: Final = frozenset({"stopping", "released", "taking_back"})


def gpu_command(
    client: Client,
    command: str,
    gpu: int,
    *,
    window_s: float | None = None,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """`gpu release N` (``command`` "release") or `gpu take-back N` ("take-back"): ask, then
    follow the release in `status` until it is where the command leads."""
    payload: dict[str, Any] = {
        "command": "gpu_release" if command == "release" else "gpu_take_back",
        "gpu": gpu,
    }
    if window_s is not None:
        payload["window_s"] = window_s
    pending = RELEASE_PENDING if command == "release" else TAKE_BACK_PENDING
    try:
        reply = client.call(payload)
        release = reply.get("release") or {}
        if not as_json:
            print(accepted_line(command, release), file=out, flush=True)
        shown = release.get("outcome")
        while release.get("phase") in pending:
            sleep(POLL_S)
            found = client.call({"command": "status"}).get("gpu_release") or {}
            if found.get("id") != release.get("id"):
                print(f"llm-supervisor: GPU {gpu}'s release is gone from the daemon", file=err)
                return EX_FAILED
            release = found
            if not as_json and release.get("phase") in pending and release.get("outcome") != shown:
                shown = release.get("outcome")
                print(f"GPU {gpu}: {shown}", file=out, flush=True)
    except Refused as exc:  # not taken, with why (one GPU at a time, not released, ...)
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except KeyboardInterrupt:
        print(f"llm-supervisor: stopped waiting; the {command} goes on (`llm-supervisor status`)", file=err)
        return EX_INTERRUPTED
    if as_json:
        print(json.dumps(release, indent=2), file=out)
    ok = release.get("phase") == ("released" if command == "release" else "done")
    if not as_json:
        if ok:
            print("\n".join(render.gpu_release_done(release)), file=out)
        else:
            print(f"llm-supervisor: GPU {gpu}: {release.get('outcome')}", file=err)
    return EX_OK if ok else EX_FAILED


def accepted_line(command: str, release: Mapping[str, Any]) -> str:
    """``GPU 1 (GPU-...): release accepted; stopping gpu1, then closing NVML``."""
    what = "release" if command == "release" else "take-back"
    return f"GPU {release.get('gpu')} ({release.get('uuid')}): {what} accepted; {release.get('outcome')}"


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
            f"llm-supervisor: the daemon ({who}) runs on {state_dir}: reset the GPU with it running"
            " (`llm-supervisor gpu release N`, the reset, `llm-supervisor gpu take-back N`, which clears"
            " the condition), or stop it, reset the GPU, then clear the condition and start it (docs/gpu.md)",
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
