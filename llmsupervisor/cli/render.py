"""What the CLI prints: the status table, the one-line answers, the progress and event lines.

Pure functions of the daemon's JSON (daemon/status.py ``status_json``, the control replies,
daemon/events.py): unit tests render fake snapshots with them, no daemon needed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

# States in which an engine has no process serving or coming up: `status` exits 1 on them.
DOWN_STATES: Final = frozenset({"stopped", "stopping", "backoff", "fatal"})
_SINCE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(seconds: float) -> str:
    """``45s``, ``1m10s``, ``15m``, ``2h05m``: short, for progress lines and ages."""
    total = max(0, int(seconds))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        minutes, secs = divmod(total, 60)
        return f"{minutes}m" if secs == 0 else f"{minutes}m{secs:02d}s"
    hours, rest = divmod(total, 3600)
    return f"{hours}h{rest // 60:02d}m"


def parse_since(text: str) -> float:
    """``10m`` -> 600.0; ``30s``, ``2h``, ``1d``, or plain seconds. Raises ValueError."""
    match = _SINCE_RE.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (like 30s, 10m, 2h, 1d)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _gpu_reading(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def gpu_memory(used: int | None, total: int | None) -> str:
    if used is None:
        return "-"
    gib = 1024**3
    return f"{used / gib:.1f}/{total / gib:.0f}G" if total else f"{used / gib:.1f}G"


def short_exit(text: str) -> str:
    """``killed by SIGKILL`` -> ``SIGKILL``; ``exited with code 1`` -> ``exit 1``."""
    if text.startswith("killed by "):
        return text[len("killed by ") :]
    if text.startswith("exited with code "):
        return "exit " + text[len("exited with code ") :]
    return text


def last_exit(engine: Mapping[str, Any]) -> str:
    """The last exit nobody asked for, ``crashed (SIGKILL) 2m ago``; or, where a restart came
    after it (or there was no exit: a hang kill, an operator's restart), that restart and its
    cause, ``restarted (hang) 1m ago``; else ``-``."""
    text = engine.get("last_exit")
    restart = engine.get("last_restart")
    if isinstance(restart, Mapping) and restart.get("cause") not in ("crash", "start_failed"):
        restart_age, exit_age = restart.get("age_s"), engine.get("last_exit_age_s")
        if not text or (restart_age is not None and exit_age is not None and restart_age < exit_age):
            when = f" {duration(restart_age)} ago" if restart_age is not None else ""
            return f"restarted ({restart.get('cause')}){when}"
    if not text:
        return "-"
    age = engine.get("last_exit_age_s")
    return f"crashed ({short_exit(text)})" + (f" {duration(age)} ago" if age is not None else "")


def state_text(engine: Mapping[str, Any]) -> str:
    state = str(engine["state"]).upper()
    phase = engine.get("phase")
    return f"{state} ({phase})" if phase else state


def hold_text(engine: Mapping[str, Any]) -> str | None:
    """``stop hold by alice (uid 1000) since 2026-11-26 08:00:12`` (local time), or None; with
    ``, not saved yet: No space left on device`` while its file is not written (a full disk)."""
    hold = engine.get("hold")
    unsaved = engine.get("hold_unsaved")
    if not hold:
        return f"hold removed, not saved yet: {unsaved}" if unsaved else None
    since = hold.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since is not None else "?"
    text = f"{hold.get('hold')} hold by {hold.get('by')} since {when}"
    return f"{text}, not saved yet: {unsaved}" if unsaved else text


def _detail(engine: Mapping[str, Any]) -> str:
    """The last column, never cut: an operator's hold, then the findings, else the state's
    reason (a FATAL engine's reason says why it gave up and how to retry)."""
    findings = "; ".join(
        f"{f['kind']} ({f['severity']}): {f['summary']}"
        if f.get("summary")
        else f"{f['kind']} ({f['severity']})"
        for f in engine.get("findings", [])
    )
    detail = findings or dying_reason(engine) or str(engine.get("reason") or "")
    marks = [f"[{m}]" for m in (hold_text(engine), roll_text(engine)) if m]
    return " ".join([*marks, detail]) if detail else " ".join(marks)


def dying_reason(engine: Mapping[str, Any]) -> str | None:
    """A BACKOFF or FATAL engine's reason led by the line its own runtime printed as it died
    (``python3: can't open file ...``, a traceback's last line: the JSON's ``last_error_line``),
    so that a table cut to the terminal's width still shows it; None for any other engine."""
    line = engine.get("last_error_line")
    reason = str(engine.get("reason") or "")
    if not line or engine.get("state") not in ("backoff", "fatal") or str(line) not in reason:
        return None
    rest = reason.replace(f": {line}", "", 1)
    return f"{line}; {rest}" if rest else str(line)


# The marker of a reload that changed the engine's spec and has not rolled it yet (the JSON's
# ``config_roll``, daemon/status.py): the policy rolls changed engines within max_unavailable.
ROLL_TEXT: Final = {
    "pending": "new config pending: rolls within max_unavailable",
    "halted": "new config pending: the roll is halted",
    "failed": "failed on the new config: the roll is halted",
}


def roll_text(engine: Mapping[str, Any]) -> str | None:
    roll = engine.get("config_roll")
    return ROLL_TEXT.get(str(roll), f"config roll: {roll}") if roll else None


STATUS_HEADER: Final = (
    "ENGINE",
    "STATE",
    "MODEL",
    "GPU",
    "CPUS",
    "PORT",
    "FOR",
    "RESTARTS",
    "LAST EXIT",
    "ROTATION",
    "STEP",
    "GPU MEM",
    "TEMP",
    "POWER",
    "FINDINGS / REASON",
)


def status_rows(engines: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [STATUS_HEADER]
    for name, e in engines.items():
        steps = e.get("batch_steps") or 0
        rows.append(
            (
                name,
                state_text(e),
                str(e.get("model") or "-"),
                ",".join(str(g) for g in e.get("gpus", [])) or "-",
                str(e.get("cpus") or "-"),
                str(e.get("port", "-")),
                duration(e.get("for_s") or 0.0),
                str(e.get("restarts", 0)),
                last_exit(e),
                "in" if e.get("in_rotation") else "held" if e.get("hold") else "out",
                f"{e.get('batch_step', 0)}/{steps}" if steps else "-",
                gpu_memory(e.get("gpu_memory_used_bytes"), e.get("gpu_memory_total_bytes")),
                _gpu_reading(e.get("gpu_temperature_c"), "C"),
                _gpu_reading(e.get("gpu_power_w"), "W"),
                _detail(e),
            )
        )
    return rows


# Columns hidden when no engine has a value (a box without GPUs, or no NVML); `-o wide` shows them.
GPU_COLUMNS: Final = ("GPU", "GPU MEM", "TEMP", "POWER")
# Fitting a terminal drops columns in this order (least needed first) until the table fits;
# ENGINE, STATE, HOST and the last column always stay, and the last is never cut (it wraps).
FIT_DROP_ORDER: Final = (
    "CPUS",
    "STEP",
    "POWER",
    "TEMP",
    "PORT",
    "FOR",
    "GPU MEM",
    "LAST EXIT",
    "GPU",
    "MODEL",
    "RESTARTS",
    "ROTATION",
)
# Room kept for the last column when fitting, so one long reason does not drop every column.
DETAIL_RESERVE: Final = 30


def table(rows: Sequence[tuple[str, ...]], *, width: int | None = None, wide: bool = False) -> list[str]:
    """Rows (the first is the header) as aligned lines, the last column not padded. Not ``wide``:
    GPU columns without a value on any row are left out, and with ``width`` (the terminal's)
    columns are dropped in FIT_DROP_ORDER until the rest fits beside DETAIL_RESERVE."""
    header = rows[0]
    keep = list(range(len(header)))
    if not wide:
        keep = [
            i for i in keep if header[i] not in GPU_COLUMNS or any(r[i] not in ("-", "") for r in rows[1:])
        ]

    def line_width(columns: list[int]) -> int:
        fixed = sum(max(len(r[i]) for r in rows) + 2 for i in columns[:-1])
        return fixed + min(DETAIL_RESERVE, max(len(r[columns[-1]]) for r in rows))

    if width is not None and not wide:
        for title in FIT_DROP_ORDER:
            if line_width(keep) <= width:
                break
            keep = [i for i in keep if header[i] != title]
    widths = {i: max(len(r[i]) for r in rows) for i in keep[:-1]}
    return [("  ".join(r[i].ljust(widths[i]) for i in keep[:-1]) + "  " + r[keep[-1]]).rstrip() for r in rows]


def format_status(
    status: Mapping[str, Any], names: Sequence[str] = (), *, width: int | None = None, wide: bool = False
) -> str:
    """One row per engine (only ``names`` when given); the last column is not padded or cut.
    ``width``: fit a terminal that wide; ``wide``: every column (`status -o wide`)."""
    engines: Mapping[str, Mapping[str, Any]] = status.get("engines", {})
    if names:
        engines = {n: engines[n] for n in names if n in engines}
    lines = table(status_rows(engines), width=width, wide=wide)
    marked = status.get("gpu_faults_marked") or {}
    if marked:
        lines.append("GPUs marked for faults: " + ", ".join(f"GPU {g}: {n}" for g, n in marked.items()))
    for condition in status.get("node_conditions") or ():
        lines.append(
            f"Node condition {condition.get('condition')} on GPU {condition.get('gpu')}:"
            f" {condition.get('reason')} (not ready; node-level remediation takes it from here)"
        )
    unsaved = status.get("state_files_unsaved") or []
    if unsaved:
        errors = "; ".join(sorted({str(u.get("error")) for u in unsaved}))
        lines.append(
            f"State files not saved yet ({errors}): {', '.join(str(u.get('file')) for u in unsaved)};"
            " written as soon as the disk takes them, lost if the daemon restarts before"
        )
    nvml = status.get("nvml")
    if isinstance(nvml, Mapping):
        lines += nvml_lines(nvml)
    lines += gpu_verdict_lines(status.get("gpu_verdicts") or {})
    return "\n".join(lines)


def nvml_lines(nvml: Mapping[str, Any]) -> list[str]:
    """What `status` says under the table about NVML (docs/gpu.md): that it cannot be opened, and
    why; the engines waiting for it; GPUs lost to calls that hang; GPUs whose XIDs are not seen."""
    out = []
    if nvml.get("up") is False and nvml.get("needed", True):
        line = f"NVML unavailable ({nvml.get('reason')})"
        if isinstance(for_s := nvml.get("for_s"), int | float):
            line += f" for {duration(for_s)}"
        line += f": no GPU telemetry (XIDs, ECC, thermal, lost GPUs); retrying, {nvml.get('attempts')} tries"
        if nvml.get("detail"):
            line += f"; {nvml['detail']}"
        out.append(line)
    waiting = nvml.get("engines_waiting") or {}
    if waiting:
        out.append(
            "Waiting for NVML before starting (named by GPU index): "
            + ", ".join(f"{name} ({duration(left or 0)} left)" for name, left in sorted(waiting.items()))
        )
    for gpu in nvml.get("hung_gpus") or ():
        out.append(f"GPU {gpu}: NVML calls stopped answering while the other GPUs answer: taken as lost")
    for gpu, why in sorted((nvml.get("events_unwatched") or {}).items()):
        out.append(f"GPU {gpu}: XID events not seen (left out of NVML's event set: {why})")
    return out


# How each GPU's faults are judged (daemon/status.py gpu_verdict_sources).
_VERDICT_SOURCES: Final = {
    "recovery_action": "the GPU's recovery action (field 230)",
    "xid_catalogue": "NVIDIA's XID catalogue (the driver has no recovery action, R565+ needed)",
}


def gpu_verdict_lines(sources: Mapping[str, str]) -> list[str]:
    """``GPU faults judged by the GPU's recovery action (field 230): GPU 0,1``, one line per way."""
    by_source: dict[str, list[str]] = {}
    for gpu, source in sources.items():
        by_source.setdefault(source, []).append(gpu)
    return [
        f"GPU faults judged by {_VERDICT_SOURCES.get(source, source)}: GPU {','.join(gpus)}"
        for source, gpus in sorted(by_source.items())
    ]


def unknown_engines(known: Iterable[str], names: Iterable[str]) -> list[str]:
    """One line per name that is not an engine, with the engines there are (a typo is told as
    one, never answered with an empty table or a wait that cannot end)."""
    known = list(known)
    listed = ", ".join(known) or "none"
    return [f"no engine named {n!r}; engines: {listed}" for n in names if n not in known]


def meant_to_serve(engine: Mapping[str, Any]) -> bool:
    """The daemon's word for it (engine/status.py ``meant_to_serve``: enabled, or started by hand
    for this run of the daemon); from a daemon that does not say, ``enabled``."""
    return bool(engine.get("meant_to_serve", engine.get("enabled", True)))


def status_exit_code(status: Mapping[str, Any], names: Sequence[str] = ()) -> tuple[int, list[str]]:
    """0, or 1 with why: a named engine (or, without names, any meant to serve) is FATAL or down,
    or a named engine does not exist."""
    engines: Mapping[str, Mapping[str, Any]] = status.get("engines", {})
    problems = unknown_engines(engines, names)
    checked = (
        [n for n in names if n in engines] if names else [n for n, e in engines.items() if meant_to_serve(e)]
    )
    problems += [
        f"{n} is {engines[n]['state'].upper()}" for n in checked if engines[n]["state"] in DOWN_STATES
    ]
    return (1 if problems else 0), problems


def accepted_line(reply: Mapping[str, Any]) -> str:
    """``gpu1: restart accepted; draining, 3 requests in flight``; and when the hold could not
    be written (a full disk), that it holds now and is saved once the disk has room."""
    line = f"{reply.get('engine')}: {reply.get('accepted')} accepted"
    doing = reply.get("doing")
    line = f"{line}; {doing}" if doing else f"{line} (was {str(reply.get('state', '?')).upper()})"
    unsaved = reply.get("hold_unsaved")
    if unsaved:
        line += (
            f"; the hold is not saved yet ({unsaved}): it holds now, is written once the disk has"
            " room, and a daemon restart before then would forget it"
        )
    return line


def reload_line(reply: Mapping[str, Any]) -> str:
    """``reload accepted; added gpu3; changed gpu1, gpu2; rolling gpu1 (within max_unavailable)``:
    the reply's ``rolling`` are the engines the policy restarts onto the new config (a changed
    engine that is stopped or disabled is not among them: it just has its new spec). A daemon
    older than the rolling reload has no ``rolling``: its changed engines are "restarting"."""
    rolls = "rolling" in reply
    parts = []
    for key, label in (
        ("added", "added"),
        ("changed", "changed" if rolls else "restarting"),
        ("removed", "stopping"),
    ):
        names = reply.get(key) or []
        if names:
            parts.append(f"{label} {', '.join(names)}")
    if reply.get("rolling"):
        parts.append(f"rolling {', '.join(reply['rolling'])} (restarted within max_unavailable)")
    for setting in reply.get("next_start_only") or []:
        parts.append(f"{setting} takes effect at the next daemon start")
    return "reload accepted; " + ("; ".join(parts) if parts else "nothing changed")


RELOAD_VERBS: Final = {
    "restart": "restarting",
    "stop": "stopping",
    "start": "starting",
    "next start": "new spec at next start for",
}


def reload_lines(reply: Mapping[str, Any], *, dry_run: bool = False) -> list[str]:
    """A reload's (or ``--dry-run``'s) answer: what happens, then per engine why: the fields that
    changed and what follows (the daemon's table, config/reload_diff.py), unchanged ones last.

    ``reload accepted; restarting gpu1 (rolled within max_unavailable=1); stopping gpu2``
    ``  gpu1: restart (model reload): model: llama-8b -> llama-70b``"""
    rows: list[Mapping[str, Any]] = reply.get("engines") or []
    if "lines" not in reply:  # a daemon from before the table
        return [reload_line(reply)]
    head = "dry run, nothing applied; a reload would be: " if dry_run else "reload accepted; "
    parts = []
    for action, verb in RELOAD_VERBS.items():
        names = [str(r["engine"]) for r in rows if r.get("action") == action]
        if names:
            rolled = f" (rolled within max_unavailable={reply.get('max_unavailable', 1)})"
            parts.append(f"{verb} {', '.join(names)}" + (rolled if action == "restart" else ""))
    later = [s["field"] for s in reply.get("settings") or [] if s.get("when") != "now"]
    if later:
        parts.append(f"{', '.join(later)} at the next daemon start")
    lines = [head + ("; ".join(parts) if parts else "nothing changes")]
    described: list[str] = reply["lines"]
    unchanged = []
    for index, line in enumerate(described):
        row = rows[index] if index < len(rows) else None
        if row is not None and row.get("action") == "nothing" and not row.get("changes"):
            unchanged.append(str(row["engine"]))
        else:
            lines.append(f"  {line}")
    if unchanged:
        lines.append(f"  unchanged: {', '.join(unchanged)}")
    return lines


def progress_line(name: str, engine: Mapping[str, Any], *, waited_s: float) -> str:
    """``gpu1 STARTING 1m10s / 15m: loading weights``: the state, how long it has been in it
    against its budget (start_timeout_s while starting, drain_timeout_s while draining), and
    the start phase or the state's reason."""
    state = str(engine.get("state", "?"))
    for_s = float(engine.get("for_s") or 0.0)
    budget = {"starting": engine.get("start_timeout_s"), "draining": engine.get("drain_timeout_s")}.get(state)
    clock = f"{duration(for_s)} / {duration(budget)}" if budget else duration(for_s)
    detail = engine.get("phase") or engine.get("reason") or ""
    if state == "draining" and engine.get("requests_running"):
        detail = f"{engine['requests_running']} requests in flight"
    line = f"{name} {state.upper()} {clock}"
    if detail:
        line += f": {detail}"
    return line + f" (waited {duration(waited_s)})"


def event_line(event: Mapping[str, Any]) -> str:
    """``2026-11-23 11:20:36 gpu1 transition READY -> DRAINING: draining: ...``; the kind is
    left out where the message begins with it (``finding hang (critical): ...``)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(event.get("time", 0.0))))
    engine = event.get("engine") or "-"
    kind, message = str(event.get("kind", "?")), str(event.get("message", ""))
    return f"{stamp} {engine} {message if message.startswith(kind) else f'{kind} {message}'}"


def event_lines(events: Iterable[Mapping[str, Any]]) -> list[str]:
    return [event_line(e) for e in events]


# ---- the fleet view: `status --host URL ...` ----

FLEET_HEADER = ("HOST", *STATUS_HEADER)


@dataclass(frozen=True)
class HostStatus:
    """One daemon's status as read over HTTP, or why it could not be read."""

    host: str
    status: Mapping[str, Any] | None
    error: str | None = None


def format_fleet_status(
    hosts: Sequence[HostStatus], names: Sequence[str] = (), *, width: int | None = None, wide: bool = False
) -> str:
    """One table for all hosts, one row per engine with its HOST first; a host that did not
    answer is one row saying why, not an error."""
    rows: list[tuple[str, ...]] = [FLEET_HEADER]
    blank = ("-",) * (len(STATUS_HEADER) - 2)
    for h in hosts:
        if h.status is None:
            rows.append((h.host, "-", "unreachable", *blank[1:], f"unreachable: {h.error}"))
            continue
        engines: Mapping[str, Mapping[str, Any]] = h.status.get("engines", {})
        if names:
            engines = {n: engines[n] for n in names if n in engines}
        rows += [(h.host, *row) for row in status_rows(engines)[1:]]
    return "\n".join(table(rows, width=width, wide=wide))


def fleet_exit_code(hosts: Sequence[HostStatus], names: Sequence[str] = ()) -> tuple[int, list[str]]:
    """1 when any host is unreachable or any engine checked on any host is FATAL or down (a name
    counts as missing only when no host has it)."""
    problems = [f"{h.host}: unreachable: {h.error}" for h in hosts if h.status is None]
    reached = [h for h in hosts if h.status is not None]
    for h in reached:
        assert h.status is not None
        engines = h.status.get("engines", {})
        here = [n for n in names if n in engines]
        if names and not here:
            continue  # none of the names asked about runs on this host
        _, host_problems = status_exit_code(h.status, here)
        problems += [f"{h.host}: {p}" for p in host_problems]
    for n in names:
        if reached and not any(n in (h.status or {}).get("engines", {}) for h in reached):
            problems.append(f"no engine named {n!r} on any host")
    return (1 if problems else 0), problems
