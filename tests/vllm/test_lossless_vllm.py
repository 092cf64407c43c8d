"""No request lost on a crash or a hang, behind the balancers people use (issue 27).

Two real vLLM CPU engines, supervised by the real daemon, behind (1) Debian's HAProxy with the
lossless recipe of docs/load-balancers.md (L7 retries on a connection failure, an empty
response, a response timeout and 503, ``option redispatch``, the daemon's agent-check every
250 ms) and (2) the vLLM project's router (``vllm-router``), whose workers the daemon's view
reaches through the ``router-sync`` sidecar. Mixed load from the ``openai`` client (half the
workers stream, half do not; ``max_retries=0``, so the client hides nothing), then one fault per
test on an engine serving it:

- a SIGKILL of the engine's API server (the crash path);
- a real hang of its EngineCore under load, injected as users meet them (issue 25's injector,
  tests/lib/hang_injection/sitecustomize.py; the API server still answers /health): a deadlock
  (every thread blocked on the GIL, 0 % CPU: the ``frozen`` rule) and a spin (a thread holding
  the GIL at 100 % CPU, no step: the ``spinning`` rule). Behind HAProxy both, behind the router
  the deadlock.

Each request is classed by what the client got: ``ok`` (every token asked for), ``failed``
(no answer, or an error status: it had received no byte of an answer), ``cut`` (a stream that
had its response and then broke: under way on the failed engine; ``cut_before_token``: it had
the 200 and its headers, no token yet). The claims: ``failed`` is 0 and every non-streamed
request succeeds (a request without a byte is retried elsewhere: by HAProxy's ``redispatch``;
by the router because one failure opens the worker's breaker, ``--cb-failure-threshold 1``,
since its retries re-pick by round robin, docs/notes-router-retries.md), and the cut streams are at
most what the balancer had in flight on the failed engine between the fault and its removal
(HAProxy: its sessions there, from its stats socket; the router, which cannot say: every
streaming client). The numbers go to docs/load-balancers.md; each test prints its own, with
the slowest first byte: for a hang, how long a request held by the hung engine waited before the
balancer resent it, which is the daemon's time to find the hang and cut the API server (the
stacks come after the cut: engine/evidence.py).

The engines are shared by the module's tests (each fault ends with the engine READY again), so
the whole module starts two engines once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lib.daemon import Daemon, free_port, wait_for
from tests.lib.hangs import hang_env, inject, rule_of
from tests.lib.haproxy import haproxy, stat
from tests.lib.vllm_env import API_KEY, READY_TIMEOUT_S, build_model, vllm_engine, vllm_python

pytestmark = pytest.mark.vllm_cpu

openai = pytest.importorskip("openai")

MAX_TOKENS = 32
CLIENTS = 6
STREAM_CLIENTS = CLIENTS // 2  # every other client streams
ENGINES = ("e1", "e2")

# The recipe (docs/load-balancers.md, "Lossless on a crash or a hang"), ports filled in.
HAPROXY_CFG = """\
global
    maxconn 256
    stats socket {stats_socket} level admin
    log stdout format raw local0 info   # the test's: every request not answered normally
defaults
    mode http
    log global
    option httplog
    option dontlog-normal
    timeout connect 1s
    timeout client 300s
    # Longer than the longest non-streamed answer: a hung engine is bounded by the daemon (the
    # agent drains it at the first missed canary, the kill closes what it held), not by this.
    timeout server 300s
    timeout check 2s
    # L7 retries: a request that has received no byte of an answer is sent again, to another
    # server (redispatch), when its connection fails, is closed without an answer (a killed
    # engine), times out, or gets 503 or 500 (vLLM 0.32 answers EngineDeadError with 500).
    retries 3
    option redispatch 1
    # The whole request in HAProxy's buffer before a server is picked, so that every retry can
    # resend all of it (a completion request is a few kB; tune.bufsize is 16 kB).
    option http-buffer-request
    retry-on conn-failure empty-response response-timeout 500 503
frontend llm
    bind 127.0.0.1:{frontend_port}
    default_backend engines
backend engines
    balance leastconn
    option httpchk
    http-check send meth GET uri-lf /engines/%[srv_name]/ready
    default-server check addr 127.0.0.1 port {supervisor_port} inter 1s fall 2 rise 2
    default-server agent-check agent-addr 127.0.0.1 agent-inter 250ms
    server e1 127.0.0.1:{e1_port} agent-port {e1_agent}
    server e2 127.0.0.1:{e2_port} agent-port {e2_agent}
