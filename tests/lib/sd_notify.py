"""A real datagram socket standing in for systemd's notify socket (``NOTIFY_SOCKET``)."""

from __future__ import annotations

import socket
from pathlib import Path


class Receiver:
    """What systemd's notify socket would receive."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(65536).decode("latin-1"))
            except BlockingIOError:
                return self.messages

    def close(self) -> None:
        self.sock.close()
