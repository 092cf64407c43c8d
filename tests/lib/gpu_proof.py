"""The checks of issue 24, "Proof on a real GPU", shared by ``bench/gpu_proof.py`` (the one
prepared call on a lent H100/H200) and the ``gpu`` tier (``tests/host/test_gpu_proof.py``).

Each check fills one ``Result``, printed as one JSON line; one that fails or runs past its
budget records its error and the run goes on. The order and the expectations come from the
issue and from ../shared/docs/gpu-review.md (Q7); docs/gpu-validation.md says how to run it and
what each line proves:

    1 facts            driver, NVML, nvidia-ml-py; per GPU name, UUID, PCI bus id, MIG mode;
                       the PID namespace
    2 pid_attribution  a setsid parent spawns (multiprocessing, spawn) a torch grandchild holding
                       N GiB: NVML lists the grandchild's PID; how long after its exit NVML stops
                       listing it and memory falls
    3 memory           nvmlMemory v1 and v2, idle and with N GiB held, against nvidia-smi
    4 index_mapping    CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=i (and =UUID): CUDA's
                       device 0 is NVML's GPU i
    5 fault_state      field 230, remapped rows, ECC, supported events, what the daemon's reader
                       registered, nvmlEventSetWait timing out while 4 threads sample
    6 thermal_power    thresholds, margin, clock-event mask and power idle and under a bf16
                       matmul burn; throttle-duration deltas; the daemon's detectors fed with it
    7 daemon           the real daemon over a fake vLLM engine holding memory on its GPU
    8 cost             the daemon's CPU per GPU sample and per event wait

``--fake`` runs all of it against the pynvml-level fake (``probes/fake_nvml.py``; check 7 through
``run --fake-gpu FILE``) with no CUDA: every path that needs no GPU runs, and each CUDA part is
listed in the line's ``skipped``. Nothing here resets a GPU or changes clocks, power limits, ECC
or MIG: it reads NVML and allocates memory through torch, nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import psutil

from llmsupervisor.probes.fake_nvml import FakeDevice, FakeNvml, fake_uuid
from llmsupervisor.probes.gpu_readings import EVENT_KINDS, GpuSample, recovery_action_name
from llmsupervisor.probes.nvml import (
    DEFAULT_EVENT_TYPES,
    FI_GPU_RECOVERY_ACTION,
    FI_HW_POWER_BRAKE_NS,
    FI_HW_THERMAL_NS,
    FI_SW_THERMAL_NS,
    PROC_PID_INIT_INO,
    NvmlReader,
    in_host_pid_namespace,
)
from llmsupervisor.probes.nvml import VALUE_MEMBERS as _VALUE_MEMBERS
from tests.lib.paths import LIB, REPO

GIB: Final = 1024**3
MIB: Final = 1024**2
# Two readings of the same memory taken a moment apart (NVML twice, or NVML and nvidia-smi) may
# differ by what the driver moved meanwhile; more than this is a disagreement, not noise.
MEMORY_SLACK_MIB: Final = 64
# The event types the issue names (gpu-review.md Q7): double-bit ECC, XID, DRAM retirement
# failure, fatal poison, GPU unavailable, recovery action.
Q7_EVENT_BITS: Final = (0x2, 0x8, 0x800, 0x2000, 0x4000, 0x8000)
THRESHOLDS: Final = {"shutdown": 0, "slowdown": 1, "mem_max": 2, "gpu_max": 3}  # NVML_TEMPERATURE_THRESHOLD_*
GPU_RELEASE_TIMEOUT_S: Final = 30.0  # EngineSpec.gpu_release_timeout_s's default
PYTHON_PATH: Final = str(REPO)

# -- results ------------------------------------------------------------------------------


@dataclass
class Result:
    """One check's JSON line. ``problems``: what contradicts the daemon's assumptions (the check
    fails); ``skipped``: the parts that did not run and why; ``notes``: facts worth reading that
    are nobody's fault."""

    check: int
    name: str
    data: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    elapsed_s: float = 0.0

    def expect(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems

    def line(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "name": self.name,
            "ok": self.ok,
            "elapsed_s": round(self.elapsed_s, 2),
            "problems": self.problems,
            "skipped": self.skipped,
            "notes": self.notes,
            "error": self.error,
            "data": self.data,
        }


LINE_KEYS: Final = frozenset(Result(0, "").line())


class CheckTimeout(Exception):
    pass


# -- NVML helpers -------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def read(lib: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``lib.name(*args)``, or ``{"error": "NVMLError_NotSupported"}`` (a reading, not a crash)."""
    fn = getattr(lib, name, None)
    if fn is None:
        return {"error": f"{name} is not in this binding"}
    try:
        return _plain(fn(*args, **kwargs))
    except Exception as exc:
        return {"error": type(exc).__name__}


def failed(value: Any) -> bool:
    return isinstance(value, dict) and "error" in value


def return_name(code: int) -> str:
    """An NVML return code's name (``NVML_SUCCESS``, ``NVML_ERROR_NOT_SUPPORTED``...)."""
    import pynvml

    for name in dir(pynvml):
        if (name == "NVML_SUCCESS" or name.startswith("NVML_ERROR_")) and getattr(pynvml, name) == code:
            return name
    return f"code_{code}"


def field_values(lib: Any, handle: Any, ids: Sequence[int]) -> dict[str, Any]:
    """Each field's own return code and value (nvmlFieldValue_t.nvmlReturn)."""
    try:
        values = lib.nvmlDeviceGetFieldValues(handle, list(ids))
    except Exception as exc:
        return {"error": type(exc).__name__}
    out: dict[str, Any] = {}
    for v in values:
        ret = int(v.nvmlReturn)
        entry: dict[str, Any] = {"return": return_name(ret)}
        if ret == 0:
            entry["value"] = int(getattr(v.value, _VALUE_MEMBERS.get(int(v.valueType), "ullVal")))
        out[str(int(v.fieldId))] = entry
    return out


def memory(lib: Any, handle: Any) -> dict[str, Any]:
    """v1 (used includes driver-reserved memory) and v2 (reserved on its own), in bytes."""
    out: dict[str, Any] = {}
    try:
        v1 = lib.nvmlDeviceGetMemoryInfo(handle)
        out["v1"] = {"total": int(v1.total), "free": int(v1.free), "used": int(v1.used)}
    except Exception as exc:
        out["v1"] = {"error": type(exc).__name__}
    try:
        v2 = lib.nvmlDeviceGetMemoryInfo(handle, version=lib.nvmlMemory_v2)
        out["v2"] = {
            "total": int(v2.total),
            "reserved": int(v2.reserved),
            "free": int(v2.free),
            "used": int(v2.used),
        }
    except Exception as exc:
        out["v2"] = {"error": type(exc).__name__}
    return out


def compute_pids(lib: Any, handle: Any) -> dict[int, int | None]:
    """NVML's compute processes on a GPU: PID -> bytes (None where the driver cannot say)."""
    return {
        int(p.pid): None if getattr(p, "usedGpuMemory", None) is None else int(p.usedGpuMemory)
        for p in lib.nvmlDeviceGetComputeRunningProcesses(handle)
    }


def smi_memory() -> list[dict[str, Any]] | dict[str, str]:
    """``nvidia-smi --query-gpu=index,memory.used,memory.reserved,memory.total``, in MiB."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found"}
    argv = [
        exe,
        "--query-gpu=index,memory.used,memory.reserved,memory.total",
        "--format=csv,noheader,nounits",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip()[:300]}
    rows = []
    for line in done.stdout.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        row: dict[str, Any] = {"index": int(cells[0])}
        for key, cell in zip(("used_mib", "reserved_mib", "total_mib"), cells[1:], strict=False):
            row[key] = float(cell) if re.fullmatch(r"[0-9.]+", cell) else cell
        rows.append(row)
    return rows


def driver_answers() -> bool:
    """Whether an NVIDIA driver answers NVML here (the gpu tier's skip condition)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LiveFakeNvml(FakeNvml):
    """The fake with a driver's one habit the checks measure: a process that holds memory is
    listed, and its memory counted in ``used``, while it lives, and not after it exits.

    ``hold`` says which (real, local) process holds how much on which GPU; the fake mode's holder
    grandchild is registered so, and checks 2 and 3 run their whole path over it."""

    def __init__(self, devices: Sequence[FakeDevice]) -> None:
        super().__init__(devices)
        self.holders: dict[int, tuple[int, int]] = {}  # pid -> (GPU index, bytes)
        self._base_used = [d.memory_used for d in self.devices]
        self._sync_lock = threading.Lock()

    def hold(self, pid: int, gpu: int, nbytes: int) -> None:
        with self._sync_lock:
            self.holders[pid] = (gpu, nbytes)

    def _sync(self) -> None:
        with self._sync_lock:
            for pid in [p for p in self.holders if not _alive(p)]:
                del self.holders[pid]
            for index, dev in enumerate(self.devices):
                mine = [(pid, n) for pid, (g, n) in self.holders.items() if g == index]
                dev.processes = [(pid, n) for pid, n in mine]
                dev.memory_used = self._base_used[index] + sum(n for _, n in mine)

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        self._sync()
        return super().nvmlDeviceGetComputeRunningProcesses(h)

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
        self._sync()
        return super().nvmlDeviceGetMemoryInfo(h, version)


# -- the run's context --------------------------------------------------------------------


@dataclass
class Options:
    fake: bool = False
    fake_gpus: int = 1
    gpu: int = 0  # the GPU that memory is held on and burned
    hold_gib: float = 10.0  # checks 2 and 3
    engine_gib: float = 4.0  # check 7's engine
    foreign_gib: float = 1.0  # check 7's foreign process (above foreign_min_mib, 256)
    burn_s: float = 75.0  # check 6
    event_waits: int = 3  # checks 5 and 8
    event_wait_ms: int = 1000
    cost_samples: int = 50  # check 8
    cpu_window_s: float = 10.0  # check 7: the daemon's CPU over this long, one engine ready
    release_timeout_s: float = 30.0  # check 2: how long to watch for the release


CHILD_PROBE: Final = (
    "import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda_version': torch.version.cuda,"
    " 'cuda': torch.cuda.is_available(), 'device_count': torch.cuda.device_count()}))"
)


class Proof:
    """NVML opened once for the run (pynvml, or ``LiveFakeNvml`` with ``--fake``), what torch
    can do here (asked of a child: this process never creates a CUDA context, so that it never
    shows in NVML's process lists), and a scratch folder."""

    def __init__(self, opts: Options, lib: Any = None) -> None:
        self.opts = opts
        if lib is None and opts.fake:
            lib = LiveFakeNvml([FakeDevice(fake_uuid(i)) for i in range(opts.fake_gpus)])
        if lib is None:
            import pynvml

            lib = pynvml
        self.lib: Any = lib
        self.lib.nvmlInit()
        self.workdir = Path(tempfile.mkdtemp(prefix="gpu-proof-"))
        self.torch: dict[str, Any] = {"skipped": "--fake: no CUDA"} if opts.fake else self._probe_torch()

    @property
    def cuda(self) -> bool:
        return bool(self.torch.get("cuda")) and not self.opts.fake

    def _probe_torch(self) -> dict[str, Any]:
        try:
            done = subprocess.run(
                [sys.executable, "-c", CHILD_PROBE],
                capture_output=True,
                text=True,
                timeout=180,
                env=child_env(),
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"error": "the torch probe took over 180 s"}
        if done.returncode != 0:
            return {"error": done.stderr.strip()[-300:]}
        probed: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return probed

    def no_cuda(self, result: Result, what: str) -> bool:
        """True (and ``what`` listed as skipped) when CUDA cannot run here."""
        if self.cuda:
            return False
        why = "--fake" if self.opts.fake else f"no CUDA through torch here ({self.torch})"
        result.skipped.append(f"{what}: {why}")
        return True

    def gpus(self) -> list[tuple[int, Any, str]]:
        """(NVML index, handle, UUID) of every GPU NVML can name."""
        out = []
        for index in range(int(self.lib.nvmlDeviceGetCount())):
            with contextlib.suppress(Exception):
                handle = self.lib.nvmlDeviceGetHandleByIndex(index)
                out.append((index, handle, str(_plain(self.lib.nvmlDeviceGetUUID(handle)))))
        return out

    def handle(self, index: int) -> Any:
        return self.lib.nvmlDeviceGetHandleByIndex(index)

    def uuid(self, index: int) -> str:
        return str(_plain(self.lib.nvmlDeviceGetUUID(self.handle(index))))

    def reader(self) -> NvmlReader:
        """The daemon's own reader over the same binding (its own nvmlInit, NVML counts them)."""
        return NvmlReader(self.lib)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.lib.nvmlShutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    parts = [PYTHON_PATH, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != PYTHON_PATH]]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.pop("NOTIFY_SOCKET", None)
    env.update(extra)
    return env


def cuda_env(gpu: int | str) -> dict[str, str]:
    return child_env(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(gpu))


def wait_until(predicate: Callable[[], Any], timeout_s: float, poll_s: float = 0.02) -> tuple[Any, float]:
    """(the first truthy value, seconds it took), or (None, timeout_s)."""
    start = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            return None, timeout_s
        time.sleep(poll_s)


# -- the holder: a setsid parent and its spawned grandchild -------------------------------

HOLDER_CODE: Final = (
    "import sys; from tests.lib.gpu_proof import holder_main; sys.exit(holder_main(sys.argv[1:]))"
)


def _grandchild(conn: Any, gib: float, fake: bool) -> None:
    """Spawned (multiprocessing, spawn) by ``holder_main``: hold ``gib`` GiB on CUDA device 0
    until told to exit. With ``fake`` it holds nothing (``LiveFakeNvml`` lists it instead)."""
    info: dict[str, Any] = {"grandchild_pid": os.getpid()}
    keep: Any = None
    if fake:
        info["held_bytes"] = int(gib * GIB)
    else:
        try:
            import torch

            keep = torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda:0")
            keep.zero_()
            torch.cuda.synchronize()
            uuid = str(torch.cuda.get_device_properties(0).uuid)
            info.update(held_bytes=keep.numel(), uuid=uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
        except Exception as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"[:500]
    conn.send(info)
    with contextlib.suppress(EOFError):
        conn.recv()
    del keep


def holder_main(argv: Sequence[str]) -> int:
    """The setsid parent: spawn the grandchild, print what it says (one JSON line), and on a
    ``release`` line tell it to exit, join it and print when it exited (monotonic, the same
    clock as the caller's on Linux). Exits on stdin EOF."""
    import multiprocessing

    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, required=True)
    parser.add_argument("--fake", action="store_true")
    args = parser.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_grandchild, args=(theirs, args.gib, args.fake), name="gpu-proof-holder")
    child.start()
    info: dict[str, Any] = (
        mine.recv() if mine.poll(300) else {"error": "the grandchild said nothing in 300 s"}
    )
    info.update(parent_pid=os.getpid(), parent_sid=os.getsid(0), parent_pgid=os.getpgid(0))
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() == "release":
            with contextlib.suppress(OSError):
                mine.send("exit")
            child.join(60)
            print(json.dumps({"exited_at": time.monotonic(), "exitcode": child.exitcode}), flush=True)
        else:
            break
    if child.is_alive():
        child.kill()
        child.join(10)
    return 0


