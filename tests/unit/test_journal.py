"""journald's native protocol, against a real datagram socket standing in for journald."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsupervisor import logs


def parse(datagram: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    rest = datagram
    while rest:
        line, _, after = rest.partition(b"\n")
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields[key.decode()] = value.decode()
            rest = after
        else:  # binary form
            (size,) = struct.unpack("<Q", after[:8])
            fields[line.decode()] = after[8 : 8 + size].decode()
            rest = after[8 + size + 1 :]
    return fields


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[Path, socket.socket]]:
    path = tmp_path / "journal.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    yield path, sock
    sock.close()


def record(msg: str, level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("llmsupervisor.engine", level, __file__, 10, msg, (), None)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_engine_fields_and_priorities(journal: tuple[Path, socket.socket]) -> None:
    path, sock = journal
    handler = logs.JournalHandler(path, gpus_of={"gpu1": "1"})
    try:
        handler.emit(record("READY -> DRAINING: kv pressure", logging.WARNING, engine="gpu1"))
        handler.emit(
            record(
                "ERROR 11-22 [core.py:1] boom\n  second line", logging.ERROR, engine="gpu1", engine_pid=4242
            )
        )
        handler.emit(record("daemon line"))
    finally:
        handler.close()
    own, output, daemon = (parse(sock.recv(65536)) for _ in range(3))
    assert own["ENGINE"] == "gpu1" and own["GPU"] == "1" and own["PRIORITY"] == "4"
    assert own["SYSLOG_IDENTIFIER"] == "llm-supervisor"
    assert output["SYSLOG_IDENTIFIER"] == "vllm-gpu1" and output["ENGINE_PID"] == "4242"
    assert output["PRIORITY"] == "3"
    assert output["MESSAGE"] == "ERROR 11-22 [core.py:1] boom\n  second line"  # binary form, one entry
    assert "ENGINE" not in daemon and daemon["PRIORITY"] == "6"
    assert all(k == k.upper() and not k.startswith("_") for k in own)


def test_shutdown_output_is_info_and_tagged_in_every_format(journal: tuple[Path, socket.socket]) -> None:
    """An engine's line during a stop the daemon ordered (engine/output.py): priority 6 with
    SHUTDOWN=1 and its own level kept, ``shutdown`` in JSON, ``(stopping)`` in text."""
    path, sock = journal
    line = "ERROR 11-23 [async_llm.py:906] AsyncLLM output_handler failed. EngineDeadError"
    extra = {"engine": "gpu1", "engine_pid": 42, "engine_shutdown": True, "engine_level": "ERROR"}
    handler = logs.JournalHandler(path)
    try:
        handler.emit(record(line, logging.INFO, **extra))
    finally:
        handler.close()
    fields = parse(sock.recv(65536))
    assert fields["PRIORITY"] == "6" and fields["SHUTDOWN"] == "1" and fields["ENGINE_LEVEL"] == "ERROR"
    assert '"shutdown": true' in logs.JsonFormatter().format(record(line, logging.INFO, **extra))
    text = logs.EngineFormatter(journal=True).format(record(line, logging.INFO, **extra))
    assert text == f"<6>[gpu1] (stopping) {line}"


def test_falls_back_to_prefixed_stderr_when_journald_is_gone(tmp_path: Path) -> None:
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            lines.append(self.format(rec))

    fallback = Collect()
    fallback.setFormatter(logs.EngineFormatter(journal=True))
    handler = logs.JournalHandler(tmp_path / "missing.sock", fallback=fallback)
    try:
        handler.emit(record("still logged", logging.ERROR, engine="gpu0"))
    finally:
        handler.close()
    assert lines == ["<3>[gpu0] still logged"]


def test_setup_picks_the_native_handler_only_under_the_journal(
    journal: tuple[Path, socket.socket], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _sock = journal
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream_file = tmp_path / "stderr"
    try:
        with open(stream_file, "w") as stream:
            st = stream_file.stat()
            monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
            logs.setup("info", stream=stream, journal_socket=path)
            assert isinstance(root.handlers[0], logs.JournalHandler)
            root.handlers[0].close()
            monkeypatch.setenv("JOURNAL_STREAM", "1:2")
            logs.setup("info", stream=stream, journal_socket=path)
            assert not isinstance(logging.getLogger().handlers[0], logs.JournalHandler)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
