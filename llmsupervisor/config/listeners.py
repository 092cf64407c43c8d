"""Every address the config makes something listen on, checked against the others: the daemon's
``http_listen``, each engine's ``host``:``port`` (vLLM) and its ``agent_port`` (the HAProxy agent,
on the engine's host, daemon/agent.py).

Two listeners on one port whose addresses overlap cannot both bind: the second fails at start. An
engine on the daemon's own ``http_listen`` went FATAL on "held by pid N (llm-supervisor), which is
not an engine of this supervisor" (issue 39), after check-config and doctor had said OK. A
wildcard address (``0.0.0.0``, ``::``) overlaps every address; ``localhost`` is the loopback
addresses; any other name only itself (no name is looked up).

Engines are compared with each other by port alone, whatever their hosts (the check since the
first release, kept: two engines of one box on one port are a mistake whatever they bind). Read
from the raw entries, so that an engine with a problem elsewhere still takes part.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any, Final

from llmsupervisor.config.problems import _Collector
from llmsupervisor.config.spec import EngineSpec

ENGINE_HOST: Final = EngineSpec.__dataclass_fields__["host"].default
_LOOPBACK: Final = frozenset({"127.0.0.1", "::1"})


def addresses(host: str) -> frozenset[str] | None:
    """The addresses ``host`` binds, normalised (``[::1]`` and ``0:0::1`` are ``::1``); None for
    a wildcard, which binds them all."""
    text = host.strip().strip("[]").lower()
    if text in ("", "*"):
        return None
    if text == "localhost":
        return _LOOPBACK
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return frozenset({text})
    return None if address.is_unspecified else frozenset({address.compressed})


def overlap(a: str, b: str) -> bool:
    """Whether listeners on hosts ``a`` and ``b`` (one port) would take one address."""
    first, second = addresses(a), addresses(b)
    return first is None or second is None or bool(first & second)


def split_listen(value: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[V6]:PORT``) as the daemon binds it, or None when it is not one."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _name(raw: Mapping[str, Any], i: int) -> str:
    name = raw.get("name")
    return f"engines[{i}] ({name})" if isinstance(name, str) else f"engines[{i}]"


def check_listeners(
    engines_raw: list[Any],
    defaults: Mapping[str, Any],
    out: _Collector,
    *,
    http_listen: str | None,
    http_listen_set: bool,
) -> None:
    """Every engine port and agent port once among the engines, and none of them on the daemon's
    ``http_listen`` (None: that value has a problem of its own). The problem is at
    ``supervisor.http_listen`` where the file sets it, else at the engine's key."""
    daemon = split_listen(http_listen) if http_listen is not None else None
    default_host = defaults.get("host", ENGINE_HOST)
    seen_ports: dict[int, int] = {}
    for i, raw in enumerate(engines_raw):
        if not isinstance(raw, dict):
            continue
        host = raw.get("host", default_host)
        # The vLLM port and the HAProxy agent port share one namespace: both are listened on.
        for key in ("port", "agent_port"):
            port = raw.get(key)
            if not isinstance(port, int) or isinstance(port, bool):
                continue
            if port in seen_ports:
                out.add(("engines", i, key), f"port {port} is already used by engines[{seen_ports[port]}]")
            else:
                seen_ports[port] = i
            daemon_host = daemon[0] if daemon is not None and port == daemon[1] else None
            if daemon_host is None or not isinstance(host, str) or not overlap(host, daemon_host):
                continue
            listener = f"{_name(raw, i)}'s {key} ({host}:{port})"
            if http_listen_set:
                out.add(
                    ("supervisor", "http_listen"),
                    f"{http_listen} is also {listener}: the daemon and the engine cannot both listen there",
                )
            else:
                out.add(
                    ("engines", i, key),
                    f"port {port} on {host} is the daemon's own listener (http_listen, by default "
                    f"{http_listen}): choose another port, or set supervisor.http_listen",
                )
