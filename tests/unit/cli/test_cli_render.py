"""The CLI's output and decisions without a daemon: fake snapshots rendered, `--wait` judged, the
progress line on a TTY and off it, the event ring, the start phase read from real vLLM lines."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from llmsupervisor import control
from llmsupervisor.cli import control as cli_control
from llmsupervisor.cli import fleet, wait
from llmsupervisor.cli import main as cli
from llmsupervisor.cli import render as cli_render
from llmsupervisor.cli.client import Client, Unreachable
from llmsupervisor.cli.wait import Baseline, judge
from llmsupervisor.daemon.events import EventRing
from llmsupervisor.engine.output import later_phase, start_phase

FATAL_REASON = (
    "process exited with code 1 during start (waiting for /health): RuntimeError: Engine core initialization"
    " failed. See root cause above.; 3 failures in a row without becoming ready, giving up"
    " (llm-supervisor start gpu1 retries)"
)


def engine(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "state": "ready",
        "phase": None,
        "reason": "ready",
        "for_s": 70.0,
        "pid": 100,
        "incarnation": 1,
        "state_changes": 2,
        "model": "llama-70b",
        "port": 8001,
        "gpus": [0, 1],
        "in_rotation": True,
        "restarts": 0,
        "findings": [],
        "last_exit": None,
        "last_exit_age_s": None,
        "requests_running": 0,
        "batch_step": 0,
        "batch_steps": 0,
        "gpu_temperature_c": 61.0,
        "gpu_power_w": 300.0,
        "gpu_memory_used_bytes": 70 * 1024**3,
        "gpu_memory_total_bytes": 160 * 1024**3,
        "enabled": True,
        "wants_run": True,
        "start_timeout_s": 900.0,
        "drain_timeout_s": 120.0,
    }
    base.update(fields)
    return base


def snapshot(**engines: dict[str, Any]) -> dict[str, Any]:
    return {"pid": 1, "engines": engines, "gpu_faults_marked": {}}


def test_status_table_columns_phase_memory_last_exit_and_whole_fatal_reason() -> None:
    snap = snapshot(
        gpu0=engine(restarts=1, last_exit="killed by SIGKILL", last_exit_age_s=125.0),
        gpu1=engine(state="fatal", reason=FATAL_REASON, pid=None, incarnation=None, in_rotation=False),
        gpu2=engine(state="starting", phase="loading weights", for_s=12.0, gpu_memory_used_bytes=None),
    )
    text = cli_render.format_status(snap)
    header, row0, row1, row2 = text.splitlines()
    assert header.split()[:6] == ["ENGINE", "STATE", "MODEL", "GPU", "CPUS", "PORT"]
    assert "GPU MEM" in header and "LAST EXIT" in header
    assert "crashed (SIGKILL) 2m05s ago" in row0
    assert "70.0/160G" in row0 and "llama-70b" in row0 and "0,1" in row0
    assert row1.startswith("gpu1") and "FATAL" in row1 and row1.endswith(FATAL_REASON)  # not cut at 80
    assert "STARTING (loading weights)" in row2
    assert cli_render.format_status(snap, ["gpu2"]).splitlines()[1].startswith("gpu2")
    assert len(cli_render.format_status(snap, ["gpu2"]).splitlines()) == 2


def test_findings_show_with_their_summary() -> None:
    finding = {"kind": "hang", "severity": "critical", "summary": "canary missed 3 deadlines"}
    text = cli_render.format_status(snapshot(gpu0=engine(findings=[finding])))
    assert text.splitlines()[1].endswith("hang (critical): canary missed 3 deadlines")


def test_status_exit_code() -> None:
    off = engine(state="stopped", enabled=False, meant_to_serve=False, wants_run=False, held_by_operator=True)
    snap = snapshot(a=engine(), b=engine(state="fatal"), c=engine(state="starting"), off=off)
    assert cli_render.status_exit_code(snap, ["a"]) == (0, [])
    assert cli_render.status_exit_code(snap, ["c"]) == (0, [])
    assert cli_render.status_exit_code(snap, ["a", "b"]) == (1, ["b is FATAL"])
    nope = "no engine named 'nope'; engines: a, b, c, off"
    assert cli_render.status_exit_code(snap, ["nope"]) == (1, [nope])
    assert cli_render.status_exit_code(snap) == (1, ["b is FATAL"])  # a disabled engine is not down
    assert cli_render.status_exit_code(snapshot(a=engine(), off=off)) == (0, [])
    assert cli_render.status_exit_code(snap, ["off"]) == (0, [])  # by name too: the config put it there


def test_status_exits_0_where_the_operator_put_every_engine() -> None:
    """Issue 39 (3): a monitoring script must not alert on an intended stop or drain; only what
    nobody asked for is: down, FATAL, or a drained engine that should still run and does not."""
    stopped = {"state": "stopped", "wants_run": False, "held_by_operator": True, "pid": None}
    drained = {"state": "draining", "held_by_operator": True, "in_rotation": False}
    on_purpose = snapshot(
        a=engine(),
        s=engine(**stopped, hold={"hold": "stop", "by": "alice (uid 1000)", "since": 0.0}),
        stopping=engine(**{**stopped, "state": "stopping"}),
        d=engine(**drained, hold={"hold": "drain", "by": "alice (uid 1000)", "since": 0.0}),
        up=engine(state="starting", phase="loading weights"),
    )
    assert cli_render.status_exit_code(on_purpose) == (0, [])
    assert cli_render.status_exit_code(on_purpose, ["s", "d"]) == (0, [])
    unasked = snapshot(
        crashed=engine(state="backoff", pid=None),
        gave_up=engine(state="fatal", pid=None),
        down=engine(state="stopped", pid=None),  # meant to serve, nobody stopped it: not ready
        drained_crashed=engine(**{**drained, "state": "backoff"}),
        ok=engine(**drained),
    )
    assert cli_render.status_exit_code(unasked) == (
        1,
        [
            "crashed is BACKOFF",
            "gave_up is FATAL",
            "down is STOPPED",
            "drained_crashed is BACKOFF (drained, but meant to run)",
        ],
    )


def test_progress_and_answer_lines() -> None:
    starting = engine(state="starting", phase="loading weights", for_s=70.0)
    assert (
        cli_render.progress_line("gpu1", starting, waited_s=75.0)
        == "gpu1 STARTING 1m10s / 15m: loading weights (waited 1m15s)"
    )
    draining = engine(state="draining", for_s=5.0, requests_running=3)
    assert cli_render.progress_line("gpu1", draining, waited_s=5.0) == (
        "gpu1 DRAINING 5s / 2m: 3 requests in flight (waited 5s)"
    )
    reply = {
        "engine": "gpu1",
        "accepted": "restart",
        "state": "ready",
        "doing": "draining, 3 requests in flight",
    }
    assert cli_render.accepted_line(reply) == "gpu1: restart accepted; draining, 3 requests in flight"
    assert cli_render.reload_line({"reloaded": True, "added": [], "changed": ["b"], "removed": ["c"]}) == (
        "reload accepted; restarting b; stopping c"
    )


def test_reload_line_says_which_engines_roll() -> None:
    """The reload reply's ``rolling`` (daemon/reload.py): the engines the policy restarts onto the
    new config, a changed engine that is stopped not among them, one a halted roll left behind
    among them."""
    reply = {"reloaded": True, "added": ["d"], "changed": ["b", "s"], "removed": [], "rolling": ["a", "b"]}
    assert cli_render.reload_line(reply) == (
        "reload accepted; added d; changed b, s; rolling a, b (restarted within max_unavailable)"
    )
    nothing = {"reloaded": True, "added": [], "changed": [], "removed": [], "rolling": []}
    assert cli_render.reload_line(nothing) == "reload accepted; nothing changed"
    assert cli_render.duration(59) == "59s" and cli_render.duration(3725) == "1h02m"


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("10m", 600.0), ("2h", 7200.0), ("1d", 86400.0), ("45", 45.0)]
)
def test_parse_since(text: str, seconds: float) -> None:
    assert cli_render.parse_since(text) == seconds


def test_parse_since_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="not a duration"):
        cli_render.parse_since("soon")


def transition(to_state: str, message: str) -> dict[str, Any]:
    return {"seq": 9, "kind": "transition", "engine": "gpu1", "to_state": to_state, "message": message}


def test_judge_restart() -> None:
    base = Baseline("restart", incarnation=3, state_changes=10)
    named = {"name": "gpu1"}
    assert judge(base, {**engine(incarnation=3), **named}, []) is None  # the old READY, not yet restarted
    assert judge(base, {**engine(state="starting", incarnation=4, phase="compiling"), **named}, []) is None
    done = judge(base, {**engine(incarnation=4), **named}, [])
    assert done is not None and done.reached and done.line == "gpu1: READY (restart done)"
    # BACKOFF in between counts even when the engine is STARTING again by the next look.
    failed = judge(
        base,
        {**engine(state="starting", incarnation=5), **named},
        [
            transition(
                "backoff", "STARTING -> BACKOFF: not ready within start_timeout_s=900 (waiting for /health)"
            )
        ],
    )
    assert failed is not None and not failed.reached
    assert (
        failed.line
        == "gpu1: restart failed (BACKOFF): not ready within start_timeout_s=900 (waiting for /health)"
    )
    fatal = judge(base, {**engine(state="fatal", state_changes=14, reason="gave up"), **named}, [])
    assert fatal is not None and fatal.line == "gpu1: restart failed (FATAL): gave up"
    stopped = judge(base, {**engine(state="stopped", wants_run=False, incarnation=None), **named}, [])
    assert stopped is not None and "stopped meanwhile" in stopped.line


def test_judge_stop_drain_start() -> None:
    named = {"name": "e"}
    assert judge(Baseline("stop"), {**engine(state="draining"), **named}, []) is None
    stop = judge(Baseline("stop"), {**engine(state="stopped", pid=None), **named}, [])
    assert stop is not None and stop.reached
    assert judge(Baseline("drain"), {**engine(state="draining", requests_running=2), **named}, []) is None
    drain = judge(Baseline("drain"), {**engine(state="draining", requests_running=0), **named}, [])
    assert drain is not None and drain.reached
    start = judge(Baseline("start"), {**engine(), **named}, [])
    assert start is not None and start.reached
    reload_ready = judge(
        Baseline("reload", incarnation=2), {**engine(incarnation=2), **named}, [transition("ready", "")]
    )
    assert reload_ready is not None and reload_ready.reached


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_in_place_on_a_tty() -> None:
    out = FakeTty()
    progress = wait.Progress(out)
    progress.show("a STARTING 1s", 1)
    progress.show("a STARTING 2s", 1)
    progress.end()
    assert out.getvalue() == "\r\x1b[2Ka STARTING 1s\r\x1b[2Ka STARTING 2s\r\x1b[2K"


def test_progress_off_a_tty_is_a_line_per_change_or_every_few_seconds() -> None:
    out = io.StringIO()
    now = [0.0]
    progress = wait.Progress(out, clock=lambda: now[0])
    progress.show("a STARTING 0s: spawned", ("starting", "spawned"))
    now[0] = 1.0
    progress.show("a STARTING 1s: spawned", ("starting", "spawned"))  # no change: not printed
    progress.show("a STARTING 1s: compiling", ("starting", "compiling"))
    now[0] = 7.0
    progress.show("a STARTING 7s: compiling", ("starting", "compiling"))  # a while later: printed
    assert out.getvalue().splitlines() == [
        "a STARTING 0s: spawned",
        "a STARTING 1s: compiling",
        "a STARTING 7s: compiling",
    ]


class FakeClient(Client):
    def __init__(self, rounds: list[tuple[list[dict[str, Any]], dict[str, Any]]]) -> None:
        super().__init__(path=Path("/nonexistent"))
        self.rounds = rounds
        self.asked: list[dict[str, Any]] = []

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        self.asked.append(payload)
        if payload["command"] == "events":
            return {"events": self.rounds[0][0], "last_seq": 9}
        engines = self.rounds.pop(0)[1]
        if not self.rounds:
            self.rounds.append(([], engines))
        return {"engines": engines}


def test_wait_follows_the_engine_to_ready() -> None:
    client = FakeClient(
        [
            ([], {"a": engine(state="draining", incarnation=1)}),
            ([], {"a": engine(state="starting", phase="loading weights", incarnation=2)}),
            ([], {"a": engine(state="ready", incarnation=2)}),
        ]
    )
    out, err = io.StringIO(), io.StringIO()
    waiting = wait.Waiting({"a": Baseline("restart", incarnation=1)}, events_seq=5)
    assert wait.wait(client, waiting, timeout_s=None, out=out, err=err) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("a DRAINING ")
    assert lines[1].startswith("a STARTING ") and ": loading weights" in lines[1]
    assert lines[-1] == "a: READY (restart done)"
    assert client.asked[0] == {"command": "events", "engine": "a", "after": 5, "wait_s": 1.0}


def test_wait_on_an_unreachable_daemon_is_69() -> None:
    class Gone(Client):
        def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
            raise Unreachable("the daemon went away")

    err = io.StringIO()
    waiting = wait.Waiting({"a": Baseline("start")}, events_seq=0)
    code = wait.wait(Gone(Path("/x")), waiting, timeout_s=None, out=io.StringIO(), err=err)
    assert code == 69 and "lost the daemon while waiting" in err.getvalue()


def test_broken_config_says_so_instead_of_not_running() -> None:
    err = io.StringIO()
    client = Client(Path("/nonexistent.sock"), config_problem="c.yaml:3: x: bad")
    code = cli_control.status(client, [], as_json=False, out=io.StringIO(), err=err)
    assert code == 78 and err.getvalue() == "llm-supervisor: the config is broken: c.yaml:3: x: bad\n"


def test_config_and_socket_after_the_subcommand(tmp_path: Any) -> None:
    args = cli._parser().parse_args(["status", "a", "--config", "/x.yaml", "--socket", "/s.sock"])
    assert (str(args.config), str(args.socket), args.names) == ("/x.yaml", "/s.sock", ["a"])
    args = cli._parser().parse_args(["--config", "/y.yaml", "restart", "gpu0", "--wait", "--timeout", "60"])
    assert (str(args.config), args.engines, args.wait, args.timeout) == ("/y.yaml", ["gpu0"], True, 60.0)
    args = cli._parser().parse_args(["events", "gpu0", "--follow", "--since", "10m"])
    assert (args.engine, args.follow, args.since) == ("gpu0", True, "10m")


# Real lines of vLLM 0.32's CPU build starting (a daemon log of tests/vllm/test_vllm_cpu.py), and the
# GPU build's graph capture line (docs/vllm-notes.md §5).
REAL_LINES = [
    ("(APIServer pid=4794) INFO 11-23 11:19:09 [model.py:733] Resolved architecture: LlamaForCausalLM", None),
    (
        "(EngineCore pid=4827) INFO 11-23 11:19:26 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with"
        " config: model='/m/tiny', speculative_config=None, compilation_config={'level': 3}",
        None,
    ),
    (
        "(Worker pid=4863) INFO 11-23 11:19:56 [cpu_model_runner.py:68] Starting to load model /m/tiny...",
        "loading weights",
    ),
    ("Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]", "loading weights"),
    (
        "(Worker pid=4863) INFO 11-23 11:19:56 [default_loader.py:501] Loading weights took 0.02 seconds",
        "compiling",
    ),
    (
        "(Worker pid=4863) INFO 11-23 11:19:58 [cpu_model_runner.py:87]"
        " Warming up model for the compilation...",
        "compiling",
    ),
    (
        "(EngineCore pid=1) INFO 11-23 11:20:00 [gpu_model_runner.py:1]"
        " Capturing CUDA graphs (mixed prefill-decode)",
        "capturing graphs",
    ),
    (
        "(APIServer pid=4794) INFO 11-23 11:20:37 [entry.py:140] Starting vLLM server on http://127.0.0.1:56505",
        "listening",
    ),
    ("INFO:     Application startup complete.", "listening"),
    (
        "(APIServer pid=4794) INFO 11-23 11:20:37 [api_utils.py:286] non-default args: {'host': '127.0.0.1'}",
        None,
    ),
]


@pytest.mark.parametrize(("line", "phase"), REAL_LINES)
def test_start_phase_from_real_vllm_lines(line: str, phase: str | None) -> None:
    assert start_phase(line) == phase


def test_phases_only_move_forward() -> None:
    assert later_phase(None, "loading weights")
    assert later_phase("spawned", "compiling")
    assert not later_phase("compiling", "loading weights")
    assert not later_phase("compiling", "compiling")


def test_event_ring_keeps_marked_records_bounded_and_filters() -> None:
    ring = EventRing(capacity=3)
    log = logging.getLogger("test.events")
    log.addHandler(ring)
    log.setLevel(logging.INFO)
    try:
        log.info("not an event", extra={"engine": "a"})
        for i in range(5):
            log.info("step %d", i, extra={"engine": "a" if i % 2 else "b", "event": "action"})
        log.warning("x -> y", extra={"engine": "a", "event": "transition", "to_state": "fatal"})
    finally:
        log.removeHandler(ring)
    kept = ring.select()
    assert [e.message for e in kept] == ["step 3", "step 4", "x -> y"]  # the oldest dropped
    assert [e.seq for e in kept] == [4, 5, 6] and ring.last_seq == 6
    assert [e.message for e in ring.select(engine="a")] == ["step 3", "x -> y"]
    assert [e.message for e in ring.select(after_seq=5)] == ["x -> y"]
    assert ring.select(after_seq=5)[0].as_json()["to_state"] == "fatal"
    assert ring.select(since_time_s=kept[-1].time_s + 60) == []
    # A long poll with nothing new returns empty after its wait.
    assert asyncio.run(ring.wait_select(after_seq=6, wait_s=0.05)) == []


def test_events_request_is_validated() -> None:
    assert control._validated({"command": "events"}) == {"command": "events"}
    with pytest.raises(control.ControlError, match="after must be a number"):
        control._validated({"command": "events", "after": "x"})


def test_event_line_says_the_kind_once() -> None:
    finding = {"time": 0.0, "engine": "a", "kind": "finding", "message": "finding hang (critical): x"}
    assert cli_render.event_line(finding).endswith(" a finding hang (critical): x")
    moved = {"time": 0.0, "engine": "a", "kind": "transition", "message": "READY -> DRAINING: why"}
    assert cli_render.event_line(moved).endswith(" a transition READY -> DRAINING: why")


def test_what_an_accepted_command_does_and_the_summary_phase() -> None:
    import dataclasses

    from llmsupervisor.core.state import EngineState as S
    from llmsupervisor.daemon.requests import what_happens
    from llmsupervisor.daemon.status import summary
    from llmsupervisor.engine.status import EngineLoad
    from tests.lib.statuses import status as engine_status

    ready = dataclasses.replace(engine_status("gpu1"), load=EngineLoad(requests_running=3))
    assert what_happens("restart", ready) == "draining, 3 requests in flight, then restarting"
    assert what_happens("drain", ready) == "out of rotation, draining, 3 requests in flight"
    assert what_happens("stop", ready) == "draining, 3 requests in flight, then stopping"
    assert what_happens("start", ready) == "already ready"
    stopped = engine_status("gpu1", S.STOPPED, incarnation=None, wants_run=False)
    assert what_happens("restart", stopped) == "starting"
    assert what_happens("stop", stopped) == "already stopped; held until `start`"
    fatal = engine_status("gpu1", S.FATAL, incarnation=None)
    assert what_happens("stop", fatal) == "was FATAL: now STOPPED, held until `start`"
    assert what_happens("drain", stopped) == "held: it stays out of rotation once it is ready"
    starting = engine_status("gpu1", S.STARTING, start_phase="compiling")
    assert what_happens("restart", starting) == "abandoning this start, starting again"
    assert what_happens("start", dataclasses.replace(ready, state=S.DRAINING)) == "back in rotation"
    assert summary([starting], now=70.0) == "0/1 engines ready; gpu1 starting (1m10s): compiling"


class StatusOnly(Client):
    def __init__(self) -> None:
        super().__init__(Path("/nonexistent"))
        self.calls = 0

    def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise Unreachable("the daemon is not running")
        return snapshot(a=engine())


def test_watch_redraws_in_place_keeps_trying_and_ends_cleanly_on_ctrl_c() -> None:
    out = FakeTty()
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    assert cli_control.watch(StatusOnly(), [], interval_s=2.0, out=out, sleep=sleep) == 0
    frames = out.getvalue().split("\x1b[H\x1b[2J")[1:]
    assert len(frames) == 3 and sleeps == [2.0, 2.0, 2.0]
    assert "READY" in frames[0] and "the daemon is not running" in frames[1] and "READY" in frames[2]


def test_events_follow_prints_new_ones_and_ends_on_ctrl_c() -> None:
    class Events(Client):
        def __init__(self) -> None:
            super().__init__(Path("/nonexistent"))
            self.asked: list[dict[str, Any]] = []

        def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
            self.asked.append(payload)
            if len(self.asked) == 1:
                return {
                    "events": [
                        {"seq": 3, "time": 0, "engine": "a", "kind": "operator", "message": "operator: drain"}
                    ],
                    "last_seq": 3,
                }
            if len(self.asked) == 2:
                return {
                    "events": [
                        {
                            "seq": 4,
                            "time": 0,
                            "engine": "a",
                            "kind": "transition",
                            "message": "READY -> DRAINING: x",
                        }
                    ],
                    "last_seq": 4,
                }
            raise KeyboardInterrupt

    client, out = Events(), io.StringIO()
    assert (
        cli_control.events(client, "a", since_s=600.0, follow=True, as_json=False, out=out, err=io.StringIO())
        == 0
    )
    assert [line.split(" ", 2)[2] for line in out.getvalue().splitlines()] == [
        "a operator: drain",
        "a transition READY -> DRAINING: x",
    ]
    assert client.asked[0] == {"command": "events", "engine": "a", "since_s": 600.0}
    assert client.asked[1]["after"] == 3 and client.asked[2]["after"] == 4


# ---- the fleet view ----


def test_fleet_table_has_a_host_column_and_unreachable_hosts_are_rows() -> None:
    hosts = [
        fleet.HostStatus("http://h1:9400", snapshot(gpu0=engine(), bad=engine(state="fatal"))),
        fleet.HostStatus("http://h2:9400", snapshot(gpu0=engine())),
        fleet.HostStatus("http://h3:9400", None, "no answer within 3 s"),
    ]
    lines = fleet.format_fleet_status(hosts).splitlines()
    assert lines[0].split()[:3] == ["HOST", "ENGINE", "STATE"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["http://h1:9400", "gpu0", "READY"],
        ["http://h1:9400", "bad", "FATAL"],
        ["http://h2:9400", "gpu0", "READY"],
        ["http://h3:9400", "-", "unreachable"],
    ]
    assert lines[-1].endswith("unreachable: no answer within 3 s")
    # Columns line up across hosts: STATE starts at the same offset on every row.
    assert len({line.index(line.split()[2]) for line in lines}) == 1
    code, problems = fleet.fleet_exit_code(hosts)
    assert code == 1
    assert problems == ["http://h3:9400: unreachable: no answer within 3 s", "http://h1:9400: bad is FATAL"]
    # Only gpu0 asked about, everywhere reachable: up.
    assert fleet.fleet_exit_code(hosts[:2], ["gpu0"]) == (0, [])
    assert "bad" not in fleet.format_fleet_status(hosts[:2], ["gpu0"])
    assert fleet.fleet_exit_code(hosts[:2], ["nope"]) == (1, ["no engine named 'nope' on any host"])


def test_hosts_file_skips_blanks_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# the A cluster\nhttp://h1:9400\n\n  h2:9400   # spare\n#http://h3:9400\n")
    assert fleet.read_hosts_file(str(path)) == ["http://h1:9400", "h2:9400"]


def test_a_host_that_is_not_listening_is_a_row_not_an_error() -> None:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = fleet.fetch_host_status(f"127.0.0.1:{port}", deadline_s=1)
    assert got.status is None and got.error
    out, err = io.StringIO(), io.StringIO()
    assert fleet.fleet_status([f"127.0.0.1:{port}"], [], as_json=False, out=out, err=err) == 1
    assert "unreachable" in out.getvalue() and "unreachable" in err.getvalue()


def test_judge_restart_of_a_drained_engine_ends_when_the_new_incarnation_is_up_and_held() -> None:
    """Issue 22: a restart keeps the operator's drain, so the new incarnation is READY for an
    instant and then DRAINING; `restart --wait` polled forever for a READY it never saw."""
    base = Baseline("restart", incarnation=3, state_changes=10)
    drained = {"name": "gpu1", "hold": {"hold": "drain", "by": "operator", "since": 1.0}}
    assert judge(base, {**engine(state="draining", incarnation=3), **drained}, []) is None  # the old one
    done = judge(base, {**engine(state="draining", incarnation=4), **drained}, [])
    assert done is not None and done.reached
    assert done.line == "gpu1: READY and held out of rotation by a drain (restart done)"
    # A daemon whose status has no holds yet: drained is "held by an operator, meant to run".
    older = {"name": "gpu1", "held_by_operator": True, "wants_run": True}
    done = judge(base, {**engine(state="draining", incarnation=4), **older}, [])
    assert done is not None and done.reached
    # Draining because of something else (a restart's own drain) is not done.
    assert judge(base, {**engine(state="draining", incarnation=4), "name": "gpu1"}, []) is None


def test_a_held_engine_is_visibly_held_in_the_table() -> None:
    held = engine(
        state="stopped", in_rotation=False, hold={"hold": "stop", "by": "alice (uid 1000)", "since": 0.0}
    )
    rows = cli_render.status_rows({"gpu1": held}, now=180.0)
    assert rows[1][cli_render.STATUS_HEADER.index("ROTATION")] == "held"
    # A few characters in the table (issue 39: the prefix took 54); in full with -o wide.
    assert rows[1][-1] == "held: stop (alice, 3m)"
    wide = cli_render.status_rows({"gpu1": held}, wide=True)
    assert wide[1][-1].startswith("stop hold by alice (uid 1000) since ")
    assert wide[1][-1].endswith("; ready")


# ---- issue 26 (8): the table fits the terminal, empty GPU columns go ----


def test_gpu_columns_without_a_reading_are_hidden_and_wide_shows_them() -> None:
    no_gpu: dict[str, Any] = {
        "gpus": [],
        "gpu_temperature_c": None,
        "gpu_power_w": None,
        "gpu_memory_used_bytes": None,
        "gpu_memory_total_bytes": None,
    }
    snap = snapshot(cpu0=engine(**no_gpu), cpu1=engine(**no_gpu))
    header = cli_render.format_status(snap).splitlines()[0]
    for title in cli_render.GPU_COLUMNS:
        assert f" {title} " not in f" {header} "
    wide = cli_render.format_status(snap, wide=True).splitlines()[0]
    assert all(title in wide for title in cli_render.GPU_COLUMNS)
    # One engine with a reading keeps the column, for every row.
    mixed = snapshot(cpu0=engine(**no_gpu), gpu0=engine())
    assert "TEMP" in cli_render.format_status(mixed).splitlines()[0]


def test_the_table_fits_the_terminal_dropping_the_least_needed_columns_first() -> None:
    snap = snapshot(
        gpu0=engine(restarts=1, last_exit="killed by SIGKILL", last_exit_age_s=125.0, cpus="0-7"),
        gpu1=engine(state="fatal", reason=FATAL_REASON, in_rotation=False),
    )
    full = cli_render.format_status(snap)
    assert max(len(line) for line in full.splitlines()) > 150
    for width in (80, 100, 120):
        lines = cli_render.format_status(snap, width=width).splitlines()
        header = lines[0]
        # Every line fits; what says what happened stays (issue 39); the reason is cut, not wrapped.
        assert all(len(line) <= width for line in lines), lines
        for title in ("ENGINE", "STATE", "FOR", "RESTARTS", "LAST EXIT", "ROTATION", "FINDINGS / REASON"):
            assert title in header, (width, header)
        assert lines[2].endswith("…") and FATAL_REASON.startswith(lines[2].split("  ")[-1].strip()[:-1])
        assert "SIGKILL" in lines[1] and re.search(r"\b2m(05s)? ago", lines[1])
    narrow = cli_render.format_status(snap, width=80).splitlines()[0]
    assert "CPUS" not in narrow and "STEP" not in narrow  # the first to go
    assert "CPUS" in cli_render.format_status(snap, width=80, wide=True).splitlines()[0]
    # A terminal wide enough keeps every column with a value.
    assert cli_render.format_status(snap, width=1000) == full


def test_status_on_a_terminal_is_fitted_and_off_it_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    class Answering:
        def call(self, payload: dict[str, Any], *, timeout_s: float = 10.0) -> Any:
            return snapshot(gpu1=engine(state="fatal", reason=FATAL_REASON, cpus="0-7"))

    monkeypatch.setenv("COLUMNS", "80")
    tty, pipe, err = Tty(), io.StringIO(), io.StringIO()
    client: Any = Answering()
    cli_control.status(client, [], as_json=False, out=tty, err=err)
    cli_control.status(client, [], as_json=False, out=pipe, err=err)
    assert "CPUS" not in tty.getvalue().splitlines()[0]
    assert "CPUS" in pipe.getvalue().splitlines()[0]
    wide = Tty()
    cli_control.status(client, [], as_json=False, out=wide, err=err, wide=True)
    assert "CPUS" in wide.getvalue().splitlines()[0]


def test_status_output_option_parses() -> None:
    parser = cli._parser()
    assert parser.parse_args(["status", "-o", "wide"]).output == "wide"
    assert parser.parse_args(["status", "--output", "json"]).output == "json"


def test_the_table_marks_a_pending_config_roll_and_a_halted_one() -> None:
    rows = cli_render.status_rows(
        {
            "a": engine(config_roll="pending"),
            "b": engine(config_roll="halted"),
            "c": engine(state="backoff", reason="start failed", config_roll="failed"),
            "d": engine(),
        }
    )
    assert rows[1][-1] == "new config pending: rolls within max_unavailable; ready"
    assert rows[2][-1].startswith("new config pending: the roll is halted; ")
    assert rows[3][-1] == "failed on the new config: the roll is halted; start failed"
    assert rows[4][-1] == "ready"


def test_status_without_a_daemon_says_the_status_file_is_stale(tmp_path: Path) -> None:
    """Issue 26 (11): a killed daemon's status.json still says READY; `status` says the daemon
    is not running and when that status was written, and never shows it as now."""
    import json as json_module
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    status_file = tmp_path / "status.json"
    status_file.write_text(
        json_module.dumps({"pid": gone.pid, "written_at": 1_790_000_000.0, "engines": {"a": engine()}})
    )
    client = Client(tmp_path / "nothing.sock", status_file=status_file)
    out, err = io.StringIO(), io.StringIO()
    assert cli_control.status(client, [], as_json=False, out=out, err=err) == 69
    assert out.getvalue() == ""
    note = err.getvalue().splitlines()[0]
    assert note.startswith(f"llm-supervisor: daemon not running (pid {gone.pid} is gone); last status at ")
    assert str(status_file) in note
