"""What the CLI prints: the status table, the one-line answers, the progress and event lines.

Pure functions of the daemon's JSON (daemon/status.py ``status_json``, the control replies,
daemon/events.py): unit tests render fake snapshots with them, no daemon needed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

# States in which an engine has no process serving or coming up: `status` exits 1 on them for an
# engine meant to serve that no operator holds (``unexpected``).
DOWN_STATES: Final = frozenset({"stopped", "stopping", "backoff", "fatal"})
_SINCE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(seconds: float, *, coarse: bool = False) -> str:
    """``45s``, ``1m10s``, ``15m``, ``2h05m``: short, for progress lines and ages. ``coarse`` (a
    narrow table): the larger unit only, ``1m``, ``2h``."""
    total = max(0, int(seconds))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        minutes, secs = divmod(total, 60)
        return f"{minutes}m" if secs == 0 or coarse else f"{minutes}m{secs:02d}s"
    hours, rest = divmod(total, 3600)
    return f"{hours}h" if coarse else f"{hours}h{rest // 60:02d}m"


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


def last_exit(engine: Mapping[str, Any], *, short: bool = False) -> str:
    """The last exit nobody asked for, ``crashed (SIGKILL) 2m ago``; or, where a restart came
    after it (or there was no exit: a hang kill, an operator's restart), that restart and its
    cause, ``restarted (hang) 1m ago``; else ``-``. ``short`` (a narrow terminal): ``SIGKILL 2m
    ago``, ``hang 1m ago``."""
    text = engine.get("last_exit")
    restart = engine.get("last_restart")
    if isinstance(restart, Mapping) and restart.get("cause") not in ("crash", "start_failed"):
        restart_age, exit_age = restart.get("age_s"), engine.get("last_exit_age_s")
        if not text or (restart_age is not None and exit_age is not None and restart_age < exit_age):
            when = f" {duration(restart_age, coarse=short)} ago" if restart_age is not None else ""
            cause = str(restart.get("cause"))
            return f"{SHORT_CAUSES.get(cause, cause)}{when}" if short else f"restarted ({cause}){when}"
    if not text:
        return "-"
    age = engine.get("last_exit_age_s")
    when = f" {duration(age, coarse=short)} ago" if age is not None else ""
    return f"{short_exit(text)}{when}" if short else f"crashed ({short_exit(text)}){when}"


# The restart causes (core/policy.py RESTART_CAUSES) in a narrow LAST EXIT column.
SHORT_CAUSES: Final = {"config_change": "config", "engine_dead": "dead", "runner_died": "bug"}


def state_text(engine: Mapping[str, Any], *, short: bool = False) -> str:
    """``STARTING (loading weights)``; ``short``: the state alone (the phase goes to the reason)."""
    state = str(engine["state"]).upper()
    phase = engine.get("phase")
    return f"{state} ({phase})" if phase and not short else state


def hold_text(engine: Mapping[str, Any]) -> str | None:
    """``stop hold by alice (uid 1000) since 2026-11-26 08:00:12`` (local time), or None; with
    ``, not saved yet: No space left on device`` while its file is not written (a full disk)."""
    hold = engine.get("hold")
    unsaved = engine.get("hold_unsaved")
    if not hold:
        return f"hold removed, not saved yet: {unsaved}" if unsaved else None
    text = f"{hold.get('hold')} hold by {hold.get('by')} since {hold_since(hold)}"
    reset = hold.get("gpu_reset")
    if isinstance(reset, Mapping):
        gpu = reset.get("gpu")
        text += (
            f" for the reset of GPU {gpu} ({reset.get('uuid')}):"
            f" `llm-supervisor gpu take-back {gpu}` starts it"
        )
    return f"{text}, not saved yet: {unsaved}" if unsaved else text


def hold_since(hold: Mapping[str, Any]) -> str:
    """When the hold was taken, local time: ``2026-11-26 08:00:12``."""
    since = hold.get("since")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since is not None else "?"


def short_hold(engine: Mapping[str, Any], *, now: float | None = None, short: bool = False) -> str | None:
    """The table's few characters for a hold: ``held: drain (alice, 3m)``: its kind, who (the
    user, without the uid) and for how long (``hold_text`` and `describe` say it all); ``short``
    (a narrow table, whose ROTATION says ``held``): ``drain (alice, 3m)``."""
    hold = engine.get("hold")
    unsaved = engine.get("hold_unsaved")
    if not hold:
        return f"hold removed, not saved yet: {unsaved}" if unsaved else None
    who = re.sub(r" \(uid \d+\)$", "", str(hold.get("by") or "operator"))
    since = hold.get("since")
    held_s = (time.time() if now is None else now) - since if since is not None else None
    age = f", {duration(held_s, coarse=short)}" if held_s is not None else ""
    reset = hold.get("gpu_reset")
    kind = (
        f"{hold.get('hold')} for GPU {reset.get('gpu')} reset"
        if isinstance(reset, Mapping)
        else hold.get("hold")
    )
    text = ("" if short else "held: ") + f"{kind} ({who}{age})"
    return f"{text}, not saved yet: {unsaved}" if unsaved else text


# The state an operator's hold puts an engine in: there, its reason only repeats the hold.
HELD_STATES: Final = {"stop": "stopped", "drain": "draining"}


def detail(
    engine: Mapping[str, Any], *, wide: bool = False, short: bool = False, now: float | None = None
) -> str:
    """The last column: an operator's hold, a reload's roll, then the findings, else the state's
    reason (a FATAL engine's reason says why it gave up and how to retry). ``wide``: the hold in
    full; ``short``: a STARTING engine's phase leads (the STATE column has no room for it)."""
    findings = "; ".join(
        f"{f['kind']} ({f['severity']}): {f['summary']}"
        if f.get("summary")
        else f"{f['kind']} ({f['severity']})"
        for f in engine.get("findings", [])
    )
    hold = engine.get("hold") or {}
    repeats = HELD_STATES.get(str(hold.get("hold"))) == engine.get("state") and not wide
    reason = "" if repeats else dying_reason(engine) or str(engine.get("reason") or "")
    if short and engine.get("phase"):  # "start", "start at ladder step 1/3": the phase says more
        reason = str(engine["phase"]) + ("" if reason.startswith("start") else f"; {reason}")
    held = hold_text(engine) if wide else short_hold(engine, now=now, short=short)
    return "; ".join(part for part in (held, roll_text(engine), findings or reason) if part)


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


def status_rows(
    engines: Mapping[str, Mapping[str, Any]],
    *,
    wide: bool = False,
    short: bool = False,
    now: float | None = None,
) -> list[tuple[str, ...]]:
    """The table's rows, the header first. ``short``: the narrow forms of STATE, LAST EXIT and
    the reason (a terminal too narrow for the long ones); ``wide``: an operator's hold in full."""
    rows: list[tuple[str, ...]] = [STATUS_HEADER]
    for name, e in engines.items():
        steps = e.get("batch_steps") or 0
        rows.append(
            (
                name,
                state_text(e, short=short),
                str(e.get("model") or "-"),
                ",".join(str(g) for g in e.get("gpus", [])) or "-",
                str(e.get("cpus") or "-"),
                str(e.get("port", "-")),
                duration(e.get("for_s") or 0.0, coarse=short),
                str(e.get("restarts", 0)),
                last_exit(e, short=short),
                "in" if e.get("in_rotation") else "held" if e.get("hold") else "out",
                f"{e.get('batch_step', 0)}/{steps}" if steps else "-",
                gpu_memory(e.get("gpu_memory_used_bytes"), e.get("gpu_memory_total_bytes")),
                _gpu_reading(e.get("gpu_temperature_c"), "C"),
                _gpu_reading(e.get("gpu_power_w"), "W"),
                detail(e, wide=wide, short=short, now=now),
            )
        )
    return rows


# Columns hidden when no engine has a value (a box without GPUs, or no NVML); `-o wide` shows them.
GPU_COLUMNS: Final = ("GPU", "GPU MEM", "TEMP", "POWER")
# Fitting a terminal drops columns in this order (least needed first) until the table fits. What
# says what happened is never dropped: ENGINE, STATE, FOR, RESTARTS, LAST EXIT, ROTATION (and
# HOST), and the last column, which is cut to the width instead (with an ellipsis).
FIT_DROP_ORDER: Final = ("CPUS", "STEP", "POWER", "TEMP", "PORT", "GPU MEM", "GPU", "MODEL")
# Room the last column should keep when fitting: below it, the narrow forms are used.
DETAIL_RESERVE: Final = 24
# The least of the last column a fitted line shows, however narrow the terminal.
DETAIL_LEAST: Final = 12
ELLIPSIS: Final = "…"


def fit_columns(rows: Sequence[tuple[str, ...]], width: int | None, *, wide: bool = False) -> list[int]:
    """The columns shown: not ``wide``, GPU columns without a value on any row are left out, and
    with ``width`` (the terminal's) columns are dropped in FIT_DROP_ORDER until the others fit
    beside DETAIL_RESERVE (or none is left to drop)."""
    header = rows[0]
    keep = list(range(len(header)))
    if wide:
        return keep
    keep = [i for i in keep if header[i] not in GPU_COLUMNS or any(r[i] not in ("-", "") for r in rows[1:])]
    if width is not None:
        for title in FIT_DROP_ORDER:
            if fixed_width(rows, keep) + min(DETAIL_RESERVE, detail_width(rows)) <= width:
                break
            keep = [i for i in keep if header[i] != title]
    return keep


def fixed_width(rows: Sequence[tuple[str, ...]], columns: Sequence[int]) -> int:
    """The width of every column but the last, with the two spaces after each."""
    return sum(max(len(r[i]) for r in rows) + 2 for i in columns[:-1])


def detail_width(rows: Sequence[tuple[str, ...]]) -> int:
    return max(len(r[-1]) for r in rows)


def table(rows: Sequence[tuple[str, ...]], *, width: int | None = None, wide: bool = False) -> list[str]:
    """Rows (the first is the header) as aligned lines, the last column not padded; with
    ``width`` (and not ``wide``) it is cut to what the width leaves (at least DETAIL_LEAST), with
    an ellipsis: the whole of it is in `describe` and `-o wide`."""
    keep = fit_columns(rows, width, wide=wide)
    widths = {i: max(len(r[i]) for r in rows) for i in keep[:-1]}
    room = max(DETAIL_LEAST, width - fixed_width(rows, keep)) if width is not None and not wide else None
    lines = []
    for r in rows:
        last = r[keep[-1]]
        if room is not None and len(last) > room:
            # The header says what the column is, whole: its last word where it has no room.
            last = last.split()[-1] if r is rows[0] else last[: room - 1].rstrip() + ELLIPSIS
        lines.append(("  ".join(r[i].ljust(widths[i]) for i in keep[:-1]) + "  " + last).rstrip())
    return lines


def fitted(make: Callable[[bool], list[tuple[str, ...]]], *, width: int | None, wide: bool) -> list[str]:
    """The table from ``make(short)``: the long forms where they fit the width, else the short
    ones (STATE without its phase, a short LAST EXIT), which keep more room for the reason."""
    rows = make(False)
    if width is not None and not wide:
        keep = fit_columns(rows, width)
        if fixed_width(rows, keep) + min(DETAIL_RESERVE, detail_width(rows)) > width:
            rows = make(True)
    return table(rows, width=width, wide=wide)


def format_status(
    status: Mapping[str, Any],
    names: Sequence[str] = (),
    *,
    width: int | None = None,
    wide: bool = False,
    now: float | None = None,
) -> str:
    """One row per engine (only ``names`` when given). ``width``: fit a terminal that wide (the
    reason cut with an ellipsis); ``wide``: every column, the reason whole (`status -o wide`).
    ``now``: the wall clock a hold's age is counted to (default: now)."""
    engines: Mapping[str, Mapping[str, Any]] = status.get("engines", {})
    if names:
        engines = {n: engines[n] for n in names if n in engines}

    def rows(short: bool) -> list[tuple[str, ...]]:
        return status_rows(engines, wide=wide, short=short, now=now)

    lines = fitted(rows, width=width, wide=wide)
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
    release = status.get("gpu_release")
    if isinstance(release, Mapping):
        lines += gpu_release_lines(release)
    nvml = status.get("nvml")
    if isinstance(nvml, Mapping):
        lines += nvml_lines(nvml)
    lines += gpu_verdict_lines(status.get("gpu_verdicts") or {})
    return "\n".join(lines)


# A finished release stays in `status` this long (then `events` and the journal have it).
RELEASE_SHOWN_S: Final = 600.0


def gpu_release_lines(release: Mapping[str, Any]) -> list[str]:
    """What `status` says under the table about a GPU's release for a reset (docs/gpu.md,
    "Resetting one GPU"): where it stands, and what the operator does next."""
    gpu, phase = release.get("gpu"), release.get("phase")
    for_s = release.get("for_s")
    ago = f" {duration(for_s)} ago" if isinstance(for_s, int | float) else ""
    ends = release.get("ends_in_s")
    if phase == "stopping":
        return [f"GPU {gpu} release (by {release.get('by')}): {release.get('outcome')}"]
    if phase == "released":
        by_itself = f"; taken back by itself in {duration(ends)}" if isinstance(ends, int | float) else ""
        return [
            f"GPU {gpu} released for its reset{ago} by {release.get('by')}: NVML closed on purpose, no GPU"
            f" telemetry on any GPU; reset it: {release.get('reset_command')}, then"
            f" `{release.get('take_back_command')}`{by_itself}"
        ]
    if phase == "taking_back":
        return [f"GPU {gpu} being taken back: {release.get('outcome')}"]
    if isinstance(for_s, int | float) and for_s > RELEASE_SHOWN_S:
        return []
    if phase == "failed":
        return [f"GPU {gpu} release failed{ago}: {release.get('outcome')}"]
    outcome = str(release.get("outcome") or "")
    return [f"GPU {gpu} taken back{ago}: {outcome.removeprefix('taken back: ')}"]


def gpu_release_done(release: Mapping[str, Any]) -> list[str]:
    """What `gpu release` prints once NVML is closed, and `gpu take-back` once the GPU is back."""
    gpu = release.get("gpu")
    if release.get("phase") != "released":
        return [f"GPU {gpu} {release.get('outcome')}"]
    engines = ", ".join(release.get("engines") or ()) or "no engine"
    kept = release.get("kept_stopped") or ()
    ends = release.get("ends_in_s")
    window = duration(ends) if isinstance(ends, int | float) else "its window"
    bus = release.get("pci_bus_id")
    lines = [
        f"GPU {gpu} released ({release.get('uuid')}{f', PCI {bus}' if bus else ''}): {engines} stopped and"
        " held; NVML closed, so the daemon reads no GPU until you take it back"
        f" (within {window}; then it takes it back by itself)",
    ]
    if kept:
        lines.append(f"Left stopped (an operator stopped them before): {', '.join(kept)}")
    lines += [
        "Reset it now, as root:",
        f"  {release.get('reset_command')}",
        f"  (the same board: -i {bus}, or -i {gpu} where nvidia-smi numbers the GPUs as NVML does)"
        if bus
        else f"  (the same board: -i {gpu} where nvidia-smi numbers the GPUs as NVML does)",
        "Then:",
        f"  {release.get('take_back_command')}",
    ]
    return lines


def nvml_lines(nvml: Mapping[str, Any]) -> list[str]:
    """What `status` says under the table about NVML (docs/gpu.md): that it cannot be opened, and
    why; the engines waiting for it; GPUs lost to calls that hang; GPUs whose XIDs are not seen;
    NVSwitch GPUs whose fabric is not registered, and the engines waiting for it."""
    out = []
    if nvml.get("reason") == "released":
        pass  # closed on purpose: the release's own line says so (gpu_release_lines)
    elif nvml.get("up") is False and nvml.get("needed", True):
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
    unready = {g: str(s) for g, s in (nvml.get("fabric") or {}).items() if s != "completed"}
    if unready:
        gpus = ", ".join(f"GPU {g} {s.replace('_', ' ')}" for g, s in sorted(unready.items()))
        out.append(f"NVSwitch fabric not registered: {gpus} (systemctl status nvidia-fabricmanager)")
    for name, why in sorted((nvml.get("engines_waiting_fabric") or {}).items()):
        out.append(f"Waiting for the GPU fabric before starting: {name}: {why}")
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


def unexpected(engine: Mapping[str, Any]) -> str | None:
    """Why an engine is not where the operator put it, or None where it is (issue 39: a monitoring
    script must not alert on an intended stop). The daemon's words of intent decide
    (engine/status.py): not meant to serve (``enabled: false``, being removed) or stopped by an
    operator, any state without a process is where it belongs; drained (held out of rotation, yet
    meant to run), BACKOFF and FATAL are not; otherwise every state but STARTING, READY, SHEDDING
    and DRAINING is down."""
    state = str(engine.get("state"))
    if not meant_to_serve(engine) or not engine.get("wants_run", True):
        return None
    drained = bool(engine.get("held_by_operator", bool(engine.get("hold"))))
    if drained:
        return f"{state.upper()} (drained, but meant to run)" if state in ("backoff", "fatal") else None
    return state.upper() if state in DOWN_STATES else None


def status_exit_code(status: Mapping[str, Any], names: Sequence[str] = ()) -> tuple[int, list[str]]:
    """0, or 1 with why: a named engine (or, without names, any) is not where the operator put it
    (``unexpected``: down, FATAL, not ready when it should be), or a named engine does not exist.
    An engine stopped or drained on purpose, or disabled, is where it belongs."""
    engines: Mapping[str, Mapping[str, Any]] = status.get("engines", {})
    problems = unknown_engines(engines, names)
    checked = [n for n in names if n in engines] if names else list(engines)
    problems += [f"{n} is {why}" for n in checked if (why := unexpected(engines[n])) is not None]
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
    "remove": "removing",
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
    the start phase or the state's reason. A drain an operator holds has no budget (it lasts
    until `start`); an engine waiting for a reload's roll says so rather than its old reason."""
    state = str(engine.get("state", "?"))
    for_s = float(engine.get("for_s") or 0.0)
    held = state == "draining" and (engine.get("hold") or {}).get("hold") == "drain"
    budget = {"starting": engine.get("start_timeout_s"), "draining": engine.get("drain_timeout_s")}.get(state)
    clock = f"{duration(for_s)} / {duration(budget)}" if budget and not held else duration(for_s)
    waiting_turn = roll_text(engine) if state == "ready" else None  # a reload's roll still to come
    detail = engine.get("phase") or waiting_turn or engine.get("reason") or ""
    if held:
        detail = short_hold(engine) or detail
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
