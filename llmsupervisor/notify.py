"""sd_notify: tell systemd when we are ready, what we are doing, and that the loop is alive.

Built on the ``sdnotify`` package, minus its traps (docs/host-notes.md §2.5): it connects once in its
constructor (a re-bound socket would lose every later message), never closes its socket, and
swallows every error. Here each message gets a fresh, connected, close-on-exec socket inside a
``SystemdNotifier`` with ``debug=True``, which is closed after the one send; errors surface and
are logged (the first one loudly) and counted, never raised into the loop. STATUS text is made
latin-1-safe before it reaches sdnotify, which encodes latin-1.

Without ``NOTIFY_SOCKET`` (a terminal, a test) every call is a no-op returning False.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import sdnotify

from llmsupervisor.redact import redact

log = logging.getLogger("llmsupervisor.notify")


class _Sender(Protocol):
    def notify(self, state: str) -> Any: ...

    def close(self) -> None: ...


class _OneShotNotifier(sdnotify.SystemdNotifier):  # type: ignore[misc]
    """sdnotify's sender on a socket we open (and close) ourselves, one per message."""

    def __init__(self, address: str) -> None:
        self.debug = True  # sdnotify re-raises instead of swallowing
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self.socket.connect("\0" + address[1:] if address.startswith("@") else address)
        except OSError:
            self.socket.close()
            raise

    def close(self) -> None:
        self.socket.close()


class Notifier:
    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        factory: Callable[[str], _Sender] = _OneShotNotifier,
        pid: int | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.socket_path = env.get("NOTIFY_SOCKET") or None
        self.factory = factory
        self.failures_total = 0
        self.sent_total = 0
        self._last_status: str | None = None
        self.watchdog_interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        watchdog_pid = env.get("WATCHDOG_PID", "")
        me = pid if pid is not None else os.getpid()
        if usec.isdigit() and int(usec) > 0 and (not watchdog_pid or watchdog_pid == str(me)):
            # sd_watchdog_enabled(3): ping at half the interval.
            self.watchdog_interval_s = int(usec) / 1_000_000 / 2

    @property
    def enabled(self) -> bool:
        return self.socket_path is not None

    def send(self, *fields: str) -> bool:
        """One datagram with ``fields`` joined by newlines. True if it was sent."""
        address = self.socket_path
        if address is None:
            return False
        message = "\n".join(fields)
        try:
            sender = self.factory(address)
            with contextlib.closing(sender):
                sender.notify(message)
        except (OSError, UnicodeError, TypeError) as exc:
            self.failures_total += 1
            level = logging.WARNING if self.failures_total == 1 else logging.DEBUG
            log.log(
                level,
                "sd_notify to %s failed (%d so far): %s: %r",
                self.socket_path,
                self.failures_total,
                type(exc).__name__,
                message[:80],
            )
            return False
        self.sent_total += 1
        return True

    def ready(self, status: str) -> bool:
        self._last_status = status
        return self.send("READY=1", f"STATUS={_status_text(status)}")

    def status(self, text: str) -> bool:
        """Send STATUS= only when it changed."""
        if text == self._last_status:
            return False
        self._last_status = text
        return self.send(f"STATUS={_status_text(text)}")

    def watchdog(self) -> bool:
        return self.watchdog_interval_s is not None and self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def reloading(self) -> bool:
        # One datagram with MONOTONIC_USEC: notify-reload (systemd >= 253) ignores the reload without it.
        return self.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", f"STATUS={_status_text(status)}")


def _status_text(text: str) -> str:
    # One line; sdnotify encodes latin-1, so replace what latin-1 cannot carry.
    line = " ".join(redact(text).split())  # a failure's text may quote a command line
    return line.encode("latin-1", "replace").decode("latin-1")
