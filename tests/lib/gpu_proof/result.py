"""One check's outcome: its JSON line, and the error a check that runs past its budget raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final


@dataclass
class Result:
    """One check's JSON line. ``problems``: what contradicts the daemon's assumptions (the check
    fails); ``skipped``: the parts that did not run and why; ``notes``: facts worth reading that
    are nobody's fault."""

    check: int
    name: str
    data: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    elapsed_s: float = 0.0

    def expect(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems

    def line(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "name": self.name,
            "ok": self.ok,
            "elapsed_s": round(self.elapsed_s, 2),
            "problems": self.problems,
            "skipped": self.skipped,
            "notes": self.notes,
            "error": self.error,
            "data": self.data,
        }


LINE_KEYS: Final = frozenset(Result(0, "").line())


class CheckTimeout(Exception):
    pass
