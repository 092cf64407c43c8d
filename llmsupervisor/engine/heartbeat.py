"""Giving an engine the step heartbeat: ``--scheduler-cls`` and the plugin on its PYTHONPATH.

The scheduler the flag names (probes/vllm_plugin/llmsupervisor_step_heartbeat.py) subclasses the
one vLLM would have used and writes a step counter into ``engines/NAME/step-heartbeat`` in the
state dir. The flag is added only when the engine's vLLM resolves ``--scheduler-cls`` the way 0.32
does (``SchedulerConfig.get_scheduler_cls``: 0.11 replaces the class when async scheduling is on),
nobody set ``scheduler-cls`` already or a flag with which vLLM picks its own
(``--diffusion-config``), and the operator did not turn it off (``step_heartbeat: false``).
Without it the daemon finds hangs with the rules that need no heartbeat.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from llmsupervisor.probes import vllm_plugin
from llmsupervisor.probes.heartbeat import FILE_NAME
from llmsupervisor.probes.vllm_plugin.llmsupervisor_step_heartbeat import ENV, QUALNAME

FLAG: Final = "scheduler-cls"
# Flags with which vLLM picks a scheduler class of its own, which it does only while no
# --scheduler-cls is given: ours would take its place, so those engines go without the heartbeat.
# vLLM 0.32 and 0.34 (config/vllm.py): --diffusion-config makes it DiffusionScheduler or
# DiffusionAsyncScheduler. tests/lib/vllm_surface.py finds every place a release of the support
# matrix sets the class itself, and fails on one that no flag here covers.
OWN_SCHEDULER_FLAGS: Final = frozenset({"diffusion-config"})
PLUGIN_DIR: Final = Path(vllm_plugin.__file__).resolve().parent
# In vLLM 0.32's config/scheduler.py: the dotted name is resolved and called as the class.
_RESOLVER: Final = b"def get_scheduler_cls"


def heartbeat_path(state_dir: Path, engine: str) -> Path:
    return state_dir / "engines" / engine / FILE_NAME


def heartbeat_launch(
    command: Sequence[str],
    args: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    path: Path,
    enabled: bool,
) -> tuple[list[str], dict[str, str]]:
    """The flags to add and the environment entries to set for the heartbeat; nothing when it
    is off, the operator chose a scheduler or has vLLM choose its own, or the engine's vLLM
    cannot take ours."""
    if not enabled or FLAG in args or OWN_SCHEDULER_FLAGS & set(args) or not command:
        return [], {}
    if not vllm_resolves_scheduler(command[0]):
        return [], {}
    python_path = env.get("PYTHONPATH", "")
    return ["--" + FLAG, QUALNAME], {
        ENV: str(path),
        "PYTHONPATH": str(PLUGIN_DIR) + (os.pathsep + python_path if python_path else ""),
    }


def vllm_resolves_scheduler(program: str) -> bool:
    """Whether the vLLM installed beside ``program`` resolves ``--scheduler-cls`` as 0.32 does."""
    located = program if "/" in program else shutil.which(program)
    if located is None:
        return False
    return _prefix_resolves(Path(os.path.abspath(located)).parent.parent)


@functools.lru_cache(maxsize=64)
def _prefix_resolves(prefix: Path) -> bool:
    prefixes = [prefix, Path("/usr/local")] if prefix == Path("/usr") else [prefix]
    for base in prefixes:
        for packages in (*base.glob("lib/python3*/site-packages"), *base.glob("lib/python3*/dist-packages")):
            source = packages / "vllm" / "config" / "scheduler.py"
            try:
                return _RESOLVER in source.read_bytes()
            except OSError:
                continue
    return False


__all__ = [
    "FLAG",
    "OWN_SCHEDULER_FLAGS",
    "PLUGIN_DIR",
    "heartbeat_launch",
    "heartbeat_path",
    "vllm_resolves_scheduler",
]
