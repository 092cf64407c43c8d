"""Keeping the supervisor's own probes out of vLLM's access log.

Every tick the supervisor asks each engine for /health and /metrics (and /v1/models while it
starts); uvicorn logs each request, and those lines were 85 % of the journal. vLLM releases with
``--disable-access-log-for-endpoints`` (0.32 has it: a comma-separated list of paths) drop them
at the source, so the daemon adds the flag when the engine's vLLM has it. Whether it has it is
read from the installed package's source next to the engine's interpreter (importing vLLM takes
seconds; its version number says nothing of a backport), once per installation. Without the flag
the output forwarder drops the same lines (engine/output.py), so every version is quiet.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from llmsupervisor.engine.output import PROBE_PATHS

FLAG: Final = "disable-access-log-for-endpoints"
_FLAG_FIELD: Final = b"disable_access_log_for_endpoints"
# Flags with which the operator already decided about the access log.
_OPERATOR_FLAGS: Final = frozenset({FLAG, "disable-uvicorn-access-log"})


def probe_access_flags(
    command: Sequence[str], args: Mapping[str, Any], *, log_probe_requests: bool
) -> list[str]:
    """The flags to add to an engine's command line: ``--disable-access-log-for-endpoints``
    with the probe paths when its vLLM has the flag and nobody set the access log otherwise."""
    if log_probe_requests or _OPERATOR_FLAGS & set(args) or not command:
        return []
    if not vllm_has_endpoint_filter(command[0]):
        return []
    return ["--" + FLAG, ",".join(PROBE_PATHS)]


def vllm_has_endpoint_filter(program: str) -> bool:
    """Whether the vLLM installed beside ``program`` (``.../bin/python`` or ``.../bin/vllm``)
    knows ``--disable-access-log-for-endpoints``."""
    located = program if "/" in program else shutil.which(program)
    if located is None:
        return False
    # Not resolved: a venv's bin/python is a link to the system interpreter.
    prefix = Path(os.path.abspath(located)).parent.parent
    return _prefix_has_flag(prefix)


@functools.lru_cache(maxsize=64)
def _prefix_has_flag(prefix: Path) -> bool:
    prefixes = [prefix, Path("/usr/local")] if prefix == Path("/usr") else [prefix]
    for base in prefixes:
        for packages in (*base.glob("lib/python3*/site-packages"), *base.glob("lib/python3*/dist-packages")):
            entrypoints = packages / "vllm" / "entrypoints"
            if not entrypoints.is_dir():
                continue
            for source in entrypoints.rglob("cli_args.py"):
                try:
                    if _FLAG_FIELD in source.read_bytes():
                        return True
                except OSError:
                    continue
            return False
    return False


__all__ = ["FLAG", "probe_access_flags", "vllm_has_endpoint_filter"]
