"""``cpus: auto`` on a real NVIDIA GPU: the CPUs NVML names for a GPU are the kernel's view of
its NUMA node, and the daemon binds a GPU engine there from its first instruction.

The ``gpu`` tier: skipped where no NVIDIA driver answers (CI has none); run on a lent GPU
machine (docs/engines.md, "Placement", has the output of such a run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from llmsupervisor.probes.cpus import allowed_cpus_of, format_cpu_list, host_cpus, parse_cpu_list
from llmsupervisor.probes.nvml import NvmlReader
from tests.lib.daemon import fake_engine, free_port
from tests.lib.gpu_proof import driver_answers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not driver_answers(), reason="no NVIDIA driver answers NVML here"),
]


def _pci_bus_ids() -> dict[str, str]:
    """UUID -> the GPU's PCI address as sysfs spells it (``0000:00:05.0``)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        found = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            # NVML gives an 8-digit domain ("00000000:00:05.0"), sysfs a 4-digit one.
            found[uuid.decode() if isinstance(uuid, bytes) else uuid] = bus.lower()[-12:]
        return found
    finally:
        pynvml.nvmlShutdown()


def _smi_affinity() -> dict[int, str]:
    """GPU index -> the "CPU Affinity" column of ``nvidia-smi topo -m`` (empty without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60).stdout
    print(out)
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in out.splitlines()]
    header = next((line for line in lines if "CPU Affinity" in line), None)
    if header is None:
        return {}
    # The header's first cell is the row names' column (empty), so its indices match the rows'.
    at = next(i for i, c in enumerate(header.split("\t")) if "CPU Affinity" in c)
    found = {}
    for line in lines:
        cells = line.split("\t")
        name = cells[0].strip()
        if name.startswith("GPU") and name[3:].isdigit() and len(cells) > at:
            found[int(name[3:])] = cells[at].strip()
    return found


def test_nvml_cpu_affinity_is_the_gpus_numa_node() -> None:
    reader = NvmlReader()
    uuids = reader.open()
    try:
        assert uuids, "NVML answers but lists no GPU"
        buses = _pci_bus_ids()
        smi = _smi_affinity()
        for uuid, index in uuids.items():
            cpus = reader.cpu_affinity(uuid)
            print(f"GPU {index} {uuid}: NVML CPU affinity {format_cpu_list(cpus or ())}")
            assert cpus, f"NVML gave no CPU affinity for GPU {index}"
            assert cpus <= set(range(os.cpu_count() or 1)), cpus
            local = Path("/sys/bus/pci/devices") / buses[uuid] / "local_cpulist"
            if local.exists():
                kernel = set(parse_cpu_list(local.read_text().strip()))
                print(f"GPU {index}: kernel {local} = {format_cpu_list(kernel)}")
                assert cpus == kernel
            try:
                said = set(parse_cpu_list(smi[index])) if index in smi else None
            except ValueError:
                said = None  # "N/A", or a layout this parser does not know: printed above
            if said is not None:
                assert cpus == said, smi[index]
    finally:
        reader.close()


def _cli(config: Path, command: str) -> str:
    """``llm-supervisor --config CONFIG COMMAND``'s output (printed: the run's record)."""
    argv = [sys.executable, "-m", "llmsupervisor", "--config", str(config), command]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout
    print(out)
    return out


def _engine(name: str, gpus: list[int], cpus: Any) -> dict[str, Any]:
    return fake_engine(name, free_port(), gpus=gpus, cpus=cpus)


def test_the_daemon_binds_a_gpu_engine_to_its_gpus_numa_node(daemon_factory: Any, tmp_path: Path) -> None:
    reader = NvmlReader()
    uuids = reader.open()
    try:
        index_of = {index: uuid for uuid, index in uuids.items()}
        node = reader.cpu_affinity(index_of[0])
    finally:
        reader.close()
    assert node
    usable = node & host_cpus()
    assert len(usable) >= 2, f"GPU 0's node has too few CPUs for this test: {format_cpu_list(usable)}"
    # The last CPU of the node is claimed by an explicit engine: auto never hands it out.
    claimed = max(usable)
    expected = tuple(sorted(usable - {claimed}))
    config = {
        "engines": [
            _engine("gpu0", [0], "auto"),
            _engine("pinned", [], [claimed]),
        ]
    }
    d = daemon_factory(config)
    doctor = _cli(d.config_path, "doctor")
    assert f"engine gpu0 cpus: {format_cpu_list(expected)} (auto: on the NUMA node of GPU(s) 0" in doctor
    d.start()
    gpu0 = d.wait_state("gpu0", "ready", timeout_s=60)
    pinned = d.wait_state("pinned", "ready", timeout_s=60)
    d.wait_log("CPU placement: gpu0 on", timeout_s=5)
    assert gpu0["cpus"] == format_cpu_list(expected)
    assert pinned["cpus"] == str(claimed)
    # Every process and thread of the engine runs there, from the first one.
    proc = psutil.Process(gpu0["pid"])
    assert allowed_cpus_of(gpu0["pid"]) == expected
    for thread in proc.threads():
        assert allowed_cpus_of(thread.id) == expected
    env = proc.environ()
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == format_cpu_list(expected)
    assert allowed_cpus_of(pinned["pid"]) == (claimed,)
    # The daemon itself stays where it was started.
    assert set(allowed_cpus_of(d.pid) or ()) == set(host_cpus())
    assert format_cpu_list(expected) in _cli(d.config_path, "status")
    assert d.stop() == 0
