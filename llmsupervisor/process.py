"""Engine processes: spawn isolated, watch for exit, signal, kill whole trees, find leftovers.

Every engine runs in its own session and process group (``setsid``), so its whole tree
(API server, EngineCore, workers, resource tracker) can be signalled as one. The daemon is a
child subreaper (``PR_SET_CHILD_SUBREAPER``): when vLLM's API server dies, its EngineCore and
workers are reparented to the daemon instead of PID 1 (docs/vllm-notes.md §6.4), so they can be killed
and reaped here.

Two ways to recognise an engine process of ours, because neither alone is enough:

* marker variables in its environment (``MARKER_*``): readable for the API server, but **not**
  for EngineCore and workers, whose ``setproctitle("VLLM::...")`` overwrites the memory that
  ``/proc/PID/environ`` shows (measured with vLLM's setproctitle: 1524 empty entries);
* the process group, recorded in ``STATE_DIR/engines/NAME/group.json`` with the leader's start
  time at every spawn. A group id cannot be reused while any member lives, and members started
  before the recorded leader are not ours, which rules out a recycled id.

We spawn with ``os.posix_spawnp`` rather than ``subprocess``/asyncio subprocesses: the daemon
owns every ``waitpid`` for its children (pidfds), which it needs anyway to reap adopted orphans,
and no ``preexec_fn`` runs in a process that has threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import ipaddress
import json
import logging
import os
import signal
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil

from llmsupervisor.files import read_bounded, remove_file, write_json_atomic

log = logging.getLogger(__name__)

MARKER_ENGINE: Final = "LLMSUPERVISOR_ENGINE"
MARKER_STATE_DIR: Final = "LLMSUPERVISOR_STATE_DIR"
MARKER_DAEMON_PID: Final = "LLMSUPERVISOR_DAEMON_PID"

# The daemon's own systemd plumbing; an engine that inherited these could mark the unit READY,
# feed its watchdog or steal its sockets (docs/host-notes.md §2.6).
STRIPPED_ENV: Final = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)

ENGINE_OOM_SCORE_ADJ: Final = 500  # the kernel should pick an engine, not the supervisor

PR_SET_CHILD_SUBREAPER: Final = 36


def become_subreaper() -> bool:
    """Make orphaned descendants reparent to this process. Returns False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


