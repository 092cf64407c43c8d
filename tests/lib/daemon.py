"""The real daemon (``python -m llmsupervisor``) as a subprocess against a config, and what
tests need around it: fake-vLLM engine entries, the ``--fake-gpu`` file, /metrics samples.

The daemon writes ``STATE_DIR/status.json`` on every state change; tests poll it with
deadlines (never fixed sleeps) and read the daemon's log file for the reasons.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

import httpx
import psutil
import yaml

from llmsupervisor import process
from tests.lib.paths import LIB, REPO

FAKE_VLLM = LIB / "fake_vllm.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


alive = process.alive


def stop_helpers(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """End the helper servers a test started (HAProxy, Prometheus...): SIGTERM each, 10 s to
    exit, then SIGKILL."""
    for proc in procs:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Daemon:
    """The real daemon (``python -m llmsupervisor``) in its own session, logging to a file."""

    # Every daemon started: a failing test's report carries the logs' tails of those running or
    # cleaned up during it (tests/conftest.py), so that a CI failure says what the daemon saw.
    started: ClassVar[list[Daemon]] = []

    def __init__(
        self, tmp_path: Path, config: dict[str, Any], *, name: str = "daemon", run_args: tuple[str, ...] = ()
    ) -> None:
        self.run_args = run_args  # after `run`, e.g. ("--fake-gpu", PATH)
        self.dir = tmp_path
        self.state_dir = tmp_path / "state"
        config.setdefault("supervisor", {}).setdefault("state_dir", str(self.state_dir))
        config["supervisor"].setdefault("tick_interval_s", 0.3)
        config["supervisor"].setdefault("http_listen", f"127.0.0.1:{free_port()}")
        self.http_url = "http://" + config["supervisor"]["http_listen"]
        self.config_path = tmp_path / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = tmp_path / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cleaned_at: float | None = None  # when cleanup() ran (None: not yet)
        self.cwd: Path | None = None  # the directory the daemon is started in (None: this process's)

    def start(self, extra_env: dict[str, str] | None = None) -> Daemon:
        """Start the daemon, in ``self.cwd`` when set (as an operator elsewhere would; the package
        is still this repository's)."""
        cwd = self.cwd
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSUPERVISOR_")}
        # Tests read the text log; "auto" would pick JSON on a CI runner that is itself a pod.
        env["LLMSUP_LOG_FORMAT"] = "text"
        if cwd is not None:
            env["PYTHONPATH"] = _with_repo(env.get("PYTHONPATH"))
        env.update(extra_env or {})
        if self not in Daemon.started:
            Daemon.started.append(self)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "llmsupervisor",
                    "--config",
                    str(self.config_path),
                    *(("run", *self.run_args) if self.run_args else ()),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=cwd,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.state_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}
        if data.get("pid") != self.pid:
            return {}  # a status file of an earlier daemon on this state dir
        return data

    def engine(self, name: str) -> dict[str, Any]:
        engine: dict[str, Any] = self.status().get("engines", {}).get(name, {})
        return engine

    def wait_state(self, name: str, state: str, *, timeout_s: float = 30.0, **match: Any) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            engine = self.engine(name)
            if engine.get("state") == state and all(engine.get(k) == v for k, v in match.items()):
                return engine
            return None

        try:
            result: dict[str, Any] = wait_for(check, timeout_s=timeout_s, what=f"{name} {state} {match}")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\nstatus: {self.engine(name)}\nlog tail:\n{self.log()[-4000:]}"
            ) from None
        return result

    def wait_reason(self, name: str, text: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """The engine's status once its reason says ``text`` (a state may keep one reason)."""
        found: dict[str, Any] = wait_for(
            lambda: e if text in (e := self.engine(name)).get("reason", "") else None,
            timeout_s=timeout_s,
            what=f"{name}'s reason to say {text!r}",
        )
        return found

    def wait_log(self, text: str, *, timeout_s: float = 30.0, after: int = 0) -> None:
        """Wait for ``text`` in the log, past its first ``after`` characters (``len(d.log())``
        taken before the cause: a daemon shared by a module's tests logged earlier ones)."""
        wait_for(lambda: text in self.log()[after:], timeout_s=timeout_s, what=f"log line {text!r}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def wait_exit(self, *, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon did not exit within {timeout_s} s:\n{self.log()[-4000:]}") from None

    def stop(self) -> int:
        self.signal(signal.SIGTERM)
        return self.wait_exit()

    def cli(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """``llm-supervisor ARGS --config PATH`` against this daemon, as the operator runs it."""
        return cli(self, *args, timeout_s=timeout_s)

    def cli_ok(self, *args: str) -> str:
        """A CLI command against this daemon that must succeed (exit 0); its output."""
        done = cli(self, *args)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def spawned_sessions(self) -> set[int]:
        """Every engine leader this daemon spawned (its pid is the session id of the engine's tree)."""
        return {int(pid) for pid in re.findall(r"spawned pid (\d+)", self.log())}

    def engine_processes(self) -> list[int]:
        """Live engine processes (not zombies): those carrying this daemon's state-dir marker, and
        every process in the session of an engine it spawned (vLLM's EngineCore and workers rename
        themselves with setproctitle, which hides their environment)."""
        sessions = self.spawned_sessions()
        found = set(process.marker_processes(self.state_dir.resolve()))
        for pid in psutil.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getsid(pid) in sessions:
                    found.add(pid)
        return sorted(p for p in found if alive(p))

    def tail(self, lines: int = 80) -> str:
        """The last ``lines`` lines of the daemon's log, for a failing test's report."""
        try:
            return "\n".join(self.log().splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def cleanup(self) -> None:
        self.cleaned_at = time.time()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.engine_processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def fake_engine(name: str, port: int, **fields: Any) -> dict[str, Any]:
    """A fake-vLLM engine entry; ``fake_*`` keyword args become ``--fake-*`` flags."""
    args = {k.replace("_", "-"): v for k, v in fields.pop("args", {}).items()}
    for key in [k for k in fields if k.startswith("fake_")]:
        args[key.replace("_", "-")] = fields.pop(key)
    entry: dict[str, Any] = {
        "name": name,
        "model": "tiny",
        "port": port,
        "command": [sys.executable, str(FAKE_VLLM)],
        "args": args,
        "backoff_initial_s": 0.2,
        "backoff_max_s": 1.0,
        "stop_timeout_s": 5,
        "group_term_timeout_s": 2,
        "drain_grace_s": 0.2,
        "start_timeout_s": 20,
        "canary_timeout_s": 5,
    }
    entry.update(fields)
    return entry


# Fast detector settings for tests that make a cause happen through the real daemon.
FAST_DETECTORS = {
    "hang_idle_after_s": 2,
    "sustain_s": {"kv_pressure": 0.5, "thermal": 0.5, "preemption_storm": 0.5},
    "clear_s": {"kv_pressure": 0.5, "thermal": 0.5},
}


def write_gpu(path: Path, *, events: list[dict[str, Any]] | None = None, **gpu0: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": [{"index": 0, **gpu0}], "events": events or []}))
    tmp.replace(path)


def metric(url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            series, value = line.rsplit(" ", 1)
            got = ",".join(sorted(series[len(name) + 1 : -1].split(",")))
            if got == want:
                return float(value)
    return None


def _with_repo(pythonpath: str | None) -> str:
    """PYTHONPATH with this repository first: ``python -m llmsupervisor`` run elsewhere than the
    repository root imports this repository's package all the same."""
    return os.pathsep.join(p for p in (str(REPO), pythonpath) if p)


def cli(
    d: Daemon | None,
    *args: str,
    config: Path | None = None,
    timeout_s: float = 60,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`llm-supervisor ARGS --config PATH` as the operator runs it (a subprocess), captured; in
    ``cwd`` when given (``config`` may then be relative to it)."""
    path = config if config is not None else d.config_path if d is not None else Path("/nonexistent.yaml")
    env = {**os.environ, "PYTHONPATH": _with_repo(os.environ.get("PYTHONPATH"))} if cwd is not None else None
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "llmsupervisor",
            *args,
            "--config",
            str(path),
        ],  # --config after the subcommand
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s,
        cwd=cwd,
        env=env,
    )
