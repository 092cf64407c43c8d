"""Check 5, fault-state reads: field 230 (the recovery action), remapped rows, ECC, the supported
events against those the daemon's reader registered, and nvmlEventSetWait timing out in about its
timeout while 4 threads sample (no sample waits behind it)."""

from __future__ import annotations

import threading
import time
from typing import Any, Final

from llmsupervisor.probes.gpu_readings import EVENT_KINDS, recovery_action_name
from llmsupervisor.probes.nvml import (
    DEFAULT_EVENT_TYPES,
    FI_GPU_RECOVERY_ACTION,
    FI_HW_POWER_BRAKE_NS,
    FI_HW_THERMAL_NS,
    FI_SW_THERMAL_NS,
    NvmlReader,
)
from tests.lib.gpu_proof.nvml_reads import failed, field_values, read
from tests.lib.gpu_proof.proof import Options, Proof
from tests.lib.gpu_proof.result import Result

# The event types the issue names (gpu-review.md Q7): double-bit ECC, XID, DRAM retirement
# failure, fatal poison, GPU unavailable, recovery action.
Q7_EVENT_BITS: Final = (0x2, 0x8, 0x800, 0x2000, 0x4000, 0x8000)


def _event_names(mask: int) -> list[str]:
    return [name for bit, name in EVENT_KINDS.items() if mask & bit]


def check_fault_state(proof: Proof, r: Result) -> None:
    lib, opts = proof.lib, proof.opts
    reader = proof.reader()
    reader.open()
    try:
        registered = reader.registered_events()
        rows = []
        for index, handle, uuid in proof.gpus():
            fields = field_values(
                lib,
                handle,
                [FI_GPU_RECOVERY_ACTION, FI_SW_THERMAL_NS, FI_HW_THERMAL_NS, FI_HW_POWER_BRAKE_NS],
            )
            action = fields.get(str(FI_GPU_RECOVERY_ACTION), {}) if not failed(fields) else {}
            if "value" in action:
                action["name"] = recovery_action_name(action["value"])
                r.expect(action["value"] == 0, f"GPU {index}: recovery action {action['name']} standing")
            supported = read(lib, "nvmlDeviceGetSupportedEventTypes", handle)
            mask = int(supported) if not failed(supported) else 0
            ecc: dict[str, Any] = {"mode": read(lib, "nvmlDeviceGetEccMode", handle)}
            for kind, error_type in (("corrected", 0), ("uncorrected", 1)):
                for counter, counter_type in (("volatile", 0), ("aggregate", 1)):
                    ecc[f"{kind}_{counter}"] = read(
                        lib, "nvmlDeviceGetTotalEccErrors", handle, error_type, counter_type
                    )
            got = registered.get(uuid, 0)
            row = {
                "index": index,
                "fields": fields,
                "recovery_action": action,
                "remapped_rows": read(lib, "nvmlDeviceGetRemappedRows", handle),
                "ecc": ecc,
                "supported_events": hex(mask) if not failed(supported) else supported,
                "supported_names": _event_names(mask),
                "q7_bits": {hex(bit): bool(mask & bit) for bit in Q7_EVENT_BITS},
                "registered": _event_names(got),
                "not_registered": _event_names(DEFAULT_EVENT_TYPES & mask & ~got),
            }
            rows.append(row)
            r.expect(
                got == DEFAULT_EVENT_TYPES & mask,
                f"GPU {index}: supported and wanted but not registered: {row['not_registered']}",
            )
            remapped = row["remapped_rows"]
            if not failed(remapped):
                r.expect(not remapped[3], f"GPU {index}: a row remap failed: {remapped}")
        r.data["gpus"] = rows
        r.data["wait"] = _event_wait_while_sampling(reader, [u for _, _, u in proof.gpus()], opts, r)
    finally:
        reader.close()


def _event_wait_while_sampling(
    reader: NvmlReader, uuids: list[str], opts: Options, r: Result
) -> dict[str, Any]:
    """``opts.event_waits`` waits of ``opts.event_wait_ms`` while 4 threads sample every GPU:
    the wait must time out in about its timeout and hold no sampler back."""
    stop = threading.Event()
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def sampler() -> None:
        while not stop.is_set():
            for uuid in uuids:
                t0 = time.monotonic()
                try:
                    reader.sample(uuid)
                except Exception as exc:
                    with lock:
                        errors.append(type(exc).__name__)
                with lock:
                    latencies.append(time.monotonic() - t0)

    threads = [threading.Thread(target=sampler, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    waits = []
    events = []
    try:
        for _ in range(opts.event_waits):
            t0 = time.monotonic()
            event = reader.wait_event(opts.event_wait_ms)
            waits.append(round(time.monotonic() - t0, 4))
            if event is not None:
                events.append({"kind": event.kind, "index": event.index, "xid": event.xid})
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    timeout_s = opts.event_wait_ms / 1000
    for took in waits:
        r.expect(
            0.8 * timeout_s <= took <= timeout_s + 1.0,
            f"nvmlEventSetWait({opts.event_wait_ms}) returned after {took} s",
        )
    if events:
        r.notes.append(f"events arrived during the waits: {events}")
    r.expect(bool(latencies), "no sample finished while the event waits ran")
    r.expect(not errors, f"samples failed during the waits: {sorted(set(errors))}")
    slowest = max(latencies, default=0.0)
    r.expect(
        slowest < timeout_s, f"a sample took {slowest:.3f} s while an event wait ran: it waited behind it"
    )
    return {
        "timeout_ms": opts.event_wait_ms,
        "waits_s": waits,
        "events": events,
        "samples_meanwhile": len(latencies),
        "sample_p50_ms": round(1000 * sorted(latencies)[len(latencies) // 2], 3) if latencies else None,
        "sample_max_ms": round(1000 * slowest, 3),
    }
