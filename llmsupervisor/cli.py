"""Command line: ``llm-supervisor [run]``, ``check-config``, ``doctor``, and the control commands
(``status``, ``restart``, ``drain``, ``stop``, ``start``, ``reload``) that talk to a running
daemon over its control socket. No supervision logic here."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from llmsupervisor import __version__, control, logs
from llmsupervisor.config import DEFAULT_CONFIG_PATH, SupervisorSettings, load_config, state_dir_named_in
from llmsupervisor.daemon import lock
from llmsupervisor.errors import EX_ALREADY_RUNNING, EX_CONFIG, AlreadyRunning, ConfigError

SYSTEMD_SOCKET = Path("/run/llm-supervisor/control.sock")
EX_UNAVAILABLE = 69  # the daemon is not running or refused


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-supervisor", description="Launch and supervise vLLM engines, one per GPU (or GPU group)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG_PATH,
        help=f"config file (default {DEFAULT_CONFIG_PATH})",
    )
    sub = parser.add_subparsers(dest="command")
    run_parser = sub.add_parser("run", help="run the daemon in the foreground (the default)")
    run_parser.add_argument(
        "--fake-gpu",
        type=Path,
        metavar="FILE",
        help="testing aid: read GPU telemetry and XID events from a JSON file instead of NVML",
    )
    check = sub.add_parser("check-config", help="validate a config file; exit 78 with one line per problem")
    check.add_argument("path", nargs="?", type=Path, help="config file (default: --config)")
    parser.add_argument("--socket", type=Path, help="control socket (default: found from --config)")
    status = sub.add_parser("status", help="engines, states, ports, restarts")
    status.add_argument("--json", action="store_true", help="machine-readable")
    for name, text in (
        ("restart", "drain the engine, then restart it"),
        ("drain", "take the engine out of rotation and let in-flight requests finish"),
        ("stop", "drain and stop the engine; it stays stopped"),
        ("start", "start a stopped, FATAL or drained engine"),
    ):
        sub.add_parser(name, help=text).add_argument("engine")
    sub.add_parser("reload", help="re-read the config; restart only engines whose spec changed")
    doctor = sub.add_parser(
        "doctor", help="check this machine before the first start: one line per check, exit 1 on any FAIL"
    )
    # Also accepted after the subcommand (`llm-supervisor doctor --config PATH`).
    doctor.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="config file")
    return parser


def _socket_candidates(args: argparse.Namespace) -> list[Path]:
    if args.socket:
        return [args.socket]
    state_dir = state_dir_named_in(Path(args.config)) or SupervisorSettings().state_dir
    return [SYSTEMD_SOCKET, control.default_socket_path(state_dir.resolve())]


def control_command(args: argparse.Namespace) -> int:
    candidates = _socket_candidates(args)
    path = next((p for p in candidates if p.exists()), candidates[-1])
    payload: dict[str, Any] = {"command": args.command}
    if getattr(args, "engine", None):
        payload["engine"] = args.engine
    try:
        reply = control.request(path, payload)
    except control.ControlError as exc:
        print(f"llm-supervisor: {exc}", file=sys.stderr)
        return EX_UNAVAILABLE
    if not reply.get("ok"):
        print(f"llm-supervisor: {reply.get('error')}", file=sys.stderr)
        return 1
    result: Any = reply.get("result")
    if args.command == "status" and not args.json:
        print(format_status(result))
    elif args.command == "reload" and isinstance(result, dict) and not result.get("reloaded"):
        for problem in result.get("problems", []):
            print(problem, file=sys.stderr)
        print("llm-supervisor: reload rejected; the daemon keeps its previous config", file=sys.stderr)
        return EX_CONFIG
    else:
        print(json.dumps(result, indent=2))
    return 0


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _gpu_reading(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def format_status(status: dict[str, Any]) -> str:
    """One row per engine; the last column (findings, else the state's reason) is not padded."""
    header = (
        "ENGINE",
        "STATE",
        "GPU",
        "PORT",
        "FOR",
        "RESTARTS",
        "ROTATION",
        "STEP",
        "TEMP",
        "POWER",
        "FINDINGS / REASON",
    )
    rows = [header]
    for name, e in status.get("engines", {}).items():
        steps = e.get("batch_steps") or 0
        findings = ", ".join(f"{f['kind']} ({f['severity']})" for f in e.get("findings", []))
        rows.append(
            (
                name,
                e["state"].upper(),
                ",".join(str(g) for g in e["gpus"]) or "-",
                str(e["port"]),
                _age(e["for_s"]),
                str(e["restarts"]),
                "in" if e.get("in_rotation") else "out",
                f"{e.get('batch_step', 0)}/{steps}" if steps else "-",
                _gpu_reading(e.get("gpu_temperature_c"), "C"),
                _gpu_reading(e.get("gpu_power_w"), "W"),
                (findings or e.get("reason") or "")[:80],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    marked = status.get("gpu_faults_marked") or {}
    if marked:
        lines.append("GPUs marked for faults: " + ", ".join(f"GPU {g}: {n}" for g, n in marked.items()))
    return "\n".join(lines)


def check_config(path: Path) -> int:
    try:
        config = load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EX_CONFIG
    print(f"{path}: OK, {len(config.engines)} engine(s): {', '.join(e.name for e in config.engines)}")
    return 0


def run(path: Path, fake_gpu: Path | None = None) -> int:
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
    # One daemon per state dir, decided before anything touches it: a second one would kill the
    # running daemon's engines as leftovers and take over (then remove) its control socket.
    state_dir = config.supervisor.state_dir.resolve()
    try:
        held = lock.acquire(state_dir)
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
        log.critical("%s; not starting", exc.strerror)
        return 1
    with held:
        from llmsupervisor.daemon.supervisor import Supervisor

        reader = None
        if fake_gpu is not None:
            from llmsupervisor.probes.fake_gpu import FileGpu

            log.warning("GPU telemetry from %s (--fake-gpu), not NVML", fake_gpu)
            reader = FileGpu(fake_gpu)

        async def supervise() -> int:
            # Built inside the loop: the daemon's clock is the loop's (llmsupervisor/aio.py).
            return await Supervisor(config, gpus_of=gpus_of, gpu_reader=reader).run()

        return asyncio.run(supervise())


def doctor(path: Path) -> int:
    from llmsupervisor import doctor

    results = doctor.run_checks(path)
    for result in results:
        print(result)
    return 1 if doctor.failed(results) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        return doctor(args.config)
    if args.command == "check-config":
        return check_config(args.path or args.config)
    if args.command in control.COMMANDS:
        return control_command(args)
    return run(args.config, getattr(args, "fake_gpu", None))


if __name__ == "__main__":
    raise SystemExit(main())
