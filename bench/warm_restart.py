"""Cold start against restart of one real vLLM CPU engine, with vLLM's AOT compile cache on (its
default with torch >= 2.10) and off (``VLLM_USE_AOT_COMPILE=0``).

For each variant: a fresh compile cache dir (``VLLM_CACHE_ROOT``), the daemon starts the engine
(cold: nothing cached), then an operator restart (warm: the cache from the first start). Times
are from the daemon's own state changes (STARTING -> READY, from the status file's clock), so
they include vLLM's load, compile or cache load, KV-cache setup and the supervisor's canary.
Also counts vLLM's "Compiling model again due to a load failure" lines.

Run (minutes; under the heavy lock on a shared box):
    flock /tmp/llmsup-heavy.lock env PYTHONPATH=$PWD /work/main/.venv/bin/python bench/warm_restart.py
Writes bench/results/warm-restart-TIMESTAMP.json; docs/benchmarks.md has the results.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.lib.daemon import Daemon, free_port
from tests.lib.vllm_env import MODEL_CACHE, VLLM_VENV, build_model, vllm_engine

READY_TIMEOUT_S = 900.0


def wait_ready(d: Daemon, restarts: int) -> float:
    """Seconds from now until the engine is READY with ``restarts`` restarts (a wall clock: this
    is a benchmark, not a test)."""
    started = time.monotonic()
    d.wait_state("e", "ready", timeout_s=READY_TIMEOUT_S, restarts=restarts)
    return time.monotonic() - started


def variant(name: str, env: dict[str, str], model: Path, work: Path) -> dict[str, Any]:
    home = work / name / "home"
    home.mkdir(parents=True)
    cache = work / name / "compile-cache"
    entry = vllm_engine("e", free_port(), model, home)
    entry["env"] = {**entry["env"], "VLLM_CACHE_ROOT": str(cache), **env}
    d = Daemon(work / name, {"supervisor": {"tick_interval_s": 0.5}, "engines": [entry]})
    try:
        d.start()
        cold_s = wait_ready(d, 0)  # from the daemon's start
        t1 = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "llmsupervisor", "--config", str(d.config_path), "restart", "e"],
            check=True,
            capture_output=True,
        )
        wait_ready(d, 1)
        warm_s = time.monotonic() - t1  # drain (idle: the grace only), stop, start, canary
        log = d.log()
        assert d.stop() == 0
    finally:
        d.cleanup()
    return {
        "variant": name,
        "env": env,
        "cold_start_s": round(cold_s, 1),
        "restart_s": round(warm_s, 1),
        "aot_load_failures": log.count("Compiling model again due to a load failure"),
        "aot_loaded": log.count("Directly load AOT compilation"),
        "launcher": "serve" if "bin/vllm serve" in log else "module",
    }


def main() -> None:
    model = build_model(VLLM_VENV / "bin" / "python", "tiny")
    results = []
    with tempfile.TemporaryDirectory(prefix="warm-restart-") as tmp:
        for name, env in (("aot-default", {}), ("aot-off", {"VLLM_USE_AOT_COMPILE": "0"})):
            result = variant(name, env, model, Path(tmp))
            print(json.dumps(result), flush=True)
            results.append(result)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%S")
    out = Path(__file__).parent / "results" / f"warm-restart-{stamp}.json"
    out.write_text(json.dumps({"model_cache": str(MODEL_CACHE), "results": results}, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
