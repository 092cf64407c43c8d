"""The inner loop's one real-vLLM test (`scripts/test quick`): the daemon starts one real vLLM CPU
engine serving the tiny model, calls it READY only after a real completion, and leaves no engine
process behind on SIGTERM. The rest of the real rung (several engines, crashes, hangs, balancers,
vLLM 0.11.0) is in the other modules of this folder; this one is the smallest whole path through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lib.daemon import Daemon
from tests.lib.vllm_env import READY_TIMEOUT_S, complete, one_engine_daemon

pytestmark = pytest.mark.vllm_cpu


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d, _ = one_engine_daemon(tmp_path, "smoke")
    try:
        yield d
    finally:
        d.cleanup()


def test_one_real_engine_serves_and_leaves_nothing_behind(daemon: Daemon) -> None:
    engine = daemon.wait_state("smoke", "ready", timeout_s=READY_TIMEOUT_S)
    assert engine["pid"] in daemon.engine_processes()
    assert complete(engine["port"])["choices"][0]["text"] is not None
    assert daemon.stop() == 0
    assert daemon.engine_processes() == []
