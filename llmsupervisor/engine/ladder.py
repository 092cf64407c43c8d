"""The batch-size ladder step an engine's next spawn runs at, persisted in the state dir
(``STATE_DIR/engines/NAME/ladder.json``) so that it survives daemon restarts. A ladder changed
in the config starts again at the top step."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmsupervisor.config import EngineSpec
from llmsupervisor.files import JsonFileWriter, read_json

log = logging.getLogger("llmsupervisor.engine")


def flags_text(args: Mapping[str, Any]) -> str:
    return " ".join(f"--{k} {v}" for k, v in args.items())


class LadderStore:
    def __init__(self, state_dir: Path, spec: EngineSpec) -> None:
        self._state_dir = state_dir
        self.spec = spec
        # Written again until it lands (a full disk): a step lost to a restart would start the
        # engine at the batch that ran it out of memory. No link below the state dir is followed.
        self._file = JsonFileWriter(
            self.path, what="the ladder step", engine=spec.name, indent=None, root=state_dir
        )
        self.step = self._load()

    @property
    def path(self) -> Path:
        return self._state_dir / "engines" / self.spec.name / "ladder.json"

    def _load(self) -> int:
        saved = read_json(self.path, root=self._state_dir)
        ladder = [dict(step) for step in self.spec.ladder]
        if not isinstance(saved, dict):
            return 0
        step = saved.get("step")
        if saved.get("ladder") != ladder:
            if step:
                log.info(
                    "ladder changed in the config: back to the top step", extra={"engine": self.spec.name}
                )
            return 0
        if isinstance(step, int) and 0 < step <= len(ladder):
            log.info(
                "batch-size ladder: resuming at step %d/%d (%s)",
                step,
                len(ladder),
                flags_text(self.spec.step_args(step)),
                extra={"engine": self.spec.name},
            )
            return step
        return 0

    def respec(self, spec: EngineSpec) -> None:
        ladder_changed = spec.ladder != self.spec.ladder
        self.spec = spec
        if ladder_changed:
            self.step = self._load()

    def set(self, step: int, reason: str) -> None:
        """The step the next spawn runs at (persisted; a failed save is logged and tried again
        until it lands, not fatal)."""
        step = max(0, min(step, len(self.spec.ladder)))
        if step == self.step:
            return
        log.warning(
            "batch-size ladder: step %d -> %d (%s): %s",
            self.step,
            step,
            flags_text(self.spec.step_args(step)) or "the engine's own flags",
            reason,
            extra={"engine": self.spec.name},
        )
        self.step = step
        # In a thread: the next spawn reads self.step, and an fsync on the loop stalled the daemon
        # on a busy disk (files.JsonFileWriter). A failed save is logged there and tried again.
        self._file.save({"step": step, "ladder": [dict(s) for s in self.spec.ladder]})
