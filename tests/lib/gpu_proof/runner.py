"""The run: the checks in the issue's order, each under its budget (an exception or an overrun
ends it with ``error`` set, and the run goes on), one JSON line each; ``main`` is
``bench/gpu_proof.py``'s command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Final

from tests.lib.gpu_proof.cost import check_cost
from tests.lib.gpu_proof.daemon import check_daemon
from tests.lib.gpu_proof.facts import check_facts
from tests.lib.gpu_proof.fault_state import check_fault_state
from tests.lib.gpu_proof.index_mapping import check_index_mapping
from tests.lib.gpu_proof.memory import check_memory
from tests.lib.gpu_proof.pid_attribution import check_pid_attribution
from tests.lib.gpu_proof.proof import Options, Proof, child_env
from tests.lib.gpu_proof.result import CheckTimeout, Result
from tests.lib.gpu_proof.thermal_power import check_thermal_power

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
