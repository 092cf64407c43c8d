"""The holder: a setsid parent (``holder_main``, run as ``python -c HOLDER_CODE``) that spawns
(multiprocessing, spawn) a grandchild holding N GiB on CUDA device 0; ``Holder`` starts it on a
GPU and always ends it. Checks 2, 3 and 7 hold memory through it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

from tests.lib.gpu_proof.live_fake import LiveFakeNvml
from tests.lib.gpu_proof.nvml_reads import GIB
from tests.lib.gpu_proof.proof import Proof, cuda_env
from tests.lib.paths import REPO

HOLDER_CODE: Final = (
    "import sys; from tests.lib.gpu_proof.holder import holder_main; sys.exit(holder_main(sys.argv[1:]))"
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