"""


@dataclass
class Outcomes:
    counts: Counter[str] = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)  # time to the first byte of an answer

    def add(self, outcome: str, detail: str = "", wait_s: float | None = None) -> None:
        self.counts[outcome] += 1
        if outcome != "ok":
            line = f"{time.strftime('%H:%M:%S')} {outcome} {detail[:160]}"
            # Failures first: they are what a failed assertion must show.
            if outcome.startswith("cut"):
                self.details.append(line)
            else:
                self.details.insert(0, line)
        if wait_s is not None:
            self.waits_s.append(wait_s)


class MixedLoad:
    """Workers sending completions through the balancer until stopped: half stream."""

    def __init__(self, base_url: str, workers: int = CLIENTS) -> None:
        self.base_url = base_url
        self.out = Outcomes()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i % 2 == 0,), daemon=True) for i in range(workers)
        ]

    def _one(self, client: Any, stream: bool) -> tuple[str, str, float | None]:
        sent = time.monotonic()
        args: dict[str, Any] = {
            "model": "tiny",
            "prompt": "lossless",
            "max_tokens": MAX_TOKENS,
            "extra_body": {"ignore_eos": True},
        }
        try:
            if not stream:
                resp = client.completions.create(**args)
                answered_s = time.monotonic() - sent
                choice = resp.choices[0]
                used = resp.usage.completion_tokens if resp.usage else None
                if choice.finish_reason != "length" or used != MAX_TOKENS:
                    return "truncated", f"{choice.finish_reason} {used}", answered_s
                return "ok", "", answered_s
            chunks = client.completions.create(stream=True, stream_options={"include_usage": True}, **args)
        except openai.APIStatusError as exc:
            return "failed", f"HTTP {exc.status_code} {str(exc)[:100]}", None
        except openai.APIError as exc:
            return "failed", f"{type(exc).__name__} {exc}", None
        wait_s: float | None = None
        text, finish, tokens = "", None, None
        try:
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].text:
                    text += chunk.choices[0].text
                    if wait_s is None:
                        wait_s = time.monotonic() - sent
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:  # the last chunk, with stream_options.include_usage
                    tokens = chunk.usage.completion_tokens
        except Exception as exc:  # a stream that broke, whatever the client raised for it
            return ("cut" if text else "cut_before_token"), f"{type(exc).__name__} {exc}", wait_s
        if finish != "length" or tokens != MAX_TOKENS:
            return ("cut" if text else "cut_before_token"), f"ended {finish} after {tokens} tokens", wait_s
        return "ok", "", wait_s

    def _run(self, stream: bool) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0, timeout=300)
        while not self._stop.is_set():
            outcome, detail, wait_s = self._one(client, stream)
            with self._lock:
                self.out.add(
                    f"{outcome}{'' if outcome == 'ok' else '/stream' if stream else '/plain'}", detail, wait_s
                )

    def ok(self) -> int:
        with self._lock:
            return self.out.counts["ok"]

    def start(self) -> MixedLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> Outcomes:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=320)
        return self.out


class Sampler:
    """The most sessions a balancer had open on one engine while a fault was being handled."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.most = max(self.most, self._read())
            time.sleep(0.05)

    def __enter__(self) -> Sampler:
        self.most = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    python = vllm_python()
    haproxy_bin = haproxy()
    router_bin = Path(sys.executable).parent / "vllm-router"
    model = build_model(python, "tiny")
    tmp = tmp_path_factory.mktemp("lossless")
    home = tmp / "home"
    home.mkdir()
    ports = {n: free_port() for n in ("e1", "e2", "e1_agent", "e2_agent", "frontend", "supervisor", "router")}
    engines = []
    for name in ENGINES:
        engine = vllm_engine(name, ports[name], model, home, agent_port=ports[f"{name}_agent"])
        engine["args"] = {**engine["args"], "max-num-seqs": 8}
        engine.update({"drain_grace_s": 3.0, "drain_timeout_s": 60})
        # Every process of the engine loads the hang injector; a spin ends by itself after 60 s.
        engine["env"] = {**engine["env"], **hang_env(tmp / f"hang-{name}"), "LLMSUP_HANG_SPIN_S": "60"}
        engines.append(engine)
    config = {
        "supervisor": {
            "tick_interval_s": 0.5,
            "shutdown_timeout_s": 120,
            "http_listen": f"127.0.0.1:{ports['supervisor']}",
        },
        "engines": engines,
    }
    daemon = Daemon(tmp, config)
    cfg = tmp / "haproxy.cfg"
    stats_socket = tmp / "haproxy.sock"
    cfg.write_text(
        HAPROXY_CFG.format(
            stats_socket=stats_socket,
            frontend_port=ports["frontend"],
            supervisor_port=ports["supervisor"],
            **{f"{n}_port": ports[n] for n in ENGINES},
            **{f"{n}_agent": ports[f"{n}_agent"] for n in ENGINES},
        )
    )
    subprocess.run([haproxy_bin, "-c", "-f", str(cfg)], check=True, capture_output=True)
    daemon.start()
    procs: list[subprocess.Popen[bytes]] = []
    logs = tmp / "balancers.log"
    with open(logs, "ab") as log:
        procs.append(subprocess.Popen([haproxy_bin, "-f", str(cfg), "-db"], stdout=log, stderr=log))
        if router_bin.exists():
            # Starts with no worker: router-sync adds the engines as they turn READY.
            procs.append(
                subprocess.Popen(
                    [
                        str(router_bin),
                        "--port",
                        str(ports["router"]),
                        "--policy",
                        "round_robin",
                        "--health-check-interval-secs",
                        "1",
                        "--worker-startup-check-interval",
                        "1",
                        "--worker-startup-timeout-secs",
                        "10",
                        # A retry re-picks by round robin and may land on the worker that just
                        # failed; one failure opening that worker's breaker sends the next try to
                        # the other (docs/load-balancers.md, "The vLLM router").
                        "--cb-failure-threshold",
                        "1",
                        "--cb-timeout-duration-secs",
                        "1",
                        "--retry-max-retries",
                        "8",
                        "--retry-initial-backoff-ms",
                        "100",
                        "--retry-max-backoff-ms",
                        "500",
                        "--log-level",
                        "warning",
                    ],
                    stdout=log,
                    stderr=log,
                )
            )
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "llmsupervisor",
                        "router-sync",
                        "--daemon",
                        daemon.http_url,
                        "--router",
                        f"http://127.0.0.1:{ports['router']}",
                        "--interval",
                        "0.25",
                    ],
                    stdout=log,
                    stderr=log,
                )
            )
    try:
        yield {
            "daemon": daemon,
            "ports": ports,
            "stats": stats_socket,
            "router": router_bin.exists(),
            "logs": logs,
            "hangs": {name: tmp / f"hang-{name}" for name in ENGINES},
        }
    finally:
        for proc in reversed(procs):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        daemon.cleanup()


