"""What the step heartbeat costs vLLM per step, and the daemon per read.

The plugin's two calls per step (``on_schedule`` and ``on_done``: a clock read, a few integer
updates and one 72-byte ``struct.pack_into`` into the mmap'd page) against a step of vLLM that
takes milliseconds (tiny model on the CPU build) to tens of milliseconds (a GPU decode step of a
large batch); and the daemon's read (open, two 72-byte preads, close) once per round.

    .venv/bin/python bench/step_heartbeat_cost.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from llmsupervisor.probes.heartbeat import read_heartbeat  # noqa: E402
from llmsupervisor.probes.vllm_plugin.llmsupervisor_step_heartbeat import Heartbeat  # noqa: E402

N = 200_000
REPEATS = 5


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step-heartbeat"
        beat = Heartbeat(str(path))

        def step() -> None:
            beat.on_schedule(8)
            beat.on_done(8)

        per_step_us = [t / N * 1e6 for t in timeit.repeat(step, number=N, repeat=REPEATS)]
        reads = 20_000
        per_read_us = [
            t / reads * 1e6 for t in timeit.repeat(lambda: read_heartbeat(path), number=reads, repeat=REPEATS)
        ]
        beat_read = read_heartbeat(path)
        assert beat_read is not None and not isinstance(beat_read, Exception), beat_read
    print(f"python {sys.version.split()[0]}, {N} steps x {REPEATS}")
    print(
        f"per step (schedule + done): median {statistics.median(per_step_us):.2f} us, "
        f"min {min(per_step_us):.2f} us"
    )
    print(f"per daemon read: median {statistics.median(per_read_us):.1f} us, min {min(per_read_us):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
