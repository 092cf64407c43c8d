"""Issue 38, point 5: an engine that prints long lines must not make `logs NAME` build a huge
reply on the daemon's loop.

Before: the per-engine ring kept 1,000 lines of up to 64 KiB each per incarnation (no byte
bound), and after long lines `logs NAME` built a 71 MB reply on the event loop (`/livez` took
3.4 s) that the CLI read with a quadratic ``data += chunk`` (66 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import control
from llmsupervisor.daemon import output_ring
from llmsupervisor.daemon.output_ring import OutputRing
from llmsupervisor.engine.output import OUTPUT_LINE_LIMIT

log = logging.getLogger("llmsupervisor.engine.output")


def _say(ring: OutputRing, engine: str, pid: int, text: str) -> None:
    record = log.makeRecord(log.name, logging.INFO, __file__, 1, "%s", (text,), None)
    record.engine, record.engine_pid = engine, pid
    ring.handle(record)


def _texts_bytes(lines: list[Any]) -> int:
    return sum(len(line.text.encode()) for line in lines)


def test_the_ring_is_bounded_in_bytes_per_incarnation_and_per_line() -> None:
    ring = OutputRing()
    for n in range(1000):  # as long as the forwarder lets a line be (engine/output.py)
        _say(ring, "a", 10, f"{n:04d} " + "x" * (OUTPUT_LINE_LIMIT - 5))
    kept = ring.select("a")
    assert 0 < _texts_bytes(kept) <= output_ring.BYTES_KEPT
    assert all(len(line.text.encode()) <= output_ring.LINE_BYTES_KEPT + 200 for line in kept)
    assert "bytes cut" in kept[-1].text and kept[-1].text.startswith("0999 ")  # the newest kept
    # The previous incarnation is bounded the same way once a new one begins.
    _say(ring, "a", 11, "new incarnation")
    assert _texts_bytes(ring.select("a", previous=True)) <= output_ring.BYTES_KEPT
    # Short lines are kept whole, up to the line count.
    ring = OutputRing()
    for n in range(1500):
        _say(ring, "b", 20, f"INFO line {n}")
    lines = ring.select("b")
    assert len(lines) == output_ring.LINES_KEPT and lines[-1].text == "INFO line 1499"


def test_a_multibyte_line_is_cut_on_a_character_boundary() -> None:
    ring = OutputRing()
    _say(ring, "a", 10, "é" * OUTPUT_LINE_LIMIT)
    (line,) = ring.select("a")
    assert len(line.text.encode()) <= output_ring.LINE_BYTES_KEPT + 200
    assert "\ufffd" not in line.text


def test_a_large_logs_reply_is_encoded_off_the_loop_and_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control server encodes a reply of many lines in a thread, so the loop keeps turning;
    the CLI's client reads a multi-megabyte reply whole."""
    lines = [{"seq": n, "text": "y" * 16_000} for n in range(400)]  # ~6.4 MB
    encoders: list[str] = []
    real = control._encode

    def spy(reply: dict[str, Any]) -> bytes:
        encoders.append(threading.current_thread().name)
        return real(reply)

    async def handler(request: dict[str, Any]) -> Any:
        return {"lines": lines if request["command"] == "logs" else []}

    async def scenario() -> dict[str, Any]:
        server = control.ControlServer(tmp_path / "c.sock", handler)
        await server.start()
        try:
            return await asyncio.to_thread(
                control.request, tmp_path / "c.sock", {"command": "logs", "engine": "a"}, timeout_s=60
            )
        finally:
            await server.close()

    monkeypatch.setattr(control, "_encode", spy)
    reply = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert reply["ok"] and len(reply["result"]["lines"]) == 400
    assert encoders and all(name != threading.main_thread().name for name in encoders)


def test_the_client_reads_a_reply_in_many_chunks(tmp_path: Path) -> None:
    """A reply that comes in thousands of small writes is read whole. (The client's read is no
    longer quadratic, a bytearray grown in place; that is a matter of time, which no test here
    asserts: this one passed before too.)"""
    path = tmp_path / "c.sock"
    body = json.dumps({"ok": True, "result": {"text": "z" * 3_000_000}}).encode() + b"\n"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            for i in range(0, len(body), 1024):
                conn.sendall(body[i : i + 1024])

    t = threading.Thread(target=serve)
    t.start()
    try:
        reply = control.request(path, {"command": "status"}, timeout_s=30)
    finally:
        t.join()
        listener.close()
    assert len(reply["result"]["text"]) == 3_000_000
