"""Logging: native journald records under systemd, timestamped lines elsewhere.

Under systemd (``JOURNAL_STREAM`` matches stderr's device and inode) each record goes to
journald's native socket as one entry with fields: ``PRIORITY``, ``SYSLOG_IDENTIFIER``, and for
records about an engine ``ENGINE=`` and ``GPU=``, so ``journalctl -u llm-supervisor ENGINE=gpu0``
tells one engine's story, its forwarded vLLM lines included (identifier ``vllm-NAME``, the
priority from vLLM's own level word, ``ENGINE_PID=`` the engine process). What an engine prints
while the daemon stops it on purpose is shutdown output (engine/output.py): priority 6 (info)
whatever its level word, with ``SHUTDOWN=1`` and ``ENGINE_LEVEL=`` its own level (JSON:
``shutdown``; text: ``(stopping)`` after the engine's tag). If that socket is
missing or a send fails, the record falls back to stderr with a ``<N>`` prefix on every line, so
``journalctl -p warning`` still works and traceback lines keep their priority (docs/host-notes.md §6).
Records about an engine carry ``engine`` in ``extra`` and are tagged ``[name]`` in text form.

The format is chosen by ``--log-format`` / ``LLMSUP_LOG_FORMAT`` (``auto``, ``json``, ``text``):
``auto`` is journald under systemd, JSON lines on stdout inside a Kubernetes pod
(``KUBERNETES_SERVICE_HOST`` is set) and text on stderr otherwise. ``json`` writes one object per
line to stdout: ``time`` (UTC, RFC 3339), ``level``, ``logger``, ``message``, and ``engine``,
``gpu``, ``engine_pid``, ``exception`` when they apply; a log collector (Fluent Bit, Vector,
Loki's promtail) needs no parser rules for it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, TextIO

from llmsupervisor.redact import RedactFilter

JOURNAL_SOCKET: Final = Path("/run/systemd/journal/socket")
JOURNAL_MESSAGE_LIMIT: Final = 48 * 1024  # bigger payloads would need the memfd path

JOURNAL_PRIORITY: Final = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def stderr_is_journal(stream: TextIO | None = None) -> bool:
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not dev or not ino:
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError):
        return False
    return f"{st.st_dev}:{st.st_ino}" == value


def _priority(levelno: int) -> int:
    for level in (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO):
        if levelno >= level:
            return JOURNAL_PRIORITY[level]
    return JOURNAL_PRIORITY[logging.DEBUG]


class EngineFormatter(logging.Formatter):
    """Prefixes ``[engine]`` and, for the journal, ``<priority>`` on every line."""

    def __init__(self, *, journal: bool) -> None:
        fmt = "%(message)s" if journal else "%(asctime)s %(levelname)-7s %(message)s"
        super().__init__(fmt)
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        engine = getattr(record, "engine", None)
        text = super().format(record)
        lines = text.splitlines() or [""]
        tag = f"[{engine}] " if engine else ""
        if tag and getattr(record, "engine_shutdown", False):
            tag += "(stopping) "
        if self.journal:
            prefix = f"<{_priority(record.levelno)}>"
            return "\n".join(f"{prefix}{tag}{line}" for line in lines)
        if tag:
            head = lines[0]
            # Tag after the timestamp and level, so columns line up.
            marker = f"{record.levelname:<7s} "
            if marker in head:
                before, _, after = head.partition(marker)
                lines[0] = f"{before}{marker}{tag}{after}"
            lines[1:] = [f"{tag}{line}" for line in lines[1:]]
        return "\n".join(lines)


LOG_FORMATS: Final = ("auto", "json", "text")
LOG_FORMAT_ENV: Final = "LLMSUP_LOG_FORMAT"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback goes into ``exception``)."""

    def __init__(self, *, gpus_of: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.gpus_of = gpus_of if gpus_of is not None else {}

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, tz=UTC)
        entry: dict[str, object] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        engine = getattr(record, "engine", None)
        if engine:
            entry["engine"] = str(engine)
            if engine in self.gpus_of:
                entry["gpu"] = self.gpus_of[engine]
        engine_pid = getattr(record, "engine_pid", None)
        if engine_pid:
            entry["engine_pid"] = engine_pid
        if getattr(record, "engine_shutdown", False):
            entry["shutdown"] = True
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # ensure_ascii keeps every line 7-bit clean whatever an engine printed.
        return json.dumps(entry, ensure_ascii=True, default=str)


