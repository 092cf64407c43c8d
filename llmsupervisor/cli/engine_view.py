"""One engine up close: `llm-supervisor logs NAME` (its recent output, kept by the daemon) and
`llm-supervisor describe NAME` (a vertical view, as ``kubectl describe`` and ``systemctl status``:
process, placement, state and reason, the last restart and why, recent events, last lines).

Both read the daemon over the control socket (control.py ``logs``, ``status``, ``events``);
what the daemon keeps is bounded (daemon/output_ring.py: the current and the previous
incarnation's last lines); under systemd the journal has all of it, and both say how to ask it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, TextIO

from llmsupervisor.cli import render
from llmsupervisor.cli.client import EX_FAILED, EX_OK, Client, Refused, Unreachable, unreachable

DESCRIBE_EVENTS: Final = 10
DESCRIBE_LINES: Final = 10
FOLLOW_WAIT_S: Final = 25.0


def log_line(line: Mapping[str, Any]) -> str:
    """One kept output line: local time, the engine's pid, the text; shutdown output marked."""
    stamp = time.strftime("%H:%M:%S", time.localtime(float(line.get("time") or 0)))
    mark = " (stopping)" if line.get("shutdown") else ""
    return f"{stamp} [{line.get('pid')}]{mark} {line.get('text', '')}"


