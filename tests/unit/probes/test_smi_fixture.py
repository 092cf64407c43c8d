"""A recorded ``nvidia-smi -q -x`` as a fixture: the reader must report what nvidia-smi showed.

No recording exists yet (no GPU in the sessions that wrote this; docs/gpu.md). Each
``tests/fixtures/nvidia-smi/*.xml`` becomes ``FakeDevice``s built from nvidia-smi's own numbers;
the real ``NvmlReader`` runs over them. The harness itself runs on a synthetic document with the
same element names (nvidia-smi's XML schema, ``nvsmi_device_v12.dtd``), so it is ready to consume
a recording the day one is added.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from llmsupervisor.probes.fake_nvml import MIB, FakeDevice, FakeNvml
from llmsupervisor.probes.gpu_readings import GpuSample
from llmsupervisor.probes.nvml import NvmlReader
from tests.lib.paths import REPO

FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"

SYNTHETIC = """<?xml version="1.0" ?>
<nvidia_smi_log>
  <driver_version>570.00</driver_version>
  <attached_gpus>1</attached_gpus>
  <gpu id="00000000:18:00.0">
    <product_name>NVIDIA H100 80GB HBM3</product_name>
    <uuid>GPU-00000000-1111-2222-3333-444444444444</uuid>
    <mig_mode><current_mig>Disabled</current_mig><pending_mig>Disabled</pending_mig></mig_mode>
    <fb_memory_usage>
      <total>81559 MiB</total><reserved>579 MiB</reserved><used>0 MiB</used><free>80979 MiB</free>
    </fb_memory_usage>
    <temperature>
      <gpu_temp>33 C</gpu_temp>
      <gpu_temp_slow_threshold>90 C</gpu_temp_slow_threshold>
      <gpu_temp_max_gpu_threshold>87 C</gpu_temp_max_gpu_threshold>
    </temperature>
    <gpu_power_readings>
      <power_draw>70.50 W</power_draw><current_power_limit>700.00 W</current_power_limit>
    </gpu_power_readings>
    <clocks><sm_clock>345 MHz</sm_clock><mem_clock>2619 MHz</mem_clock></clocks>
    <processes>
      <process_info><pid>4242</pid><type>C</type><used_memory>1024 MiB</used_memory></process_info>
    </processes>
  </gpu>
</nvidia_smi_log>
"""


def _number(gpu: ET.Element, path: str) -> float | None:
    """``"81559 MiB"`` -> 81559.0; None for an absent element or ``N/A``."""
    text = gpu.findtext(path)
    match = re.match(r"\s*([0-9.]+)", text or "")
    return float(match.group(1)) if match else None


def devices_from_smi(xml_text: str) -> list[FakeDevice]:
    """The fake's devices, with nvidia-smi's own figures (nvidia-smi's order is NVML's)."""
    devices = []
    for gpu in ET.fromstring(xml_text).iter("gpu"):
        device = FakeDevice(str(gpu.findtext("uuid", "")).strip(), name=str(gpu.findtext("product_name", "")))
        mib = {k: _number(gpu, f"fb_memory_usage/{k}") for k in ("total", "reserved", "used")}
        if mib["total"] is not None:
            device.memory_total = int(mib["total"] * MIB)
        if mib["reserved"] is not None:
            device.memory_reserved = int(mib["reserved"] * MIB)
        if mib["used"] is not None:
            device.memory_used = int(mib["used"] * MIB)  # nvidia-smi R510+: reserved left out
        if (temp := _number(gpu, "temperature/gpu_temp")) is not None:
            device.temperature_c = int(temp)
        if (slow := _number(gpu, "temperature/gpu_temp_slow_threshold")) is not None:
            device.thresholds[1] = int(slow)  # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        if (gpu_max := _number(gpu, "temperature/gpu_temp_max_gpu_threshold")) is not None:
            device.thresholds[3] = int(gpu_max)  # NVML_TEMPERATURE_THRESHOLD_GPU_MAX
        power = gpu.find("gpu_power_readings")
        power = power if power is not None else gpu.find("power_readings")  # before R535
        if power is not None:
            if (draw := _number(power, "power_draw")) is not None:
                device.power_mw = int(draw * 1000)
            limit = _number(power, "current_power_limit") or _number(power, "enforced_power_limit")
            if limit is not None:
                device.power_limit_mw = int(limit * 1000)
        if (sm := _number(gpu, "clocks/sm_clock")) is not None:
            device.sm_clock_mhz = int(sm)
        if (mem := _number(gpu, "clocks/mem_clock")) is not None:
            device.mem_clock_mhz = int(mem)
        mig = gpu.findtext("mig_mode/current_mig")
        device.mig_mode = None if mig in (None, "N/A") else (int(mig == "Enabled"), 0)
        device.processes = [
            (int(p.findtext("pid", "0")), int((_number(p, "used_memory") or 0) * MIB))
            for p in gpu.iterfind("processes/process_info")
        ]
        devices.append(device)
    return devices


def check_reader_agrees(xml_text: str) -> list[GpuSample]:
    devices = devices_from_smi(xml_text)
    assert devices, "no <gpu> in the document"
    reader = NvmlReader(FakeNvml(devices), pids_visible=True)
    uuids = reader.open()
    try:
        samples = [reader.sample(uuid) for uuid in uuids]
    finally:
        reader.close()
    for device, sample in zip(devices, samples, strict=True):
        assert sample.uuid == device.uuid and sample.name == device.name
        assert sample.memory_used_bytes == device.memory_used  # as nvidia-smi shows it, not v1's
        assert sample.memory_reserved_bytes == device.memory_reserved
        assert sample.memory_total_bytes == device.memory_total
        assert sample.temperature_c == device.temperature_c
        assert sample.slowdown_temperature_c == device.thresholds[1]
        assert sample.power_w == pytest.approx(device.power_mw / 1000)
        assert sample.sm_clock_mhz == device.sm_clock_mhz
        assert sample.mig_enabled is (None if device.mig_mode is None else bool(device.mig_mode[0]))
        assert sample.processes is not None
        assert [(p.pid, p.used_bytes) for p in sample.processes] == device.processes
    return samples


def test_the_harness_reads_a_document_of_nvidia_smis_shape() -> None:
    (sample,) = check_reader_agrees(SYNTHETIC)
    assert sample.memory_used_bytes == 0 and sample.memory_reserved_bytes == 579 * MIB
    assert sample.temperature_c == 33 and sample.mig_enabled is False


RECORDED = sorted(FIXTURES.glob("*.xml"))


@pytest.mark.parametrize("path", RECORDED or [None], ids=[p.name for p in RECORDED] or ["none"])
def test_a_recorded_nvidia_smi_agrees_with_the_reader(path: Path | None) -> None:
    if path is None:
        pytest.skip(f"no recorded nvidia-smi -q -x in {FIXTURES} (docs/gpu.md)")
    check_reader_agrees(path.read_text())