class Holder:
    """``holder_main`` in its own session (setsid), on one GPU; a context manager that always
    ends it. ``info``: the grandchild's PID, the parent's PID and session, the bytes held."""

    def __init__(self, proof: Proof, gpu: int, gib: float, *, timeout_s: float = 240.0) -> None:
        self.proof = proof
        self.log_path = proof.workdir / f"holder-{time.monotonic_ns()}.log"
        argv = [
            sys.executable,
            "-c",
            HOLDER_CODE,
            "--gib",
            str(gib),
            *(["--fake"] if proof.opts.fake else []),
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=REPO,
                env=cuda_env(gpu),
                start_new_session=True,
            )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info = self._next(timeout_s)
        if "error" in self.info:
            raise RuntimeError(f"holder: {self.info['error']}; log: {self._log_tail()}")
        if isinstance(proof.lib, LiveFakeNvml):
            proof.lib.hold(int(self.info["grandchild_pid"]), gpu, int(self.info["held_bytes"]))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-1000:]
        return ""

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            return {"error": f"no answer in {timeout_s} s"}
        parsed: dict[str, Any] = json.loads(line)
        return parsed

    @property
    def grandchild_pid(self) -> int:
        return int(self.info["grandchild_pid"])

    def release(self, timeout_s: float = 90.0) -> dict[str, Any]:
        """Tell the grandchild to exit; its exit time (monotonic) and exit code."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("release\n")
        self.proc.stdin.flush()
        return self._next(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- 1. facts -----------------------------------------------------------------------------


def check_facts(proof: Proof, r: Result) -> None:
    lib = proof.lib
    try:
        binding = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        binding = None
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = None
    r.data.update(
        fake=proof.opts.fake,
        driver_version=read(lib, "nvmlSystemGetDriverVersion"),
        nvml_version=read(lib, "nvmlSystemGetNVMLVersion"),
        cuda_driver_version=read(lib, "nvmlSystemGetCudaDriverVersion"),
        nvidia_ml_py=binding,
        python=sys.version.split()[0],
        kernel=os.uname().release,
        torch=proof.torch,
        host_pid_namespace=in_host_pid_namespace(),
        pid_namespace_inode=pid_ns,
        init_pid_namespace_inode=PROC_PID_INIT_INO,
        proc_1_comm=Path("/proc/1/comm").read_text().strip() if Path("/proc/1/comm").exists() else None,
        cpus=os.cpu_count(),
    )
    gpus = []
    for index, handle, uuid in proof.gpus():
        mig = read(lib, "nvmlDeviceGetMigMode", handle)
        pci = read(lib, "nvmlDeviceGetPciInfo", handle)
        gpus.append(
            {
                "index": index,
                "name": read(lib, "nvmlDeviceGetName", handle),
                "uuid": uuid,
                "pci_bus_id": pci if failed(pci) else _plain(getattr(pci, "busId", None)),
                "mig_mode": mig,
                "memory_total_bytes": memory(lib, handle).get("v2", {}).get("total"),
            }
        )
        r.expect(uuid.startswith(("GPU-", "MIG-")), f"GPU {index}: UUID {uuid!r} is not GPU-...")
        if not failed(mig) and int(mig[0]) == 1:
            r.notes.append(
                f"GPU {index} has MIG enabled: the daemon refuses engines on it (CUDA numbers MIG devices)"
            )
    r.data["gpus"] = gpus
    r.data["count"] = int(lib.nvmlDeviceGetCount())
    r.expect(bool(gpus), "NVML names no GPU")
    r.expect(len(gpus) == r.data["count"], "some GPU NVML counts cannot be named")
    if not r.data["host_pid_namespace"]:
        r.notes.append(
            "own PID namespace: NVML's host PIDs are not ours (the daemon then counts every process)"
        )


# -- 2. PID attribution -------------------------------------------------------------------


def check_pid_attribution(proof: Proof, r: Result) -> None:
    opts, lib = proof.opts, proof.lib
    if (
        proof.no_cuda(r, "the grandchild's CUDA allocation (the fake lists the grandchild instead)")
        and not opts.fake
    ):
        return
    handle, uuid = proof.handle(opts.gpu), proof.uuid(opts.gpu)
    idle = memory(lib, handle).get("v2", {})
    r.data.update(gpu=opts.gpu, uuid=uuid, hold_gib=opts.hold_gib, idle_v2_used=idle.get("used"))
    with Holder(proof, opts.gpu, opts.hold_gib) as holder:
        info = holder.info
        r.data["holder"] = info
        r.expect(
            info.get("parent_sid") == info.get("parent_pid"), "the holder's parent is not a session leader"
        )
        if "uuid" in info:
            r.expect(
                info["uuid"] == uuid, f"the grandchild's CUDA device is {info['uuid']}, NVML's GPU is {uuid}"
            )
        gc = holder.grandchild_pid
        _, took_s = wait_until(
            lambda: compute_pids(lib, handle) if gc in compute_pids(lib, handle) else None, 10
        )
        pids = compute_pids(lib, handle)
        r.data.update(nvml_pids={str(p): b for p, b in pids.items()}, listed_after_s=round(took_s, 3))
        host_ns = in_host_pid_namespace()
        if host_ns:
            r.expect(gc in pids, f"NVML lists {sorted(pids)}, not the grandchild {gc}")
            r.expect(
                info["parent_pid"] not in pids, "NVML lists the holder's parent, which never touched CUDA"
            )
            if gc in pids and pids[gc] is not None:
                r.expect(
                    pids[gc] >= 0.95 * info["held_bytes"],
                    f"NVML attributes {pids[gc]} bytes to the grandchild, which holds {info['held_bytes']}",
                )
        else:
            r.notes.append(
                "own PID namespace: NVML lists host PIDs; the daemon counts every process on the GPU"
            )
            r.expect(bool(pids), "NVML lists no process while the grandchild holds memory")
        reader = proof.reader()
        reader.open()
        try:
            sample = reader.sample(uuid)
        finally:
            reader.close()
        seen = [p.pid for p in sample.processes or ()]
        r.data["reader_pids"] = seen
        r.data["reader_pids_visible"] = sample.pids_visible
        if host_ns:
            r.expect(gc in seen, "the daemon's reader does not see the grandchild")
        held_used = memory(lib, handle).get("v2", {}).get("used")
        r.data["held_v2_used"] = held_used
        exited = holder.release()
        r.data["grandchild_exit"] = exited
        exited_at = float(exited.get("exited_at", time.monotonic()))

        def unlisted() -> bool:
            return gc not in compute_pids(lib, handle)

        def fell() -> bool:
            used = memory(lib, handle).get("v2", {}).get("used")
            return used is not None and held_used is not None and used < held_used - info["held_bytes"] / 2

        for name, predicate in (("unlisted", unlisted), ("memory_fell", fell)):
            ok, _ = wait_until(predicate, opts.release_timeout_s, poll_s=0.01)
            after = round(time.monotonic() - exited_at, 3)
            r.data[f"{name}_after_exit_s"] = after if ok else None
            r.expect(bool(ok), f"{name}: not within {opts.release_timeout_s} s of the grandchild's exit")
    waits = [r.data.get(k) for k in ("unlisted_after_exit_s", "memory_fell_after_exit_s")]
    if all(isinstance(w, float) for w in waits):
        longest = max(w for w in waits if isinstance(w, float))
        r.data["release_wait_needed_s"] = longest
        r.expect(
            longest < GPU_RELEASE_TIMEOUT_S,
            f"the release took {longest} s, longer than gpu_release_timeout_s's default"
            f" {GPU_RELEASE_TIMEOUT_S}",
        )


# -- 3. memory v1 vs v2 -------------------------------------------------------------------


def _compare_memory(r: Result, phase: str, nvml: dict[str, Any], smi: Any, index: int) -> dict[str, Any]:
    v1, v2 = nvml.get("v1", {}), nvml.get("v2", {})
    out: dict[str, Any] = {"nvml": nvml}
    if "error" in v1 or "error" in v2:
        r.expect(False, f"{phase}: a memory call failed: v1 {v1}, v2 {v2}")
        return out
    slack = MEMORY_SLACK_MIB * MIB
    r.expect(v1["total"] == v2["total"], f"{phase}: v1 total {v1['total']} != v2 total {v2['total']}")
    r.expect(
        abs(v1["used"] - (v2["used"] + v2["reserved"])) <= slack,
        f"{phase}: v1 used {v1['used']} is not v2 used + reserved ({v2['used']} + {v2['reserved']})",
    )
    out["reserved_mib"] = round(v2["reserved"] / MIB, 1)
    out["v1_minus_v2_used_mib"] = round((v1["used"] - v2["used"]) / MIB, 1)
    rows = [row for row in smi if row.get("index") == index] if isinstance(smi, list) else []
    if rows:
        row = rows[0]
        out["smi"] = row
        used = row.get("used_mib")
        if isinstance(used, float):
            out["smi_used_is"] = (
                "v2"
                if abs(used - v2["used"] / MIB) <= MEMORY_SLACK_MIB
                else "v1"
                if abs(used - v1["used"] / MIB) <= MEMORY_SLACK_MIB
                else "neither"
            )
            r.expect(
                out["smi_used_is"] == "v2", f"{phase}: nvidia-smi's used is {out['smi_used_is']}'s, not v2's"
            )
        reserved = row.get("reserved_mib")
        if isinstance(reserved, float):
            r.expect(
                abs(reserved - v2["reserved"] / MIB) <= MEMORY_SLACK_MIB,
                f"{phase}: nvidia-smi's reserved {reserved} MiB != v2's {v2['reserved'] / MIB:.0f} MiB",
            )
    return out


def check_memory(proof: Proof, r: Result) -> None:
    opts, lib = proof.opts, proof.lib
    handle, uuid = proof.handle(opts.gpu), proof.uuid(opts.gpu)
    smi = smi_memory()
    if isinstance(smi, dict):
        r.skipped.append(f"nvidia-smi: {smi['error']}")
    r.data["idle"] = _compare_memory(r, "idle", memory(lib, handle), smi, opts.gpu)
    if proof.no_cuda(r, "memory held through CUDA (the fake counts the holder instead)") and not opts.fake:
        return
    with Holder(proof, opts.gpu, opts.hold_gib) as holder:
        nvml_held, smi_held = memory(lib, handle), smi_memory()
        held = r.data["held"] = _compare_memory(r, "held", nvml_held, smi_held, opts.gpu)
        reader = proof.reader()
        reader.open()
        try:
            sample = reader.sample(uuid)
        finally:
            reader.close()
        held["reader"] = {"used": sample.memory_used_bytes, "reserved": sample.memory_reserved_bytes}
        v2_idle = r.data["idle"]["nvml"].get("v2", {}).get("used")
        v2_held = nvml_held.get("v2", {}).get("used")
        if isinstance(v2_idle, int) and isinstance(v2_held, int):
            grew = v2_held - v2_idle
            held["v2_used_grew_gib"] = round(grew / GIB, 3)
            r.expect(
                grew >= 0.95 * holder.info["held_bytes"],
                f"v2 used grew {grew / GIB:.2f} GiB with {opts.hold_gib} GiB held",
            )
            r.expect(
                sample.memory_used_bytes is not None
                and abs(sample.memory_used_bytes - v2_held) <= MEMORY_SLACK_MIB * MIB,
                f"the daemon's reader says {sample.memory_used_bytes} used, v2 says {v2_held}",
            )


# -- 4. index mapping ---------------------------------------------------------------------

CUDA_CHILD: Final = (
    "import json, torch; p = torch.cuda.get_device_properties(0); u = str(p.uuid);"
    " print(json.dumps({'device_count': torch.cuda.device_count(), 'name': p.name,"
    " 'uuid': u if u.startswith('GPU-') else 'GPU-' + u,"
    " 'pci': [getattr(p, 'pci_domain_id', None), getattr(p, 'pci_bus_id', None),"
    " getattr(p, 'pci_device_id', None)]}))"
)


def cuda_view(visible: str, timeout_s: float = 120) -> dict[str, Any]:
    """What a child with CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=``visible`` sees."""
    done = subprocess.run(
        [sys.executable, "-c", CUDA_CHILD],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=cuda_env(visible),
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-300:]}
    view: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return view


def check_index_mapping(proof: Proof, r: Result) -> None:
    rows = []
    for index, _handle, uuid in proof.gpus():
        row: dict[str, Any] = {"index": index, "uuid": uuid, "env": {"by_index": str(index), "by_uuid": uuid}}
        rows.append(row)
        if proof.no_cuda(r, f"GPU {index}: the CUDA child's device UUID"):
            continue
        for form, visible in (("by_index", str(index)), ("by_uuid", uuid)):
            view = row[form] = cuda_view(visible)
            if r.expect("error" not in view, f"GPU {index} {form}: the child failed: {view.get('error')}"):
                r.expect(
                    view["device_count"] == 1,
                    f"GPU {index} {form}: the child sees {view['device_count']} devices",
                )
                r.expect(
                    view["uuid"] == uuid,
                    f"GPU {index} {form}: CUDA device 0 is {view['uuid']}, NVML's is {uuid}",
                )
    r.data["gpus"] = rows


# -- 5. fault-state reads -----------------------------------------------------------------


def _event_names(mask: int) -> list[str]:
    return [name for bit, name in EVENT_KINDS.items() if mask & bit]


def check_fault_state(proof: Proof, r: Result) -> None:
    lib, opts = proof.lib, proof.opts
    reader = proof.reader()
    reader.open()
    try:
        registered = reader.registered_events()
        rows = []
        for index, handle, uuid in proof.gpus():
            fields = field_values(
                lib,
                handle,
                [FI_GPU_RECOVERY_ACTION, FI_SW_THERMAL_NS, FI_HW_THERMAL_NS, FI_HW_POWER_BRAKE_NS],
            )
            action = fields.get(str(FI_GPU_RECOVERY_ACTION), {}) if not failed(fields) else {}
            if "value" in action:
                action["name"] = recovery_action_name(action["value"])
                r.expect(action["value"] == 0, f"GPU {index}: recovery action {action['name']} standing")
            supported = read(lib, "nvmlDeviceGetSupportedEventTypes", handle)
            mask = int(supported) if not failed(supported) else 0
            ecc: dict[str, Any] = {"mode": read(lib, "nvmlDeviceGetEccMode", handle)}
            for kind, error_type in (("corrected", 0), ("uncorrected", 1)):
                for counter, counter_type in (("volatile", 0), ("aggregate", 1)):
                    ecc[f"{kind}_{counter}"] = read(
                        lib, "nvmlDeviceGetTotalEccErrors", handle, error_type, counter_type
                    )
            got = registered.get(uuid, 0)
            row = {
                "index": index,
                "fields": fields,
                "recovery_action": action,
                "remapped_rows": read(lib, "nvmlDeviceGetRemappedRows", handle),
                "ecc": ecc,
                "supported_events": hex(mask) if not failed(supported) else supported,
                "supported_names": _event_names(mask),
                "q7_bits": {hex(bit): bool(mask & bit) for bit in Q7_EVENT_BITS},
                "registered": _event_names(got),
                "not_registered": _event_names(DEFAULT_EVENT_TYPES & mask & ~got),
            }
            rows.append(row)
            r.expect(
                got == DEFAULT_EVENT_TYPES & mask,
                f"GPU {index}: supported and wanted but not registered: {row['not_registered']}",
            )
            remapped = row["remapped_rows"]
            if not failed(remapped):
                r.expect(not remapped[3], f"GPU {index}: a row remap failed: {remapped}")
        r.data["gpus"] = rows
        r.data["wait"] = _event_wait_while_sampling(reader, [u for _, _, u in proof.gpus()], opts, r)
    finally:
        reader.close()


def _event_wait_while_sampling(
    reader: NvmlReader, uuids: list[str], opts: Options, r: Result
) -> dict[str, Any]:
    """``opts.event_waits`` waits of ``opts.event_wait_ms`` while 4 threads sample every GPU:
    the wait must time out in about its timeout and hold no sampler back."""
    stop = threading.Event()
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def sampler() -> None:
        while not stop.is_set():
            for uuid in uuids:
                t0 = time.monotonic()
                try:
                    reader.sample(uuid)
                except Exception as exc:
                    with lock:
                        errors.append(type(exc).__name__)
                with lock:
                    latencies.append(time.monotonic() - t0)

    threads = [threading.Thread(target=sampler, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    waits = []
    events = []
    try:
        for _ in range(opts.event_waits):
            t0 = time.monotonic()
            event = reader.wait_event(opts.event_wait_ms)
            waits.append(round(time.monotonic() - t0, 4))
            if event is not None:
                events.append({"kind": event.kind, "index": event.index, "xid": event.xid})
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    timeout_s = opts.event_wait_ms / 1000
    for took in waits:
        r.expect(
            0.8 * timeout_s <= took <= timeout_s + 1.0,
            f"nvmlEventSetWait({opts.event_wait_ms}) returned after {took} s",
        )
    if events:
        r.notes.append(f"events arrived during the waits: {events}")
    r.expect(bool(latencies), "no sample finished while the event waits ran")
    r.expect(not errors, f"samples failed during the waits: {sorted(set(errors))}")
    slowest = max(latencies, default=0.0)
    r.expect(
        slowest < timeout_s, f"a sample took {slowest:.3f} s while an event wait ran: it waited behind it"
    )
    return {
        "timeout_ms": opts.event_wait_ms,
        "waits_s": waits,
        "events": events,
        "samples_meanwhile": len(latencies),
        "sample_p50_ms": round(1000 * sorted(latencies)[len(latencies) // 2], 3) if latencies else None,
        "sample_max_ms": round(1000 * slowest, 3),
    }


# -- 6. thermal and power -----------------------------------------------------------------

BURN_CODE: Final = """
import json, sys, time, torch
seconds, n = float(sys.argv[1]), 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
print(json.dumps({"started": time.monotonic()}), flush=True)
t0, iters = time.monotonic(), 0
while time.monotonic() - t0 < seconds:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
    iters += 20
