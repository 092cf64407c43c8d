"""The checks of issue 24, "Proof on a real GPU", shared by ``bench/gpu_proof.py`` (the one
prepared call on a lent H100/H200) and the ``gpu`` tier (``tests/host/test_gpu_proof.py``).

Each check fills one ``Result``, printed as one JSON line; one that fails or runs past its
budget records its error and the run goes on. The order and the expectations come from the
issue and from ../shared/docs/gpu-review.md (Q7); docs/gpu-validation.md says how to run it and
what each line proves:

    1 facts            driver, NVML, nvidia-ml-py; per GPU name, UUID, PCI bus id, MIG mode,
                       NVSwitch fabric state (both fabric calls); the PID namespace
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

One module per check (``facts.py`` ... ``cost.py``, each ``check_NAME(proof, result)``), beside
what they share: ``result.py`` (the line), ``proof.py`` (the run's options, NVML opened once, the
children's environment), ``nvml_reads.py`` (NVML read as data), ``live_fake.py`` (the fake's
process habit), ``holder.py`` (the setsid parent and its memory-holding grandchild), and
``runner.py`` (the order, the budgets, ``main``).
"""

from tests.lib.gpu_proof.live_fake import LiveFakeNvml
from tests.lib.gpu_proof.nvml_reads import driver_answers
from tests.lib.gpu_proof.proof import Options, Proof
from tests.lib.gpu_proof.result import LINE_KEYS, Result
from tests.lib.gpu_proof.runner import CHECKS, main, run_check

__all__ = [
    "CHECKS",
    "LINE_KEYS",
    "LiveFakeNvml",
    "Options",
    "Proof",
    "Result",
    "driver_answers",
    "main",
    "run_check",
]
