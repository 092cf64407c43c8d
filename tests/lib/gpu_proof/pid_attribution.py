"""Check 2, PID attribution: a setsid parent spawns (multiprocessing, spawn) a torch grandchild
holding N GiB; NVML lists the grandchild's PID, not the parent's; how long after its exit NVML
stops listing it and the memory falls."""

from __future__ import annotations

import time
from typing import Final

from llmsupervisor.probes.nvml import in_host_pid_namespace
from tests.lib.gpu_proof.holder import Holder
from tests.lib.gpu_proof.nvml_reads import compute_pids, memory
from tests.lib.gpu_proof.proof import Proof, wait_until
from tests.lib.gpu_proof.result import Result

GPU_RELEASE_TIMEOUT_S: Final = 30.0  # EngineSpec.gpu_release_timeout_s's default


def check_pid_attribution(proof: Proof, r: Result) -> None:
    opts, lib = proof.opts, proof.lib
    if (
        proof.no_cuda(r, "the grandchild's CUDA allocation (the fake lists the grandchild instead)")
        and not opts.fake
    ):
        return
    handle, uuid = proof.handle(opts.gpu), proof.uuid(opts.gpu)
    idle = memory(lib, handle).get("v2", {})
    r.data.update(gpu=opts.gpu, uuid=uuid, hold_gib=opts.hold_gib, idle_v2_used=idle.get("used"))
    with Holder(proof, opts.gpu, opts.hold_gib) as holder:
        info = holder.info
        r.data["holder"] = info
        r.expect(
            info.get("parent_sid") == info.get("parent_pid"), "the holder's parent is not a session leader"
        )
        if "uuid" in info:
            r.expect(
                info["uuid"] == uuid, f"the grandchild's CUDA device is {info['uuid']}, NVML's GPU is {uuid}"
            )
        gc = holder.grandchild_pid
        _, took_s = wait_until(
            lambda: compute_pids(lib, handle) if gc in compute_pids(lib, handle) else None, 10
        )
        pids = compute_pids(lib, handle)
        r.data.update(nvml_pids={str(p): b for p, b in pids.items()}, listed_after_s=round(took_s, 3))
        host_ns = in_host_pid_namespace()
        if host_ns:
            r.expect(gc in pids, f"NVML lists {sorted(pids)}, not the grandchild {gc}")
            r.expect(
                info["parent_pid"] not in pids, "NVML lists the holder's parent, which never touched CUDA"
            )
            if gc in pids and pids[gc] is not None:
                r.expect(
                    pids[gc] >= 0.95 * info["held_bytes"],
                    f"NVML attributes {pids[gc]} bytes to the grandchild, which holds {info['held_bytes']}",
                )
        else:
            r.notes.append(
                "own PID namespace: NVML lists host PIDs; the daemon counts every process on the GPU"
            )
            r.expect(bool(pids), "NVML lists no process while the grandchild holds memory")
        sample = proof.sample(uuid)
        seen = [p.pid for p in sample.processes or ()]
        r.data["reader_pids"] = seen
        r.data["reader_pids_visible"] = sample.pids_visible
        if host_ns:
            r.expect(gc in seen, "the daemon's reader does not see the grandchild")
        held_used = memory(lib, handle).get("v2", {}).get("used")
        r.data["held_v2_used"] = held_used
        exited = holder.release()
        r.data["grandchild_exit"] = exited
        exited_at = float(exited.get("exited_at", time.monotonic()))

        def unlisted() -> bool:
            return gc not in compute_pids(lib, handle)

        def fell() -> bool:
            used = memory(lib, handle).get("v2", {}).get("used")
            return used is not None and held_used is not None and used < held_used - info["held_bytes"] / 2

        for name, predicate in (("unlisted", unlisted), ("memory_fell", fell)):
            ok, _ = wait_until(predicate, opts.release_timeout_s, poll_s=0.01)
            after = round(time.monotonic() - exited_at, 3)
            r.data[f"{name}_after_exit_s"] = after if ok else None
            r.expect(bool(ok), f"{name}: not within {opts.release_timeout_s} s of the grandchild's exit")
    waits = [r.data.get(k) for k in ("unlisted_after_exit_s", "memory_fell_after_exit_s")]
    if all(isinstance(w, float) for w in waits):
        longest = max(w for w in waits if isinstance(w, float))
        r.data["release_wait_needed_s"] = longest
        r.expect(
            longest < GPU_RELEASE_TIMEOUT_S,
            f"the release took {longest} s, longer than gpu_release_timeout_s's default"
            f" {GPU_RELEASE_TIMEOUT_S}",
        )
