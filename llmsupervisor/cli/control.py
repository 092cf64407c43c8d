"""The CLI's commands over the control socket: `status`, `restart|drain|stop|start|reload`, `events`.

The client and the exit codes: cli/client.py; `--wait`: cli/wait.py; `status --host`: cli/fleet.py.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from llmsupervisor.cli import render
from llmsupervisor.cli.client import (
    EX_CONFIG,
    EX_FAILED,
    EX_INTERRUPTED,
    EX_OK,
    EX_UNAVAILABLE,
    Client,
    Refused,
    Unreachable,
    unreachable,
)
from llmsupervisor.cli.wait import WAIT_POLL_S, Baseline, Progress, Waiting, wait
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
    unknown = render.unknown_engines(result.get("engines", {}), names)
    if unknown:  # said alone: no table (an empty one, for a typo) before it
        for problem in unknown:
            print(f"llm-supervisor: {problem}", file=err)
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
    err: TextIO | None = None,
    wide: bool = False,
) -> int:
    """Redraw the status in place until Ctrl-C (exit 0). A daemon that goes away is shown, and
    the view keeps trying: a daemon restart should not end the operator's watch. A name that is
    no engine ends it at once (exit 1): a typo would only ever show an empty table."""
    if names:
        try:
            unknown = render.unknown_engines(client.call({"command": "status"})["engines"], names)
        except (Unreachable, Refused):
            unknown = []  # the view says so, and keeps trying
        for problem in unknown:
            print(f"llm-supervisor: {problem}", file=err or sys.stderr)
        if unknown:
            return EX_FAILED
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


def names_or_all(command: str, names: Sequence[str], *, every: bool) -> str | None:
    """What is wrong with `restart|drain|stop|start`'s engines (exit 2), or None: engine names or
    `--all`, one of the two."""
    if names and every:
        named = " ".join(names)
        return f"{command}: --all or engine names, not both: `{command} --all` or `{command} {named}`"
    return None if names or every else f"{command}: name one or more engines, or --all"


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


def engine_commands(
    client: Client,
    command: str,
    names: Sequence[str],
    *,
    every: bool,
    wait_for: bool,
    timeout_s: float | None,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """`restart|drain|stop|start NAME...` or `--all`. Every name is checked before anything is
    sent: a typo in the third name must not leave the first two done.

    A restart of several is rolled from here, one engine at a time, each READY before the next
    is sent (so at most one is out of rotation for it); the daemon's own roll under
    ``max_unavailable`` is the reload's (core/policy.py). The others are sent at once: a drain or
    a stop of several takes them out because the operator asked, a start adds capacity."""
    try:
        engines: dict[str, Any] = client.call({"command": "status"})["engines"]
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    if every:
        # Every engine meant to serve: enabled, or started by hand for this run of the daemon.
        names = [n for n, e in engines.items() if render.meant_to_serve(e)]
        if command == "restart":  # --all restarts what runs; an engine an operator stopped stays so
            skipped = [n for n in names if not engines[n].get("wants_run", True)]
            names = [n for n in names if n not in skipped]
            if skipped:
                print(
                    f"llm-supervisor: not restarting {', '.join(skipped)}: stopped by an operator", file=err
                )
        if not names:
            print(f"llm-supervisor: {command} --all: no engine to {command}", file=err)
            return EX_OK
    unknown = render.unknown_engines(engines, names)
    for problem in unknown:
        print(f"llm-supervisor: {problem}", file=err)
    if unknown:
        return EX_FAILED
    names = list(dict.fromkeys(names))  # a name given twice is one engine
    if len(names) == 1:
        return engine_command(
            client,
            command,
            names[0],
            wait_for=wait_for,
            timeout_s=timeout_s,
            as_json=as_json,
            out=out,
            err=err,
        )
    if command == "restart":
        return _rolled_restart(
            client, names, timeout_s=timeout_s, as_json=as_json, out=out, err=err, clock=clock
        )
    bases: dict[str, Baseline] = {}
    events_seq: int | None = None
    code = EX_OK
    for name in names:
        try:
            reply = client.call({"command": command, "engine": name})
        except Unreachable as exc:
            return unreachable(client, exc, err)
        except Refused as exc:
            print(f"llm-supervisor: {name}: {exc}", file=err)
            code = EX_FAILED
            continue
        print(json.dumps(reply) if as_json else render.accepted_line(reply), file=out, flush=True)
        bases[name] = Baseline(command, reply.get("incarnation"), int(reply.get("state_changes") or 0))
        seq = int(reply.get("events_seq") or 0)
        events_seq = seq if events_seq is None else min(events_seq, seq)
    if not wait_for or not bases:
        return code
    waited = wait(
        client, Waiting(bases, events_seq or 0), timeout_s=timeout_s, out=err if as_json else out, err=err
    )
    return waited if waited != EX_OK else code


def _rolled_restart(
    client: Client,
    names: Sequence[str],
    *,
    timeout_s: float | None,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    clock: Callable[[], float],
) -> int:
    progress = err if as_json else out
    print(
        f"restarting {', '.join(names)} one at a time, each READY before the next"
        " (Ctrl-C stops the roll; the engines not reached keep running)",
        file=progress,
        flush=True,
    )
    deadline = clock() + timeout_s if timeout_s is not None else None
    for index, name in enumerate(names):
        left_s = max(0.0, deadline - clock()) if deadline is not None else None
        code = engine_command(
            client, "restart", name, wait_for=True, timeout_s=left_s, as_json=as_json, out=out, err=err
        )
        if code != EX_OK:
            rest = names[index + 1 :]
            if rest:
                print(f"llm-supervisor: roll stopped at {name}; not restarted: {', '.join(rest)}", file=err)
            return code
    return EX_OK


def wait_for_state(
    client: Client,
    names: Sequence[str],
    target: str,
    *,
    timeout_s: float | None,
    out: TextIO,
    err: TextIO,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """`wait NAME... --for ready|stopped`: wait, doing nothing, until every engine named is there
    (as `kubectl wait`). ``ready``: READY or SHEDDING (serving); ``stopped``: STOPPED or FATAL
    with no process. Exit 0 reached, 1 on ``--timeout`` or when an engine waited for to be ready
    is FATAL (it will not get there by itself), 69 the daemon went away."""
    started = clock()
    progress = Progress(out, clock=clock)
    checked = False
    try:
        while True:
            engines = client.call({"command": "status"})["engines"]
            if not checked:
                unknown = render.unknown_engines(engines, names)
                for problem in unknown:
                    print(f"llm-supervisor: {problem}", file=err)
                if unknown:
                    return EX_FAILED
                checked = True
            pending = [n for n in names if not _there(engines.get(n, {}), target)]
            waited_s = clock() - started
            if not pending:
                progress.end()
                for name in names:
                    print(f"{name}: {str(engines[name].get('state', '?')).upper()}", file=out)
                return EX_OK
            gone = [n for n in pending if n not in engines]
            fatal = [n for n in pending if target == "ready" and engines.get(n, {}).get("state") == "fatal"]
            # A hold is as final as FATAL: a drained or stopped engine is never ready by itself.
            held = [n for n in pending if target == "ready" and n not in fatal and _held(engines.get(n, {}))]
            if gone or fatal or held:
                progress.end()
                for name in gone:
                    print(f"{name}: the engine is gone (removed by a reload)", file=err)
                for name in fatal:
                    print(
                        f"{name}: FATAL, it will not be ready by itself: {engines[name].get('reason')}",
                        file=err,
                    )
                for name in held:
                    print(f"{name}: {held_line(name, engines[name])}", file=err)
                return EX_FAILED
            name = pending[0]
            line = render.progress_line(name, engines[name], waited_s=waited_s)
            if len(names) > 1:
                line += f" [{len(names) - len(pending)}/{len(names)} engines {target}]"
            progress.show(line, (name, engines[name].get("state"), engines[name].get("phase")))
            if timeout_s is not None and waited_s >= timeout_s:
                progress.end()
                still = ", ".join(f"{n} {str(engines[n].get('state', '?')).upper()}" for n in pending)
                print(f"llm-supervisor: not {target} after {render.duration(waited_s)}: {still}", file=err)
                return EX_FAILED
            sleep(WAIT_POLL_S)
    except KeyboardInterrupt:
        progress.end()
        return EX_INTERRUPTED
    except Unreachable as exc:
        progress.end()
        if not checked:
            return unreachable(client, exc, err)
        print(f"llm-supervisor: lost the daemon while waiting: {exc}", file=err)
        return EX_UNAVAILABLE
    except Refused as exc:
        progress.end()
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED


def _held(engine: Mapping[str, Any]) -> bool:
    """Held out of service by an operator (a drain, a stop) or by the config (``enabled: false``,
    not started by hand): the daemon's ``held_by_operator``."""
    return bool(engine.get("held_by_operator", engine.get("hold") is not None))


