"""The Python stacks of running processes, through ``py-spy dump``: several at once, under one deadline.

The primitive under an engine's evidence (engine/evidence.py decides when and in what order; the
runner reaches it through the ``Processes`` seam, engine/processes.py). It knows nothing of
engines: pids in, one ``StackDump`` per pid out, or None where there is no py-spy.

py-spy reads the target's memory (process_vm_readv, ptrace), so it works on a process frozen
by SIGSTOP as well; a stopped process is dumped with ``--nonblocking``, which does not pause and
resume it. Whatever fails is a ``StackDump`` with ``ok`` False and the reason as its text.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class StackDump:
    pid: int
    title: str  # the command line (VLLM::EngineCore, ...)
    state: str  # from /proc/PID/status: "S (sleeping)", "T (stopped)", ...
    ok: bool
    text: str  # the stacks, or why there are none


def find_py_spy() -> str | None:
    """py-spy next to the daemon's python (its venv, where the package installs it), else PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def proc_facts(pid: int) -> tuple[str, str]:
    """A process's command line (its title) and its state from /proc; "?" for what cannot be read."""
    title, state = "?", "?"
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        title = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:300] or "?"
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                state = line.split(":", 1)[1].strip()
                break
    return title, state


def _dump_one(py_spy: str, pid: int, timeout_s: float) -> StackDump:
    title, state = proc_facts(pid)
    argv = [py_spy, "dump", "--pid", str(pid)]
    if state.startswith(("T", "t")):
        argv.append("--nonblocking")  # it is frozen already: do not pause and resume it
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired:
        return StackDump(pid, title, state, False, f"py-spy did not finish within {timeout_s:g} s")
    except OSError as exc:
        return StackDump(pid, title, state, False, f"cannot run py-spy: {exc.strerror or exc}")
    if done.returncode != 0:
        first = next((ln for ln in done.stderr.splitlines() if ln.strip()), f"exit {done.returncode}")
        return StackDump(pid, title, state, False, f"py-spy failed: {first.strip()}")
    return StackDump(pid, title, state, True, done.stdout)


async def dump_stacks(
    pids: Sequence[int], *, timeout_s: float, py_spy: str | None = None
) -> list[StackDump] | None:
    """Every process's stacks, concurrently, within ``timeout_s`` in all; None without py-spy."""
    py_spy = py_spy or find_py_spy()
    if py_spy is None:
        return None
    if not pids:
        return []
    # A thread per process (blocking subprocess.run: the daemon starts no asyncio child watcher),
    # all under one deadline.
    loop = asyncio.get_running_loop()
    results: list[StackDump | None] = [None] * len(pids)

    async def one(i: int, pid: int) -> None:
        results[i] = await asyncio.to_thread(_dump_one, py_spy, pid, timeout_s)

    tasks = [loop.create_task(one(i, pid)) for i, pid in enumerate(pids)]
    # subprocess.run kills py-spy at timeout_s; the margin covers starting the threads.
    await asyncio.wait(tasks, timeout=timeout_s + 1.0)
    out = []
    for pid, result in zip(pids, results, strict=True):
        if result is None:
            title, state = proc_facts(pid)
            result = StackDump(pid, title, state, False, f"no answer within {timeout_s:g} s")
        out.append(result)
    return out
