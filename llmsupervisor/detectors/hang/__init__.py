"""The HANG family: is the engine doing anything at all?

::

    detect.py   detect_hang: the facts once, then the first rule that fires, as a finding
    facts.py    HangFacts: the walk back to the last sign of life, the misses, a stopped
                process, the newest sweep, the stuck step
    rules.py    HANG_RULES: the rules in order, each a pure (facts, window, now, cfg) -> RuleHit
    front.py    the ``front`` rule's test: the API server's event loop held
    steps.py    the step heartbeat: a stuck engine, and the frozen, spinning and overdue tests
    sweeps.py   the process sweeps in a window and the CPU used between two
    suspect.py  a hang suspected at its first sign, before a rule proves it (the load balancer's cue)
"""

from __future__ import annotations

from llmsupervisor.detectors.hang.detect import detect_hang
from llmsupervisor.detectors.hang.facts import HangFacts, hang_facts
from llmsupervisor.detectors.hang.rules import HANG_RULES, HangRule, RuleHit
from llmsupervisor.detectors.hang.suspect import hang_suspected

__all__ = ["HANG_RULES", "HangFacts", "HangRule", "RuleHit", "detect_hang", "hang_facts", "hang_suspected"]
