"""Check 1, facts: driver, NVML, nvidia-ml-py; per GPU its name, UUID, PCI bus id, MIG mode and
NVSwitch fabric state (issue 36, M6); the PID namespace."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from llmsupervisor.probes.nvml import PROC_PID_INIT_INO, in_host_pid_namespace
from tests.lib.gpu_proof.nvml_reads import fabric, failed, memory, plain, read
from tests.lib.gpu_proof.proof import Proof
from tests.lib.gpu_proof.result import Result


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
        fab = fabric(lib, handle)
        gpus.append(
            {
                "index": index,
                "name": read(lib, "nvmlDeviceGetName", handle),
                "uuid": uuid,
                "pci_bus_id": pci if failed(pci) else plain(getattr(pci, "busId", None)),
                "mig_mode": mig,
                "memory_total_bytes": memory(lib, handle).get("v2", {}).get("total"),
                "fabric": fab,
            }
        )
        if (problem := fab["versioned"].get("problem") or fab["unversioned"].get("problem")) is not None:
            r.notes.append(f"GPU {index}: NVSwitch fabric: {problem} (the daemon holds engines on it)")
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
