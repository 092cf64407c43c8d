"""Issue 38, points 9 and 10: a port held by someone else is not the engine's failure, and only a
listener the engine's own bind would collide with holds it.

Point 9 on virtual time (the runner with fake processes): a foreign holder used to spend the
failure budget (FATAL after 5 preflight failures in about 12 s, still FATAL once the port was
free); now the engine waits in STARTING, says who holds the port, and starts once it is free.
Point 10 on real loopback sockets: a listener on ``[::1]`` only (IPV6_V6ONLY) counted as a holder
of an engine bound to 127.0.0.1, which then never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsupervisor import aio, process
from llmsupervisor.engine.commands import Stop
from llmsupervisor.engine.launch import PORT_WAIT_MAX_S, preflight_port
from llmsupervisor.engine.processes import HostProcesses
from tests.lib.runner_harness import Harness, S, ready_as, run, spec
from tests.lib.sockets import has_ipv6_loopback

# ---- point 9: waiting for a held port, on virtual time ----


def test_a_foreign_holder_does_not_spend_the_failure_budget_and_the_engine_starts_once_it_is_free(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(max_failures=5, failure_window_s=600.0), held_ports={8000: 4242})
        waiting = await h.until(lambda s: "waiting for it" in s.state_reason)
        assert waiting.state is S.STARTING
        assert "port 8000 is held by pid 4242 (fake process 4242)" in waiting.state_reason
        # Ten minutes held: far past the 5 failures that used to make it FATAL in ~12 s.
        deadline = aio.now() + 600.0
        while aio.now() < deadline:
            await asyncio.sleep(5.0)
            assert h.status.state is S.STARTING, h.status.state_reason
        assert h.status.failures == 0 and S.FATAL not in h.states and S.BACKOFF not in h.states
        assert h.procs.spawned == []  # nothing spawned onto a held port
        freed_at = aio.now()
        del h.procs.held_ports[8000]
        await h.until(ready_as(1))
        assert aio.now() - freed_at <= PORT_WAIT_MAX_S + 1.0  # its own bounded backoff
        await h.close()

    run(scenario)


def test_a_stop_while_waiting_for_the_port_stops_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(tmp_path, spec(), held_ports={8000: None})
        waiting = await h.until(lambda s: "waiting for it" in s.state_reason)
        assert "a process this user cannot see" in waiting.state_reason
        asked = aio.now()
        h.send(Stop())
        await h.state(S.STOPPED)
        assert aio.now() - asked < 1.0
        assert h.procs.spawned == []
        await h.close()

    run(scenario)


# ---- point 10: which listeners hold an engine's port, on real loopback sockets ----


needs_ipv6 = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")


@contextlib.contextmanager
def listening(host: str, port: int = 0, *, v6only: bool = True) -> Iterator[int]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        s.bind((host, port))
        s.listen()
        yield s.getsockname()[1]


@needs_ipv6
def test_a_listener_on_ipv6_loopback_only_does_not_hold_an_engine_on_ipv4_loopback() -> None:
    with listening("::1") as port:
        assert process.port_holders(port) == [os.getpid()]  # someone listens on the port
        assert process.port_holders(port, host="127.0.0.1") == []  # but not where the engine binds
        assert process.port_holders(port, host="::1") == [os.getpid()]
        assert process.port_holders(port, host="::") == [os.getpid()]


@needs_ipv6
def test_the_preflight_of_an_engine_on_ipv4_loopback_lets_a_listener_on_ipv6_loopback_be(
    tmp_path: Path,
) -> None:
    """The daemon's own preflight, with the host's real processes: it raised PortHeld here."""
    with listening("::1") as port:
        asyncio.run(preflight_port(spec(host="127.0.0.1", port=port), HostProcesses(tmp_path)))


@needs_ipv6
def test_a_v6only_wildcard_does_not_hold_ipv4_but_a_dual_stack_one_does() -> None:
    with listening("::", v6only=True) as port:
        assert process.port_holders(port, host="127.0.0.1") == []
        assert process.port_holders(port, host="::1") == [os.getpid()]
    with listening("::", v6only=False) as port:
        assert process.port_holders(port, host="127.0.0.1") == [os.getpid()]
        assert process.port_holders(port, host="0.0.0.0") == [os.getpid()]


def test_ipv4_listeners_hold_by_address_and_wildcard() -> None:
    with listening("127.0.0.1") as port:
        assert process.port_holders(port, host="127.0.0.1") == [os.getpid()]
        assert process.port_holders(port, host="0.0.0.0") == [os.getpid()]  # the wildcard covers it
        assert process.port_holders(port, host="127.0.0.2") == []  # another address of lo
        assert process.port_holders(port, host="localhost") == [os.getpid()]
    with listening("0.0.0.0") as port:
        assert process.port_holders(port, host="127.0.0.2") == [os.getpid()]
