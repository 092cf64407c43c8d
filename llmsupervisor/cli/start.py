"""The daemon's start (``llm-supervisor [run]``): the config loaded (exit 78 on any problem), the
daemon moved to the config file's directory (the one rule for relative paths, docs/configuration.md),
the state dir's lock taken (exit 75 when another daemon holds it), then the supervisor until it
exits. No supervision logic here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import sys
from pathlib import Path

from llmsupervisor import __version__, logs
from llmsupervisor.config import SupervisorConfig, load_config
from llmsupervisor.config.checks import hub_offline_problem
from llmsupervisor.daemon import lock
from llmsupervisor.daemon import state_dir as state_dir_check
from llmsupervisor.errors import EX_ALREADY_RUNNING, EX_CONFIG, AlreadyRunning, ConfigError, UnsafeStateDir


def run(path: Path, fake_gpu: Path | None = None) -> int:
    """The daemon over the config at ``path`` (absolute: the daemon moves to its directory), until
    it exits; its exit status. Called in-process by tests, it returns to the directory it was
    called in."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        logs.setup("info")
        for problem in exc.problems:
            logging.getLogger("llmsupervisor").error("%s", problem)
        logging.getLogger("llmsupervisor").critical("invalid config, not starting (exit %d)", EX_CONFIG)
        return EX_CONFIG
    # GPU= on each engine's journal entries (kept in step with reloads by the supervisor).
    gpus_of = {e.name: ",".join(str(g) for g in e.gpus) for e in config.engines}
    logs.setup(config.supervisor.log_level, gpus_of=gpus_of)
    log = logging.getLogger("llmsupervisor")
    # One rule for relative paths (docs/configuration.md): the loader resolved the file's own
    # next to it, and the daemon works there, so what an engine resolves itself (its command's
    # arguments, args, env) is next to the file too, whoever started the daemon from wherever.
    workdir = config.path.parent
    log.info(
        "llm-supervisor %s (Python %s, pid %d): config %s; engines start in %s",
        __version__,
        platform.python_version(),
        os.getpid(),
        config.path,
        workdir,
    )
    try:
        previous: int | None = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        previous = None  # a working directory removed under us: nothing to go back to
    try:
        try:
            os.chdir(workdir)
        except OSError as exc:
            log.critical("cannot work in %s, the config file's directory: %s; not starting", workdir, exc)
            return 1
        return _supervise(config, gpus_of, fake_gpu)
    finally:
        if previous is not None:  # back where it was called (the tests call it in-process)
            with contextlib.suppress(OSError):
                os.fchdir(previous)
            os.close(previous)


def _supervise(config: SupervisorConfig, gpus_of: dict[str, str], fake_gpu: Path | None) -> int:
    """The daemon over a loaded config, in the config file's directory: the state dir's lock,
    then the supervisor until it exits."""
    log = logging.getLogger("llmsupervisor")
    for warning in config.warnings:
        log.warning("config: %s", warning)
    # One daemon per state dir, decided before anything touches it: a second one would kill the
    # running daemon's engines as leftovers and take over (then remove) its control socket.
    state_dir = config.supervisor.state_dir.resolve()
    try:
        # Whom the state dir lets in, before anything is written there (daemon/state_dir.py).
        for unsafe in state_dir_check.prepare(state_dir):
            log.warning("%s", unsafe)
        held = lock.acquire(state_dir)
    except UnsafeStateDir as exc:
        message = f"{exc}; not starting (exit {EX_CONFIG})"
        print(f"llm-supervisor: {message}", file=sys.stderr)
        log.critical("%s", message)
        return EX_CONFIG
    except AlreadyRunning as exc:
        who = f"pid {exc.pid}" if exc.pid is not None else "pid unknown"
        message = (
            f"another daemon ({who}) is running on state dir {state_dir};"
            f" not starting (exit {EX_ALREADY_RUNNING})"
        )
        print(f"llm-supervisor: {message}", file=sys.stderr)
        log.critical("%s", message)
        return EX_ALREADY_RUNNING
    except OSError as exc:
        log.critical("%s; not starting", exc.strerror if exc.filename is None else exc)
        return 1
    if held.pid_unwritten is not None:
        # A full disk must not keep the engines down (issue 38): the lock holds, the file is empty.
        log.warning(
            "%s: cannot write this daemon's pid (%s); the lock is held all the same",
            held.path,
            held.pid_unwritten.strerror or held.pid_unwritten,
        )
    with held:
        from llmsupervisor.daemon.supervisor import Supervisor

        for spec in config.engines:
            # check-config and doctor refuse this; the daemon runs the other engines and lets
            # this one fail into FATAL, which is visible in status and the metrics.
            offline = hub_offline_problem(spec, os.environ) if spec.enabled else None
            if offline is not None:
                log.warning("engine %s will not load: %s", spec.name, offline)

        reader = None
        if fake_gpu is not None:
            from llmsupervisor.probes.fake_nvml import FileNvml
            from llmsupervisor.probes.nvml import NvmlReader

            # The real reader over a pynvml-level fake: only the binding is faked.
            log.warning("GPU telemetry from %s (--fake-gpu), not NVML", fake_gpu)
            fake = FileNvml(fake_gpu)
            reader = NvmlReader(fake, pids_visible=fake.pids_visible)

        async def supervise() -> int:
            # Built inside the loop: the daemon's clock is the loop's (llmsupervisor/aio.py).
            return await Supervisor(config, gpus_of=gpus_of, gpu_reader=reader).run()

        return asyncio.run(supervise())
