"""HANG: is the engine doing anything at all?

Busy is not dead (docs/vllm-notes.md §7): a slow canary while the step or token counters advance is
load, not a hang. Like STALL (detectors/stall.py), the detector needs no ``sustain_s``: each rule
already needs its signs frozen for a stretch of readings.

``detect_hang`` reads the window once into ``HangFacts`` (detectors/hang/facts.py), tries the
rules of ``HANG_RULES`` in order (detectors/hang/rules.py, where the table of them is) and makes
the first that fires a finding: its evidence, then what every hang finding says (the rule, how
long the engine has been hung, the deadline misses, the last reading's counters).
"""

from __future__ import annotations

from llmsupervisor.core.findings import Finding, FindingKind, Severity, counted
from llmsupervisor.core.observe import ObservationWindow
from llmsupervisor.detectors.config import DetectorConfig
from llmsupervisor.detectors.hang.facts import HangFacts, hang_facts, miss_detail
from llmsupervisor.detectors.hang.rules import HANG_RULES, RuleHit
from llmsupervisor.detectors.series import new_finding


def detect_hang(window: ObservationWindow, now: float, cfg: DetectorConfig) -> Finding | None:
    """The first of ``HANG_RULES`` that fires over the window's facts at ``now``, as a finding;
    None when none does (detectors/hang/rules.py says when each fires)."""
    facts = hang_facts(window, now, cfg)
    if facts is None:
        return None
    for rule in HANG_RULES:
        hit = rule(facts, window, now, cfg)
        if hit is not None:
            return hang_finding(facts, hit, now)
    return None


def hang_finding(facts: HangFacts, hit: RuleHit, now: float) -> Finding:
    """The HANG finding of a rule that fired: its evidence first, then the facts every hang
    finding carries."""
    evidence: dict[str, float | str] = dict(hit.evidence)
    evidence.update(
        {"rule": hit.rule, "frozen_s": now - hit.since_s, "misses": facts.misses, "limit_s": hit.limit_s}
    )
    last_miss = facts.last_miss
    if last_miss is not None:
        evidence["last_miss"] = miss_detail(last_miss)
    reading = facts.last_reading
    if reading is not None:
        counts = {
            "requests_in_flight": facts.work,
            "iterations_total": reading.iterations_total,
            "generation_tokens_total": reading.generation_tokens_total,
        }
        evidence.update({name: n for name, n in counts.items() if n is not None})
    if last_miss is not None and last_miss.canary is not None:
        evidence["canary_latency_s"] = last_miss.canary.latency_s
    state = "idle by its gauges" if facts.idle else "with work queued or unknown"
    return new_finding(
        facts.newest,
        FindingKind.HANG,
        Severity.CRITICAL,
        hit.since_s,
        f"{hit.why} ({counted(facts.misses, 'deadline miss', 'deadline misses')}, {state})",
        **evidence,
    )


__all__ = ["detect_hang", "hang_finding"]
