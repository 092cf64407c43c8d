"""The step heartbeat: the plugin's writer, the daemon's reader, and when the daemon adds it."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from llmsupervisor.engine.heartbeat import FLAG, PLUGIN_DIR, heartbeat_launch, vllm_resolves_scheduler
from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.heartbeat import StepBeat, parse, read_heartbeat
from llmsupervisor.probes.vllm_plugin import llmsupervisor_step_heartbeat as plugin
from llmsupervisor.probes.vllm_plugin.llmsupervisor_step_heartbeat import (
    ENV,
    LAYOUT,
    QUALNAME,
    Heartbeat,
)


def test_the_writer_counts_steps_and_the_reader_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "beat"
    beat = Heartbeat(str(path))
    first = read_heartbeat(path)
    assert isinstance(first, StepBeat)
    assert (first.pid, first.scheduled, first.done, first.work) == (os.getpid(), 0, 0, 0)
    beat.on_schedule(3)
    mid = read_heartbeat(path)
    assert isinstance(mid, StepBeat) and mid.pending and mid.work == 3
    beat.on_done(2)
    done = read_heartbeat(path)
    assert isinstance(done, StepBeat) and not done.pending
    assert (done.scheduled, done.done, done.work) == (1, 1, 2)
    assert done.done_s >= done.scheduled_s and done.longest_step_s >= 0


def test_async_scheduling_two_steps_in_flight_time_each_from_its_start(tmp_path: Path) -> None:
    beat = Heartbeat(str(tmp_path / "beat"))
    beat.on_schedule(1)
    beat.on_schedule(1)  # async scheduling: the next step is scheduled before this one is back
    beat.on_done(1)
    beat.on_done(0)
    got = read_heartbeat(tmp_path / "beat")
    assert isinstance(got, StepBeat) and (got.scheduled, got.done) == (2, 2)


def test_the_longest_step_decays(tmp_path: Path) -> None:
    beat = Heartbeat(str(tmp_path / "beat"))
    beat.longest_s = 2.0
    for _ in range(1000):
        beat.on_schedule(1)
        beat.on_done(1)
    assert beat.longest_s < 0.02  # 2 s x 0.995^1000, plus the microseconds of these steps


def test_the_longest_step_halves_every_two_idle_seconds_but_the_time_per_token_stays(tmp_path: Path) -> None:
    # An idle engine takes no steps to decay by: the first small step after a pause (a canary's)
    # must not keep the last long prefill as its bound. Its size-scaled bound stays, so a long
    # prefill after the pause still gets a long one.
    beat = Heartbeat(str(tmp_path / "beat"))
    beat.longest_s, beat.per_token_s = 2.0, 0.01
    beat.done_s -= 6.0  # the last step came back 6 s ago: three half-lives
    beat.on_schedule(0, tokens=5)
    assert beat.longest_s == pytest.approx(0.25, rel=0.01)
    assert beat.per_token_s == 0.01
    got = read_heartbeat(tmp_path / "beat")
    assert isinstance(got, StepBeat) and got.longest_step_s == pytest.approx(0.25, rel=0.01)
    # A step scheduled while one is under way (async scheduling) is not after a pause.
    beat.on_schedule(0, tokens=5)
    assert beat.longest_s == pytest.approx(0.25, rel=0.01)


def test_no_file_is_no_heartbeat_and_a_torn_or_foreign_record_is_a_failure(tmp_path: Path) -> None:
    assert read_heartbeat(tmp_path / "absent") is None
    (tmp_path / "zeros").write_bytes(bytes(4096))  # created, not yet written
    assert isinstance(read_heartbeat(tmp_path / "zeros"), ProbeFailure)
    beat = Heartbeat(str(tmp_path / "beat"))
    record = bytearray((tmp_path / "beat").read_bytes()[: LAYOUT.size])
    assert parse(bytes(record)) is not None
    record[16] |= 1  # the sequence odd: the writer was mid-record
    assert parse(bytes(record)) is None
    assert parse(bytes(record[:10])) is None
    del beat


def test_the_plugin_module_imports_without_vllm_or_llmsupervisor() -> None:
    # The engine's Python has neither the daemon's package nor (for this check) anything but the
    # standard library: the module must import from the plugin folder alone.
    keep = "[p for p in sys.path if 'site-packages' not in p]"
    code = f"import sys; sys.path[:] = [{str(PLUGIN_DIR)!r}] + {keep}; "
    code += "import llmsupervisor_step_heartbeat as m; print(m.QUALNAME)"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == QUALNAME


def _vllm(tmp_path: Path, resolver: bool) -> str:
    """A fake vLLM installation: bin/python and a config/scheduler.py with or without 0.32's
    resolver."""
    config = tmp_path / "lib" / "python3.11" / "site-packages" / "vllm" / "config"
    config.mkdir(parents=True)
    (config / "scheduler.py").write_text("def get_scheduler_cls(self): ...\n" if resolver else "x = 1\n")
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("")
    return str(python)


@pytest.mark.parametrize(
    ("resolver", "args", "enabled", "added"),
    [
        (True, {}, True, True),
        (False, {}, True, False),  # vLLM 0.11: async scheduling would replace the class
        (True, {FLAG: "my.Scheduler"}, True, False),  # the operator's own scheduler
        # vLLM's own choice (0.32, 0.34: DiffusionScheduler), which ours would replace
        (True, {"diffusion-config": {"canvas_length": 64}}, True, False),
        (True, {}, False, False),  # step_heartbeat: false
    ],
)
def test_the_flag_is_added_only_where_vllm_takes_it_and_nobody_chose_otherwise(
    tmp_path: Path, resolver: bool, args: dict[str, object], enabled: bool, added: bool
) -> None:
    python = _vllm(tmp_path, resolver)
    beat = tmp_path / "state" / "step-heartbeat"
    argv, env = heartbeat_launch(
        [python, "-m", "vllm"], args, {"PYTHONPATH": "/opt/x"}, path=beat, enabled=enabled
    )
    assert vllm_resolves_scheduler(python) is resolver
    if not added:
        assert (argv, env) == ([], {})
        return
    assert argv == ["--" + FLAG, QUALNAME]
    assert env == {ENV: str(beat), "PYTHONPATH": f"{PLUGIN_DIR}{os.pathsep}/opt/x"}


def test_a_step_s_tokens_and_the_slowest_time_per_token_and_requests_admitted(tmp_path: Path) -> None:
    # What bounds a step by its size (detectors/hang/steps.py, overdue) and what shows the API server
    # admits requests (detectors/hang/front.py).
    beat = Heartbeat(str(tmp_path / "beat"))
    beat.on_add()
    beat.on_add()
    beat.on_schedule(2, tokens=300)  # a prefill
    beat.on_schedule(2, tokens=2)  # async scheduling: the next one while it runs
    under_way = read_heartbeat(tmp_path / "beat")
    assert isinstance(under_way, StepBeat)
    assert (under_way.added, under_way.tokens_pending) == (2, 302)
    beat.on_done(2)
    beat.on_done(2)
    done = read_heartbeat(tmp_path / "beat")
    assert isinstance(done, StepBeat) and done.tokens_pending == 0 and done.per_token_s > 0
    # The bound of a step under way: its tokens x the slowest time per token, or the longest
    # recent step, whichever is more.
    assert done.expected_step_s == max(done.longest_step_s, 0)
    big = StepBeat(
        pid=1, scheduled=2, done=1, scheduled_s=0, done_s=0, work=1, longest_step_s=0.05,
        tokens_pending=400, per_token_s=0.01,
    )  # fmt: skip
    assert big.expected_step_s == pytest.approx(4.0)


class _Asked:
    """Records every attribute asked of it (the plugin's view of a vLLM object) and answers
    from ``values``."""

    def __init__(self, asked: list[str], **values: object) -> None:
        object.__setattr__(self, "_asked", asked)
        object.__setattr__(self, "_values", values)

    def __getattribute__(self, name: str) -> object:
        if name.startswith("__"):
            return object.__getattribute__(self, name)
        object.__getattribute__(self, "_asked").append(name)
        return object.__getattribute__(self, "_values")[name]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("positional", [False, True])
def test_the_plugin_touches_nothing_in_vllm_beyond_what_it_declares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool, positional: bool
) -> None:
    # What tests/lib/vllm_surface.py checks every release of the support matrix for (BASES,
    # ASYNC_FIELD, CONFIG_ARG, WRAPPED, HELD_COUNT, STEP_TOKENS) is all the plugin uses of vLLM:
    # a fake vLLM that records what is asked of its scheduler, its config and a step's output.
    asked: list[str] = []

    class Base:
        def __init__(self, vllm_config: object, log_stats: bool = False) -> None:
            self.init = (vllm_config, log_stats)

        def __getattribute__(self, name: str) -> object:
            if not name.startswith("_") and name != "init":
                asked.append(name)
            return object.__getattribute__(self, name)

        def add_request(self, request: object) -> None:
            pass

        def schedule(self) -> object:
            return _Asked(asked, total_num_scheduled_tokens=7)

        def update_from_output(self, output: object, runner_output: object) -> None:
            pass

        def get_num_unfinished_requests(self) -> int:
            return 1

    module, name = plugin.BASES[async_scheduling]
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{name: Base}))
    monkeypatch.setenv(ENV, str(tmp_path / "beat"))
    config = _Asked(asked, scheduler_config=_Asked(asked, async_scheduling=async_scheduling))
    sched = plugin.scheduler(config, log_stats=True) if positional else plugin.scheduler(vllm_config=config)
    assert isinstance(sched, Base) and sched.init[0] is config
    assert {k for k, v in vars(type(sched)).items() if callable(v)} == {"__init__", *plugin.WRAPPED}
    sched.add_request(object())
    out = sched.schedule()
    sched.update_from_output(out, None)
    beat = read_heartbeat(tmp_path / "beat")
    assert isinstance(beat, StepBeat) and (beat.added, beat.done, beat.work) == (1, 1, 1)
    assert sorted(set(asked)) == sorted(
        {"scheduler_config", plugin.ASYNC_FIELD, *plugin.WRAPPED, plugin.HELD_COUNT, plugin.STEP_TOKENS}
    )
