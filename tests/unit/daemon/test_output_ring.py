"""Each engine's kept output (daemon/output_ring.py) and the one-engine views over it
(cli/engine_view.py): issue 26, point 3, "why did it restart?"."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from llmsupervisor.cli import render
from llmsupervisor.cli.engine_view import format_describe, log_line
from llmsupervisor.daemon.output_ring import OutputRing, engine_process
from llmsupervisor.redact import MASK

log = logging.getLogger("llmsupervisor.engine.output")


def _say(ring: OutputRing, engine: str, pid: int, text: str, **extra: object) -> None:
    record = log.makeRecord(log.name, logging.INFO, __file__, 1, "%s", (text,), None)
    record.engine, record.engine_pid = engine, pid
    for key, value in extra.items():
        setattr(record, key, value)
    ring.handle(record)


def test_the_ring_keeps_this_incarnation_and_the_previous_one_bounded() -> None:
    ring = OutputRing(capacity=3)
    for n in range(5):
        _say(ring, "a", 10, f"first {n}")
    _say(ring, "b", 30, "other engine")
    _say(ring, "a", 11, "second 0", engine_shutdown=True, engine_level="ERROR")
    assert [line.text for line in ring.select("a", previous=True)] == ["first 2", "first 3", "first 4"]
    (now,) = ring.select("a")
    assert (now.pid, now.level, now.shutdown) == (11, "ERROR", True)
    assert [line.text for line in ring.select("a", previous=True, last=1)] == ["first 4"]
    assert ring.select("nosuch") == [] and ring.select("b")[0].text == "other engine"
    # A third incarnation pushes the first out.
    _say(ring, "a", 12, "third 0")
    assert [line.text for line in ring.select("a", previous=True)] == ["second 0"]
    # A record that is not an engine's output line is not kept.
    ring.handle(log.makeRecord(log.name, logging.INFO, __file__, 1, "daemon", (), None))
    assert ring.last_seq == 8


def test_follow_waits_for_new_lines_and_secrets_are_masked() -> None:
    ring = OutputRing()

    async def go() -> list[str]:
        after = ring.last_seq
        asyncio.get_running_loop().call_later(0.05, _say, ring, "a", 1, "--api-key sk-secret-1 started")
        found = await ring.wait_select("a", after_seq=after, wait_s=5)
        return [line.text for line in found]

    assert asyncio.run(go()) == [f"--api-key {MASK} started"]


def test_engine_process_reads_this_process_and_survives_a_gone_one() -> None:
    import os

    me = engine_process(os.getpid())
    assert me["command"] and isinstance(me["rss_bytes"], int) and me["rss_bytes"] > 0
    assert engine_process(2**22 + 12345) == {"pid": 2**22 + 12345, "command": None, "rss_bytes": None}


ENGINE: dict[str, Any] = {
    "state": "ready",
    "phase": None,
    "reason": "ready",
    "for_s": 75.0,
    "pid": 4242,
    "incarnation": 3,
    "model": "tiny",
    "port": 8001,
    "gpus": [0, 1],
    "cpus": "0-7",
    "in_rotation": True,
    "restarts": 2,
    "restarts_by_reason": {"crash": 1, "hang": 1},
    "last_exit": "exited with code 1",
    "last_exit_age_s": 600.0,
    "last_failure": "hang: no canary answer for 12 s",
    "findings": [],
    "gpu_memory_used_bytes": None,
    "last_incident": "/var/lib/llm-supervisor/incidents/e-1.txt",
    "last_restart": {
        "cause": "hang",
        "reason": "hang: no canary answer for 12 s",
        "incident": "/var/lib/llm-supervisor/incidents/e-1.txt",
        "age_s": 90.0,
    },
}


def test_describe_answers_why_it_restarted() -> None:
    kept: dict[str, Any] = {
        "lines": [{"seq": 1, "time": 0, "pid": 4241, "shutdown": True, "text": "ERROR EngineDeadError"}],
        "process": {"pid": 4242, "command": "python -m vllm --api-key ***", "rss_bytes": 640 * 2**20},
        "journal": "journalctl -u llm-supervisor ENGINE=e",
    }
    events = [{"time": 0, "engine": "e", "kind": "transition", "message": "transition READY -> STOPPING"}]
    text = format_describe("e", ENGINE, events, kept)
    assert "PID:" in text and "4242 (incarnation 3)" in text
    assert "python -m vllm --api-key ***" in text and "RSS 640 MiB" in text
    assert "GPUs:" in text and "0,1" in text and "0-7" in text
    assert "hang, 1m30s ago" in text
    assert "/var/lib/llm-supervisor/incidents/e-1.txt" in text
    assert text.count("incidents/e-1.txt") == 1  # the restart's incident is not repeated
    assert "crash 1, hang 1" in text
    assert "READY -> STOPPING" in text
    assert "[4241] (stopping) ERROR EngineDeadError" in text
    assert "journalctl -u llm-supervisor ENGINE=e" in text
    assert log_line(kept["lines"][0]).endswith("[4241] (stopping) ERROR EngineDeadError")


def test_the_table_says_a_restart_came_after_the_last_exit() -> None:
    assert render.last_exit(ENGINE).startswith("restarted (hang) ")
    crashed = {**ENGINE, "last_restart": {**ENGINE["last_restart"], "cause": "crash", "age_s": 5.0}}
    assert render.last_exit(crashed).startswith("crashed (exit 1)")
    never = {**ENGINE, "last_exit": None, "last_exit_age_s": None, "last_restart": None}
    assert render.last_exit(never) == "-"
    older = {**ENGINE, "last_exit_age_s": 10.0}
    assert render.last_exit(older).startswith("crashed (exit 1)")