def logs(
    client: Client,
    name: str,
    *,
    previous: bool,
    lines: int | None,
    follow: bool,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    request: dict[str, Any] = {"command": "logs", "engine": name, "previous": previous, "lines": lines}
    try:
        reply = client.call(request)
        _show(reply["lines"], as_json=as_json, out=out)
        if not follow:
            if not reply["lines"]:
                which = "previous incarnation" if previous else "engine"
                print(f"llm-supervisor: no output kept for this {which}", file=err)
            elif previous:
                found = client.call({"command": "events", "engine": name})["events"]
                print(f"llm-supervisor: {how_it_ended(reply['lines'], found)}", file=err)
            if reply.get("journal"):
                print(f"llm-supervisor: all of it is in the journal: {reply['journal']}", file=err)
            return EX_OK
        after = reply["last_seq"]
        while True:  # a long poll; Ctrl-C ends it, exit 0, as `events -f` and `journalctl -f`
            request = {"command": "logs", "engine": name, "after": after, "wait_s": FOLLOW_WAIT_S}
            reply = client.call(request, timeout_s=FOLLOW_WAIT_S + 10)
            _show(reply["lines"], as_json=as_json, out=out)
            after = max([after, *(line["seq"] for line in reply["lines"])])
    except KeyboardInterrupt:  # the end of a follow, not a failure
        return EX_OK
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED


# Where an incarnation's life ends: the first of these after its first line is how it ended.
ENDING_STATES: Final = frozenset({"stopping", "stopped", "backoff", "fatal"})


def how_it_ended(lines: Sequence[Mapping[str, Any]], events: Iterable[Mapping[str, Any]]) -> str:
    """How the incarnation whose kept ``lines`` these are ended, from the engine's events: the
    first transition out of its life (to STOPPING, STOPPED, BACKOFF or FATAL) after its first
    line: ``pid 48213 ended 11:20:41: READY -> BACKOFF: process killed by SIGKILL unexpectedly;
    ...``. The event ring is bounded: when it no longer has it, say where to look."""
    pid = lines[-1].get("pid")
    first_s = float(lines[0].get("time") or 0.0)
    for event in events:
        if (
            event.get("kind") == "transition"
            and event.get("to_state") in ENDING_STATES
            and float(event.get("time") or 0.0) >= first_s
        ):
            stamp = time.strftime("%H:%M:%S", time.localtime(float(event.get("time") or 0.0)))
            return f"pid {pid} ended {stamp}: {event.get('message')}"
    return f"pid {pid}: how it ended is no longer in the daemon's event ring"


def _show(lines: Iterable[Mapping[str, Any]], *, as_json: bool, out: TextIO) -> None:
    for line in lines:
        print(json.dumps(line) if as_json else log_line(line), file=out)
    out.flush()


def describe(client: Client, name: str, *, as_json: bool, out: TextIO, err: TextIO) -> int:
    try:
        status = client.call({"command": "status"})
        engine = status.get("engines", {}).get(name)
        if engine is None:
            names = ", ".join(status.get("engines", {}))
            print(f"llm-supervisor: no engine named {name!r}; engines: {names}", file=err)
            return EX_FAILED
        found = client.call({"command": "events", "engine": name})["events"][-DESCRIBE_EVENTS:]
        kept = client.call({"command": "logs", "engine": name, "lines": DESCRIBE_LINES})
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    if as_json:
        print(json.dumps({"engine": engine, "events": found, "logs": kept}, indent=2), file=out)
    else:
        print(format_describe(name, engine, found, kept, release=status.get("gpu_release")), file=out)
    return EX_OK


def _bytes(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def _age(seconds: Any) -> str:
    return f"{render.duration(float(seconds))} ago" if isinstance(seconds, int | float) else "-"


def format_describe(
    name: str,
    engine: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    kept: Mapping[str, Any],
    *,
    release: Mapping[str, Any] | None = None,
) -> str:
    """The vertical view: one ``Field:  value`` per line, then the events and the last lines.
    ``release``: the daemon's GPU release (`status`'s ``gpu_release``), shown when it is on one
    of the engine's GPUs and under way."""
    process = kept.get("process") or {}
    restart = engine.get("last_restart")
    rows: list[tuple[str, str]] = [
        ("Name", name),
        ("State", f"{render.state_text(engine)} for {render.duration(float(engine.get('for_s') or 0))}"),
        ("Reason", str(engine.get("reason") or "-")),
        ("In rotation", "yes" if engine.get("in_rotation") else "no"),
    ]
    if (hold := render.hold_text(engine)) is not None:
        rows.append(("Hold", hold))
    if release and release.get("active") and release.get("gpu") in (engine.get("gpus") or ()):
        rows += [("GPU release", line) for line in render.gpu_release_lines(release)]
    pid = engine.get("pid")
    rows += [
        ("PID", f"{pid} (incarnation {engine.get('incarnation')})" if pid is not None else "-"),
        ("Command", str(process.get("command") or "-")),
        ("Model", str(engine.get("model") or "-")),
        ("Port", str(engine.get("port") or "-")),
        ("GPUs", ",".join(str(g) for g in engine.get("gpus") or ()) or "-"),
        ("CPUs", str(engine.get("cpus") or "-")),
        ("Memory", f"RSS {_bytes(process.get('rss_bytes'))} (API server process)"),
    ]
    if engine.get("gpu_memory_used_bytes") is not None:
        used, total = engine.get("gpu_memory_used_bytes"), engine.get("gpu_memory_total_bytes")
        rows.append(("GPU memory", render.gpu_memory(used, total)))
    by_reason = engine.get("restarts_by_reason") or {}
    counts = ", ".join(f"{cause} {n}" for cause, n in sorted(by_reason.items()))
    rows.append(("Restarts", f"{engine.get('restarts', 0)}" + (f" ({counts})" if counts else "")))
    if restart:
        rows.append(("Last restart", f"{restart.get('cause')}, {_age(restart.get('age_s'))}"))
        if restart.get("reason"):
            rows.append(("  why", str(restart["reason"])))
        if restart.get("incident"):
            rows.append(("  incident", str(restart["incident"])))
    else:
        rows.append(("Last restart", "-"))
    rows.append(("Last exit", render.last_exit(engine)))
    if engine.get("last_failure"):
        rows.append(("Last failure", str(engine["last_failure"])))
    if engine.get("last_incident") and (not restart or restart.get("incident") != engine["last_incident"]):
        rows.append(("Last incident", str(engine["last_incident"])))
    for finding in engine.get("findings") or ():
        rows.append(("Finding", f"{finding.get('severity')}: {finding.get('summary')}"))
    width = max(len(label) for label, _ in rows) + 2
    text = [f"{label + ':':<{width}}{value}" for label, value in rows]
    text.append("")
    text.append(f"Events (last {DESCRIBE_EVENTS}):" if events else "Events: none kept")
    text += [f"  {line}" for line in render.event_lines(events)]
    lines = kept.get("lines") or []
    text.append("")
    text.append(f"Last output (llm-supervisor logs {name}):" if lines else "Last output: none kept")
    text += [f"  {log_line(line)}" for line in lines]
    if kept.get("journal"):
        text.append(f"  (all of it: {kept['journal']})")
    return "\n".join(text)


__all__ = ["describe", "format_describe", "log_line", "logs"]
