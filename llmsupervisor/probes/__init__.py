"""Probes: read-only looks at an engine, each with its own deadline; failures are data."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, get_args

log = logging.getLogger("llmsupervisor.probes")

# timeout   the probe's deadline passed (or an earlier call for the same target is still stuck)
# connect   nothing answered: connection refused, reset, or the process is gone
# http      an answer that is not the expected one (non-200, protocol error)
# parse     an answer that could not be read (a garbage /metrics body)
# nvml      an NVML call failed, or NVML is unavailable on this host
# gpu_lost  NVML says the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST, usually after XID 79)
# released  NVML closed on purpose (an operator's `gpu release`, for a GPU reset): no reading,
#           and no trouble either (daemon/gpu_release.py)
# error     the probe itself could not run: the daemon is out of file descriptors, or a bug.
#           Says nothing about the engine, so no detector acts on it (ProbeErrors counts it).
ProbeFailureKind = Literal["timeout", "connect", "http", "parse", "nvml", "gpu_lost", "released", "error"]
PROBE_FAILURE_KINDS: Final[frozenset[str]] = frozenset(get_args(ProbeFailureKind))


@dataclass(frozen=True, slots=True)
class ProbeFailure:
    """A probe that produced no sample; kept in the observation instead of raised."""

    kind: ProbeFailureKind
    detail: str

    def __post_init__(self) -> None:
        if self.kind not in PROBE_FAILURE_KINDS:
            raise ValueError(f"unknown probe failure kind {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


# Out of descriptors, for this process (EMFILE) or the whole host (ENFILE): every probe that
# opens a socket or a /proc file fails until some are released.
DESCRIPTOR_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE})
PROBE_ERROR_LOG_EVERY_S: Final = 60.0


def error_name(exc: BaseException) -> str:
    """``EMFILE`` for an OSError with an errno, else the exception's type name."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, f"errno{exc.errno}")
    return type(exc).__name__


class ProbeErrors:
    """Probes that raised instead of returning a value, counted by (probe, error) for
    ``llmsupervisor_probe_errors_total`` and logged at most once per ``log_every_s`` per pair.

    A probe that raises is the daemon's trouble, not the engine's: the round records a
    ``ProbeFailure("error")`` and goes on, and the engine keeps serving (issue 17: with the
    descriptor limit reached, the /proc sweep raised through the round and both engines were
    restarted). One process-wide instance, ``PROBE_ERRORS``; probes run in threads too, hence
    the lock.
    """

    def __init__(
        self, *, log_every_s: float = PROBE_ERROR_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log_every_s = log_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, str], int] = {}
        self._logged_s: dict[tuple[str, str], float] = {}

    def record(self, probe: str, exc: BaseException) -> ProbeFailure:
        name = error_name(exc)
        key = (probe, name)
        now = self._clock()
        with self._lock:
            self._totals[key] = self._totals.get(key, 0) + 1
            count = self._totals[key]
            last = self._logged_s.get(key)
            loud = last is None or now - last >= self.log_every_s
            if loud:
                self._logged_s[key] = now
        if loud:
            if isinstance(exc, OSError) and exc.errno in DESCRIPTOR_ERRNOS:
                log.error(
                    "the daemon is out of file descriptors (%s in the %s probe, %d so far): probes "
                    "fail until some are released; engines are kept. Raise LimitNOFILE= or find "
                    "who holds the daemon's connections",
                    name,
                    probe,
                    count,
                )
            else:
                log.error("the %s probe raised %s (%d so far): %s", probe, name, count, exc, exc_info=exc)
        return ProbeFailure("error", f"{probe} probe could not run: {name}: {exc}"[:300])

    def totals(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._totals)

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()
            self._logged_s.clear()


PROBE_ERRORS: Final = ProbeErrors()


__all__ = [
    "DESCRIPTOR_ERRNOS",
    "PROBE_ERRORS",
    "PROBE_FAILURE_KINDS",
    "ProbeErrors",
    "ProbeFailure",
    "ProbeFailureKind",
    "error_name",
]
