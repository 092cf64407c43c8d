"""A rotating slowloris and a load balancer's checks, for the HTTP listener's tests (issue 38,
point 1).

The attacker runs as its own process (``python -m tests.lib.slowloris HOST PORT COUNT``), so
that it competes with the daemon for the CPU as a local user would, not for the test's GIL: it
holds ``COUNT`` connections, each sending a partial request and closed and opened again every
``period_s`` (staggered), so none is ever older than the listener's silent grace. The checks are
what HAProxy's ``option httpchk`` does: connect, send a whole request, read the status line,
close; one after another, each with its own generous timeout.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.lib.paths import REPO

PERIOD_S = 0.35  # the attacker: every connection replaced this often
PARTIAL_PROBE_LINE = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "  # a whole line, never the end
# The attacks the tests run: (id, connections, what each sends and never finishes).
ATTACKS = (
    ("64-probe-line", 64, PARTIAL_PROBE_LINE),
    ("256-probe-line", 256, PARTIAL_PROBE_LINE),
    ("256-half-line", 256, b"GET /engines/"),
    ("256-silent", 256, b""),
)


@contextlib.contextmanager
def rotating_slowloris(
    host: str, port: int, count: int, *, partial: bytes = PARTIAL_PROBE_LINE, period_s: float = PERIOD_S
) -> Iterator[subprocess.Popen[bytes]]:
    """The attacker, running until the block ends; it has opened every connection once when the
    block begins."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.lib.slowloris",
            host,
            str(port),
            str(count),
            str(period_s),
            partial.hex(),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"rotating\n", "the attacker did not start"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass(frozen=True, slots=True)
class Check:
    status: int | None  # None: no status line (refused, reset, timed out)
    latency_s: float


def check(host: str, port: int, path: str, *, timeout_s: float) -> Check:
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(max(0.01, timeout_s - (time.monotonic() - started)))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while b"\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return Check(None, time.monotonic() - started)
    parts = data.split(b" ", 2)
    status = (
        int(parts[1]) if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else None
    )
    return Check(status, time.monotonic() - started)


def balancer(
    host: str,
    port: int,
    paths: tuple[str, ...],
    rounds: int,
    *,
    interval_s: float = 0.1,
    timeout_s: float = 5.0,
) -> dict[str, list[Check]]:
    """``rounds`` rounds of one check of each path, ``interval_s`` apart."""
    out: dict[str, list[Check]] = {path: [] for path in paths}
    for _ in range(rounds):
        for path in paths:
            out[path].append(check(host, port, path, timeout_s=timeout_s))
        time.sleep(interval_s)
    return out


def assert_all_answered(checks: dict[str, list[Check]], what: str) -> None:
    """Every check answered 200; the figures printed first (`pytest -s`, docs/reliability.md)."""
    for path, done in checks.items():
        print(f"{what}: {path}: {figures(done)}")
    for path, done in checks.items():
        assert all(c.status == 200 for c in done), f"{path}: {figures(done)}"


def figures(checks: list[Check]) -> str:
    """``30 of 30 answered 200; latency median 3 ms, max 41 ms``: for docs/reliability.md."""
    ok = [c for c in checks if c.status == 200]
    ms = sorted(c.latency_s * 1000 for c in checks)
    answered = f"{len(ok)} of {len(checks)} answered 200"
    return f"{answered}; latency median {statistics.median(ms):.0f} ms, max {ms[-1]:.0f} ms"


def _attack(host: str, port: int, count: int, period_s: float, partial: bytes) -> None:
    socks: list[socket.socket | None] = [None] * count
    opened = [0.0] * count

    def reopen(i: int) -> None:
        old = socks[i]
        if old is not None:
            old.close()
        socks[i] = None
        try:
            s = socket.create_connection((host, port), timeout=1.0)
            s.setblocking(False)
            if partial:
                with contextlib.suppress(OSError):
                    s.send(partial)
            socks[i] = s
        except OSError:
            pass  # refused or timed out: tried again at its next turn
        opened[i] = time.monotonic()

    for i in range(count):
        reopen(i)
        opened[i] -= period_s * (count - i) / count  # staggered: one comes due every period/count
    print("rotating", flush=True)
    turn = min(range(count), key=lambda i: opened[i])  # the oldest: the order stays the same
    while True:
        time.sleep(max(0.0, opened[turn] + period_s - time.monotonic()))
        reopen(turn)
        turn = (turn + 1) % count


if __name__ == "__main__":
    _attack(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), bytes.fromhex(sys.argv[5]))
