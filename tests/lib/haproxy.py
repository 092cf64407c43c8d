"""HAProxy (Debian's package) in front of engines: the binary, and its stats socket's view."""

from __future__ import annotations

import csv
import io
import os
import shutil
import socket
from pathlib import Path

import pytest


def haproxy() -> str:
    path = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not os.path.exists(path):
        message = "haproxy not installed (apt-get install haproxy)"
        if os.environ.get("LLMSUP_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def stat(stats_socket: Path) -> dict[str, dict[str, str]]:
    """``show stat`` rows of the backend's servers, by server name."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(stats_socket))
        sock.sendall(b"show stat\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
    servers = [r for r in rows if r["pxname"] == "engines" and r["svname"] not in ("FRONTEND", "BACKEND")]
    return {r["svname"]: r for r in servers}


def server_status(stats_socket: Path, server: str) -> str:
    """A server's status word (UP, DOWN, DRAIN, MAINT...), or "" while the socket cannot say."""
    try:
        return stat(stats_socket)[server]["status"].split(" ")[0]
    except (OSError, KeyError):
        return ""