def both_serving(d: Daemon, url: str) -> None:
    for name in ENGINES:
        d.wait_state(name, "ready", timeout_s=READY_TIMEOUT_S)
    answered: list[int] = []

    def routed() -> bool:
        resp = httpx.post(
            url + "/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        answered.append(resp.status_code)
        return answered[-6:] == [200] * 6

    wait_for(routed, timeout_s=120, what="the balancer routing to the engines", poll_s=0.2)
    time.sleep(1.5)  # past `rise 2` x `inter 1s` for both servers


def haproxy_sessions(stats_socket: Path, server: str) -> int:
    return int(stat(stats_socket)[server]["scur"] or 0)


def router_sessions() -> int:
    """What the router may have had in flight on one worker: every streaming client. Neither
    side can say better from outside: the router exports no per-worker load for round_robin
    (``/get_loads`` answers -1), and vLLM's gauges freeze with a hung EngineCore, while the
    requests the router keeps sending it (round robin, until the sidecar removes it) pile up."""
    return STREAM_CLIENTS


def run_fault(
    fleet: dict[str, Any],
    *,
    via: str,
    victim: str,
    fault: Callable[[int], None],
    sessions: Callable[[], int],
) -> tuple[Outcomes, int, str]:
    """Load through ``via``, the fault on ``victim``'s serving incarnation, the victim back
    READY, more load; then the outcomes and the most sessions open on the victim meanwhile."""
    d: Daemon = fleet["daemon"]
    both_serving(d, via)
    load = MixedLoad(via).start()
    try:
        wait_for(lambda: load.ok() >= 24, timeout_s=300, what=f"load flowing through {via}")
        before = d.engine(victim)
        seen = len(d.log().splitlines())
        with Sampler(sessions) as sampler:
            fault(int(before["pid"]))
            fault_at = time.time()
            d.wait_state(victim, "ready", timeout_s=READY_TIMEOUT_S, restarts=before["restarts"] + 1)
        ok_then = load.ok()
        wait_for(lambda: load.ok() >= ok_then + 24, timeout_s=300, what="load after the fault")
    finally:
        out = load.stop()
    lines = d.log().splitlines()[seen:]  # this fault's
    transitions = "\n".join(
        line
        for line in lines
        if " -> " in line or "suspected" in line or "finding hang" in line or "front cut" in line
    )
    # The daemon's side of a hang: when it was suspected, found (by which rule), and cut.
    daemon_side = [x[:300] for x in lines if "suspected" in x or "finding hang" in x or "front cut" in x]
    print(
        f"\nfault at {time.strftime('%H:%M:%S', time.localtime(fault_at))}.{int(fault_at % 1 * 1000):03d} "
        f"{via} {victim}: {dict(out.counts)}; sessions on {victim} <= {sampler.most}; "
        f"slowest first byte {max(out.waits_s):.1f} s\n" + "\n".join(daemon_side + out.details[:20])
    )
    return out, sampler.most, transitions


def assert_lossless(out: Outcomes, in_flight: int, transitions: str) -> None:
    counts = out.counts
    failed = {
        k: v for k, v in counts.items() if k.startswith(("failed", "truncated")) or k.endswith("/plain")
    }
    cut = sum(v for k, v in counts.items() if k.startswith("cut"))
    assert counts["ok"] > 0
    assert not failed, f"requests failed before a byte: {failed}: {out.details[:6]}\n{transitions}"
    assert cut <= max(in_flight, 1), f"{cut} cut streams, {in_flight} in flight: {out.details[:6]}"


def sigkill_api_server(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def hang_engine_core(fleet: dict[str, Any], victim: str, what: str) -> Callable[[int], None]:
    """The fault: ``what`` (deadlock, spin) in the victim's EngineCore, through its injector."""

    def fault(pid: int) -> None:
        inject(fleet["hangs"][victim], "EngineCore", what)

    return fault


# The rules that find each injected hang under load (tests/vllm/test_hang_kinds.py); the
# deadline rule is the backstop when a loaded host blurs the CPU readings.
HANG_RULES = {"deadlock": {"frozen", "cpu_idle", "deadlines"}, "spin": {"spinning", "deadlines"}}


def assert_hang_cut_first(victim: str, what: str, log: str) -> None:
    """Found by a rule for its kind, and the API server cut before the stacks (``log``: the
    fault's transitions, findings and cuts, from run_fault)."""
    lines = log.splitlines()
    found = [x for x in lines if f"[{victim}] finding hang (critical)" in x]
    assert found and rule_of(found[-1]) in HANG_RULES[what], f"{found[-1:]}\n{log}"
    assert any(f"[{victim}]" in x and "front cut at" in x for x in lines), log


def test_haproxy_sigkill_of_an_api_server_fails_no_request(fleet: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{fleet['ports']['frontend']}/v1"
    out, in_flight, log = run_fault(
        fleet,
        via=url,
        victim="e1",
        fault=sigkill_api_server,
        sessions=lambda: haproxy_sessions(fleet["stats"], "e1"),
    )
    assert_lossless(out, in_flight, log)


@pytest.mark.parametrize(("victim", "what"), [("e2", "deadlock"), ("e1", "spin")])
def test_haproxy_hung_engine_core_fails_no_request(fleet: dict[str, Any], victim: str, what: str) -> None:
    url = f"http://127.0.0.1:{fleet['ports']['frontend']}/v1"
    out, in_flight, log = run_fault(
        fleet,
        via=url,
        victim=victim,
        fault=hang_engine_core(fleet, victim, what),
        sessions=lambda: haproxy_sessions(fleet["stats"], victim),
    )
    assert_hang_cut_first(victim, what, log)
    assert_lossless(out, in_flight, log)


def test_vllm_router_sigkill_of_an_api_server(fleet: dict[str, Any]) -> None:
    if not fleet["router"]:
        pytest.skip("vllm-router not installed in the test venv (pip install -e '.[dev]')")
    url = f"http://127.0.0.1:{fleet['ports']['router']}/v1"
    out, in_flight, log = run_fault(
        fleet,
        via=url,
        victim="e1",
        fault=sigkill_api_server,
        sessions=router_sessions,
    )
    assert_lossless(out, in_flight, log)


def test_vllm_router_deadlocked_engine_core(fleet: dict[str, Any]) -> None:
    if not fleet["router"]:
        pytest.skip("vllm-router not installed in the test venv (pip install -e '.[dev]')")
    url = f"http://127.0.0.1:{fleet['ports']['router']}/v1"
    out, in_flight, log = run_fault(
        fleet,
        via=url,
        victim="e2",
        fault=hang_engine_core(fleet, "e2", "deadlock"),
        sessions=router_sessions,
    )
    assert_hang_cut_first("e2", "deadlock", log)
    assert_lossless(out, in_flight, log)
