"""A restart of one real vLLM CPU engine while another serves load: with ``cpus: auto`` (one
core each) and without ``cpus`` (vLLM's own OpenMP binding, the same cores for every engine).

The motivating incident: without placement every engine of the CPU build binds its OpenMP
threads by vLLM's rule (``VLLM_CPU_OMP_THREADS_BIND=auto``: on 2 cores, one reserved, the
threads on core 0), and with two engines under load a restarting engine starved on the busy
core and failed its start after ten minutes.

One daemon per variant over two engines of the tiny model (tests/lib/tiny_model.py), e1 and e2,
started with ``vllm serve``, warm compile caches (the tests' own, under
~/.cache/llm-supervisor). For each run of a variant:

    idle     the operator restart of e2 (``llm-supervisor restart e2 --wait``), nothing else
             running: the request to READY (the daemon's canary included), wall clock
    loaded   the same while e1 serves ``--clients`` concurrent streaming completions, started
             ``--warmup-s`` before the request and kept going until e2 is READY

A start gets ``--deadline-s`` (the engine's ``start_timeout_s`` too); a start that fails or runs
past it is recorded as a failure, not waited on. Also recorded: ``Cpus_allowed_list`` of every
process of both engines (and the distinct lists of their threads, which is where vLLM's own
binding shows), per-core CPU use and the load average over each restart, and e1's streamed
tokens per second before and during the loaded restart.

Run (minutes; under the heavy lock on a shared box, nothing else heavy meanwhile):
    flock /tmp/llmsup-heavy.lock env PYTHONPATH=$PWD /work/main/.venv/bin/python bench/placement_restart.py
Writes bench/results/placement-restart-<date>.{json,md} after every measurement;
docs/benchmarks.md ("CPU placement under load") has the results.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from llmsupervisor import process  # noqa: E402
from tests.lib.daemon import Daemon, free_port  # noqa: E402
from tests.lib.vllm_env import VLLM_VENV, build_model, vllm_engine  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VARIANTS: dict[str, dict[str, Any]] = {
    "auto": {"cpus": "auto"},  # disjoint: one core each on the 2-core box
    "none": {},  # no placement: vLLM's own binding (the old behaviour)
}


class Load:
    """``clients`` threads streaming completions from one engine back to back until closed;
    counts the streamed tokens (one SSE event each) and the failed requests."""

    def __init__(self, port: int, clients: int) -> None:
        self.port, self.stop = port, threading.Event()
        self.tokens = [0] * clients  # one slot per thread: no lock needed
        self.failed = 0
        self.threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _stream(self, slot: int) -> None:
        body = {"model": "tiny", "prompt": "keep busy", "max_tokens": 128, "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            try:
                with httpx.stream(
                    "POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=120
                ) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            self.tokens[slot] += 1
                        if self.stop.is_set():
                            return
            except httpx.HTTPError:
                self.failed += 1
                self.stop.wait(0.5)

    def streamed(self) -> int:
        return sum(self.tokens)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=130)


def _allowed(status: Path) -> str | None:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _role(pid: int) -> str:
    try:
        title = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return "?"
    if not title:
        return "(no command line: exiting)"
    if title.startswith("VLLM::"):
        return title.split()[0]
    if "resource_tracker" in title:
        return "resource tracker"  # multiprocessing's, started by the API server
    return "api server" if " serve " in title else title[:60]


def affinity(d: Daemon, name: str) -> list[dict[str, Any]]:
    """Every process of the engine: its role, its ``Cpus_allowed_list`` (the main thread's) and
    how many of its threads have each distinct list (vLLM binds its OpenMP threads one by one)."""
    pid = d.engine(name).get("pid")
    if pid is None:
        return []
    rows = []
    for member in sorted(process.group_members(pid)):
        threads: collections.Counter[str] = collections.Counter()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{member}/task").iterdir():
                allowed = _allowed(task / "status")
                if allowed is not None:
                    threads[allowed] += 1
        rows.append(
            {
                "pid": member,
                "role": _role(member),
                "cpus_allowed_list": _allowed(Path(f"/proc/{member}/status")),
                "threads": dict(sorted(threads.items())),
            }
        )
    return rows


def restart(d: Daemon, name: str, deadline_s: float) -> dict[str, Any]:
    """The operator restart through the CLI, timed from the request to READY (or failure)."""
    restarts = d.engine(name).get("restarts")
    argv = [sys.executable, "-m", "llmsupervisor", "--config", str(d.config_path), "restart", name]
    argv += ["--wait", "--timeout", str(deadline_s + 60)]
    psutil.cpu_percent(percpu=True)  # starts the per-core window
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=deadline_s + 120)
        rc, said = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        rc, said = None, ["the CLI did not return"]
    took_s = time.monotonic() - started
    engine = d.engine(name)
    ok = rc == 0 and engine.get("state") == "ready"
    return {
        "ok": ok,
        "restart_s": round(took_s, 1),
        "cli_rc": rc,
        "cli_said": said[0] if said else "",
        "state_after": engine.get("state"),
        "reason_after": engine.get("reason"),
        "restarts": [restarts, engine.get("restarts")],
        "core_busy_pct": psutil.cpu_percent(percpu=True),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def one_run(d: Daemon, ports: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    time.sleep(args.settle_s)  # the last start's compile and warmup are over
    idle = restart(d, "e2", args.deadline_s)
    print(f"  idle restart: {idle['restart_s']} s ok={idle['ok']}", flush=True)
    run: dict[str, Any] = {"idle": idle}
    if not idle["ok"]:
        return run
    time.sleep(args.settle_s)
    load = Load(ports["e1"], args.clients)
    try:
        time.sleep(args.warmup_s)
        t0, n0 = time.monotonic(), load.streamed()
        time.sleep(5)
        before_tps = (load.streamed() - n0) / (time.monotonic() - t0)
        e1_under_load = affinity(d, "e1")
        failed0, t1, n1 = load.failed, time.monotonic(), load.streamed()
        loaded = restart(d, "e2", args.deadline_s)
        loaded["e1_tokens_per_s_before"] = round(before_tps, 1)
        loaded["e1_tokens_per_s_during"] = round((load.streamed() - n1) / (time.monotonic() - t1), 1)
        loaded["e1_client_errors_during"] = load.failed - failed0
        loaded["e1_affinity_under_load"] = e1_under_load
    finally:
        load.close()
    print(
        f"  loaded restart: {loaded['restart_s']} s ok={loaded['ok']} "
        f"(e1 {loaded['e1_tokens_per_s_before']} -> {loaded['e1_tokens_per_s_during']} tok/s)",
        flush=True,
    )
    run["loaded"] = loaded
    return run


def variant(
    result: dict[str, Any], model: Path, work: Path, args: argparse.Namespace, save: Callable[[], None]
) -> None:
    """One daemon over e1 and e2 with the variant's fields; fills ``result`` as it goes."""
    name, fields = result["variant"], result["fields"]
    home = work / name / "home"
    home.mkdir(parents=True)
    ports = {e: free_port() for e in ("e1", "e2")}
    engines = []
    for e, port in ports.items():
        # Same engine names as the tests: their warm compile caches.
        entry = vllm_engine(e, port, model, home, **fields)
        entry["start_timeout_s"] = args.deadline_s
        entry["max_failures"] = 100  # a failed start is a result here, never FATAL
        engines.append(entry)
    config = {"supervisor": {"tick_interval_s": 1.0, "shutdown_timeout_s": 120}, "engines": engines}
    d = Daemon(work / name, config)
    try:
        started = time.monotonic()
        d.start()
        first: dict[str, Any] = {}
        for e in ports:
            try:
                d.wait_state(e, "ready", timeout_s=args.deadline_s - (time.monotonic() - started))
                first[e] = round(time.monotonic() - started, 1)
            except AssertionError as exc:
                first[e] = None
                result["error"] = str(exc)[-3000:]
        result["first_start_s"] = first  # both engines at once, from the daemon's start
        print(f"{name}: first start {first}", flush=True)
        save()
        if "error" in result:
            return
        result["affinity"] = {e: affinity(d, e) for e in ports}
        result["placed"] = {e: d.engine(e).get("cpus") for e in ports}
        for i in range(args.runs):
            run = one_run(d, ports, args)
            run["e2_affinity_after"] = affinity(d, "e2")
            result["runs"].append(run)
            save()
            if not run["idle"]["ok"] or not run.get("loaded", {}).get("ok", False):
                break  # a failed start: the engine is in BACKOFF, later runs would not compare
            print(f"{name}: run {i + 1} done", flush=True)
        with contextlib.suppress(AssertionError):
            result["daemon_exit"] = d.stop()
    finally:
        # vLLM's own account of its binding, and the daemon's placement (the log goes with tmp).
        lines = d.log().splitlines()
        keep = ("OMP_THREADS_BIND=", "core ids=", "reserved_cpus=", "CPU placement", "spawned pid", "backoff")
        result["log_lines"] = [x[-300:] for x in lines if any(k in x for k in keep)][-40:]
        d.cleanup()


def _cpus_text(rows: Sequence[dict[str, Any]]) -> str:
    parts = []
    for r in rows:
        threads = "/".join(r["threads"])
        parts.append(f"{r['role']} {r['cpus_allowed_list']}" + (f" (threads {threads})" if threads else ""))
    return "; ".join(parts)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| variant | run | e2 restart, host idle | e2 restart, e1 under load | e1 tokens/s before → during "
        "| busy % per core during the loaded restart | load avg (1 min) at its end |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in report["variants"]:
        for i, run in enumerate(v["runs"], 1):
            idle, loaded = run["idle"], run.get("loaded")

            def cell(m: dict[str, Any] | None) -> str:
                if m is None:
                    return "not run"
                return (
                    f"{m['restart_s']} s"
                    if m["ok"]
                    else f"**failed** after {m['restart_s']} s ({m['cli_said']})"
                )

            tps = (
                f"{loaded['e1_tokens_per_s_before']} → {loaded['e1_tokens_per_s_during']}"
                if loaded is not None
                else ""
            )
            busy = ", ".join(f"{x:.0f}" for x in loaded["core_busy_pct"]) if loaded else ""
            la = loaded["loadavg_1m"][1] if loaded else ""
            lines.append(f"| {v['variant']} | {i} | {cell(idle)} | {cell(loaded)} | {tps} | {busy} | {la} |")
    lines += ["", "First start (both engines at once, from the daemon's start to READY):", ""]
    for v in report["variants"]:
        lines.append(
            f"* {v['variant']}: {v.get('first_start_s')}"
            + (f" ERROR {v['error'][:300]}" if "error" in v else "")
        )
    lines += ["", "Cpus_allowed_list per process (and the distinct lists of its threads):", ""]
    for v in report["variants"]:
        for e, rows in v.get("affinity", {}).items():
            lines.append(f"* {v['variant']} {e} (placed: {v.get('placed', {}).get(e)}): {_cpus_text(rows)}")
        for i, run in enumerate(v["runs"], 1):
            loaded = run.get("loaded")
            if loaded is not None:
                under = _cpus_text(loaded["e1_affinity_under_load"])
                lines.append(f"* {v['variant']} e1 under load (run {i}): {under}")
            lines.append(f"* {v['variant']} e2 after run {i}: {_cpus_text(run.get('e2_affinity_after', []))}")
    lines += [
        "",
        f"{report['date']}, commit {report['git_commit'][:10]}, {report['cpus']} CPUs, "
        f"{report['clients']} streaming clients on e1",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/placement_restart.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="auto,none")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=900.0, help="a start's deadline (then: failed)")
    p.add_argument("--settle-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=10.0, help="load on e1 before the restart request")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not (VLLM_VENV / ".llmsup-complete").exists():
        print(f"vLLM CPU venv missing at {VLLM_VENV}: run scripts/setup-vllm-cpu", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(143)  # run the finally blocks: no engine left behind

    signal.signal(signal.SIGTERM, on_term)
    model = build_model(VLLM_VENV / "bin" / "python", "tiny")
    started = dt.datetime.now()
    stem = args.out / f"placement-restart-{started.strftime('%Y-%m-%dT%H%M%S')}"
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "git_commit": commit.strip(),
        "cpus": os.cpu_count(),
        "clients": args.clients,
        "deadline_s": args.deadline_s,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "variants": [],
    }

    def save() -> None:  # after every measurement: a run cut short keeps what it measured
        report["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="placement-restart-") as tmp:
        for name in args.variants.split(","):
            print(f"{name}: starting", flush=True)
            result: dict[str, Any] = {"variant": name, "fields": VARIANTS[name], "runs": []}
            report["variants"].append(result)
            variant(result, model, Path(tmp), args, save)
            save()
    print(markdown(report))
    print(stem.with_suffix(".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