took = time.monotonic() - t0
tflops = 2 * n**3 * iters / took / 1e12
print(json.dumps({"stopped": time.monotonic(), "iters": iters, "tflops": tflops}), flush=True)
"""


def _tick(lib: Any, reader: NvmlReader, gpus: list[tuple[int, Any, str]]) -> dict[int, tuple[GpuSample, Any]]:
    return {
        index: (reader.sample(uuid), read(lib, "nvmlDeviceGetMarginTemperature", handle))
        for index, handle, uuid in gpus
    }


def _phase_summary(ticks: list[tuple[float, dict[int, tuple[GpuSample, Any]]]]) -> dict[str, Any]:
    per_gpu: dict[str, Any] = {}
    for index in sorted({i for _, t in ticks for i in t}):
        samples = [t[index][0] for _, t in ticks if index in t]
        margins = [t[index][1] for _, t in ticks if index in t and isinstance(t[index][1], int)]
        masks: dict[str, int] = {}
        for s in samples:
            key = hex(s.clock_event_reasons) if s.clock_event_reasons is not None else "none"
            masks[key] = masks.get(key, 0) + 1
        powers = [s.power_w for s in samples if s.power_w is not None]
        temps = [s.temperature_c for s in samples if s.temperature_c is not None]
        clocks = [s.sm_clock_mhz for s in samples if s.sm_clock_mhz is not None]
        per_gpu[str(index)] = {
            "samples": len(samples),
            "clock_event_masks": masks,
            "reasons_seen": sorted(set().union(*(s.clock_event_reason_names for s in samples))),
            "temperature_c_max": max(temps, default=None),
            "margin_c_min": min(margins, default=None),
            "power_w_max": max(powers, default=None),
            "power_limit_w": samples[-1].power_limit_w if samples else None,
            "sm_clock_mhz": [min(clocks, default=None), max(clocks, default=None)],
            "unread": sorted({u for s in samples for u in s.unread}),
        }
    return per_gpu


def check_thermal_power(proof: Proof, r: Result) -> None:
    from llmsupervisor.core.observe import Observation
    from llmsupervisor.detectors import DetectorConfig, new_window
    from llmsupervisor.detectors.gpu import (
        detect_foreign_gpu_memory,
        detect_gpu_fault,
        detect_gpu_lost,
        detect_nvml_lost,
        detect_power_throttle,
        detect_thermal,
    )
    from llmsupervisor.detectors.tracker import FindingTracker

    lib, opts = proof.lib, proof.opts
    gpus = proof.gpus()
    handle0 = proof.handle(opts.gpu)
    r.data["thresholds"] = {
        str(index): {
            name: read(lib, "nvmlDeviceGetTemperatureThreshold", handle, t) for name, t in THRESHOLDS.items()
        }
        for index, handle, _ in gpus
    }
    cfg = DetectorConfig()
    window = new_window(cfg)
    tracker = FindingTracker(cfg)
    detectors = (
        detect_thermal,
        detect_power_throttle,
        detect_gpu_fault,
        detect_gpu_lost,
        detect_nvml_lost,
        detect_foreign_gpu_memory,
    )
    raw: dict[str, dict[str, Any]] = {}
    opened: list[dict[str, Any]] = []
    tick_s = 1.0 if not opts.fake else 0.1
    reader = proof.reader()
    reader.open()
    start = time.monotonic()

    def tick() -> dict[int, tuple[GpuSample, Any]]:
        got = _tick(lib, reader, gpus)
        now = time.monotonic()
        window.append(Observation(engine="gpu-proof", at_s=now, gpus={i: s for i, (s, _) in got.items()}))
        found = [f for d in detectors if (f := d(window, now, cfg)) is not None]
        for f in found:
            entry = raw.setdefault(
                f"{f.kind.value}/{f.severity.value}", {"ticks": 0, "first_s": round(now - start, 1)}
            )
            entry["ticks"] += 1
            entry["summary"] = f.summary
        update = tracker.update(found, now)
        opened.extend(
            {
                "kind": f.kind.value,
                "severity": f.severity.value,
                "at_s": round(now - start, 1),
                "summary": f.summary,
            }
            for f in update.opened
        )
        return got

    def phase(
        seconds: float, until: Callable[[], bool] | None = None
    ) -> list[tuple[float, dict[int, tuple[GpuSample, Any]]]]:
        ticks = []
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until is not None and until()):
            ticks.append((time.monotonic() - start, tick()))
            time.sleep(tick_s)
        return ticks

    try:
        idle = phase(3 * tick_s)
        fields_before = field_values(lib, handle0, [FI_SW_THERMAL_NS, FI_HW_THERMAL_NS, FI_HW_POWER_BRAKE_NS])
        burn_ticks: list[tuple[float, dict[int, tuple[GpuSample, Any]]]] = []
        fields_after: dict[str, Any] = {}
        if opts.fake:
            r.skipped.append(
                "the bf16 matmul burn: --fake (the fake GPU is scripted hot and power-capped instead)"
            )
            dev = proof.lib.devices[opts.gpu]
            saved = (dev.clock_event_reasons, dev.temperature_c, dev.power_mw, dict(dev.fields))
            dev.clock_event_reasons, dev.temperature_c, dev.power_mw = 0x4 | 0x20, 84, 690_000
            end = time.monotonic() + opts.burn_s
            while time.monotonic() < end:
                ret, ns = dev.fields[FI_SW_THERMAL_NS]
                dev.fields[FI_SW_THERMAL_NS] = (ret, ns + int(0.8 * tick_s * 1e9))
                burn_ticks += phase(tick_s)
            fields_after = field_values(
                lib, handle0, [FI_SW_THERMAL_NS, FI_HW_THERMAL_NS, FI_HW_POWER_BRAKE_NS]
            )
            dev.clock_event_reasons, dev.temperature_c, dev.power_mw, dev.fields = (
                saved[0],
                saved[1],
                saved[2],
                saved[3],
            )
        elif not proof.no_cuda(r, "the bf16 matmul burn"):
            burn_ticks = _burn(proof, r, phase)
        fields_after = fields_after or field_values(
            lib, handle0, [FI_SW_THERMAL_NS, FI_HW_THERMAL_NS, FI_HW_POWER_BRAKE_NS]
        )
        after = phase(3 * tick_s)
    finally:
        reader.close()
    deltas: dict[str, Any] = {}
    for fid in (FI_SW_THERMAL_NS, FI_HW_THERMAL_NS, FI_HW_POWER_BRAKE_NS):
        b, a = fields_before.get(str(fid), {}), fields_after.get(str(fid), {})
        deltas[str(fid)] = (
            round((a["value"] - b["value"]) / 1e9, 3)
            if "value" in a and "value" in b
            else {"before": b, "after": a}
        )
    r.data.update(
        idle=_phase_summary(idle),
        burn=_phase_summary(burn_ticks),
        after=_phase_summary(after),
        throttle_seconds_delta=deltas,
        detectors_raw=raw,
        findings_opened=opened,
        sustain_s={k.value: v for k, v in cfg.sustain_s.items() if k.value in ("thermal", "power_throttle")},
    )
    for phase_name in ("idle", "burn", "after"):
        for index, summary in r.data[phase_name].items():
            r.expect(
                not summary["unread"],
                f"{phase_name}: GPU {index}: the reader could not read {summary['unread']}",
            )
    idle0 = r.data["idle"].get(str(opts.gpu), {})
    if "gpu_idle" not in idle0.get("reasons_seen", ["gpu_idle"]):
        r.notes.append(f"idle clock-event reasons: {idle0.get('reasons_seen')} (gpu_idle expected)")


def _burn(
    proof: Proof, r: Result, phase: Callable[..., list[tuple[float, dict[int, tuple[GpuSample, Any]]]]]
) -> list[tuple[float, dict[int, tuple[GpuSample, Any]]]]:
    opts = proof.opts
    log = proof.workdir / "burn.log"
    with open(log, "w") as err:
        burner = subprocess.Popen(
            [sys.executable, "-c", BURN_CODE, str(opts.burn_s)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=cuda_env(opts.gpu),
            start_new_session=True,
        )
    try:
        assert burner.stdout is not None
        first = burner.stdout.readline()
        if not first:
            r.expect(False, f"the burn did not start: {log.read_text()[-500:]}")
            return []
        ticks = phase(opts.burn_s + 30, until=lambda: burner.poll() is not None)
        rest = burner.stdout.read()
        lines = [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
        r.data["burn_result"] = lines[-1] if lines else {"error": log.read_text()[-500:]}
        return ticks
    finally:
        if burner.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(burner.pid, signal.SIGKILL)
        burner.wait(30)


# -- 7. the daemon over a GPU engine ------------------------------------------------------

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


def check_daemon(proof: Proof, r: Result) -> None:
    import httpx

    from tests.lib.daemon import Daemon, cli, fake_engine, free_port, metric

    opts, lib = proof.opts, proof.lib
    gpu = 0 if opts.fake else opts.gpu  # the --fake-gpu file plays GPU 0
    uuid = fake_uuid(0) if opts.fake else proof.uuid(gpu)
    engine_bytes = int(opts.engine_gib * GIB)
    port = free_port()
    engine = fake_engine(
        "gpu0",
        port,
        gpus=[gpu],
        start_timeout_s=180,
        stop_timeout_s=30,
        gpu_release_timeout_s=60,
        detectors={"sustain_s": {"foreign_gpu_memory": 1}, "clear_s": {"foreign_gpu_memory": 1}},
    )
    gpu_file = proof.workdir / "fake-gpu.json"
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
    foreign: subprocess.Popen[bytes] | Holder | None = None
    try:
        d.start(extra_env=_daemon_env(proof))
        ready = d.wait_state("gpu0", "ready", timeout_s=180)
        pid = int(ready["pid"])
        r.data["engine_pid"] = pid
        seen = httpx.get(f"http://127.0.0.1:{port}/fake/cuda", timeout=10).json()
        r.data["engine_cuda"] = seen
        r.expect(
            seen.get("cuda_visible_devices") == str(gpu),
            f"the engine's CUDA_VISIBLE_DEVICES is {seen.get('cuda_visible_devices')}",
        )
        r.expect(
            seen.get("cuda_device_order") == "PCI_BUS_ID",
            f"the engine's CUDA_DEVICE_ORDER is {seen.get('cuda_device_order')}",
        )
        if "fake-cuda-gib" in engine["args"]:
            r.expect(
                seen.get("device_count") == 1, f"the engine sees {seen.get('device_count')} CUDA devices"
            )
            r.expect(
                seen.get("uuid") == uuid, f"the engine's CUDA device is {seen.get('uuid')}, its GPU is {uuid}"
            )
        if opts.fake:
            _write_fake_gpu(gpu_file, uuid, [(pid, engine_bytes)])
        else:
            pids = compute_pids(lib, proof.handle(gpu))
            r.data["nvml_pids"] = {str(p): b for p, b in pids.items()}
            if "fake-cuda-gib" in engine["args"] and in_host_pid_namespace():
                r.expect(
                    (pids.get(pid) or 0) >= 0.95 * engine_bytes,
                    f"NVML does not list the engine {pid} with its memory: {pids}",
                )
        want = 0.95 * engine_bytes if opts.fake or "fake-cuda-gib" in engine["args"] else 0
        status_used, _ = wait_until(
            lambda: (
                used
                if (used := d.engine("gpu0").get("gpu_memory_used_bytes")) is not None and used >= want
                else None
            ),
            15,
            poll_s=0.2,
        )
        r.data["status_gpu_memory_used_bytes"] = status_used
        r.expect(
            status_used is not None, f"status never showed the engine's GPU memory (>= {want:.0f} bytes)"
        )
        r.data["metrics"] = {
            "gpu_memory_used_bytes": metric(d.http_url, "llmsupervisor_gpu_memory_used_bytes", gpu=str(gpu)),
            "gpu_memory_reserved_bytes": metric(
                d.http_url, "llmsupervisor_gpu_memory_reserved_bytes", gpu=str(gpu)
            ),
            "engine_info": metric(
                d.http_url,
                "llmsupervisor_engine_info",
                engine="gpu0",
                port=str(port),
                gpus=str(gpu),
                model=str(d.engine("gpu0")["model"]),
            ),
        }
        used_metric = r.data["metrics"]["gpu_memory_used_bytes"]
        r.expect(
            used_metric is not None and used_metric >= want,
            f"/metrics shows {used_metric} bytes used on GPU {gpu}",
        )
        r.expect(
            r.data["metrics"]["engine_info"] == 1.0, f"/metrics has no engine_info for gpu0 on GPU {gpu}"
        )
        # The daemon's own CPU with one engine ready, GPU sampled every tick.
        proc = psutil.Process(d.pid)
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(opts.cpu_window_s)
        cpu, took = sum(proc.cpu_times()[:2]) - cpu0, time.monotonic() - t0
        r.data["daemon_cpu"] = {
            "window_s": round(took, 2),
            "cpu_s": round(cpu, 3),
            "percent_of_a_core": round(100 * cpu / took, 2),
        }
        # A foreign process on the engine's GPU.
        if opts.fake:
            foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            foreign_pid = foreign.pid
            _write_fake_gpu(gpu_file, uuid, [(pid, engine_bytes), (foreign_pid, int(opts.foreign_gib * GIB))])
        elif proof.no_cuda(r, "the foreign process's CUDA allocation"):
            foreign_pid = None
        else:
            foreign = Holder(proof, gpu, opts.foreign_gib)
            foreign_pid = foreign.grandchild_pid
        if foreign_pid is not None:
            finding, took_s = wait_until(
                lambda: next(
                    (f for f in d.engine("gpu0").get("findings", []) if f["kind"] == "foreign_gpu_memory"),
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
            if isinstance(foreign, Holder):
                foreign.close()
            elif foreign is not None:
                foreign.kill()
                foreign.wait()
                _write_fake_gpu(gpu_file, uuid, [(pid, engine_bytes)])
            foreign = None
        # Stop: the daemon waits for NVML to show the memory released.
        releaser = None
        if opts.fake:
            # Play the driver: the engine's memory is listed until a moment after it exits.
            def release_after_exit() -> None:
                wait_until(lambda: not _alive(pid), 60, poll_s=0.05)
                time.sleep(0.5)
                _write_fake_gpu(gpu_file, uuid, [])

            releaser = threading.Thread(target=release_after_exit, daemon=True)
            releaser.start()
        t0 = time.monotonic()
        stop = cli(d, "stop", "gpu0", "--wait", "--timeout", "120", timeout_s=150)
        r.data["stop"] = {
            "rc": stop.returncode,
            "took_s": round(time.monotonic() - t0, 2),
            "out": stop.stdout.strip()[-300:],
        }
        r.expect(stop.returncode == 0, f"stop --wait: exit {stop.returncode}: {stop.stderr.strip()[-300:]}")
        if not opts.fake:
            gone, after = wait_until(lambda: pid not in compute_pids(lib, proof.handle(gpu)), 60)
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
        r.expect(d.stop() == 0, "the daemon did not exit 0 on SIGTERM")
    finally:
        if isinstance(foreign, Holder):
            foreign.close()
        elif foreign is not None:
            foreign.kill()
            foreign.wait()
        r.data["daemon_log_tail"] = d.log()[-1500:] if d.log_path.exists() and not r.ok else None
        d.cleanup()


# -- 8. cost ------------------------------------------------------------------------------


def check_cost(proof: Proof, r: Result) -> None:
    from llmsupervisor.probes.gpu_threads import ThreadedGpuReader

    opts = proof.opts
    reader = proof.reader()

    async def measure() -> dict[str, Any]:
        threaded = ThreadedGpuReader(reader)
        gpus = await threaded.open()
        try:
            await threaded.sample_all()  # warm: thresholds read once
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(opts.cost_samples):
                await threaded.sample_all()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            per = opts.cost_samples * max(len(gpus), 1)
            waits = []
            cpu1 = time.process_time()
            for _ in range(opts.event_waits):
                t0 = time.perf_counter()
                await threaded.wait_event(opts.event_wait_ms)
                waits.append(time.perf_counter() - t0)
            wait_cpu = time.process_time() - cpu1
        finally:
            await threaded.close()
        # One sample in this thread, without the daemon's per-call thread: the NVML calls alone.
        return {
            "gpus": len(gpus),
            "samples": opts.cost_samples,
            "cpu_ms_per_gpu_sample": round(1000 * cpu / per, 3),
            "wall_ms_per_gpu_sample": round(1000 * wall / per, 3),
            "event_waits": opts.event_waits,
            "event_wait_ms": opts.event_wait_ms,
            "cpu_ms_per_event_wait": round(1000 * wait_cpu / max(opts.event_waits, 1), 3),
            "wall_s_per_event_wait": round(sum(waits) / max(len(waits), 1), 3),
        }

    r.data.update(asyncio.run(measure()))
    direct = proof.reader()
    direct.open()
    try:
        uuid = next(iter(direct.registered_events()), None)
        if uuid is not None:
            t0 = time.thread_time()
            for _ in range(opts.cost_samples):
                direct.sample(uuid)
            r.data["cpu_ms_per_sample_unthreaded"] = round(
                1000 * (time.thread_time() - t0) / opts.cost_samples, 3
            )
    finally:
        direct.close()
    # At the default 1 s tick: the share of one core the GPU sampling takes, per GPU.
    r.data["percent_of_a_core_per_gpu_at_1s_tick"] = round(r.data["cpu_ms_per_gpu_sample"] / 10, 3)
    r.expect(r.data["gpus"] > 0, "the threaded reader opened no GPU")


# -- the run ------------------------------------------------------------------------------

Check = Callable[[Proof, Result], None]
CHECKS: Final[tuple[tuple[int, str, Check], ...]] = (
    (1, "facts", check_facts),
    (2, "pid_attribution", check_pid_attribution),
    (3, "memory", check_memory),
    (4, "index_mapping", check_index_mapping),
    (5, "fault_state", check_fault_state),
    (6, "thermal_power", check_thermal_power),
    (7, "daemon", check_daemon),
    (8, "cost", check_cost),
)


def budget_s(number: int, opts: Options) -> float:
    """How long a check may run before it is stopped (its line then says so)."""
    return {2: 240.0, 3: 240.0, 4: 240.0, 6: opts.burn_s + 150.0, 7: 420.0}.get(number, 120.0)


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """CheckTimeout in the main thread after ``seconds`` (no-op elsewhere: signals need it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(_signum: int, _frame: FrameType | None) -> None:
        raise CheckTimeout(f"ran past its budget of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(proof: Proof, number: int) -> Result:
    """One check, guarded: an exception or its budget ends it with ``error`` set."""
    name, fn = next((n, f) for num, n, f in CHECKS if num == number)
    result = Result(number, name)
    start = time.monotonic()
    try:
        with _alarm(budget_s(number, proof.opts)):
            fn(proof, result)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:1000]
        result.data["traceback"] = traceback.format_exc()[-2000:]
    result.elapsed_s = time.monotonic() - start
    return result


def _parse(argv: Sequence[str] | None) -> tuple[Options, list[int], Path | None]:
    d = Options()
    p = argparse.ArgumentParser(
        prog="gpu_proof.py", description="Issue 24's proof on a real GPU: one JSON line per check."
    )
    p.add_argument("--fake", action="store_true", help="the pynvml-level fake, no CUDA (tests, dry runs)")
    p.add_argument("--fake-gpus", type=int, default=d.fake_gpus, help="with --fake: how many GPUs")
    p.add_argument(
        "--checks", default="1,2,3,4,5,6,7,8", help="which checks, in the order given (default all)"
    )
    p.add_argument("--gpu", type=int, default=d.gpu, help="the NVML index memory is held on and burned")
    p.add_argument("--hold-gib", type=float, default=d.hold_gib, help="checks 2 and 3")
    p.add_argument("--engine-gib", type=float, default=d.engine_gib, help="check 7's engine")
    p.add_argument("--foreign-gib", type=float, default=d.foreign_gib, help="check 7's foreign process")
    p.add_argument("--burn-s", type=float, default=d.burn_s, help="check 6's bf16 matmul burn")
    p.add_argument("--event-waits", type=int, default=d.event_waits, help="checks 5 and 8")
    p.add_argument("--event-wait-ms", type=int, default=d.event_wait_ms)
    p.add_argument("--cost-samples", type=int, default=d.cost_samples, help="check 8")
    p.add_argument("--cpu-window-s", type=float, default=d.cpu_window_s, help="check 7's daemon CPU window")
    p.add_argument("--release-timeout-s", type=float, default=d.release_timeout_s, help="check 2")
    p.add_argument("--out", type=Path, default=None, help="also append each line to this file")
    a = p.parse_args(argv)
    opts = Options(
        fake=a.fake,
        fake_gpus=a.fake_gpus,
        gpu=a.gpu,
        hold_gib=a.hold_gib,
        engine_gib=a.engine_gib,
        foreign_gib=a.foreign_gib,
        burn_s=a.burn_s,
        event_waits=a.event_waits,
        event_wait_ms=a.event_wait_ms,
        cost_samples=a.cost_samples,
        cpu_window_s=a.cpu_window_s,
        release_timeout_s=a.release_timeout_s,
    )
    numbers = [int(n) for n in a.checks.split(",") if n.strip()]
    known = {num for num, _, _ in CHECKS}
    if not set(numbers) <= known:
        p.error(f"--checks: known checks are {sorted(known)}")
    return opts, numbers, a.out


def main(argv: Sequence[str] | None = None) -> int:
    """Print one JSON line per check; exit 0 when every check is ok, 1 otherwise."""
    opts, numbers, out = _parse(argv)
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]  # children import tests.lib and llmsupervisor
    os.environ.pop("NOTIFY_SOCKET", None)
    proof = Proof(opts)
    ok = True
    try:
        for number in numbers:
            result = run_check(proof, number)
            ok = ok and result.ok
            line = json.dumps(result.line(), default=str)
            print(line, flush=True)
            if out is not None:
                with open(out, "a") as f:
                    f.write(line + "\n")
    finally:
        proof.close()
    return 0 if ok else 1


__all__ = [
    "CHECKS",
    "LIB",
    "LINE_KEYS",
    "LiveFakeNvml",
    "Options",
    "Proof",
    "Result",
    "driver_answers",
    "holder_main",
    "main",
    "run_check",
]
