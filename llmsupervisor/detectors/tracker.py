"""The finding tracker: sustain and hysteresis over the detectors' per-tick verdicts, so that a
finding opens once and closes once.

A finding is keyed by (engine, kind, severity): a POWER_THROTTLE that goes from INFO (power cap)
to WARNING (power brake) opens the WARNING one and later closes the INFO one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmsupervisor.core.findings import Finding, FindingKind, Severity
from llmsupervisor.detectors.config import DetectorConfig


@dataclass(frozen=True, slots=True)
class TrackerUpdate:
    opened: list[Finding]  # held for sustain_s: log once, hand to the policy
    closed: list[Finding]  # absent for clear_s: log once (the finding as last seen)
    active: list[Finding]  # open now, with this tick's evidence


@dataclass(slots=True)
class _Track:
    first_seen_s: float  # when the raw finding appeared, this unbroken run
    latest: Finding
    open: bool = False
    absent_since_s: float | None = None


class FindingTracker:
    """Sustain and hysteresis over raw findings, so each finding opens once and closes once.

    Pure apart from its own state: time is the ``now`` argument. Feed it *every* raw finding of
    the engines it tracks on every tick (one tracker per engine is simplest): a key missing from
    ``raw`` counts as absent. A raw finding opens after it has been present on every update for
    ``cfg.sustain_s[kind]`` (so one noisy tick cannot open it; zero opens at once); an open one
    closes after it has been absent on every update for ``cfg.clear_s[kind]``. An open finding
    keeps the ``since_s`` it opened with and takes each tick's evidence.
    """

    def __init__(self, cfg: DetectorConfig) -> None:
        self._cfg = cfg
        self._tracks: dict[tuple[str, FindingKind, Severity], _Track] = {}

    @property
    def active(self) -> list[Finding]:
        return [t.latest for t in self._tracks.values() if t.open]

    def update(self, raw: list[Finding], now: float) -> TrackerUpdate:
        opened: list[Finding] = []
        closed: list[Finding] = []
        present: dict[tuple[str, FindingKind, Severity], Finding] = {}
        for finding in raw:
            present.setdefault(finding.key, finding)  # a duplicate key: the first one stands
        for key, finding in present.items():
            track = self._tracks.get(key)
            if track is None:
                track = self._tracks[key] = _Track(first_seen_s=now, latest=finding)
            elif track.open:
                # Keep the opening since_s, so the cleared log line spans the whole episode.
                track.latest = _with_since(finding, track.latest.since_s)
            else:
                track.latest = finding
            track.absent_since_s = None
            if not track.open and now - track.first_seen_s >= self._cfg.sustain_s[finding.kind]:
                track.open = True
                track.latest = _with_since(finding, min(finding.since_s, track.first_seen_s))
                opened.append(track.latest)
        for key, track in list(self._tracks.items()):
            if key in present:
                continue
            if not track.open:
                del self._tracks[key]  # broken before it held for sustain_s: start over next time
                continue
            if track.absent_since_s is None:
                track.absent_since_s = now
            if now - track.absent_since_s >= self._cfg.clear_s[track.latest.kind]:
                del self._tracks[key]
                closed.append(track.latest)
        return TrackerUpdate(opened=opened, closed=closed, active=self.active)


def _with_since(finding: Finding, since_s: float) -> Finding:
    return finding if finding.since_s == since_s else dataclasses.replace(finding, since_s=since_s)


__all__ = ["FindingTracker", "TrackerUpdate"]
