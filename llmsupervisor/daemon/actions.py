"""The policy's actions, carried out as engine commands; and the GPUs marked for faults.

The executor is the one place an ``Action`` turns into ``Command``s. It never waits and never
re-enters the policy: the commands go to the runners' inboxes, and their results come back as
statuses on the next reconcile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from llmsupervisor.core.policy import Action, ActionKind
from llmsupervisor.engine.commands import Command, ResetPrefixCache, Restart, Shed, StepTo
from llmsupervisor.files import read_json, write_json_atomic

log = logging.getLogger("llmsupervisor")


class GpuMarks:
    """Faults counted against each GPU, in ``STATE_DIR/gpu-faults.json``, so that a GPU that
    keeps faulting is visible across restarts (status, metrics, the journal)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = read_json(path, {})
        self.counts: dict[int, int] = {}
        if isinstance(raw, dict):
            for gpu, entry in raw.items():
                try:
                    self.counts[int(gpu)] = int(entry["count"])
                except (ValueError, TypeError, KeyError):
                    continue

    def mark(self, gpus: tuple[int, ...], detail: str) -> None:
        raw = read_json(self.path, {})
        if not isinstance(raw, dict):
            raw = {}
        for gpu in gpus:
            self.counts[gpu] = self.counts.get(gpu, 0) + 1
            raw[str(gpu)] = {"count": self.counts[gpu], "last": detail, "at": time.time()}
            log.error("GPU %d marked: fault %d: %s", gpu, self.counts[gpu], detail, extra={"event": "action"})
        try:
            write_json_atomic(self.path, raw)
        except OSError as exc:
            log.warning("cannot save GPU marks: %s", exc)


def commands_for(action: Action) -> list[Command]:
    """What an action asks of its engine, in order."""
    kind = action.kind
    if kind is ActionKind.SHED:
        return [Shed(action.detail)]
    if kind is ActionKind.UNSHED:
        return [Shed(None)]
    if kind is ActionKind.RESET_PREFIX_CACHE:
        return [ResetPrefixCache(action.detail)]
    if kind in (ActionKind.STEP_DOWN, ActionKind.STEP_UP):
        assert action.step is not None
        step: list[Command] = [StepTo(action.step, f"{action.reason}: {action.detail}")]
        if action.planned:  # an OOM at start only changes the next spawn's flags
            step.append(Restart(cause=kind.value, reason=f"{kind}: {action.detail}"))
        return step
    cause = "scheduled" if kind is ActionKind.SCHEDULED_RESTART else action.reason
    return [
        Restart(cause=cause, reason=f"{cause}: {action.detail}", drain=action.drain, failure=action.failure)
    ]


class ActionExecutor:
    def __init__(
        self, send: Callable[[str, Command], None], gpus_of: Callable[[str], tuple[int, ...]], marks: GpuMarks
    ) -> None:
        self._send = send
        self._gpus_of = gpus_of
        self.marks = marks

    def apply(self, action: Action) -> None:
        log.warning(
            "action %s (%s): %s",
            action.kind,
            action.reason,
            action.detail,
            extra={"engine": action.engine, "event": "action"},
        )
        if action.mark_gpus:
            self.marks.mark(self._gpus_of(action.engine), action.detail)
        for cmd in commands_for(action):
            self._send(action.engine, cmd)
