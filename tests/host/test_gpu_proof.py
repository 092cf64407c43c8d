"""Issue 24's checks as the ``gpu`` tier: the same code as bench/gpu_proof.py (tests/lib/gpu_proof/),
one test per check, against the real driver. Skipped where no NVIDIA driver answers NVML (CI has
none); run on a lent GPU machine with ``pytest tests/host/test_gpu_proof.py -m gpu -s`` (each test
prints its check's JSON line). Shorter than the script's defaults: 4 GiB held, a 20 s burn.

Nothing here resets a GPU or changes clocks, power limits, ECC or MIG."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.lib.gpu_proof import Options, Proof, Result, driver_answers, run_check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not driver_answers(), reason="no NVIDIA driver answers NVML here"),
]


@pytest.fixture(scope="module")
def proof() -> Iterator[Proof]:
    p = Proof(Options(hold_gib=4.0, engine_gib=2.0, burn_s=20.0, cpu_window_s=3.0))
    try:
        yield p
    finally:
        p.close()


def check(proof: Proof, number: int, *, cuda: bool = False) -> Result:
    if cuda and not proof.cuda:
        pytest.skip(f"check {number} needs CUDA through torch: {proof.torch}")
    result = run_check(proof, number)
    print(json.dumps(result.line(), default=str))
    assert result.error is None, result.data.get("traceback", result.error)
    assert result.problems == []
    return result


def test_1_facts_name_every_gpu(proof: Proof) -> None:
    facts = check(proof, 1).data
    assert facts["gpus"] and all(g["uuid"].startswith("GPU-") for g in facts["gpus"])
    assert all(isinstance(g["pci_bus_id"], str) for g in facts["gpus"])


def test_2_nvml_lists_the_spawned_grandchild_and_drops_it_after_exit(proof: Proof) -> None:
    data = check(proof, 2, cuda=True).data
    assert data["unlisted_after_exit_s"] is not None and data["memory_fell_after_exit_s"] is not None


def test_3_v2_used_is_what_nvidia_smi_shows_and_leaves_reserved_out(proof: Proof) -> None:
    data = check(proof, 3, cuda=True).data
    assert data["held"]["v2_used_grew_gib"] >= 0.95 * proof.opts.hold_gib


def test_4_cuda_device_0_is_nvml_gpu_i_by_index_and_by_uuid(proof: Proof) -> None:
    data = check(proof, 4, cuda=True).data
    assert all(g["by_index"]["uuid"] == g["uuid"] == g["by_uuid"]["uuid"] for g in data["gpus"])


def test_5_fault_state_reads_and_the_event_wait_times_out_while_sampling(proof: Proof) -> None:
    data = check(proof, 5).data
    assert all(not g["not_registered"] for g in data["gpus"])
    assert len(data["wait"]["waits_s"]) == proof.opts.event_waits


def test_6_thermal_and_power_under_a_burn_reach_the_detectors(proof: Proof) -> None:
    data = check(proof, 6, cuda=True).data
    assert data["burn"] and data["burn_result"].get("iters", 0) > 0


def test_7_the_daemon_supervises_a_gpu_engine(proof: Proof) -> None:
    data = check(proof, 7, cuda=True).data
    assert data["foreign"]["finding"]["kind"] == "foreign_gpu_memory"


def test_8_cost_of_sampling_and_event_waits(proof: Proof) -> None:
    data = check(proof, 8).data
    assert data["gpus"] > 0
