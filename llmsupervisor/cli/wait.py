"""`--wait` for `restart|drain|stop|start|reload`: judge each engine's end, and show progress.

It follows the daemon's event ring (daemon/events.py) from the moment the command was
taken, so a failed start is seen even when the engine went through BACKOFF and back to STARTING
between two looks, and polls the status for the progress line.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

from llmsupervisor.cli import render
from llmsupervisor.cli.client import (
    EX_FAILED,
    EX_INTERRUPTED,
    EX_OK,
    EX_UNAVAILABLE,
    Client,
    Refused,
    Unreachable,
)

WAIT_POLL_S: Final = 1.0  # each round's long poll for events: the progress line's pace
PLAIN_PROGRESS_EVERY_S: Final = 5.0  # not a TTY: a line per change, else at most this often
FAILED_STATES: Final = frozenset({"backoff", "fatal"})


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
    if base.command == "reload" and "config_roll" in engine:
        # Done once it serves its new spec: the daemon marks an engine whose roll is still to
        # come (``config_roll``), so a start of the old spec that ends after the reload (a READY
        # transition, or a READY status) is not taken for its restart (issue 39).
        if engine.get("config_roll"):
            return None
        if state == "ready":
            return Verdict(True, ready)
        if state == "draining" and _drain_held(engine):
            return Verdict(True, f"{name}: READY and held out of rotation by a drain (reload done)")
    elif base.command == "reload" and any(
        e.get("kind") == "transition" and e.get("to_state") == "ready" for e in new_events
    ):  # a daemon from before config_roll: a reloaded engine restarted, or started when added
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
            line = render.progress_line(name, engines[name], waited_s=waited_s)
            if len(waiting.bases) > 1:
                line += f" [{len(waiting.done)}/{len(waiting.bases)} engines done]"
            progress.show(line, (name, engines[name].get("state"), engines[name].get("phase")))
            if timeout_s is not None and waited_s >= timeout_s:
                progress.end()
                state = str(engines[name].get("state", "?")).upper()
                print(
                    f"{name}: gave up waiting after {render.duration(waited_s)}: still {state}"
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
