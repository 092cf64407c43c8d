"""Check 7, the daemon over a GPU engine: the real daemon supervises a fake vLLM engine that holds
memory on its GPU through CUDA (``--fake``: a ``run --fake-gpu FILE`` this check rewrites as a
driver would). In order, one step each: the engine is ready with its GPU's CUDA environment; its
memory shows in NVML, the status and /metrics; the daemon's own CPU over a window; a foreign
process on the GPU opens FOREIGN_GPU_MEMORY naming its PID; ``stop --wait`` waits for NVML to
show the memory released."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import psutil

from llmsupervisor.probes.fake_nvml import fake_uuid
from llmsupervisor.probes.nvml import in_host_pid_namespace
from llmsupervisor.process import alive
from tests.lib.gpu_proof.holder import Holder
from tests.lib.gpu_proof.nvml_reads import GIB, compute_pids
from tests.lib.gpu_proof.proof import Proof, child_env, wait_until
from tests.lib.gpu_proof.result import Result

if TYPE_CHECKING:
    from tests.lib.daemon import Daemon

ENGINE: Final = "gpu0"

SDNOTIFY_STUB: Final = '''"""Stand-in for the sdnotify package (0.3.2's interface) on a machine
without it: the proof runs the daemon without NOTIFY_SOCKET, where llmsupervisor.notify never
sends."""
import socket


class SystemdNotifier:
    def __init__(self, debug=False):
        self.debug = debug
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def notify(self, state):
        self.socket.sendall(bytes(state, "latin-1"))
'''


def _daemon_env(proof: Proof) -> dict[str, str]:
    """PYTHONPATH for the daemon: the repository, and a stub ``sdnotify`` where the package is
    missing (the GPU machine has none and no registry)."""
    env = child_env()
    if importlib.util.find_spec("sdnotify") is None:
        stub = proof.workdir / "stub"
        stub.mkdir(exist_ok=True)
        (stub / "sdnotify.py").write_text(SDNOTIFY_STUB)
        env["PYTHONPATH"] = os.pathsep.join([str(stub), env["PYTHONPATH"]])
    return {"PYTHONPATH": env["PYTHONPATH"]}


def _write_fake_gpu(path: Path, uuid: str, processes: list[tuple[int, int]]) -> None:
    tmp = path.with_suffix(".tmp")
    gpu = {
        "index": 0,
        "uuid": uuid,
        "processes": [list(p) for p in processes],
        "memory_used_bytes": sum(n for _, n in processes),
    }
    tmp.write_text(json.dumps({"gpus": [gpu], "events": []}))
    tmp.replace(path)


@dataclass
class DaemonRun:
    """What the steps share: the daemon, its one engine and the GPU the engine sits on."""

    proof: Proof
    r: Result
    d: Daemon
    engine: dict[str, Any]
    port: int
    gpu: int  # the NVML index (with --fake, the --fake-gpu file's GPU 0)
    uuid: str
    gpu_file: Path  # --fake: the daemon's GPU telemetry
    pid: int = 0  # the engine's, once ready

    @property
    def fake(self) -> bool:
        return self.proof.opts.fake

    @property
    def engine_bytes(self) -> int:
        return int(self.proof.opts.engine_gib * GIB)

    @property
    def allocates(self) -> bool:
        """Whether the engine holds its memory through CUDA (a GPU machine with torch)."""
        return "fake-cuda-gib" in self.engine["args"]

    def fake_gpu(self, *processes: tuple[int, int]) -> None:
        _write_fake_gpu(self.gpu_file, self.uuid, list(processes))


def check_daemon(proof: Proof, r: Result) -> None:
    run = _prepare(proof, r)
    try:
        run.d.start(extra_env=_daemon_env(proof))
        _engine_ready_on_its_gpu(run)
        _engine_memory_listed(run)
        _memory_in_status_and_metrics(run)
        _daemon_cpu(run)
        _foreign_process_found(run)
        _stop_waits_for_the_release(run)
        r.expect(run.d.stop() == 0, "the daemon did not exit 0 on SIGTERM")
    finally:
        r.data["daemon_log_tail"] = run.d.log()[-1500:] if run.d.log_path.exists() and not r.ok else None
        run.d.cleanup()


def _prepare(proof: Proof, r: Result) -> DaemonRun:
    """The config (one engine on the GPU, foreign memory found within a second) and, with
    ``--fake``, the empty GPU file; the daemon is not started yet."""
    from tests.lib.daemon import Daemon, fake_engine, free_port

    opts = proof.opts
    gpu = 0 if opts.fake else opts.gpu  # the --fake-gpu file plays GPU 0
    port = free_port()
    engine = fake_engine(
        ENGINE,
        port,
        gpus=[gpu],
        start_timeout_s=180,
        stop_timeout_s=30,
        gpu_release_timeout_s=60,
        detectors={"sustain_s": {"foreign_gpu_memory": 1}, "clear_s": {"foreign_gpu_memory": 1}},
    )
    gpu_file = proof.workdir / "fake-gpu.json"
    uuid = fake_uuid(0) if opts.fake else proof.uuid(gpu)
    run_args: tuple[str, ...] = ()
    if opts.fake:
        _write_fake_gpu(gpu_file, uuid, [])
        run_args = ("--fake-gpu", str(gpu_file))
        r.skipped.append(
            "the engine's CUDA allocation: --fake (the --fake-gpu file lists the engine instead)"
        )
    elif not proof.no_cuda(r, "the engine's CUDA allocation"):
        engine["args"]["fake-cuda-gib"] = opts.engine_gib
    config: dict[str, Any] = {"supervisor": {"tick_interval_s": 0.5}, "engines": [engine]}
    (proof.workdir / "daemon").mkdir(exist_ok=True)
    d = Daemon(proof.workdir / "daemon", config, run_args=run_args)
    return DaemonRun(proof, r, d, engine, port, gpu, uuid, gpu_file)


def _engine_ready_on_its_gpu(run: DaemonRun) -> None:
    """READY, with CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER set for its GPU (and, allocating,
    CUDA's one device being that GPU)."""
    import httpx

    r = run.r
    ready = run.d.wait_state(ENGINE, "ready", timeout_s=180)
    run.pid = int(ready["pid"])
    r.data["engine_pid"] = run.pid
    seen = httpx.get(f"http://127.0.0.1:{run.port}/fake/cuda", timeout=10).json()
    r.data["engine_cuda"] = seen
    r.expect(
        seen.get("cuda_visible_devices") == str(run.gpu),
        f"the engine's CUDA_VISIBLE_DEVICES is {seen.get('cuda_visible_devices')}",
    )
    r.expect(
        seen.get("cuda_device_order") == "PCI_BUS_ID",
        f"the engine's CUDA_DEVICE_ORDER is {seen.get('cuda_device_order')}",
    )
    if run.allocates:
        r.expect(seen.get("device_count") == 1, f"the engine sees {seen.get('device_count')} CUDA devices")
        r.expect(
            seen.get("uuid") == run.uuid,
            f"the engine's CUDA device is {seen.get('uuid')}, its GPU is {run.uuid}",
        )


def _engine_memory_listed(run: DaemonRun) -> None:
    """NVML lists the engine's PID with its memory (``--fake``: the GPU file says so)."""
    if run.fake:
        run.fake_gpu((run.pid, run.engine_bytes))
        return
    pids = compute_pids(run.proof.lib, run.proof.handle(run.gpu))
    run.r.data["nvml_pids"] = {str(p): b for p, b in pids.items()}
    if run.allocates and in_host_pid_namespace():
        run.r.expect(
            (pids.get(run.pid) or 0) >= 0.95 * run.engine_bytes,
            f"NVML does not list the engine {run.pid} with its memory: {pids}",
        )


def _memory_in_status_and_metrics(run: DaemonRun) -> None:
    """The status and /metrics show the engine's GPU memory, and /metrics its engine_info."""
    from tests.lib.daemon import metric

    r, d, gpu = run.r, run.d, str(run.gpu)
    want = 0.95 * run.engine_bytes if run.fake or run.allocates else 0
    status_used, _ = wait_until(
        lambda: (
            used
            if (used := d.engine(ENGINE).get("gpu_memory_used_bytes")) is not None and used >= want
            else None
        ),
        15,
        poll_s=0.2,
    )
    r.data["status_gpu_memory_used_bytes"] = status_used
    r.expect(status_used is not None, f"status never showed the engine's GPU memory (>= {want:.0f} bytes)")
    r.data["metrics"] = {
        "gpu_memory_used_bytes": metric(d.http_url, "llmsupervisor_gpu_memory_used_bytes", gpu=gpu),
        "gpu_memory_reserved_bytes": metric(d.http_url, "llmsupervisor_gpu_memory_reserved_bytes", gpu=gpu),
        "engine_info": metric(
            d.http_url,
            "llmsupervisor_engine_info",
            engine=ENGINE,
            port=str(run.port),
            gpus=gpu,
            model=str(d.engine(ENGINE)["model"]),
        ),
    }
    used_metric = r.data["metrics"]["gpu_memory_used_bytes"]
    r.expect(
        used_metric is not None and used_metric >= want,
        f"/metrics shows {used_metric} bytes used on GPU {gpu}",
    )
    r.expect(r.data["metrics"]["engine_info"] == 1.0, f"/metrics has no engine_info for gpu0 on GPU {gpu}")


def _daemon_cpu(run: DaemonRun) -> None:
    """The daemon's own CPU with one engine ready, its GPU sampled every tick (a measurement)."""
    proc = psutil.Process(run.d.pid)
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(run.proof.opts.cpu_window_s)
    cpu, took = sum(proc.cpu_times()[:2]) - cpu0, time.monotonic() - t0
    run.r.data["daemon_cpu"] = {
        "window_s": round(took, 2),
        "cpu_s": round(cpu, 3),
        "percent_of_a_core": round(100 * cpu / took, 2),
    }


def _foreign_process_found(run: DaemonRun) -> None:
    """A foreign process on the engine's GPU opens FOREIGN_GPU_MEMORY naming its PID within 30 s;
    then it ends (``--fake``: and leaves the GPU file)."""
    r, d = run.r, run.d
    foreign = _start_foreign(run)
    if foreign is None:
        return
    foreign_pid = foreign.grandchild_pid if isinstance(foreign, Holder) else foreign.pid
    try:
        finding, took_s = wait_until(
            lambda: next(
                (f for f in d.engine(ENGINE).get("findings", []) if f["kind"] == "foreign_gpu_memory"),
                None,
            ),
            30,
            poll_s=0.2,
        )
        r.data["foreign"] = {"pid": foreign_pid, "finding": finding, "after_s": round(took_s, 2)}
        if r.expect(finding is not None, "FOREIGN_GPU_MEMORY did not open within 30 s"):
            r.expect(
                str(foreign_pid) in finding["summary"],
                f"the finding does not name the foreign PID: {finding['summary']}",
            )
    finally:
        _end_foreign(foreign)
    if isinstance(foreign, subprocess.Popen):
        run.fake_gpu((run.pid, run.engine_bytes))


def _start_foreign(run: DaemonRun) -> subprocess.Popen[bytes] | Holder | None:
    """``--fake``: a sleeping process the GPU file lists with memory; else a holder allocating
    through CUDA; None where CUDA cannot run here."""
    opts = run.proof.opts
    if opts.fake:
        foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        run.fake_gpu((run.pid, run.engine_bytes), (foreign.pid, int(opts.foreign_gib * GIB)))
        return foreign
    if run.proof.no_cuda(run.r, "the foreign process's CUDA allocation"):
        return None
    return Holder(run.proof, run.gpu, opts.foreign_gib)


def _end_foreign(foreign: subprocess.Popen[bytes] | Holder) -> None:
    if isinstance(foreign, Holder):
        foreign.close()
    else:
        foreign.kill()
        foreign.wait()


def _stop_waits_for_the_release(run: DaemonRun) -> None:
    """``stop --wait`` exits 0, and the daemon logs the release it waited for (``--fake``: a
    thread plays the driver, listing the memory until a moment after the engine exits)."""
    r, d = run.r, run.d
    releaser = None
    if run.fake:
        pid = run.pid

        def release_after_exit() -> None:
            wait_until(lambda: not alive(pid), 60, poll_s=0.05)
            time.sleep(0.5)
            run.fake_gpu()

        releaser = threading.Thread(target=release_after_exit, daemon=True)
        releaser.start()
    t0 = time.monotonic()
    stop = d.cli("stop", ENGINE, "--wait", "--timeout", "120", timeout_s=150)
    r.data["stop"] = {
        "rc": stop.returncode,
        "took_s": round(time.monotonic() - t0, 2),
        "out": stop.stdout.strip()[-300:],
    }
    r.expect(stop.returncode == 0, f"stop --wait: exit {stop.returncode}: {stop.stderr.strip()[-300:]}")
    if not run.fake:
        handle = run.proof.handle(run.gpu)
        gone, after = wait_until(lambda: run.pid not in compute_pids(run.proof.lib, handle), 60)
        r.data["nvml_unlisted_after_stop_s"] = round(after, 3) if gone else None
    logged, _ = wait_until(
        lambda: re.search(r"GPU memory (released [0-9.]+ s after the stop|still held[^\n]*)", d.log()),
        10,
        poll_s=0.2,
    )
    r.data["release_log"] = logged.group(0) if logged else None
    if logged is None:
        r.notes.append(
            "no release line: NVML had already dropped the engine at the daemon's first look (no wait)"
        )
    else:
        r.expect("still held" not in logged.group(0), f"the daemon gave up waiting: {logged.group(0)}")
    if releaser is not None:
        releaser.join(10)
