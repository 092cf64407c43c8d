"""The hang rules as a table (detectors/hang/rules.py): their order is the one the docs state, and
each rule, called alone over a window's facts, fires on its own kind of hang and on no other.

Virtual time; each window is a few rounds built by hand as the observer makes them (a sweep as
the round starts, the heartbeat read after its probes). The engine is vLLM 0.32's process group:
the API server (the group leader), EngineCore, Worker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmsupervisor.core.observe import Observation
from llmsupervisor.detectors import DetectorConfig, detect_hang, new_window
from llmsupervisor.detectors.hang import HANG_RULES, hang_facts, rules
from llmsupervisor.probes.health import HttpCheck
from llmsupervisor.probes.heartbeat import StepBeat
from tests.lib.hang_rounds import API, CORE, WORKER, Engine, sweep

ORDER = ("stopped", "front", "frozen", "spinning", "overdue", "cpu_idle", "deadlines")
OPERATIONS = Path(__file__).resolve().parents[4] / "docs" / "operations.md"

CFG = DetectorConfig()
OK = HttpCheck(ok=True, detail="completed", latency_s=0.04, status_code=200)
LATE = HttpCheck(ok=False, detail="timed out (ReadTimeout)", latency_s=1.0, failure="timeout")

STILL = {API: 0.02, CORE: 0.0, WORKER: 0.0}  # every thread blocked (a deadlock), or idle
LOADED = {API: 0.3, CORE: 0.4, WORKER: 1.5}  # a decode batch: the Worker computes
SPIN = {API: 0.01, CORE: 1.0, WORKER: 0.0}  # EngineCore's main thread loops; no step for the Worker
WORKER_SPIN = {API: 0.01, CORE: 0.1, WORKER: 1.0}  # the Worker loops inside a step


def held(*, tokens: int = 0, per_token_s: float = 0.0) -> StepBeat:
    """The heartbeat of an engine that holds 8 requests, a step scheduled at 0 s and not back."""
    return StepBeat(
        pid=CORE, scheduled=401, done=400, scheduled_s=0.0, done_s=0.0, work=8, longest_step_s=0.05,
        tokens_pending=tokens, per_token_s=per_token_s,
    )  # fmt: skip


def stuck_rounds(rate: dict[int, float], beat: StepBeat, *, stopped: bool = False) -> list[Observation]:
    """Rounds at 0, 2 and 4 s of an engine stuck since 0 s, at ``rate`` of a core per process."""
    engine = Engine()
    status = {CORE: "stopped"} if stopped else {}
    return [
        Observation(
            engine="e1", at_s=t + 0.01, health=OK, proc=sweep(t, engine.run(t, rate), status), heartbeat=beat
        )
        for t in (0.0, 2.0, 4.0)
    ]


def stopped_core() -> list[Observation]:
    """EngineCore stopped (SIGSTOP) in two sweeps 2 s apart, its CPU time unchanged; no heartbeat."""
    engine = Engine()
    return [
        Observation(
            engine="e1", at_s=t + 0.01, health=OK, proc=sweep(t, engine.run(t, STILL), {CORE: "stopped"})
        )
        for t in (0.0, 2.0)
    ]


def api_server_deadlocked() -> list[Observation]:
    """Two rounds that answered, then one whose /health missed twice (asked again at once), the
    API server asleep at no CPU in the sweeps before and after the misses."""
    engine = Engine()
    beat = StepBeat(
        pid=CORE, scheduled=100, done=100, scheduled_s=0.0, done_s=0.0, work=0, longest_step_s=0.05
    )
    out = [
        Observation(
            engine="e1", at_s=t + 0.01, health=OK, proc=sweep(t, engine.run(t, STILL)), heartbeat=beat
        )
        for t in (0.0, 2.01)
    ]
    first = sweep(4.02, engine.run(4.02, {API: 0.0, CORE: 0.0, WORKER: 0.0}))
    second = sweep(6.02, engine.run(6.02, {API: 0.0, CORE: 0.0, WORKER: 0.0}))
    late = Observation(
        engine="e1", at_s=5.02, health=LATE, health_after=LATE, proc=first, proc_after=second,
        heartbeat=beat, heartbeat_at_miss=beat,
    )  # fmt: skip
    return [*out, late]


def canary_missed_at_no_cpu() -> list[Observation]:
    """No heartbeat: a canary answered, the next missed its deadline, and the group used almost no
    CPU between the sweeps before it was sent and after it gave up."""
    engine = Engine()
    return [
        Observation(engine="e1", at_s=0.01, health=OK, canary=OK, proc=sweep(0.0, engine.run(0.0, STILL))),
        Observation(engine="e1", at_s=2.01, health=OK, canary=LATE, proc=sweep(2.0, engine.run(2.0, STILL))),
        Observation(engine="e1", at_s=4.01, health=OK, proc=sweep(4.0, engine.run(4.0, STILL))),
    ]


def canaries_missed() -> list[Observation]:
    """No heartbeat and no sweep: a canary answered, then a canary missed every 2 s for 14 s."""
    first = Observation(engine="e1", at_s=0.01, canary=OK)
    return [first, *(Observation(engine="e1", at_s=t + 0.01, canary=LATE) for t in range(2, 15, 2))]


def busy() -> list[Observation]:
    """Under load, a step every round, and the newest canary slow behind the batch: busy, not dead."""
    engine = Engine()
    out = []
    for i, t in enumerate((0.0, 2.0, 4.0)):
        beat = StepBeat(
            pid=CORE, scheduled=401 + 400 * i, done=400 + 400 * i, scheduled_s=t, done_s=t, work=8,
            longest_step_s=0.05,
        )  # fmt: skip
        canary = LATE if t == 4.0 else None
        out.append(
            Observation(
                engine="e1",
                at_s=t + 0.01,
                health=OK,
                canary=canary,
                proc=sweep(t, engine.run(t, LOADED)),
                heartbeat=beat,
            )
        )
    return out


# (case, window, now, the rules that fire on it, each called alone)
TABLE: list[tuple[str, list[Observation], float, set[str]]] = [
    ("busy engine", busy(), 4.01, set()),
    ("EngineCore stopped", stopped_core(), 2.01, {"stopped"}),
    ("API server deadlocked", api_server_deadlocked(), 6.02, {"front"}),
    ("EngineCore deadlocked", stuck_rounds(STILL, held()), 4.01, {"frozen"}),
    ("EngineCore spinning", stuck_rounds(SPIN, held()), 4.01, {"spinning"}),
    (
        "Worker spinning in a step",
        stuck_rounds(WORKER_SPIN, held(tokens=512, per_token_s=0.001)),
        4.01,
        {"overdue"},
    ),
    ("canary missed at no CPU", canary_missed_at_no_cpu(), 4.01, {"cpu_idle"}),
    ("canaries missed for 14 s", canaries_missed(), 14.01, {"deadlines"}),
    # Two rules fire: the order decides, and the stopped process is the finding's.
    (
        "EngineCore stopped while holding work",
        stuck_rounds(STILL, held(), stopped=True),
        4.01,
        {"stopped", "frozen"},
    ),
]


@pytest.mark.parametrize(("case", "observations", "now", "firing"), TABLE, ids=[row[0] for row in TABLE])
def test_each_rule_fires_on_its_own_hang_and_no_other(
    case: str, observations: list[Observation], now: float, firing: set[str]
) -> None:
    window = new_window(CFG)
    for obs in observations:
        window.append(obs)
    facts = hang_facts(window, now, CFG)
    assert facts is not None
    fired = {}
    for rule in HANG_RULES:
        hit = rule(facts, window, now, CFG)
        if hit is not None:
            assert hit.rule == rule.__name__
            fired[hit.rule] = hit
    assert set(fired) == firing, case
    # detect_hang reports the first that fires, in HANG_RULES' order.
    finding = detect_hang(window, now, CFG)
    first = next((name for name in ORDER if name in firing), None)
    assert (None if finding is None else finding.evidence["rule"]) == first
    if finding is not None:
        assert finding.since_s == fired[str(first)].since_s
        assert finding.evidence["limit_s"] == fired[str(first)].limit_s


def test_the_rules_are_tried_in_the_order_the_docs_state() -> None:
    assert tuple(rule.__name__ for rule in HANG_RULES) == ORDER
    # The table in detectors/hang/rules.py's docstring, one ``name`` a row.
    assert tuple(re.findall(r"^``(\w+)``\s", rules.__doc__ or "", re.M)) == ORDER
    # The table in docs/operations.md: its rule column, top to bottom.
    text = OPERATIONS.read_text(encoding="utf-8")
    table = text[text.index("| hang | rule |") :].split("\n\n", 1)[0]
    column = [row.split("|")[2] for row in table.splitlines()[2:]]
    assert tuple(name for cell in column for name in re.findall(r"`(\w+)`", cell)) == ORDER


def test_every_rule_says_its_name_when_it_fires_and_why_a_busy_engine_cannot_trip_it() -> None:
    for rule in HANG_RULES:
        doc = rule.__doc__ or ""
        assert doc.startswith(f"``{rule.__name__}``"), rule.__name__
        assert "Why a busy engine cannot trip it:" in doc, rule.__name__
