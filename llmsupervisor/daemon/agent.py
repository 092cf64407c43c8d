"""HAProxy's agent-check: one TCP port per engine that answers one line and closes.

HAProxy's ``agent-check`` connects to ``agent-port``, sends nothing, and reads a line of words
(the HAProxy configuration manual, "agent-check"). So there is no request to name an engine in:
each engine with ``agent_port`` set gets its own listener, on the engine's own ``host`` (where
HAProxy already reaches vLLM). The reply is a pure function of the engine's latest status:

=================================  ===================  =========================================
engine                             reply                HAProxy does
=================================  ===================  =========================================
READY, in rotation                 ``ready up NN%``     serve it, at NN% of its configured weight
SHEDDING, DRAINING (any reason)    ``drain``            no new sessions; in-flight ones finish
READY, a hang suspected            ``drain``            the same, from the first missed canary
READY, a HANG or STALL found       ``down``             marked down, before the stacks and kill
STOPPED, FATAL                     ``maint``            out until the agent says ``ready``
on a GPU under a node condition    ``maint``            out until the node is repaired
STARTING, BACKOFF, STOPPING, ...   ``down``             marked down
=================================  ===================  =========================================

A hang is suspected (detectors/hang/suspect.py) at its first sign, a canary without an answer or a
stopped process, seconds before a HANG rule proves it and the daemon takes the stacks and kills
the engine: from then on HAProxy sends new requests to the peers, and only the requests already
sent wait (with ``retry-on empty-response``, HAProxy resends those that got no byte when the kill
closes their connections; docs/load-balancers.md).

``ready`` clears a DRAIN or MAINT that an earlier reply set, so an engine that comes back is
served again without an operator. The weight ``NN%`` drops below 100 for an engine that serves
worse than its peers: each batch-size ladder step down, a thermal or power throttle, a
degradation finding, a KV cache over 90 % and an action in flight each halve it or scale it down
(``weight_percent``); HAProxy then sends it proportionally fewer new requests.

Like the HTTP endpoints, a connection never waits on an engine: the line is computed from the
published status, written with a deadline, and the socket is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Final

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.node_condition import NodeCondition, engine_blocked
from llmsupervisor.core.state import EngineState
from llmsupervisor.detectors import FindingKind
from llmsupervisor.engine.status import EngineStatus

log = logging.getLogger(__name__)

WRITE_TIMEOUT_S: Final = 2.0
MAX_CONNECTIONS: Final = 64  # per engine; HAProxy opens one per check and closes it
MIN_WEIGHT_PERCENT: Final = 1  # 0% would be a drain, which is the state machine's word to say
KV_BUSY_RATIO: Final = 0.9

_THROTTLED: Final = frozenset({FindingKind.THERMAL, FindingKind.POWER_THROTTLE})
_UNRESPONSIVE: Final = frozenset({FindingKind.HANG, FindingKind.STALL})
_DEGRADED: Final = frozenset(
    {
        FindingKind.DEGRADATION_THROUGHPUT,
        FindingKind.DEGRADATION_TTFT,
        FindingKind.DEGRADATION_PREFIX_CACHE,
        FindingKind.KV_PRESSURE,
        FindingKind.PREEMPTION_STORM,
    }
)


def weight_percent(status: EngineStatus) -> int:
    """100 for an engine at its best; lower for one that serves worse right now."""
    weight = 100.0
    if status.ladder_steps and status.ladder_step:
        # n steps down of N: (N + 1 - n) / (N + 1) of the full weight.
        weight *= (status.ladder_steps + 1 - status.ladder_step) / (status.ladder_steps + 1)
    kinds = {f.kind for f in status.findings}
    if kinds & _THROTTLED:
        weight *= 0.5
    if kinds & _DEGRADED:
        weight *= 0.5
    if status.load is not None and (status.load.kv_usage_ratio or 0.0) >= KV_BUSY_RATIO:
        weight *= 0.5
    if status.busy:
        weight *= 0.5  # an action is in flight: a restart or a cache reset may follow
    return max(MIN_WEIGHT_PERCENT, round(weight))


def agent_reply(status: EngineStatus | None, conditions: tuple[NodeCondition, ...] = ()) -> str:
    """The agent's line for an engine (without the newline)."""
    if status is None or status.task_failed is not None:
        return "down"
    if engine_blocked(status.spec.gpus, conditions) is not None:
        return "maint"  # its GPU is the node's problem now (core/node_condition.py)
    if status.in_rotation:
        return f"ready up {weight_percent(status)}%"
    if status.state is EngineState.READY and status.task_failed is None:
        # Out of rotation while READY: unresponsive (engine/status.py). A suspicion may be
        # false (it clears at the next answer): drain. A HANG or STALL found is not: down.
        return "down" if {f.kind for f in status.findings} & _UNRESPONSIVE else "drain"
    if status.state in (EngineState.SHEDDING, EngineState.DRAINING):
        return "drain"
    if status.state in (EngineState.STOPPED, EngineState.FATAL):
        return "maint"
    return "down"


class AgentServers:
    """One listener per engine with an ``agent_port``; ``sync`` follows the config on reload."""

    def __init__(
        self,
        status_of: Callable[[str], EngineStatus | None],
        *,
        node_conditions: Callable[[], tuple[NodeCondition, ...]] = lambda: (),
    ) -> None:
        self._status_of = status_of
        self._node_conditions = node_conditions
        self._servers: dict[str, tuple[tuple[str, int], asyncio.Server]] = {}
        self._open: dict[str, int] = {}

    def addresses(self) -> dict[str, tuple[str, int]]:
        return {name: address for name, (address, _server) in self._servers.items()}

    async def sync(self, specs: Iterable[EngineSpec]) -> None:
        """Listen for every spec with an agent port; stop listening for the others. A port that
        cannot be bound is logged and left out: the engine is supervised all the same."""
        wanted = {s.name: (s.host, s.agent_port) for s in specs if s.agent_port is not None}
        for name in list(self._servers):
            address, server = self._servers[name]
            if wanted.get(name) != address:
                del self._servers[name]
                server.close()
                await server.wait_closed()
        for name, (host, port) in wanted.items():
            if name in self._servers:
                continue
            try:
                server = await asyncio.start_server(functools.partial(self._answer, name), host, port)
            except OSError as exc:
                log.error(
                    "cannot listen for the HAProxy agent on %s:%d: %s",
                    host,
                    port,
                    exc,
                    extra={"engine": name},
                )
                continue
            self._servers[name] = ((host, port), server)
            log.info("HAProxy agent on %s:%d", host, port, extra={"engine": name})

    async def close(self) -> None:
        await self.sync(())

    async def _answer(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[name] = self._open.get(name, 0) + 1
        try:
            if self._open[name] <= MAX_CONNECTIONS:
                line = agent_reply(self._status_of(name), self._node_conditions())
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    writer.write(line.encode("ascii") + b"\n")
                    await writer.drain()
        except (OSError, TimeoutError):
            pass  # HAProxy went away; it will ask again at the next agent-inter
        except asyncio.CancelledError:
            pass  # the listener is closing
        finally:
            self._open[name] -= 1
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await writer.wait_closed()
