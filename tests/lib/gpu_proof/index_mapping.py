"""Check 4, index mapping: with CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES=i (or the
GPU's UUID), a child's CUDA device 0 is NVML's GPU i."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Final

from tests.lib.gpu_proof.proof import Proof, cuda_env
from tests.lib.gpu_proof.result import Result

CUDA_CHILD: Final = (
    "import json, torch; p = torch.cuda.get_device_properties(0); u = str(p.uuid);"
    " print(json.dumps({'device_count': torch.cuda.device_count(), 'name': p.name,"
    " 'uuid': u if u.startswith('GPU-') else 'GPU-' + u,"
    " 'pci': [getattr(p, 'pci_domain_id', None), getattr(p, 'pci_bus_id', None),"
    " getattr(p, 'pci_device_id', None)]}))"
)


def cuda_view(visible: str, timeout_s: float = 120) -> dict[str, Any]:
    """What a child with CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=``visible`` sees."""
    done = subprocess.run(
        [sys.executable, "-c", CUDA_CHILD],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=cuda_env(visible),
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-300:]}
    view: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return view


def check_index_mapping(proof: Proof, r: Result) -> None:
    rows = []
    for index, _handle, uuid in proof.gpus():
        row: dict[str, Any] = {"index": index, "uuid": uuid, "env": {"by_index": str(index), "by_uuid": uuid}}
        rows.append(row)
        if proof.no_cuda(r, f"GPU {index}: the CUDA child's device UUID"):
            continue
        for form, visible in (("by_index", str(index)), ("by_uuid", uuid)):
            view = row[form] = cuda_view(visible)
            if r.expect("error" not in view, f"GPU {index} {form}: the child failed: {view.get('error')}"):
                r.expect(
                    view["device_count"] == 1,
                    f"GPU {index} {form}: the child sees {view['device_count']} devices",
                )
                r.expect(
                    view["uuid"] == uuid,
                    f"GPU {index} {form}: CUDA device 0 is {view['uuid']}, NVML's is {uuid}",
                )
    r.data["gpus"] = rows
