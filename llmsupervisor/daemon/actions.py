"""The policy's actions, carried out as engine commands; and the GPUs marked for faults.

The executor is the one place an ``Action`` turns into ``Command``s. It never waits and never
re-enters the policy: the commands go to the runners' inboxes, and their results come back as
statuses on the next reconcile.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from llmsupervisor.config import EngineSpec
from llmsupervisor.core.node_condition import (
    GPU_LOST_REASON,
    GPU_UNRECOVERABLE,
    VERDICT_FIELD_DIAG,
    VERDICT_RESET,
    VERDICT_UNKNOWN,
    NodeCondition,
    gpu_unrecoverable,
    verdict_for,
)
from llmsupervisor.core.policy import Action, ActionKind
from llmsupervisor.engine.commands import Command, ResetPrefixCache, Restart, Shed, StepTo, Stop
from llmsupervisor.files import JsonFileWriter, read_json

log = logging.getLogger("llmsupervisor")

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID_PATH) -> str:
    """This boot's id: a GPU condition recorded under another boot is history (a reboot, the
    usual node-level remediation, resets the GPUs). Empty when unreadable."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


MARK_WINDOW_S = 24 * 3600.0  # marks older than this are history: neither counted nor kept
MARKS_VERSION = 2


def node_name() -> str:
    """This node's name for the marks file (informational: marks are keyed by GPU UUID)."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


class GpuMarks:
    """Faults counted against each physical GPU, in ``STATE_DIR/gpu-faults.json``, so that a GPU
    that keeps faulting is visible across restarts (status, metrics, the journal); and the GPUs
    found unrecoverable (core/node_condition.py), kept until the node reboots.

    Keyed by GPU UUID, never by NVML index: an index names another board after a GPU drops out at
    boot or is replaced, and in Kubernetes the file sits on a volume that follows the pod to
    another node. Each mark keeps its time, node and boot id; marks older than ``window_s`` are
    dropped; a condition holds only on the boot that set it. ``gpus`` gives the current NVML
    index -> UUID map (GpuMonitor's); a GPU it does not list is marked nowhere.

    The old file format (``{"0": {"count": n}}``, by index) cannot say which board a count
    belongs to, so it is ignored (logged once) and overwritten on the next mark.
    """

    def __init__(
        self,
        path: Path,
        *,
        gpus: Callable[[], Mapping[int, str]] = dict,
        boot: str | None = None,
        node: str | None = None,
        window_s: float = MARK_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.boot = boot_id() if boot is None else boot
        self.node = node_name() if node is None else node
        self.window_s = window_s
        self._gpus = gpus
        self._clock = clock
        self._by_uuid: dict[str, dict[str, Any]] = self._load()
        self._file = JsonFileWriter(path, what="the GPU marks")

    def _load(self) -> dict[str, dict[str, Any]]:
        raw = read_json(self.path, {})
        if not isinstance(raw, dict):
            return {}
        if raw.get("version") != MARKS_VERSION:
            if raw:
                log.warning(
                    "%s: GPU marks in the old by-index format are ignored: an index does not say which"
                    " physical GPU they were on",
                    self.path,
                )
            return {}
        gpus = raw.get("gpus")
        return {str(u): e for u, e in gpus.items() if isinstance(e, dict)} if isinstance(gpus, dict) else {}

    def _marks(self, uuid: str) -> list[dict[str, Any]]:
        entry = self._by_uuid.get(uuid, {})
        marks = entry.get("marks")
        horizon = self._clock() - self.window_s
        if not isinstance(marks, list):
            return []
        return [m for m in marks if isinstance(m, dict) and float(m.get("at", 0)) >= horizon]

    @property
    def counts(self) -> dict[int, int]:
        """Marks within the window per GPU, by its current NVML index."""
        out: dict[int, int] = {}
        for index, uuid in self._gpus().items():
            n = len(self._marks(uuid))
            if n:
                out[index] = n
        return out

    def _condition(self, index: int, uuid: str) -> NodeCondition | None:
        held = self._by_uuid.get(uuid, {}).get("unrecoverable")
        if isinstance(held, dict) and held.get("boot_id") == self.boot:
            reason, verdict = str(held.get("reason", "")), str(held.get("verdict", ""))
            return NodeCondition(GPU_UNRECOVERABLE, index, reason, uuid, verdict)
        return None

    @property
    def conditions(self) -> tuple[NodeCondition, ...]:
        found = (self._condition(i, u) for i, u in sorted(self._gpus().items()))
        return tuple(c for c in found if c is not None)

    def mark(
        self,
        gpus: tuple[int, ...],
        detail: str,
        *,
        reason: str = "",
        faulted: tuple[int, ...] | None = None,
        verdicts: Mapping[int, str] | None = None,
    ) -> list[NodeCondition]:
        """Count a fault against the engine's ``gpus`` that it was on (``faulted``; all of them
        when the finding did not say, or named none of them); the node conditions it newly sets.
        ``verdicts`` is each GPU's verdict on the fault (core/node_condition.py)."""
        new: list[NodeCondition] = []
        on = tuple(g for g in gpus if faulted is not None and g in faulted) or gpus
        uuids = self._gpus()
        now = self._clock()
        for gpu in on:
            uuid = uuids.get(gpu)
            if uuid is None:
                log.error("GPU %d: fault not marked, NVML does not name this GPU: %s", gpu, detail)
                continue
            verdict = verdict_for(verdicts or {}, gpu)
            marks = [
                *self._marks(uuid),
                {
                    "at": now,
                    "boot_id": self.boot,
                    "node": self.node,
                    "reason": reason,
                    "verdict": verdict,
                    "detail": detail,
                },
            ]
            entry = self._by_uuid.setdefault(uuid, {})
            entry["marks"] = marks
            log.error(
                "GPU %d (%s) marked: fault %d in %.0f h: %s",
                gpu,
                uuid,
                len(marks),
                self.window_s / 3600,
                detail,
                extra={"event": "action"},
            )
            if self._condition(gpu, uuid) is None and gpu_unrecoverable(reason, verdict):
                held = "" if reason == GPU_LOST_REASON else verdict
                why = _WHY.get(held, f"fault {len(marks)}")
                condition = NodeCondition(GPU_UNRECOVERABLE, gpu, f"{reason} ({why}): {detail}", uuid, held)
                entry["unrecoverable"] = {
                    "reason": condition.reason,
                    "verdict": held,
                    "boot_id": self.boot,
                    "at": now,
                }
                new.append(condition)
                log.critical(
                    "node condition %s: the pod is not ready; node-level remediation takes it from here",
                    condition.describe(),
                    extra={"event": "action"},
                )
        # In a thread (files.JsonFileWriter): an fsync on the loop stalls every probe and check.
        self._file.save(self._content())
        return new

    def clear(self, uuid: str) -> bool:
        """Drop the GPU's node condition (an operator reset the GPU without a reboot); its marks
        stay and keep counting within the window. False: no condition held on it."""
        entry = self._by_uuid.get(uuid)
        held = entry.pop("unrecoverable", None) if entry is not None else None
        if held is None:
            return False
        self._file.save(self._content())
        return True

    def _content(self) -> dict[str, Any]:
        # A copy: the writer's thread serialises it while the loop may mark again.
        return {"version": MARKS_VERSION, "gpus": copy.deepcopy(self._by_uuid)}

    def held_uuids(self) -> dict[str, str]:
        """The conditions of this boot in the file, by UUID (its reason): for an operator,
        without NVML to say which index each board has now."""
        out = {}
        for uuid, entry in self._by_uuid.items():
            held = entry.get("unrecoverable")
            if isinstance(held, dict) and held.get("boot_id") == self.boot:
                out[uuid] = str(held.get("reason", ""))
        return out


