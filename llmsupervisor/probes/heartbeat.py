"""Reading an engine's step heartbeat: the file its scheduler writes at every step.

The writer runs inside vLLM (probes/vllm_plugin/llmsupervisor_step_heartbeat.py, which also
defines the record). Reading it is one open and two small reads, tens of microseconds, so the
observer reads it every round: the engine's steps, counted where they happen, not inferred from
``/metrics`` counters that a long prefill or an idle engine leaves still.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.vllm_plugin.llmsupervisor_step_heartbeat import LAYOUT, MAGIC, VERSION

FILE_NAME: Final = "step-heartbeat"
_TRIES: Final = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class StepBeat:
    """The engine's scheduler as of its last step. Times are ``time.monotonic()`` of the engine's
    host (the daemon's clock too: CLOCK_MONOTONIC is one clock per host)."""

    pid: int  # the EngineCore process that writes it
    scheduled: int  # steps scheduled since the engine started
    done: int  # steps whose output the scheduler took back
    scheduled_s: float
    done_s: float  # the newest step completed then (or the writer started, before any)
    work: int  # requests the scheduler held (running + waiting) after that step
    # The longest recent step (decays over a few hundred steps, and by half every 2 s idle).
    longest_step_s: float
    # Requests the API server has handed the scheduler since the engine started.
    added: int = 0
    tokens_pending: int = 0  # scheduled in the steps not back yet
    # The slowest recent step time per scheduled token (a small step's; decays like the longest).
    per_token_s: float = 0.0

    @property
    def pending(self) -> bool:
        """A step was scheduled and has not come back."""
        return self.scheduled > self.done

    @property
    def expected_step_s(self) -> float:
        """An upper bound of the step under way, from the engine's own recent steps: a step takes
        about a + b x its tokens, so the slowest time per token seen times the tokens under way
        is at least that for a step larger than those seen, and the longest recent step is at
        least that for a smaller one. A long prefill gets a long bound; a decode step a short
        one."""
        return max(self.longest_step_s, self.tokens_pending * self.per_token_s)


def parse(record: bytes) -> StepBeat | None:
    """The record in ``record``'s first bytes; None if it is not a complete, known one."""
    if len(record) < LAYOUT.size:
        return None
    fields = LAYOUT.unpack_from(record)
    magic, version, pid, _, seq, scheduled, done, scheduled_s, done_s, work, tokens, longest_s = fields[:12]
    added, per_token_s = fields[12:]
    if magic != MAGIC or version != VERSION or seq % 2:
        return None
    return StepBeat(
        pid=pid,
        scheduled=scheduled,
        done=done,
        scheduled_s=scheduled_s,
        done_s=done_s,
        work=work,
        longest_step_s=longest_s,
        added=added,
        tokens_pending=tokens,
        per_token_s=per_token_s,
    )


def read_heartbeat(path: Path) -> StepBeat | ProbeFailure | None:
    """The heartbeat in ``path`` (blocking: one small read); None when there is no file (an
    engine without the plugin, or one that has not built its scheduler yet)."""
    try:
        # Neither a link nor a FIFO planted in its place is followed or waited on (issue 38).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ProbeFailure("error", f"{path}: {exc.strerror or exc}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ProbeFailure("error", f"{path}: not a regular file")
        for _ in range(_TRIES):
            # Two reads that agree: the writer was not mid-record (its seq is odd while writing).
            first = os.pread(fd, LAYOUT.size, 0)
            second = os.pread(fd, LAYOUT.size, 0)
            if first == second and (beat := parse(first)) is not None:
                return beat
    except OSError as exc:
        return ProbeFailure("error", f"{path}: {exc.strerror or exc}")
    finally:
        os.close(fd)
    return ProbeFailure("parse", f"{path}: no complete heartbeat record")


__all__ = ["FILE_NAME", "StepBeat", "parse", "read_heartbeat"]
