#!/usr/bin/env python3
"""Issue 24's proof on a real GPU, in one prepared call: one JSON line per check, in the issue's
order (facts, PID attribution, memory v1/v2, index mapping, fault-state reads, thermal and power,
the daemon over a GPU engine, cost). The checks live in tests/lib/gpu_proof/ (one module a check), which
the gpu tier (tests/host/test_gpu_proof.py) runs too.

Needs Python 3.11+, nvidia-ml-py, psutil, httpx, prometheus-client and PyYAML, and torch with
CUDA for the parts that allocate (the lent H100/H200 has all of them; sdnotify, which it lacks,
is stubbed for the daemon's child only). Reads NVML and allocates through torch; never resets a
GPU or changes clocks, power limits, ECC or MIG.

    python3 bench/gpu_proof.py                 # on the GPU machine: about 4 minutes
    python3 bench/gpu_proof.py --burn-s 20 --hold-gib 4 --checks 1,3,4,5
    .venv/bin/python bench/gpu_proof.py --fake --burn-s 1 --event-wait-ms 200   # here, no GPU

docs/gpu-validation.md has the device-tool command and what each line proves.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.lib.gpu_proof import main

if __name__ == "__main__":
    sys.exit(main())
