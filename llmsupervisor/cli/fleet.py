"""The fleet view: `status --host URL ...` over each daemon's HTTP /status, every host at once."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TextIO

from llmsupervisor.cli import render

FLEET_DEADLINE_S: Final = 3.0


def read_hosts_file(path: str) -> list[str]:
    """One URL a line; blank lines and ``#`` comments (whole-line or trailing) are skipped."""
    with open(path, encoding="utf-8") as f:
        return [u for line in f if (u := line.split("#", 1)[0].strip())]


def _status_url(host: str) -> str:
    url = host if "://" in host else f"http://{host}"
    return url.rstrip("/") + "/status"


def fetch_host_status(host: str, *, deadline_s: float = FLEET_DEADLINE_S) -> render.HostStatus:
    """One daemon's /status, or why not: never raises, an unreachable host is a row."""
    import httpx  # here, not at the top: plain `status` over the socket should not pay its import

    try:
        resp = httpx.get(_status_url(host), timeout=deadline_s)
        if resp.status_code != 200:
            return render.HostStatus(host, None, f"HTTP {resp.status_code} from {resp.url.path}")
        body = resp.json()
    except httpx.TimeoutException:
        return render.HostStatus(host, None, f"no answer within {deadline_s:g} s")
    except httpx.HTTPError as exc:
        return render.HostStatus(host, None, str(exc) or type(exc).__name__)
    except ValueError as exc:
        return render.HostStatus(host, None, f"not JSON: {exc}")
    if not isinstance(body, dict) or not isinstance(body.get("engines"), dict):
        return render.HostStatus(host, None, "not an llm-supervisor status")
    return render.HostStatus(host, body)


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
    code, problems = render.fleet_exit_code(results, names)
    if as_json:
        doc = {
            r.host: (dict(r.status) if r.status is not None else {"unreachable": r.error}) for r in results
        }
        print(json.dumps(doc, indent=2), file=out)
    else:
        width = shutil.get_terminal_size().columns if out.isatty() else None
        print(render.format_fleet_status(results, names, width=width, wide=wide), file=out)
    for problem in problems:
        print(f"llm-supervisor: {problem}", file=err)
    return code
