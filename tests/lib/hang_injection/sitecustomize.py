"""Hang injection for the real-vLLM tests: imported by every Python process of an engine whose
``PYTHONPATH`` holds this folder (``site`` imports ``sitecustomize`` at start-up).

A thread polls ``$LLMSUP_HANG_DIR/<role>`` every 50 ms, where role is the process's vLLM title
without ``VLLM::`` (``EngineCore``, ``Worker``) or ``APIServer`` (the
group's leader). The file says what to do, once:

``deadlock``  take the GIL and block in a C call that keeps it (``pause()`` through
              ``ctypes.PyDLL``, which does not release the GIL): every Python thread of the
              process waits on the GIL's lock, at 0 % CPU, as in a deadlock;
``spin``      loop in Python with a switch interval of an hour: the loop keeps the GIL, the
              process burns a core, and its main loop never runs (no step), for at most
              ``LLMSUP_HANG_SPIN_S`` seconds (120 by default). In the API server the loop runs
              on the main thread instead, as a coroutine that never yields does (the field's
              case there), from a handler of ``SPIN_SIGNAL`` installed at start-up: a thread
              that spins there competes for the GIL with a loop busy serving, and it won only
              after seconds of load (issue 25's api-spin/load run of 9 s), so the hang began
              later than the trigger said.

No SIGSTOP: the process is running (state R or S), as in the hangs users report (issue 25).
Test code only; never on a production engine's path.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time


def _role() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            title = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"
    if title.startswith("VLLM::"):
        return title[len("VLLM::") :].split()[0].split("_")[0]
    # The API server is the process the supervisor spawned: the leader of the engine's group.
    return "APIServer" if os.getpid() == os.getpgid(0) else "?"


# A real-time signal nothing in vLLM, uvloop or torch handles.
SPIN_SIGNAL = signal.SIGRTMIN + 5


def _spin_s() -> float:
    return float(os.environ.get("LLMSUP_HANG_SPIN_S", "120"))


def _act(what: str) -> None:
    if what == "deadlock":
        ctypes.PyDLL(None).pause()  # holds the GIL until a signal
    elif what == "spin":
        sys.setswitchinterval(3600.0)
        until = time.monotonic() + _spin_s()
        while time.monotonic() < until:
            pass
        sys.setswitchinterval(0.005)


def _spin_on_main_thread(signum: int, frame: object) -> None:
    # Runs on the main thread, between two of its loop's callbacks: the loop is held, other
    # threads keep their share of the GIL.
    until = time.monotonic() + _spin_s()
    while time.monotonic() < until:
        pass


def _watch(folder: str) -> None:
    while True:
        time.sleep(0.05)
        path = os.path.join(folder, _role())
        try:
            with open(path) as f:
                what = f.read().strip()
            os.unlink(path)
        except OSError:
            continue
        if what == "spin" and _role() == "APIServer":
            main = threading.main_thread().ident
            assert main is not None
            signal.pthread_kill(main, SPIN_SIGNAL)
            continue
        _act(what)


_folder = os.environ.get("LLMSUP_HANG_DIR")
if _folder:
    signal.signal(SPIN_SIGNAL, _spin_on_main_thread)  # site imports this on the main thread
    threading.Thread(target=_watch, args=(_folder,), name="llmsup-hang-injection", daemon=True).start()
