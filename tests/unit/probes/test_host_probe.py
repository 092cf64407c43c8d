"""Process-group sweep: the pure summary over fixtures, the sweeper's sharing and timeouts, and a
child's main-thread CPU. The sweep over a real process group is a system test
(tests/system/test_process_groups.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Collection

import pytest

from llmsupervisor.probes import ProbeFailure
from llmsupervisor.probes.host import (
    GroupSweeper,
    ListGroups,
    ProcSample,
    RawProcess,
    main_thread_cpu_s,
    summarize,
    sweep_groups,
)

GiB = 1024**3


def raw(
    pid: int, pgid: int, cmdline: tuple[str, ...] | None, rss: int | None, status: str = "sleeping"
) -> RawProcess:
    return RawProcess(
        pid=pid,
        pgid=pgid,
        name=cmdline[0].rsplit("/", 1)[-1] if cmdline else "VLLM::Worker",
        cmdline=cmdline,
        rss_bytes=rss,
        cpu_user_s=None if rss is None else 10.0,
        cpu_system_s=None if rss is None else 1.5,
        status=status,
    )


# A vLLM CPU engine as docs/vllm-notes.md §2 draws it, a zombie Worker, and a process of another group.
VLLM_TREE = [
    raw(
        500,
        500,
        ("/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"),
        640_000_000,
    ),
    raw(
        510,
        500,
        ("/opt/venv/bin/python", "-B", "-c", "from multiprocessing.resource_tracker import main;main(32)"),
        20_000_000,
    ),
    raw(520, 500, ("VLLM::EngineCore",), 600_000_000, status="running"),
    raw(530, 500, (), None, status="zombie"),
    raw(900, 900, ("/usr/bin/other",), GiB),
]


def test_summary_of_a_fixture_tree() -> None:
    sample = summarize(500, reversed(VLLM_TREE))
    assert [p.pid for p in sample.processes] == [500, 510, 520, 530]
    assert sample.processes[2].title == "VLLM::EngineCore"
    assert sample.processes[0].title.endswith("api_server --port 8000")
    zombie = sample.processes[3]
    assert (zombie.title, zombie.zombie, zombie.rss_bytes, zombie.cpu_seconds) == (
        "[VLLM::Worker]",
        True,
        None,
        None,
    )
    assert sample.processes[0].cpu_seconds == 11.5
    assert sample.rss_bytes_total == 1_260_000_000
    assert sample.cpu_seconds_total == pytest.approx(34.5)
    assert (sample.process_count, sample.zombie_count) == (4, 1)
    assert sample.pids == {500, 510, 520, 530}


def test_summary_of_an_empty_group() -> None:
    assert summarize(42, VLLM_TREE) == ProcSample(
        pgid=42, processes=(), rss_bytes_total=0, cpu_seconds_total=0.0, process_count=0, zombie_count=0
    )


def test_sweep_takes_an_injected_lister() -> None:
    asked: list[frozenset[int]] = []

    def lister(pgids: Collection[int]) -> dict[int, list[RawProcess]]:
        asked.append(frozenset(pgids))
        return {500: VLLM_TREE}  # nothing listed for 42

    samples = sweep_groups([500, 42], list_groups=lister)
    assert (samples[500].process_count, samples[42].process_count) == (4, 0)
    assert asked == [frozenset({500, 42})]


class SweepClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def monotonic(self) -> float:
        return self.now_s


def counting_lister(calls: list[frozenset[int]], release: threading.Event | None = None) -> ListGroups:
    def lister(pgids: Collection[int]) -> dict[int, list[RawProcess]]:
        calls.append(frozenset(pgids))
        if release is not None:
            release.wait(5)
        return {g: [r for r in VLLM_TREE if r.pgid == g] for g in pgids}

    return lister


def test_engines_share_one_sweep_per_max_age() -> None:
    calls: list[frozenset[int]] = []
    clock = SweepClock()
    sweeper = GroupSweeper(max_age_s=2.0, monotonic=clock.monotonic, list_groups=counting_lister(calls))

    async def scenario() -> None:
        # Stamped with the sweeper's clock when the sweep started: detectors difference sweeps.
        assert (await sweeper.sample(500, timeout_s=5)) == summarize(500, VLLM_TREE, at_s=clock.now_s)
        # The next engine asks for a group the first sweep did not cover: a new sweep, over both.
        assert isinstance(await sweeper.sample(900, timeout_s=5), ProcSample)
        clock.now_s += 1.0
        assert (await sweeper.sample(500, timeout_s=5)).process_count == 4  # type: ignore[union-attr]
        assert (await sweeper.sample(900, timeout_s=5)).process_count == 1  # type: ignore[union-attr]
        clock.now_s += 1.0  # the shared sweep is a tick old: the next look sweeps again
        assert (await sweeper.sample(900, timeout_s=5)).process_count == 1  # type: ignore[union-attr]

    asyncio.run(scenario())
    assert calls == [frozenset({500}), frozenset({500, 900}), frozenset({500, 900})]


def test_groups_nobody_asks_for_are_forgotten() -> None:
    calls: list[frozenset[int]] = []
    clock = SweepClock()
    sweeper = GroupSweeper(
        max_age_s=0.0, forget_after_s=10.0, monotonic=clock.monotonic, list_groups=counting_lister(calls)
    )

    async def scenario() -> None:
        await sweeper.sample(500, timeout_s=5)
        clock.now_s += 11.0
        await sweeper.sample(900, timeout_s=5)

    asyncio.run(scenario())
    assert calls == [frozenset({500}), frozenset({900})]


def test_a_stuck_sweep_times_out_each_asker_without_starting_another() -> None:
    calls: list[frozenset[int]] = []
    release = threading.Event()
    clock = SweepClock()
    sweeper = GroupSweeper(
        max_age_s=0.0, monotonic=clock.monotonic, list_groups=counting_lister(calls, release)
    )

    async def scenario() -> None:
        first = await sweeper.sample(500, timeout_s=0.05)
        assert isinstance(first, ProbeFailure) and first.kind == "timeout"
        clock.now_s += 5.0
        second = await sweeper.sample(500, timeout_s=0.05)  # the same sweep, still in flight
        assert isinstance(second, ProbeFailure) and second.kind == "timeout"
        release.set()
        await asyncio.sleep(0.1)
        assert isinstance(await sweeper.sample(500, timeout_s=5), ProcSample)

    asyncio.run(scenario())
    assert calls == [frozenset({500}), frozenset({500})]


def test_the_main_thread_s_cpu_leaves_out_the_other_threads() -> None:
    # A thread that burns 0.3 s counts in the process's CPU, not in its main thread's: the API
    # server's ZMQ threads go on while its loop is held (detectors/hang/front.py).
    code = (
        "import os, threading, time\n"
        "from llmsupervisor.probes.host import main_thread_cpu_s\n"
        "def burn():\n"
        "    end = time.thread_time() + 0.3\n"
        "    while time.thread_time() < end: pass\n"
        "t = threading.Thread(target=burn); t.start(); t.join()\n"
        "print(main_thread_cpu_s(os.getpid()), sum(os.times()[:2]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    main_s, process_s = (float(x) for x in out.stdout.split())
    assert process_s - main_s >= 0.25
    assert main_thread_cpu_s(2**22 + 12345) is None  # no such process
