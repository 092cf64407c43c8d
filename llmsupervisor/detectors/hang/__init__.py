"""The HANG family: is the engine doing anything at all?

::

    detect.py   detect_hang: the facts, then the first rule that fires, as a Finding
    front.py    the ``front`` rule's test: the API server's event loop held
    steps.py    the step heartbeat: a stuck engine, and the frozen, spinning and overdue tests
    sweeps.py   the process sweeps in a window and the CPU used between two
    suspect.py  a hang suspected at its first sign, before a rule proves it (the load balancer's cue)
"""

from __future__ import annotations

from llmsupervisor.detectors.hang.detect import detect_hang
from llmsupervisor.detectors.hang.suspect import hang_suspected

__all__ = ["detect_hang", "hang_suspected"]
