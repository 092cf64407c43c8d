"""Real process groups: what the sweep (probes/host.py) and ``process.members_of`` read of a
leader and its child (titles, memory, CPU, a zombie, a group that is gone), and what
``HostProcesses.signal_each`` (engine/processes.py) does to a living and a gone process. The
summaries over fixture trees are unit tests (tests/unit/probes/test_host_probe.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from llmsupervisor import process
from llmsupervisor.engine.processes import HostProcesses
from llmsupervisor.probes.host import ProcSample, list_groups_psutil, sweep_groups


def sweep(pgid: int) -> ProcSample:
    return sweep_groups([pgid])[pgid]


# The leader starts one child and sleeps without reaping it, so a killed child stays a zombie in
# the group. SIGUSR1 makes it kill and reap the child and exit, so the test leaves no zombie
# behind for init (which is slow to reap on some hosts). Both report on the shared stdout: the
# leader once its handler is in place and the child started, the child once its interpreter runs
# (before that, its command line can still be empty).
LEADER = (
    "import signal, subprocess, sys, time\n"
    "CHILD = 'import os, time; print(\"child\", os.getpid(), flush=True); time.sleep(60)'\n"
    "child = subprocess.Popen([sys.executable, '-c', CHILD])\n"
    "def stop(*_):\n"
    "    child.kill()\n"
    "    child.wait()\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGUSR1, stop)\n"
    "print('leader', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def group() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    leader = subprocess.Popen([sys.executable, "-c", LEADER], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert leader.stdout is not None
        said = {line.split()[0]: line.split()[1:] for line in (leader.stdout.readline() for _ in range(2))}
        assert set(said) == {b"leader", b"child"}, said
        yield leader, int(said[b"child"][0])
    finally:
        stop_leader(leader)
        if leader.stdout is not None:
            leader.stdout.close()


def stop_leader(leader: subprocess.Popen[bytes]) -> None:
    if leader.poll() is not None:
        return
    os.kill(leader.pid, signal.SIGUSR1)
    try:
        leader.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=5)


def test_real_process_group(group: tuple[subprocess.Popen[bytes], int]) -> None:
    leader = group[0].pid
    child = group[1]
    sample = sweep(leader)
    assert sample.pgid == leader
    assert sample.pids == {leader, child}
    assert sample.zombie_count == 0
    by_pid = {p.pid: p for p in sample.processes}
    assert "signal.signal(signal.SIGUSR1, stop)" in by_pid[leader].title
    assert by_pid[child].title.endswith("flush=True); time.sleep(60)"), by_pid[child]
    for proc in sample.processes:
        assert proc.rss_bytes is not None and proc.rss_bytes > 1_000_000
        assert proc.cpu_seconds is not None and proc.cpu_seconds >= 0
        assert proc.status in (psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING)
    assert sample.rss_bytes_total == sum(p.rss_bytes or 0 for p in sample.processes)
    # The leader's main thread is read too (the front rule's), and only the leader's.
    main_s = by_pid[leader].main_thread_cpu_seconds
    assert main_s is not None and 0 <= main_s <= (by_pid[leader].cpu_seconds or 0) + 0.02
    assert by_pid[child].main_thread_cpu_seconds is None
    assert os.getpid() not in {r.pid for r in list_groups_psutil([leader])[leader]}

    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while sweep(leader).zombie_count == 0:  # the leader never reaps it
        assert time.monotonic() < deadline, "the killed child never showed as a zombie"
        time.sleep(0.01)
    after = sweep(leader)
    assert after.process_count == 2
    zombie = next(p for p in after.processes if p.pid == child)
    assert zombie.zombie and zombie.status == psutil.STATUS_ZOMBIE
    assert zombie.title.startswith("[")  # a zombie has no command line left


def test_a_group_that_is_gone_is_empty(group: tuple[subprocess.Popen[bytes], int]) -> None:
    leader = group[0]
    assert sweep(leader.pid).process_count == 2
    stop_leader(leader)  # the child is reaped before the leader exits
    assert sweep(leader.pid).processes == ()


def test_real_groups_in_one_pass(group: tuple[subprocess.Popen[bytes], int]) -> None:
    leader = group[0].pid
    samples = sweep_groups([leader, os.getpgid(0)])
    assert samples[leader].pids == {leader, group[1]}
    assert os.getpid() in samples[os.getpgid(0)].pids


def test_members_of_many_groups_in_one_walk(group: tuple[subprocess.Popen[bytes], int]) -> None:
    leader, child = group[0].pid, group[1]
    ours = os.getpgid(0)
    members = process.members_of([leader, ours])
    assert members[leader] == sorted([leader, child])
    assert os.getpid() in members[ours] and leader not in members[ours]
    assert process.group_members(leader) == members[leader]
    assert process.members_of([]) == {}
    stop_leader(group[0])
    assert process.members_of([leader]) == {leader: []}  # every group asked for has an entry


def test_signal_each_stops_the_living_and_skips_the_gone(tmp_path: Path) -> None:
    """The freeze before an engine's stacks (engine/evidence.py): SIGSTOP to each member."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        HostProcesses(tmp_path).signal_each([gone.pid, sleeper.pid], signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while "State:\tT" not in Path(f"/proc/{sleeper.pid}/status").read_text():
            assert time.monotonic() < deadline, "never stopped"
            time.sleep(0.01)
    finally:
        sleeper.kill()  # SIGKILL ends a stopped process too
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