def resolve_format(requested: str | None = None, *, stream: TextIO | None = None) -> str:
    """``journal``, ``json`` or ``text``: what ``auto`` (or the environment) means here."""
    wanted = (requested or os.environ.get(LOG_FORMAT_ENV) or "auto").strip().lower()
    if wanted not in LOG_FORMATS:
        wanted = "auto"
    if wanted != "auto":
        return wanted
    if stderr_is_journal(stream):
        return "journal"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "json"
    return "text"


def _journal_field(key: str, value: str) -> bytes:
    data = value.encode("utf-8", "replace")
    if b"\n" in data:
        # Binary form: name, newline, little-endian u64 length, value, newline.
        return key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key.encode() + b"=" + data + b"\n"


class JournalHandler(logging.Handler):
    """journald's native protocol: one datagram per record, fields UPPERCASE."""

    def __init__(
        self,
        socket_path: Path = JOURNAL_SOCKET,
        *,
        identifier: str = "llm-supervisor",
        gpus_of: Mapping[str, str] | None = None,
        fallback: logging.Handler | None = None,
    ) -> None:
        super().__init__()
        self.socket_path = socket_path
        self.identifier = identifier
        self.gpus_of = gpus_of if gpus_of is not None else {}
        self.fallback = fallback
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def fields(self, record: logging.LogRecord) -> dict[str, str]:
        engine = getattr(record, "engine", None)
        engine_pid = getattr(record, "engine_pid", None)
        fields = {
            "MESSAGE": record.getMessage()[:JOURNAL_MESSAGE_LIMIT],
            "PRIORITY": str(_priority(record.levelno)),
            "SYSLOG_IDENTIFIER": f"vllm-{engine}" if engine and engine_pid else self.identifier,
            "LOGGER": record.name,
            "CODE_FILE": record.pathname,
            "CODE_LINE": str(record.lineno),
            "CODE_FUNC": record.funcName or "",
        }
        if record.exc_text or record.exc_info:
            fields["MESSAGE"] += "\n" + (
                record.exc_text or logging.Formatter().formatException(record.exc_info)  # type: ignore[arg-type]
            )
        if engine:
            fields["ENGINE"] = str(engine)
            if engine in self.gpus_of:
                fields["GPU"] = self.gpus_of[engine]
        if engine_pid:
            fields["ENGINE_PID"] = str(engine_pid)
        if getattr(record, "engine_shutdown", False):
            fields["SHUTDOWN"] = "1"
            fields["ENGINE_LEVEL"] = str(getattr(record, "engine_level", ""))
        return fields

    def emit(self, record: logging.LogRecord) -> None:
        try:
            payload = b"".join(_journal_field(k, v) for k, v in self.fields(record).items())
            self.sock.sendto(payload, str(self.socket_path))
        except OSError:
            if self.fallback is not None:
                self.fallback.handle(record)
            else:
                self.handleError(record)

    def close(self) -> None:
        self.sock.close()
        super().close()


def setup(
    level: str = "info",
    *,
    stream: TextIO | None = None,
    gpus_of: Mapping[str, str] | None = None,
    journal_socket: Path = JOURNAL_SOCKET,
    log_format: str | None = None,
) -> None:
    """``log_format``: ``auto``, ``json`` or ``text``; None reads ``LLMSUP_LOG_FORMAT``."""
    chosen = resolve_format(log_format, stream=stream or sys.stderr)
    handler: logging.Handler
    if chosen == "json":
        handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(JsonFormatter(gpus_of=gpus_of))
    else:
        stream = stream or sys.stderr
        journal = chosen == "journal"
        text_handler = logging.StreamHandler(stream)
        text_handler.setFormatter(EngineFormatter(journal=journal))
        handler = text_handler
        text_handler.addFilter(RedactFilter())
        if journal and journal_socket.exists():
            handler = JournalHandler(journal_socket, gpus_of=gpus_of, fallback=text_handler)
    handler.addFilter(RedactFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # httpx logs every request at INFO; the supervisor polls constantly.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def set_level(level: str) -> None:
    """Applied on reload."""
    logging.getLogger().setLevel(level.upper())
