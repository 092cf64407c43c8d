"""Logging: journald priority prefixes when stderr is the journal, timestamps otherwise.

Under systemd (``JOURNAL_STREAM`` matches stderr's device and inode) every line starts with
``<N>`` so that ``journalctl -p warning`` works; every line of a multi-line record gets the prefix,
or journald would file traceback lines at priority 6 (host-facts §6.1). Records about an engine
carry ``engine`` in ``extra`` and are tagged ``[name]`` on every line.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Final, TextIO

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


def setup(level: str = "info", *, stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EngineFormatter(journal=stderr_is_journal(stream)))
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
