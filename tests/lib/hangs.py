"""Helpers for hang injection into a real vLLM engine (tests/lib/hang_injection/sitecustomize.py),
shared by tests/vllm/test_hang_kinds.py and bench/detection_real.py."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.lib.daemon import Daemon, wait_for

INJECTION_DIR = Path(__file__).resolve().parent / "hang_injection"
HANG_LINE = "[{engine}] finding hang (critical)"


def hang_env(folder: Path) -> dict[str, str]:
    """An engine's ``env:`` entries that load the injector in each of its processes."""
    folder.mkdir(parents=True, exist_ok=True)
    return {"PYTHONPATH": str(INJECTION_DIR), "LLMSUP_HANG_DIR": str(folder)}


def inject(folder: Path, role: str, what: str) -> None:
    """Tell the engine's ``role`` process (EngineCore, Worker, APIServer) to ``deadlock`` or ``spin``."""
    tmp = folder / f".{role}.tmp"
    tmp.write_text(what)
    os.replace(tmp, folder / role)


def wait_hang(d: Daemon, engine: str, seen: int, *, timeout_s: float = 60.0) -> str:
    """The first ``finding hang`` line of ``engine`` after the first ``seen`` lines of the log."""

    def found() -> str | None:
        lines = d.log().splitlines()[seen:]
        return next((x for x in lines if HANG_LINE.format(engine=engine) in x), None)

    line: str = wait_for(found, timeout_s=timeout_s, what="the hang finding", poll_s=0.2)
    return line


def rule_of(line: str) -> str | None:
    """The rule a ``finding hang`` log line names: ``[... rule cpu_idle, ...]`` (``rule=`` before
    issue 39)."""
    m = re.search(r"\brule[= ](\w+)", line)
    return m.group(1) if m else None


class Streams:
    """``clients`` threads streaming completions back to back until closed."""

    def __init__(self, port: int, clients: int, headers: dict[str, str] | None = None) -> None:
        self.port, self.headers, self.stop = port, headers or {}, threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": "keep busy",
            "max_tokens": 128,
            "ignore_eos": True,
            "stream": True,
        }
        while not self.stop.is_set():
            try:
                with httpx.stream(
                    "POST",
                    f"http://127.0.0.1:{self.port}/v1/completions",
                    json=body,
                    headers=self.headers,
                    timeout=120,
                ) as resp:
                    for _ in resp.iter_bytes():
                        if self.stop.is_set():
                            return
            except httpx.HTTPError:
                self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=130)
