"""The fleet view: `status --host URL ...` over each daemon's HTTP /status, every host at once."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, TextIO

from llmsupervisor.cli import render

FLEET_DEADLINE_S: Final = 3.0
FLEET_HEADER: Final = ("HOST", *render.STATUS_HEADER)


@dataclass(frozen=True)
class HostStatus:
    """One daemon's status as read over HTTP, or why it could not be read."""

    host: str
    status: Mapping[str, Any] | None
    error: str | None = None


def format_fleet_status(
    hosts: Sequence[HostStatus],
    names: Sequence[str] = (),
    *,
    width: int | None = None,
    wide: bool = False,
    now: float | None = None,
) -> str:
    """One table for all hosts, one row per engine with its HOST first (fitted to ``width`` as
    `status` is: render.fitted); a host that did not answer is one row saying why, not an error.
    ``now``: the wall clock a hold's age is counted to (default: now)."""
    blank = ("-",) * (len(render.STATUS_HEADER) - 2)

    def make(short: bool) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = [FLEET_HEADER]
        for h in hosts:
            if h.status is None:
                rows.append((h.host, "-", "unreachable", *blank[1:], f"unreachable: {h.error}"))
                continue
            engines: Mapping[str, Mapping[str, Any]] = h.status.get("engines", {})
            if names:
                engines = {n: engines[n] for n in names if n in engines}
            rows += [
                (h.host, *row) for row in render.status_rows(engines, wide=wide, short=short, now=now)[1:]
            ]
        return rows

    return "\n".join(render.fitted(make, width=width, wide=wide))


def fleet_exit_code(hosts: Sequence[HostStatus], names: Sequence[str] = ()) -> tuple[int, list[str]]:
    """1 when any host is unreachable or any engine checked on any host is not where its operator
    put it (render.status_exit_code; a name counts as missing only when no host has it)."""
    problems = [f"{h.host}: unreachable: {h.error}" for h in hosts if h.status is None]
    reached = [h for h in hosts if h.status is not None]
    for h in reached:
        assert h.status is not None
        engines = h.status.get("engines", {})
        here = [n for n in names if n in engines]
        if names and not here:
            continue  # none of the names asked about runs on this host
        _, host_problems = render.status_exit_code(h.status, here)
        problems += [f"{h.host}: {p}" for p in host_problems]
    for n in names:
        if reached and not any(n in (h.status or {}).get("engines", {}) for h in reached):
            problems.append(f"no engine named {n!r} on any host")
    return (1 if problems else 0), problems


def read_hosts_file(path: str) -> list[str]:
    """One URL a line; blank lines and ``#`` comments (whole-line or trailing) are skipped."""
    with open(path, encoding="utf-8") as f:
        return [u for line in f if (u := line.split("#", 1)[0].strip())]


def _status_url(host: str) -> str:
    url = host if "://" in host else f"http://{host}"
    return url.rstrip("/") + "/status"


def fetch_host_status(host: str, *, deadline_s: float = FLEET_DEADLINE_S) -> HostStatus:
    """One daemon's /status, or why not: never raises, an unreachable host is a row."""
    import httpx  # here, not at the top: plain `status` over the socket should not pay its import

    try:
        resp = httpx.get(_status_url(host), timeout=deadline_s)
        if resp.status_code != 200:
            return HostStatus(host, None, f"HTTP {resp.status_code} from {resp.url.path}")
        body = resp.json()
    except httpx.TimeoutException:
        return HostStatus(host, None, f"no answer within {deadline_s:g} s")
    except httpx.HTTPError as exc:
        return HostStatus(host, None, str(exc) or type(exc).__name__)
    except ValueError as exc:
        return HostStatus(host, None, f"not JSON: {exc}")
    if not isinstance(body, dict) or not isinstance(body.get("engines"), dict):
        return HostStatus(host, None, "not an llm-supervisor status")
    return HostStatus(host, body)


def fleet_status(
    hosts: Sequence[str],
    names: Sequence[str],
    *,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    deadline_s: float = FLEET_DEADLINE_S,
    wide: bool = False,
) -> int:
    """Every host asked at once, each with its own deadline; one table with a HOST column."""
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        results = list(pool.map(lambda h: fetch_host_status(h, deadline_s=deadline_s), hosts))
    code, problems = fleet_exit_code(results, names)
    if as_json:
        doc = {
            r.host: (dict(r.status) if r.status is not None else {"unreachable": r.error}) for r in results
        }
        print(json.dumps(doc, indent=2), file=out)
    else:
        width = shutil.get_terminal_size().columns if out.isatty() else None
        print(format_fleet_status(results, names, width=width, wide=wide), file=out)
    for problem in problems:
        print(f"llm-supervisor: {problem}", file=err)
    return code