# What a condition's verdict says of the GPU, in its reason.
_WHY: dict[str, str] = {
    VERDICT_RESET: "needs a GPU reset",
    VERDICT_FIELD_DIAG: "a row remap failed: permanent, a field diagnostic or an RMA",
    VERDICT_UNKNOWN: "needs a look: no recovery action, and no fix in NVIDIA's XID catalogue",
}


def blocked_reason(condition: NodeCondition) -> str:
    """Why an engine on a GPU with a condition stays STOPPED at a daemon start, and what clears it:
    a reset with the daemon running (`gpu release`, the reset, `gpu take-back`, which clears the
    condition: daemon/gpu_release.py), or with it stopped and `gpu clear`."""
    gpu = condition.gpu
    clear = (
        f"llm-supervisor gpu release {gpu}, the reset, llm-supervisor gpu take-back {gpu} (with the"
        f" daemon stopped: the reset, then llm-supervisor gpu clear {condition.uuid})"
        if condition.uuid
        else "a reboot"
    )
    if condition.verdict == VERDICT_FIELD_DIAG:
        # nvml.h: failureOccurred is set "if a row remapping ever failed": a reset does not clear
        # it, and the condition would be back at the next sample.
        return (
            f"{condition.describe()}; not started: a failed row remap is permanent and no reset"
            " clears it; run NVIDIA's field diagnostic on the GPU and RMA it if that fails"
        )
    if condition.verdict == VERDICT_UNKNOWN:
        return (
            f"{condition.describe()}; not started on a GPU nobody has judged: read the XID in the"
            f" kernel log against NVIDIA's XID catalogue and reset the GPU if it says so: {clear}"
        )
    return f"{condition.describe()}; not started on a GPU that needs a reset: {clear}"


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
        Restart(
            cause=cause,
            reason=f"{cause}: {action.detail}",
            drain=action.drain,
            failure=action.failure,
            blame=action.blame,
        )
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
        commands = commands_for(action, spec)
        if action.mark_gpus:
            gpus = self._gpus_of(action.engine)
            self.marks.mark(
                gpus,
                action.detail,
                reason=action.reason,
                faulted=action.fault_gpus,
                verdicts=dict(action.gpu_verdicts),
            )
            blocked = [c for c in self.marks.conditions if c.gpu in gpus]
            if blocked:
                # Not restarted into READY on a GPU that must be reset first (NVIDIA: "terminate
                # all GPU processes, reset the GPU"): stopped until the node is remediated.
                log.error(
                    "engine stopped, not restarted: %s; start it again after the GPU is reset",
                    blocked[0].describe(),
                    extra={"engine": action.engine, "event": "action"},
                )
                commands = [Stop()]
        for cmd in commands:
            self._send(action.engine, cmd)
