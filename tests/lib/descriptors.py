"""This process's descriptor limit raised for a test that holds many sockets at once."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def descriptor_limit(at_least: int = 4096) -> Iterator[None]:
    """The soft limit raised to ``at_least`` (the test skipped where the hard limit is lower),
    and put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < at_least:
        pytest.skip(f"needs {at_least} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, at_least), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