def held_line(name: str, engine: Mapping[str, Any]) -> str:
    """Why a held engine will not be ready by itself, and what releases it."""
    release = f"`llm-supervisor start {name}` to release"
    hold = engine.get("hold")
    if hold:
        since, what = render.hold_since(hold), f"{hold.get('hold')} by {hold.get('by')}"
        return f"held by the operator since {since} ({what}); {release}"
    if not engine.get("enabled", True):
        return f"disabled in the config (enabled: false); `llm-supervisor start {name}` starts it"
    return f"held by the operator; {release}"


def _there(engine: Mapping[str, Any], target: str) -> bool:
    state = engine.get("state")
    if target == "ready":
        return state in ("ready", "shedding")
    return state in ("stopped", "fatal") and engine.get("pid") is None


def reload(
    client: Client,
    *,
    wait_for: bool,
    timeout_s: float | None,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    dry_run: bool = False,
) -> int:
    payload: dict[str, Any] = {"command": "reload", **({"dry_run": True} if dry_run else {})}
    try:
        reply = client.call(payload, timeout_s=60.0)
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    if dry_run and isinstance(reply, dict) and not reply.get("dry_run"):
        # A daemon from before --dry-run took it for a reload: say so rather than pretend.
        print("llm-supervisor: this daemon does not know --dry-run; it reloaded", file=err)
    elif isinstance(reply, dict) and not reply.get("reloaded") and (reply.get("problems") or not dry_run):
        for problem in reply.get("problems", []):
            print(problem, file=err)
        if dry_run:
            print("llm-supervisor: a reload would be rejected; the daemon keeps its config", file=err)
        else:
            print("llm-supervisor: reload rejected; the daemon keeps its previous config", file=err)
        return EX_CONFIG
    text = "\n".join(render.reload_lines(reply, dry_run=bool(reply.get("dry_run"))))
    print(json.dumps(reply, indent=2) if as_json else text, file=out, flush=True)
    if reply.get("dry_run"):
        return EX_OK
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
