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

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.node_condition import GPU_UNRECOVERABLE, NodeCondition, gpu_unrecoverable
from llmsupervisor.core.policy import Action, ActionKind
from llmsupervisor.engine.commands import Command, ResetPrefixCache, Restart, Shed, StepTo
from llmsupervisor.files import read_json, write_json_atomic

log = logging.getLogger("llmsupervisor")

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID_PATH) -> str:
    """This boot's id: a GPU condition recorded under another boot is history (a reboot, the
    usual node-level remediation, resets the GPUs). Empty when unreadable."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


class GpuMarks:
    """Faults counted against each GPU, in ``STATE_DIR/gpu-faults.json``, so that a GPU that
    keeps faulting is visible across restarts (status, metrics, the journal); and the GPUs found
    unrecoverable (core/node_condition.py), kept until the node reboots."""

    def __init__(self, path: Path, *, boot: str | None = None) -> None:
        self.path = path
        self.boot = boot_id() if boot is None else boot
        raw = read_json(path, {})
        self.counts: dict[int, int] = {}
        self._conditions: dict[int, NodeCondition] = {}
        if isinstance(raw, dict):
            for gpu, entry in raw.items():
                try:
                    self.counts[int(gpu)] = int(entry["count"])
                except (ValueError, TypeError, KeyError):
                    continue
                condition = entry.get("unrecoverable")
                if isinstance(condition, dict) and condition.get("boot_id") == self.boot:
                    self._conditions[int(gpu)] = NodeCondition(
                        GPU_UNRECOVERABLE, int(gpu), str(condition.get("reason", ""))
                    )

    @property
    def conditions(self) -> tuple[NodeCondition, ...]:
        return tuple(self._conditions[g] for g in sorted(self._conditions))

    def mark(
        self,
        gpus: tuple[int, ...],
        detail: str,
        *,
        reason: str = "",
        faulted: tuple[int, ...] | None = None,
    ) -> list[NodeCondition]:
        """Count a fault against the engine's ``gpus`` that it was on (``faulted``; all of them
        when the finding did not say, or named none of them); the node conditions it newly sets."""
        raw = read_json(self.path, {})
        if not isinstance(raw, dict):
            raw = {}
        new: list[NodeCondition] = []
        on = tuple(g for g in gpus if faulted is not None and g in faulted) or gpus
        for gpu in on:
            before = self.counts.get(gpu, 0)
            self.counts[gpu] = before + 1
            entry: dict[str, object] = {"count": self.counts[gpu], "last": detail, "at": time.time()}
            log.error("GPU %d marked: fault %d: %s", gpu, self.counts[gpu], detail, extra={"event": "action"})
            if gpu not in self._conditions and gpu_unrecoverable(reason, before):
                condition = NodeCondition(GPU_UNRECOVERABLE, gpu, f"{reason} (fault {before + 1}): {detail}")
                self._conditions[gpu] = condition
                new.append(condition)
                log.critical(
                    "node condition %s: the pod is not ready; node-level remediation takes it from here",
                    condition.describe(),
                    extra={"event": "action"},
                )
            if gpu in self._conditions:
                entry["unrecoverable"] = {"reason": self._conditions[gpu].reason, "boot_id": self.boot}
            raw[str(gpu)] = entry
        try:
            write_json_atomic(self.path, raw)
        except OSError as exc:
            log.warning("cannot save GPU marks: %s", exc)
        return new


def commands_for(action: Action, spec: EngineSpec | None = None) -> list[Command]:
    """What an action asks of its engine, in order. ``spec``: a config restart's new spec (the
    policy names the action; the config it rolls to is the daemon's)."""
    kind = action.kind
    if kind is ActionKind.CONFIG_RESTART:
        assert spec is not None, "a config restart without its spec"
        return [Restart(cause=action.reason, reason=action.detail, drain=action.drain, spec=spec)]
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

    def apply(self, action: Action, *, spec: EngineSpec | None = None) -> None:
        log.warning(
            "action %s (%s): %s",
            action.kind,
            action.reason,
            action.detail,
            extra={"engine": action.engine, "event": "action"},
        )
        if action.mark_gpus:
            self.marks.mark(
                self._gpus_of(action.engine), action.detail, reason=action.reason, faulted=action.fault_gpus
            )
        for cmd in commands_for(action, spec):
            self._send(action.engine, cmd)
