"""Check 3, memory: nvmlMemory v1 and v2, idle and with N GiB held, against nvidia-smi (v1's used
includes the driver's reserved memory; v2 gives it on its own, and nvidia-smi shows v2)."""

from __future__ import annotations

from typing import Any, Final

from tests.lib.gpu_proof.holder import Holder
from tests.lib.gpu_proof.nvml_reads import GIB, MIB, memory, smi_memory
from tests.lib.gpu_proof.proof import Proof
from tests.lib.gpu_proof.result import Result

# Two readings of the same memory taken a moment apart (NVML twice, or NVML and nvidia-smi) may
# differ by what the driver moved meanwhile; more than this is a disagreement, not noise.
MEMORY_SLACK_MIB: Final = 64


def _compare_memory(r: Result, phase: str, nvml: dict[str, Any], smi: Any, index: int) -> dict[str, Any]:
    v1, v2 = nvml.get("v1", {}), nvml.get("v2", {})
    out: dict[str, Any] = {"nvml": nvml}
    if "error" in v1 or "error" in v2:
        r.expect(False, f"{phase}: a memory call failed: v1 {v1}, v2 {v2}")
        return out
    slack = MEMORY_SLACK_MIB * MIB
    r.expect(v1["total"] == v2["total"], f"{phase}: v1 total {v1['total']} != v2 total {v2['total']}")
    r.expect(
        abs(v1["used"] - (v2["used"] + v2["reserved"])) <= slack,
        f"{phase}: v1 used {v1['used']} is not v2 used + reserved ({v2['used']} + {v2['reserved']})",
    )
    out["reserved_mib"] = round(v2["reserved"] / MIB, 1)
    out["v1_minus_v2_used_mib"] = round((v1["used"] - v2["used"]) / MIB, 1)
    rows = [row for row in smi if row.get("index") == index] if isinstance(smi, list) else []
    if rows:
        row = rows[0]
        out["smi"] = row
        used = row.get("used_mib")
        if isinstance(used, float):
            out["smi_used_is"] = (
                "v2"
                if abs(used - v2["used"] / MIB) <= MEMORY_SLACK_MIB
                else "v1"
                if abs(used - v1["used"] / MIB) <= MEMORY_SLACK_MIB
                else "neither"
            )
            r.expect(
                out["smi_used_is"] == "v2", f"{phase}: nvidia-smi's used is {out['smi_used_is']}'s, not v2's"
            )
        reserved = row.get("reserved_mib")
        if isinstance(reserved, float):
            r.expect(
                abs(reserved - v2["reserved"] / MIB) <= MEMORY_SLACK_MIB,
                f"{phase}: nvidia-smi's reserved {reserved} MiB != v2's {v2['reserved'] / MIB:.0f} MiB",
            )
    return out


def check_memory(proof: Proof, r: Result) -> None:
    opts, lib = proof.opts, proof.lib
    handle, uuid = proof.handle(opts.gpu), proof.uuid(opts.gpu)
    smi = smi_memory()
    if isinstance(smi, dict):
        r.skipped.append(f"nvidia-smi: {smi['error']}")
    r.data["idle"] = _compare_memory(r, "idle", memory(lib, handle), smi, opts.gpu)
    if proof.no_cuda(r, "memory held through CUDA (the fake counts the holder instead)") and not opts.fake:
        return
    with Holder(proof, opts.gpu, opts.hold_gib) as holder:
        nvml_held, smi_held = memory(lib, handle), smi_memory()
        held = r.data["held"] = _compare_memory(r, "held", nvml_held, smi_held, opts.gpu)
        sample = proof.sample(uuid)
        held["reader"] = {"used": sample.memory_used_bytes, "reserved": sample.memory_reserved_bytes}
        v2_idle = r.data["idle"]["nvml"].get("v2", {}).get("used")
        v2_held = nvml_held.get("v2", {}).get("used")
        if isinstance(v2_idle, int) and isinstance(v2_held, int):
            grew = v2_held - v2_idle
            held["v2_used_grew_gib"] = round(grew / GIB, 3)
            r.expect(
                grew >= 0.95 * holder.info["held_bytes"],
                f"v2 used grew {grew / GIB:.2f} GiB with {opts.hold_gib} GiB held",
            )
            r.expect(
                sample.memory_used_bytes is not None
                and abs(sample.memory_used_bytes - v2_held) <= MEMORY_SLACK_MIB * MIB,
                f"the daemon's reader says {sample.memory_used_bytes} used, v2 says {v2_held}",
            )
