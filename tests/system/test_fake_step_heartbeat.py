"""The fake vLLM's step heartbeat (``--fake-step-heartbeat``), which bench/overhead gives its
fakes so that the daemon's read of the file is measured: it is the plugin's own record, read by
the daemon's own reader, and it steps only while the fake holds work."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmsupervisor.probes.heartbeat import StepBeat, read_heartbeat
from tests.lib.daemon import FAKE_VLLM, free_port, wait_for
from tests.lib.paths import REPO

FIXTURE = REPO / "tests" / "fixtures" / "metrics" / "vllm-0.32.0-cpu.txt"


def beat(path: Path) -> StepBeat | None:
    got = read_heartbeat(path)
    return got if isinstance(got, StepBeat) else None


def fake(tmp_path: Path, *extra: str) -> Iterator[tuple[int, Path]]:
    port, path = free_port(), tmp_path / "engines" / "e1" / "step-heartbeat"
    cmd = [sys.executable, str(FAKE_VLLM), "--model", "m", "--port", str(port)]
    cmd += ["--fake-startup-delay-s", "0", "--fake-step-heartbeat", str(path), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout_s=20, what="the fake to listen")
        yield port, path
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def idle_fake(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    yield from fake(tmp_path, "--fake-completion-delay-s", "0.5")


@pytest.fixture
def busy_fake(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    yield from fake(tmp_path, "--fake-metrics-file", str(FIXTURE), "--fake-metrics-advance")


def test_an_idle_fake_takes_no_step_until_it_serves_a_completion(idle_fake: tuple[int, Path]) -> None:
    port, path = idle_fake
    first = beat(path)
    assert first is not None and first.done == 0 and first.work == 0
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10).status_code == 200
    after = beat(path)
    assert after is not None and after.done > 0  # it stepped while the completion ran
    assert wait_for(lambda: (b := beat(path)) is not None and b.work == 0, timeout_s=5, what="idle again")


def test_a_busy_fake_steps_with_the_bodys_requests_held(busy_fake: tuple[int, Path]) -> None:
    _, path = busy_fake
    first = beat(path)
    assert first is not None
    later = wait_for(
        lambda: (b := beat(path)) is not None and b.done > first.done + 5 and b, timeout_s=5, what="steps"
    )
    assert later.work == 8  # vllm:num_requests_running in the captured body
    assert later.longest_step_s > 0
