"""The CLI's commands over the control socket: `status`, `restart|drain|stop|start|reload`, `events`.

The client and the exit codes: cli/client.py; `--wait`: cli/wait.py; `status --host`: cli/fleet.py.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from llmsupervisor.cli import render
from llmsupervisor.cli.client import (
    EX_CONFIG,
    EX_FAILED,
    EX_OK,
    EX_UNAVAILABLE,
    Client,
    Refused,
    Unreachable,
    unreachable,
)
from llmsupervisor.cli.wait import Baseline, Waiting, wait
from llmsupervisor.daemon.status import read_status_file

# ---- status ----


def terminal_width(out: TextIO) -> int | None:
    """The terminal's width to fit the table to; None off a terminal (a pipe or a file gets every
    column with a value: scripts should read `--json`)."""
    return shutil.get_terminal_size().columns if out.isatty() else None


def status(
    client: Client, names: Sequence[str], *, as_json: bool, out: TextIO, err: TextIO, wide: bool = False
) -> int:
    try:
        result = client.call({"command": "status"})
    except Unreachable as exc:
        last_status_note(client, err)
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    code, problems = render.status_exit_code(result, names)
    if as_json:
        if names:
            result = {**result, "engines": {n: e for n, e in result["engines"].items() if n in names}}
        print(json.dumps(result, indent=2), file=out)
    else:
        print(render.format_status(result, names, width=terminal_width(out), wide=wide), file=out)
    for problem in problems:
        print(f"llm-supervisor: {problem}", file=err)
    return code


def last_status_note(client: Client, err: TextIO) -> None:
    """When no daemon answers: what the status file says, as stale, never as the engines' state
    now (a killed daemon's file still says READY)."""
    if client.status_file is None:
        return
    found = read_status_file(client.status_file)
    if found is not None and not found.daemon_alive:
        print(f"llm-supervisor: {found.describe()} ({client.status_file})", file=err)


def watch(
    client: Client,
    names: Sequence[str],
    *,
    interval_s: float,
    out: TextIO,
    sleep: Callable[[float], None] = time.sleep,
    rounds: int | None = None,
    wide: bool = False,
) -> int:
    """Redraw the status in place until Ctrl-C (exit 0). A daemon that goes away is shown, and
    the view keeps trying: a daemon restart should not end the operator's watch."""
    tty = out.isatty()
    done = 0
    try:
        while rounds is None or done < rounds:
            done += 1
            stamp = time.strftime("%H:%M:%S")
            try:
                body = render.format_status(
                    client.call({"command": "status"}), names, width=terminal_width(out), wide=wide
                )
            except (Unreachable, Refused) as exc:
                body = f"llm-supervisor: {exc}"
            head = f"llm-supervisor status, every {interval_s:g}s, {stamp} (Ctrl-C to quit)"
            if tty:
                out.write("\x1b[H\x1b[2J" + head + "\n\n" + body + "\n")
            else:
                out.write(head + "\n" + body + "\n\n")
            out.flush()
            if rounds is None or done < rounds:
                sleep(interval_s)
    except KeyboardInterrupt:
        if tty:
            out.write("\n")
    return EX_OK


# ---- events ----


def events(
    client: Client,
    name: str | None,
    *,
    since_s: float | None,
    follow: bool,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    def show(found: list[dict[str, Any]]) -> None:
        for event in found:
            print(json.dumps(event) if as_json else render.event_line(event), file=out, flush=True)

    payload: dict[str, Any] = {"command": "events", "engine": name}
    if since_s is not None:
        payload["since_s"] = since_s
    try:
        result = client.call(payload)
        show(result["events"])
        after = int(result["last_seq"])
        while follow:
            result = client.call(
                {"command": "events", "engine": name, "after": after, "wait_s": 5.0}, timeout_s=15.0
            )
            show(result["events"])
            after = max([after, *(int(e["seq"]) for e in result["events"])])
    except KeyboardInterrupt:
        return EX_OK
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    return EX_OK


# ---- restart, drain, stop, start, reload ----


def engine_command(
    client: Client,
    command: str,
    name: str,
    *,
    wait_for: bool,
    timeout_s: float | None,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    try:
        reply = client.call({"command": command, "engine": name})
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    print(json.dumps(reply, indent=2) if as_json else render.accepted_line(reply), file=out, flush=True)
    if not wait_for:
        return EX_OK
    base = Baseline(command, reply.get("incarnation"), int(reply.get("state_changes") or 0))
    waiting = Waiting({name: base}, int(reply.get("events_seq") or 0))
    return wait(client, waiting, timeout_s=timeout_s, out=err if as_json else out, err=err)


def reload(
    client: Client, *, wait_for: bool, timeout_s: float | None, as_json: bool, out: TextIO, err: TextIO
) -> int:
    try:
        reply = client.call({"command": "reload"}, timeout_s=60.0)
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    if isinstance(reply, dict) and not reply.get("reloaded"):
        for problem in reply.get("problems", []):
            print(problem, file=err)
        print("llm-supervisor: reload rejected; the daemon keeps its previous config", file=err)
        return EX_CONFIG
    print(json.dumps(reply, indent=2) if as_json else render.reload_line(reply), file=out, flush=True)
    names = [*reply.get("added", []), *reply.get("changed", [])]
    if not wait_for or not names:
        return EX_OK
    try:
        engines = client.call({"command": "status"})["engines"]
    except Unreachable as exc:
        print(f"llm-supervisor: lost the daemon while waiting: {exc}", file=err)
        return EX_UNAVAILABLE
    # A changed engine restarts with its new spec (a new incarnation); an added one starts.
    bases = {
        n: Baseline(
            "reload", engines.get(n, {}).get("incarnation") if n in reply.get("changed", []) else None
        )
        for n in names
    }
    for n in names:  # an engine that is not meant to run stays stopped: nothing to wait for
        engine = engines.get(n)
        if engine is not None and not engine.get("wants_run", True):
            bases.pop(n)
    if not bases:
        return EX_OK
    waiting = Waiting(bases, int(reply.get("events_seq") or 0))
    return wait(client, waiting, timeout_s=timeout_s, out=err if as_json else out, err=err)


def stream() -> tuple[TextIO, TextIO]:
    return sys.stdout, sys.stderr
