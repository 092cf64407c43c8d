"""What socket tests need of the host: more descriptors than the default soft limit, and
whether it has an IPv6 loopback at all (a container may not)."""

from __future__ import annotations

import contextlib
import resource
import socket
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def descriptors(at_least: int) -> Iterator[None]:
    """The soft descriptor limit raised to ``at_least`` for the block (skipped where the hard
    limit is lower); a burst of N connections holds 2N here, both ends in one process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < at_least:
        pytest.skip(f"needs {at_least} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, at_least), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True
