"""Evidence before the kill (engine/evidence.py) through the real daemon: a frozen fake EngineCore
child has its API server cut first, then leaves its stacks before its restart; engines placed
with ``cpus: auto`` run on disjoint CPUs."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmsupervisor.probes.cpus import allowed_cpus_of, host_cpus
from llmsupervisor.stacks import find_py_spy
from tests.lib.daemon import alive, fake_engine, free_port


def _held(port: int, closed_at: list[float]) -> None:
    """A request the hung engine holds: it ends when the API server dies (its connection closes)."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "held", "max_tokens": 4},
            timeout=60,
        )
    closed_at.append(time.time())


@pytest.mark.system
def test_a_frozen_engine_core_has_the_front_cut_then_leaves_its_stacks(daemon_factory: Any) -> None:
    """The stopped rule blames the EngineCore, not the API server: the API server is SIGKILLed
    before the stacks (a request it held ends at once), the frozen core's stacks are taken."""
    if find_py_spy() is None:
        pytest.skip("py-spy is not installed next to this python or on PATH")
    port = free_port()
    detectors = {"hang_idle_after_s": 2}
    d = daemon_factory(
        {"engines": [fake_engine("a", port, fake_child=True, detectors=detectors, live_canary_timeout_s=0.5)]}
    )
    d.start()
    first = d.wait_state("a", "ready")
    members = [p for p in d.engine_processes() if alive(p)]
    core = next(p for p in members if p != first["pid"])  # the fake EngineCore child
    httpx.post(f"http://127.0.0.1:{port}/fake/hang", timeout=5)
    closed_at: list[float] = []
    held = threading.Thread(target=_held, args=(port, closed_at), daemon=True)
    held.start()
    os.kill(core, signal.SIGSTOP)
    d.wait_log("action restart (hang)", timeout_s=30)
    again = d.wait_state("a", "ready", timeout_s=30, restarts=first["restarts"] + 1)
    assert again["pid"] != first["pid"] and again["incidents"] == 1
    incident = Path(again["last_incident"])
    assert incident.parent == d.state_dir.resolve() / "engines" / "a" / "incidents"
    text = incident.read_text()
    # The API server cut first, without stacks; the core, still frozen after its parent's
    # death (no SIGHUP/SIGCONT reached it), with its stacks.
    header = next(x for x in text.splitlines() if x.startswith(f"==== pid {first['pid']} [killed] "))
    assert "fake_vllm" in header and "front cut" in text  # its command line, read before the kill
    assert f"==== pid {core} [T (stopped)]" in text
    assert "processes: 2, stacks taken: 1" in text, text
    # The held request ended with the cut, before the stacks were written.
    held.join(timeout=30)
    assert closed_at and closed_at[0] <= incident.stat().st_mtime
    # The log line names the file; the exporter counts it.
    assert "front cut at " in d.log() and str(incident) in d.log()
    assert "stacks of 1/1 stopped process(es)" in d.log()
    metrics = httpx.get(d.http_url + "/metrics", timeout=5).text
    assert 'llmsupervisor_engine_incidents_total{engine="a"} 1.0' in metrics
    assert d.stop() == 0


@pytest.mark.system
def test_auto_placed_engines_run_on_disjoint_cpus(daemon_factory: Any) -> None:
    cpus = sorted(host_cpus())
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    ports = [free_port(), free_port()]
    d = daemon_factory(
        {
            "engines": [
                fake_engine(n, p, fake_child=True, cpus="auto") for n, p in zip("ab", ports, strict=True)
            ]
        }
    )
    d.start()
    seen: dict[str, set[int]] = {}
    for name in "ab":
        e = d.wait_state(name, "ready")
        assert e["cpus"] is not None
        pids = [p for p in d.engine_processes() if os.getpgid(p) == e["pid"]]
        assert len(pids) == 2  # the API server and its child: both bound
        sets = {allowed_cpus_of(p) for p in pids}
        assert len(sets) == 1
        (allowed,) = sets
        assert allowed is not None
        seen[name] = set(allowed)
        environ = Path(f"/proc/{e['pid']}/environ").read_bytes().split(b"\0")
        assert f"VLLM_CPU_OMP_THREADS_BIND={e['cpus']}".encode() in environ
    assert not seen["a"] & seen["b"]
    assert seen["a"] | seen["b"] == set(cpus)
    assert d.stop() == 0
