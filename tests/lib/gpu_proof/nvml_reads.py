"""NVML read the way the checks need it: a failed call is a reading (``{"error": ...}``), not a
crash; each field value with its own return code; memory v1 and v2; the processes on a GPU; and
nvidia-smi's view to hold it against."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any, Final

from llmsupervisor.probes.nvml import VALUE_MEMBERS as _VALUE_MEMBERS

GIB: Final = 1024**3
MIB: Final = 1024**2


def plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def read(lib: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``lib.name(*args)``, or ``{"error": "NVMLError_NotSupported"}`` (a reading, not a crash)."""
    fn = getattr(lib, name, None)
    if fn is None:
        return {"error": f"{name} is not in this binding"}
    try:
        return plain(fn(*args, **kwargs))
    except Exception as exc:
        return {"error": type(exc).__name__}


def failed(value: Any) -> bool:
    return isinstance(value, dict) and "error" in value


def return_name(code: int) -> str:
    """An NVML return code's name (``NVML_SUCCESS``, ``NVML_ERROR_NOT_SUPPORTED``...)."""
    import pynvml

    for name in dir(pynvml):
        if (name == "NVML_SUCCESS" or name.startswith("NVML_ERROR_")) and getattr(pynvml, name) == code:
            return name
    return f"code_{code}"


def field_values(lib: Any, handle: Any, ids: Sequence[int]) -> dict[str, Any]:
    """Each field's own return code and value (nvmlFieldValue_t.nvmlReturn)."""
    try:
        values = lib.nvmlDeviceGetFieldValues(handle, list(ids))
    except Exception as exc:
        return {"error": type(exc).__name__}
    out: dict[str, Any] = {}
    for v in values:
        ret = int(v.nvmlReturn)
        entry: dict[str, Any] = {"return": return_name(ret)}
        if ret == 0:
            entry["value"] = int(getattr(v.value, _VALUE_MEMBERS.get(int(v.valueType), "ullVal")))
        out[str(int(v.fieldId))] = entry
    return out


def fabric(lib: Any, handle: Any) -> dict[str, Any]:
    """The GPU's NVSwitch fabric registration through both calls the daemon may make
    (probes/nvml.py ``_fabric``): ``nvmlDeviceGetGpuFabricInfoV`` with the versioned struct, and
    the unversioned, deprecated ``nvmlDeviceGetGpuFabricInfo``. Each: its state by name, its status
    (``nvmlReturn_t``) by name, the cluster UUID and clique, or the error it answered
    (NotSupported off an NVSwitch fabric); and what the daemon makes of it (``problem``)."""
    import ctypes

    from llmsupervisor.probes.gpu_readings import FABRIC_STATES, GpuFabric

    out: dict[str, Any] = {}
    calls = (
        ("versioned", "nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t", "nvmlGpuFabricInfo_v2"),
        ("unversioned", "nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t", None),
    )
    for key, name, struct_name, version in calls:
        struct, fn = getattr(lib, struct_name, None), getattr(lib, name, None)
        if struct is None or fn is None:
            out[key] = {"error": f"{name} is not in this binding"}
            continue
        info = struct()
        if version is not None:
            info.version = getattr(lib, version)
        try:
            fn(handle, ctypes.byref(info))
        except Exception as exc:
            out[key] = {"error": type(exc).__name__}
            continue
        state, status = int(info.state), int(info.status)
        out[key] = {
            "state": FABRIC_STATES.get(state, state),
            "status": return_name(status),
            "cluster_uuid": bytes(info.clusterUuid).hex(),
            "clique_id": int(info.cliqueId),
            "problem": GpuFabric(state=state, status=status, status_name=return_name(status)).problem,
        }
        if hasattr(info, "healthMask"):
            out[key]["health_mask"] = int(info.healthMask)
    return out


def memory(lib: Any, handle: Any) -> dict[str, Any]:
    """v1 (used includes driver-reserved memory) and v2 (reserved on its own), in bytes."""
    out: dict[str, Any] = {}
    try:
        v1 = lib.nvmlDeviceGetMemoryInfo(handle)
        out["v1"] = {"total": int(v1.total), "free": int(v1.free), "used": int(v1.used)}
    except Exception as exc:
        out["v1"] = {"error": type(exc).__name__}
    try:
        v2 = lib.nvmlDeviceGetMemoryInfo(handle, version=lib.nvmlMemory_v2)
        out["v2"] = {
            "total": int(v2.total),
            "reserved": int(v2.reserved),
            "free": int(v2.free),
            "used": int(v2.used),
        }
    except Exception as exc:
        out["v2"] = {"error": type(exc).__name__}
    return out


def compute_pids(lib: Any, handle: Any) -> dict[int, int | None]:
    """NVML's compute processes on a GPU: PID -> bytes (None where the driver cannot say)."""
    return {
        int(p.pid): None if getattr(p, "usedGpuMemory", None) is None else int(p.usedGpuMemory)
        for p in lib.nvmlDeviceGetComputeRunningProcesses(handle)
    }


def smi_memory() -> list[dict[str, Any]] | dict[str, str]:
    """``nvidia-smi --query-gpu=index,memory.used,memory.reserved,memory.total``, in MiB."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found"}
    argv = [
        exe,
        "--query-gpu=index,memory.used,memory.reserved,memory.total",
        "--format=csv,noheader,nounits",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip()[:300]}
    rows = []
    for line in done.stdout.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        row: dict[str, Any] = {"index": int(cells[0])}
        for key, cell in zip(("used_mib", "reserved_mib", "total_mib"), cells[1:], strict=False):
            row[key] = float(cell) if re.fullmatch(r"[0-9.]+", cell) else cell
        rows.append(row)
    return rows


def driver_answers() -> bool:
    """Whether an NVIDIA driver answers NVML here (the gpu tier's skip condition)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False