# A hard limit can be huge (systemd's default is 524288; some hosts say 1048576 or infinity); a
# daemon of a few engines needs thousands at most, so the soft limit stops here.
NOFILE_CEILING: Final = 1 << 20


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (at most ``NOFILE_CEILING``).

    The default soft limit is 1024: 1,100 idle connections to the control socket used to exhaust
    it, and then the /proc sweep and every HTTP probe failed (issue 17). Raising the soft limit
    up to the hard one needs no privilege. Engines inherit it, which vLLM would do anyway (it
    raises its own limit at start). Returns (soft before, soft after); never raises.
    """
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return -1, -1
    target = NOFILE_CEILING if hard == resource.RLIM_INFINITY else min(hard, NOFILE_CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """A decoded wait status: exactly one of ``code`` and ``signal`` is set."""

    code: int | None
    signal: int | None

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        if os.WIFSIGNALED(status):
            return cls(code=None, signal=os.WTERMSIG(status))
        return cls(code=os.WEXITSTATUS(status), signal=None)

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        return f"exited with code {self.code}"


def engine_environment(
    *,
    base: Mapping[str, str],
    engine: str,
    gpus: Iterable[int | str],
    state_dir: Path,
    cache_dir: Path,
    extra: Mapping[str, str],
    daemon_pid: int,
) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in STRIPPED_ENV}
    # The GPUs the engine is monitored and marked on: an engine's ``env:`` cannot move it.
    pinned = {
        # NVML numbers GPUs in PCI bus order; CUDA would otherwise use FASTEST_FIRST. GPUs named
        # by UUID (config `gpus`) go as UUIDs, which CUDA takes whatever its order.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
    }
    env.update(
        {
            **pinned,
            # The python -m entry points skip the CLI's spawn default; fork after CUDA init breaks.
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            # Persistent compile cache: a warm cache cut engine init from 66 s to 22 s
            # (docs/vllm-notes.md §1.2).
            "VLLM_CACHE_ROOT": str(cache_dir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    for key, value in pinned.items():
        if extra.get(key, value) != value:
            log.warning(
                "engine %s: env %s=%r ignored: the engine runs on its configured gpus (%s=%r), the ones"
                " the daemon monitors (docs/gpu.md)",
                engine,
                key,
                extra[key],
                key,
                value,
            )
        env[key] = value
    # Markers last, so an operator's env cannot hide an engine from the sweeps.
    env[MARKER_ENGINE] = engine
    env[MARKER_STATE_DIR] = str(state_dir)
    env[MARKER_DAEMON_PID] = str(daemon_pid)
    return env


class EngineProcess:
    """One incarnation of an engine: its API-server PID (the group leader) and output pipes."""

    def __init__(self, pid: int, stdout_fd: int, stderr_fd: int) -> None:
        self.pid = pid
        self.pgid = pid  # setsid: the leader's pid is the group id
        self.stdout_fd = stdout_fd
        self.stderr_fd = stderr_fd
        self.exit_status: ExitStatus | None = None
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfd: int | None = None
        self._poll_task: asyncio.Task[None] | None = None

    @property
    def returned(self) -> bool:
        return self.exit_status is not None

    async def wait(self) -> ExitStatus:
        return await asyncio.shield(self._exited)

    @property
    def exited(self) -> asyncio.Future[ExitStatus]:
        """Done when the process has exited, for ``aio.wait_any`` to watch without a task.
        Shared by every waiter: never to be cancelled (``wait`` is the cancellable form)."""
        return self._exited

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            self._poll_task = loop.create_task(self._poll())
            return
        loop.add_reader(self._pidfd, self._on_pidfd)

    def _on_pidfd(self) -> None:
        self._try_reap()

    async def _poll(self) -> None:
        # Only where pidfd_open is missing (Linux < 5.3): poll, there is no event to wait on.
        while not self._try_reap():  # noqa: ASYNC110
            await asyncio.sleep(0.1)

    def _try_reap(self) -> bool:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            # Reaped elsewhere (should not happen); report as unknown exit.
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return False
        self._finish(ExitStatus.from_wait_status(status))
        return True

    def _finish(self, status: ExitStatus) -> None:
        self.exit_status = status
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if not self._exited.done():
            self._exited.set_result(status)

    def signal_main(self, sig: int) -> None:
        """Signal the API server only: vLLM drains on SIGTERM to its main PID, while a group
        SIGTERM makes the workers exit and fails in-flight requests (vllm#32420)."""
        if self.returned:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        signal_group(self.pgid, sig)


@contextlib.contextmanager
def _this_thread_on(cpus: Sequence[int]) -> Iterator[None]:
    """Run the calling thread (only it: affinity is per thread) on ``cpus`` for the block.

    posix_spawn has no affinity attribute and we run no preexec_fn, but a child inherits the
    affinity of the thread that spawns it, across exec: so the engine is bound before its first
    instruction, and every process and thread it starts inherits the binding (no race with
    threads it might start before a later sched_setaffinity from outside)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def spawn(
    argv: list[str], env: Mapping[str, str], *, cpus: Sequence[int] = (), cwd_fallback: Path | None = None
) -> EngineProcess:
    """Start ``argv`` in a new session with stdout/stderr on pipes, bound to ``cpus`` (none: the
    daemon's own); raises OSError if exec (or the binding) fails."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        file_actions = [
            (os.POSIX_SPAWN_DUP2, devnull, 0),
            (os.POSIX_SPAWN_DUP2, out_w, 1),
            (os.POSIX_SPAWN_DUP2, err_w, 2),
        ]
        with _this_thread_on(cpus):
            pid = os.posix_spawnp(argv[0], argv, dict(env), file_actions=file_actions, setsid=True)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, devnull):
            os.close(fd)
    proc = EngineProcess(pid, out_r, err_r)
    proc._watch()
    try:
        Path(f"/proc/{pid}/oom_score_adj").write_text(str(ENGINE_OOM_SCORE_ADJ))
    except OSError as exc:
        log.debug("cannot raise oom_score_adj of pid %d: %s", pid, exc)
    return proc


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_pid(pid: int, sig: int) -> None:
    """``sig`` to one process; one that is gone (or no longer ours to signal) is skipped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def members_of(pgids: Iterable[int]) -> dict[int, list[int]]:
    """Every live PID (zombies included) of each process group in ``pgids``, in one walk of ``/proc``.

    A group's members can only be found by asking every process on the host for its group (one
    ``getpgid`` each), so a caller with several groups asks for all of them at once. Every group
    asked for has an entry, empty when nothing is left in it; PIDs ascend.
    """
    found: dict[int, list[int]] = {pgid: [] for pgid in pgids}
    if not found:
        return found
    for pid in psutil.pids():
        try:
            members = found.get(os.getpgid(pid))
        except OSError:  # gone mid-walk
            continue
        if members is not None:
            members.append(pid)
    return found


def group_members(pgid: int) -> list[int]:
    """Every live PID (zombies included) whose process group is ``pgid``."""
    return members_of((pgid,))[pgid]


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap_adopted(pids: Iterable[int], *, skip: int | None = None) -> None:
    """Reap zombies among ``pids`` that were reparented to us (we are their subreaper).

    Only the given PIDs: a blanket ``waitpid(-1)`` would steal the exit status of children that
    other code waits for. ``skip`` is the engine leader, whose pidfd watcher reaps it.
    """
    me = os.getpid()
    for pid in pids:
        if pid == skip:
            continue
        try:
            if psutil.Process(pid).ppid() != me:
                continue
            os.waitpid(pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue


def marker_processes(
    state_dir: Path,
    *,
    engine: str | None = None,
    exclude_daemon_pid: int | None = None,
    only_daemon_pid: int | None = None,
) -> list[int]:
    """PIDs whose environment says they belong to an engine of the supervisor using ``state_dir``.

    ``exclude_daemon_pid`` skips processes spawned by that daemon (the live one, at startup);
    ``only_daemon_pid`` keeps only those (the guard, after its daemon died).
    Processes whose environment we may not read are not ours to kill.
    """
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(MARKER_STATE_DIR) != str(state_dir):
            continue
        if engine is not None and env.get(MARKER_ENGINE) != engine:
            continue
        if exclude_daemon_pid is not None and env.get(MARKER_DAEMON_PID) == str(exclude_daemon_pid):
            continue
        if only_daemon_pid is not None and env.get(MARKER_DAEMON_PID) != str(only_daemon_pid):
            continue
        found.append(proc.pid)
    return found


def is_ours(pid: int, state_dir: Path) -> tuple[bool, str | None]:
    """(is this PID an engine process of ours, its engine name)."""
    try:
        env = psutil.Process(pid).environ()
    except (psutil.Error, OSError):
        return False, None
    if env.get(MARKER_STATE_DIR) == str(state_dir):
        return True, env.get(MARKER_ENGINE)
    return False, None


GROUP_FILE: Final = "group.json"


@dataclass(frozen=True, slots=True)
class RecordedGroup:
    engine: str
    pgid: int
    leader_create_time: float  # psutil create_time, seconds since the epoch
    daemon_pid: int


def group_path(state_dir: Path, engine: str) -> Path:
    return state_dir / "engines" / engine / GROUP_FILE


def group_record(pid: int, daemon_pid: int) -> dict[str, Any] | None:
    """What ``record_group`` writes for the group ``pid`` leads; None when it is already gone."""
    try:
        create_time = psutil.Process(pid).create_time()
    except psutil.Error:
        return None  # already gone: nothing to find later
    return {"pgid": pid, "leader_create_time": create_time, "daemon_pid": daemon_pid}


def record_group(state_dir: Path, engine: str, pid: int, daemon_pid: int) -> None:
    record = group_record(pid, daemon_pid)
    if record is not None:  # no link below the state dir followed (files.open_directory)
        write_json_atomic(group_path(state_dir, engine), record, indent=None, root=state_dir)


def forget_group(state_dir: Path, engine: str) -> None:
    """Remove the record (no fsync: a plain unlink, as before); one that cannot be removed (a
    link planted in the state dir) is logged, and a later record replaces it."""
    try:
        remove_file(group_path(state_dir, engine), root=state_dir, durable=False)
    except OSError as exc:
        log.warning("cannot remove %s: %s", group_path(state_dir, engine), exc.strerror or exc)


def recorded_groups(state_dir: Path) -> list[RecordedGroup]:
    """The groups recorded under ``engines/*/``: read bounded, without following a link and
    without waiting on a FIFO (files.read_bounded), so a planted file cannot hang the sweep."""
    groups: list[RecordedGroup] = []
    try:
        names = sorted(os.listdir(state_dir / "engines"))
    except OSError:
        return groups
    for name in names:
        try:
            data = json.loads(read_bounded(group_path(state_dir, name), root=state_dir))
            groups.append(
                RecordedGroup(
                    name,
                    int(data["pgid"]),
                    float(data["leader_create_time"]),
                    int(data["daemon_pid"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return groups


def recorded_group_members(group: RecordedGroup) -> list[int]:
    """Live members of a recorded group that are not older than its recorded leader."""
    members = []
    for pid in group_members(group.pgid):
        try:
            # create_time has jiffy resolution: allow a little slack.
            if psutil.Process(pid).create_time() >= group.leader_create_time - 0.05:
                members.append(pid)
        except psutil.Error:
            continue
    return members


def describe_pid(pid: int) -> str:
    try:
        cmd = psutil.Process(pid).cmdline()
    except psutil.Error:
        return "?"
    text = " ".join(cmd)
    return text if len(text) <= 200 else text[:197] + "..."


async def kill_trees(pids: Iterable[int], *, timeout_s: float) -> list[int]:
    """SIGKILL every PID's process group and the PID itself; wait until they are gone.

    Returns the PIDs still alive (non-zombie) at the deadline, which the caller reports.
    """
    pids = list(pids)
    groups = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    for pgid in groups:
        if pgid not in (os.getpgid(0), 0, 1):
            signal_group(pgid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return await wait_gone(pids, timeout_s=timeout_s)


async def wait_gone(pids: Iterable[int], *, timeout_s: float, poll_s: float = 0.1) -> list[int]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = list(pids)
    while True:
        reap_adopted(pending)
        pending = [p for p in pending if alive(p)]
        if not pending or loop.time() >= deadline:
            return pending
        await asyncio.sleep(poll_s)


def port_holders(port: int, host: str | None = None) -> list[int | None]:
    """PIDs listening on TCP ``port`` (None where the kernel hides the owner from us): with
    ``host``, only those whose listener a bind of ``host:port`` collides with.

    A collision is the kernel's rule: the same family and the same address, or a wildcard
    (``0.0.0.0``, ``::``) on either side; across families only an IPv6 wildcard that also
    takes IPv4 (not IPV6_V6ONLY), which no listing says, so a listener that may collide is
    confirmed with a bind of ``host:port`` (SO_REUSEADDR, never listening): the kernel's answer.
    Before issue 38 a listener on ``[::1]`` only held an engine bound to 127.0.0.1 until FATAL.
    Blocking (psutil reads every process's descriptors): call it in a thread."""
    holders: list[int | None] = []
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError) as exc:
        if getattr(exc, "errno", None) not in (None, errno.EACCES, errno.EPERM):
            raise
        return holders
    binds = _bind_addresses(host, port) if host is not None else None
    for conn in conns:
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.pid in holders:
            continue
        ip, listen_port = conn.laddr[0], conn.laddr[1]
        if listen_port != port:
            continue
        if binds is None or any(_collide(str(ip), bind) for bind in binds):
            holders.append(conn.pid)
    if holders and binds and _bind_is_free(binds, port):
        return []  # a wildcard that may have taken our family and has not (IPV6_V6ONLY)
    return holders


def _bind_addresses(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address] | None:
    """The addresses a bind of ``host`` takes (a name may resolve to several); None where it
    does not resolve (every listener on the port counts then, as before)."""
    try:
        return [_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return list(dict.fromkeys(_address(str(info[4][0])) for info in infos)) or None


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``text`` as an address; an IPv4-mapped IPv6 one (``::ffff:127.0.0.1``) as the IPv4 it is."""
    address = ipaddress.ip_address(text.split("%", 1)[0])  # a zone ("fe80::1%eth0") binds the same
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _collide(listener: str, bind: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    try:
        held = _address(listener)
    except ValueError:
        return True  # an address we cannot read: counted, as before
    if held.version == bind.version:
        return held == bind or held.is_unspecified or bind.is_unspecified
    v6 = held if held.version == 6 else bind
    return v6.is_unspecified  # "::" may take IPv4 too (confirmed by a bind: _bind_is_free)


def _bind_is_free(binds: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address], port: int) -> bool:
    """Whether every one of ``binds`` on ``port`` binds now (the sockets closed at once)."""
    for bind in binds:
        family = socket.AF_INET6 if bind.version == 6 else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((str(bind), port))
        except OSError:
            return False  # EADDRINUSE, or an address not ours: the listing stands
    return True


async def sweep_leftovers(state_dir: Path, *, timeout_s: float) -> None:
    """Kill the engine processes an earlier daemon on ``state_dir`` left behind: those with its
    markers, and the members of the process groups it recorded."""
    leftovers = marker_processes(state_dir, exclude_daemon_pid=os.getpid())
    for group in recorded_groups(state_dir):
        if group.daemon_pid != os.getpid():
            leftovers += [p for p in recorded_group_members(group) if p not in leftovers]
            forget_group(state_dir, group.engine)
    if not leftovers:
        return
    log.warning(
        "killing %d leftover engine process(es) of an earlier run: %s",
        len(leftovers),
        ", ".join(f"{pid} ({describe_pid(pid)[:60]})" for pid in leftovers),
    )
    alive = await kill_trees(leftovers, timeout_s=timeout_s)
    if alive:
        log.error("leftover processes survived SIGKILL: %s", alive)
