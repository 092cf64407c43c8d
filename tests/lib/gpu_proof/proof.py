"""The run's context: its options, NVML opened once (``Proof``), what torch can do here, and the
environment of the children the checks start."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from llmsupervisor.probes.fake_nvml import FakeDevice, fake_uuid
from llmsupervisor.probes.gpu_readings import GpuSample
from llmsupervisor.probes.nvml import NvmlReader
from tests.lib.gpu_proof.live_fake import LiveFakeNvml
from tests.lib.gpu_proof.nvml_reads import plain
from tests.lib.gpu_proof.result import Result
from tests.lib.paths import REPO

PYTHON_PATH: Final = str(REPO)


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
                out.append((index, handle, str(plain(self.lib.nvmlDeviceGetUUID(handle)))))
        return out

    def handle(self, index: int) -> Any:
        return self.lib.nvmlDeviceGetHandleByIndex(index)

    def uuid(self, index: int) -> str:
        return str(plain(self.lib.nvmlDeviceGetUUID(self.handle(index))))

    def reader(self) -> NvmlReader:
        """The daemon's own reader over the same binding (its own nvmlInit, NVML counts them)."""
        return NvmlReader(self.lib)

    def sample(self, uuid: str) -> GpuSample:
        """One sample of ``uuid`` through the daemon's own reader, opened and closed for it."""
        reader = self.reader()
        reader.open()
        try:
            return reader.sample(uuid)
        finally:
            reader.close()

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
