"""The CLI's side of the control socket: `status`, `restart|drain|stop|start|reload`, `events`.

Exit codes, for scripts: 0 done (or, for `status`, every engine asked about is up); 1 failed (a
refused command, an engine FATAL or down, a `--wait` that ended in BACKOFF or FATAL or ran past
``--timeout``); 69 the daemon is not reachable; 78 the config is broken (and no daemon answered)
or a reload was rejected; 130 interrupted while waiting (the command itself goes on).

``--wait`` follows the daemon's event ring (daemon/events.py) from the moment the command was
taken, so a failed start is seen even when the engine went through BACKOFF and back to STARTING
between two looks, and polls the status for the progress line.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

from llmsupervisor import cli_render, control

EX_OK: Final = 0
EX_FAILED: Final = 1
EX_UNAVAILABLE: Final = 69  # the daemon is not running or not reachable
EX_CONFIG: Final = 78
EX_INTERRUPTED: Final = 130

WAIT_POLL_S: Final = 1.0  # each round's long poll for events: the progress line's pace
PLAIN_PROGRESS_EVERY_S: Final = 5.0  # not a TTY: a line per change, else at most this often
FAILED_STATES: Final = frozenset({"backoff", "fatal"})


class Unreachable(Exception):
    """The daemon did not answer (not running, stale socket, permission, timeout)."""


class Refused(Exception):
    """The daemon answered no."""


@dataclass(slots=True)
class Client:
    path: Path
    config_problem: str | None = None  # the config does not load: said instead of "not running"

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        try:
            reply = control.request(self.path, payload, timeout_s=timeout_s)
        except control.ControlError as exc:
            raise Unreachable(str(exc)) from None
        if not reply.get("ok"):
            raise Refused(str(reply.get("error")))
        return reply.get("result")


def unreachable(client: Client, exc: Unreachable, err: TextIO) -> int:
    if client.config_problem is not None:
        print(f"llm-supervisor: the config is broken: {client.config_problem}", file=err)
        return EX_CONFIG
    print(f"llm-supervisor: {exc}", file=err)
    return EX_UNAVAILABLE


# ---- status ----


def status(client: Client, names: Sequence[str], *, as_json: bool, out: TextIO, err: TextIO) -> int:
    try:
        result = client.call({"command": "status"})
    except Unreachable as exc:
        return unreachable(client, exc, err)
    except Refused as exc:
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED
    code, problems = cli_render.status_exit_code(result, names)
    if as_json:
        if names:
            result = {**result, "engines": {n: e for n, e in result["engines"].items() if n in names}}
        print(json.dumps(result, indent=2), file=out)
    else:
        print(cli_render.format_status(result, names), file=out)
    for problem in problems:
        print(f"llm-supervisor: {problem}", file=err)
    return code


def watch(
    client: Client,
    names: Sequence[str],
    *,
    interval_s: float,
    out: TextIO,
    sleep: Callable[[float], None] = time.sleep,
    rounds: int | None = None,
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
                body = cli_render.format_status(client.call({"command": "status"}), names)
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
            print(json.dumps(event) if as_json else cli_render.event_line(event), file=out, flush=True)

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


@dataclass(frozen=True, slots=True)
class Verdict:
    reached: bool
    line: str


@dataclass(slots=True)
class Baseline:
    """The engine as the command found it (from the daemon's reply)."""

    command: str
    incarnation: int | None = None
    state_changes: int = 0


def judge(
    base: Baseline, engine: Mapping[str, Any], new_events: Sequence[Mapping[str, Any]]
) -> Verdict | None:
    """Whether the command's wait is over, and how it ended (None: still going).

    Failure first: a transition to BACKOFF or FATAL since the command means the start (or the
    drain) failed, whatever happened after it."""
    name = str(engine.get("name", "?"))
    for event in new_events:
        if event.get("kind") == "transition" and event.get("to_state") in FAILED_STATES:
            message = str(event.get("message", ""))
            reason = message.split(": ", 1)[1] if " -> " in message and ": " in message else message
            to_state = str(event["to_state"]).upper()
            return Verdict(False, f"{name}: {base.command} failed ({to_state}): {reason}")
    state = engine.get("state")
    if state == "fatal" and int(engine.get("state_changes") or 0) > base.state_changes:
        return Verdict(False, f"{name}: {base.command} failed (FATAL): {engine.get('reason')}")
    ready = f"{name}: READY ({base.command} done)"
    # A reloaded engine restarted with its new spec, or started when added.
    if base.command == "reload" and any(
        e.get("kind") == "transition" and e.get("to_state") == "ready" for e in new_events
    ):
        return Verdict(True, ready)
    if base.command in ("restart", "reload"):
        if (engine.get("incarnation") or 0) > (base.incarnation or 0):
            if state == "ready":
                return Verdict(True, ready)
            if state == "draining" and _drain_held(engine):
                # A restart keeps the operator's drain: the new incarnation is ready to serve and
                # out of rotation by intent, which is as far as it goes until `start` (docs/cli.md).
                return Verdict(
                    True, f"{name}: READY and held out of rotation by a drain ({base.command} done)"
                )
    elif base.command == "start":
        if state == "ready":
            return Verdict(True, ready)
    elif base.command == "stop":
        if state in ("stopped", "fatal") and engine.get("pid") is None:
            return Verdict(True, f"{name}: {str(state).upper()} (stop done)")
        return None
    elif base.command == "drain":
        if state == "draining" and not engine.get("requests_running"):
            return Verdict(True, f"{name}: DRAINING, no requests in flight (drain done)")
        if state in ("stopped", "fatal"):
            return Verdict(True, f"{name}: {str(state).upper()}, held out of rotation (drain done)")
        return None
    if state in ("stopped", "stopping") and not engine.get("wants_run", True):
        return Verdict(False, f"{name}: {base.command} failed: the engine was stopped meanwhile")
    return None


def _drain_held(engine: Mapping[str, Any]) -> bool:
    hold = engine.get("hold")
    if hold is not None:
        return bool(hold.get("hold") == "drain")
    # A daemon without holds in its status: an engine meant to run and held is drained.
    return bool(engine.get("held_by_operator")) and bool(engine.get("wants_run", True))


class Progress:
    """One live line: redrawn in place on a TTY; elsewhere a plain line per change, or every
    PLAIN_PROGRESS_EVERY_S at most."""

    def __init__(self, out: TextIO, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._tty = out.isatty()
        self._clock = clock
        self._drawn = False
        self._last_key: object = None
        self._last_at = -PLAIN_PROGRESS_EVERY_S

    def show(self, line: str, key: object) -> None:
        if self._tty:
            # Cut to the terminal's width: a wrapped line could not be redrawn in place.
            width = shutil.get_terminal_size().columns
            self._out.write("\r\x1b[2K" + (line if len(line) < width else line[: max(width - 2, 10)] + "…"))
            self._drawn = True
        elif key != self._last_key or self._clock() - self._last_at >= PLAIN_PROGRESS_EVERY_S:
            self._out.write(line + "\n")
            self._last_key, self._last_at = key, self._clock()
        self._out.flush()

    def end(self) -> None:
        if self._tty and self._drawn:
            self._out.write("\r\x1b[2K")
            self._out.flush()
        self._drawn = False


@dataclass(slots=True)
class Waiting:
    """What one `--wait` follows: engines and how each is judged."""

    bases: dict[str, Baseline]
    events_seq: int
    done: dict[str, Verdict] = field(default_factory=dict)


def wait(
    client: Client,
    waiting: Waiting,
    *,
    timeout_s: float | None,
    out: TextIO,
    err: TextIO,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    started = clock()
    progress = Progress(out, clock=clock)
    after = waiting.events_seq
    single = next(iter(waiting.bases)) if len(waiting.bases) == 1 else None
    try:
        while True:
            found = client.call(
                {"command": "events", "engine": single, "after": after, "wait_s": WAIT_POLL_S},
                timeout_s=WAIT_POLL_S + 10.0,
            )["events"]
            after = max([after, *(int(e["seq"]) for e in found)])
            engines = client.call({"command": "status"})["engines"]
            for name, base in waiting.bases.items():
                if name in waiting.done:
                    continue
                engine = engines.get(name)
                if engine is None:
                    waiting.done[name] = Verdict(False, f"{name}: {base.command} failed: the engine is gone")
                    continue
                mine = [e for e in found if e.get("engine") == name]
                verdict = judge(base, {**engine, "name": name}, mine)
                if verdict is not None:
                    waiting.done[name] = verdict
            pending = [n for n in waiting.bases if n not in waiting.done]
            waited_s = clock() - started
            if not pending:
                progress.end()
                return _report(waiting, out, err)
            name = pending[0]
            line = cli_render.progress_line(name, engines[name], waited_s=waited_s)
            if len(waiting.bases) > 1:
                line += f" [{len(waiting.done)}/{len(waiting.bases)} engines done]"
            progress.show(line, (name, engines[name].get("state"), engines[name].get("phase")))
            if timeout_s is not None and waited_s >= timeout_s:
                progress.end()
                state = str(engines[name].get("state", "?")).upper()
                print(
                    f"{name}: gave up waiting after {cli_render.duration(waited_s)}: still {state}"
                    " (the command goes on)",
                    file=err,
                )
                return EX_FAILED
    except KeyboardInterrupt:
        progress.end()
        print("llm-supervisor: stopped waiting; the command goes on", file=err)
        return EX_INTERRUPTED
    except Unreachable as exc:
        progress.end()
        print(f"llm-supervisor: lost the daemon while waiting: {exc}", file=err)
        return EX_UNAVAILABLE
    except Refused as exc:
        progress.end()
        print(f"llm-supervisor: {exc}", file=err)
        return EX_FAILED


def _report(waiting: Waiting, out: TextIO, err: TextIO) -> int:
    code = EX_OK
    for verdict in waiting.done.values():
        print(verdict.line, file=out if verdict.reached else err)
        if not verdict.reached:
            code = EX_FAILED
    return code


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
    print(json.dumps(reply, indent=2) if as_json else cli_render.accepted_line(reply), file=out, flush=True)
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
    print(json.dumps(reply, indent=2) if as_json else cli_render.reload_line(reply), file=out, flush=True)
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


# ---- the fleet view: `status --host URL ...` over each daemon's HTTP /status ----

FLEET_DEADLINE_S: Final = 3.0


def read_hosts_file(path: str) -> list[str]:
    """One URL a line; blank lines and ``#`` comments (whole-line or trailing) are skipped."""
    with open(path, encoding="utf-8") as f:
        return [u for line in f if (u := line.split("#", 1)[0].strip())]


def _status_url(host: str) -> str:
    url = host if "://" in host else f"http://{host}"
    return url.rstrip("/") + "/status"


def fetch_host_status(host: str, *, deadline_s: float = FLEET_DEADLINE_S) -> cli_render.HostStatus:
    """One daemon's /status, or why not: never raises, an unreachable host is a row."""
    import httpx  # here, not at the top: plain `status` over the socket should not pay its import

    try:
        resp = httpx.get(_status_url(host), timeout=deadline_s)
        if resp.status_code != 200:
            return cli_render.HostStatus(host, None, f"HTTP {resp.status_code} from {resp.url.path}")
        body = resp.json()
    except httpx.TimeoutException:
        return cli_render.HostStatus(host, None, f"no answer within {deadline_s:g} s")
    except httpx.HTTPError as exc:
        return cli_render.HostStatus(host, None, str(exc) or type(exc).__name__)
    except ValueError as exc:
        return cli_render.HostStatus(host, None, f"not JSON: {exc}")
    if not isinstance(body, dict) or not isinstance(body.get("engines"), dict):
        return cli_render.HostStatus(host, None, "not an llm-supervisor status")
    return cli_render.HostStatus(host, body)


def fleet_status(
    hosts: Sequence[str],
    names: Sequence[str],
    *,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    deadline_s: float = FLEET_DEADLINE_S,
) -> int:
    """Every host asked at once, each with its own deadline; one table with a HOST column."""
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        results = list(pool.map(lambda h: fetch_host_status(h, deadline_s=deadline_s), hosts))
    code, problems = cli_render.fleet_exit_code(results, names)
    if as_json:
        doc = {
            r.host: (dict(r.status) if r.status is not None else {"unreachable": r.error}) for r in results
        }
        print(json.dumps(doc, indent=2), file=out)
    else:
        print(cli_render.format_fleet_status(results, names), file=out)
    for problem in problems:
        print(f"llm-supervisor: {problem}", file=err)
    return code
