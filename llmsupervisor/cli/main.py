"""Command line: ``llm-supervisor [run]``, ``check-config``, ``doctor``, and the control commands
(``status``, ``restart``, ``drain``, ``stop``, ``start``, ``reload``, ``events``, ``logs``,
``describe``, ``wait``, ``gpu release|take-back``) that talk to a
running daemon over its control socket (cli/control.py; what they print: cli/render.py; the
reference with exit codes: docs/cli.md). No supervision logic here."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TextIO

from llmsupervisor import __version__, control, logs
from llmsupervisor.cli import control as cli_control
from llmsupervisor.cli import engine_view, fleet, render
from llmsupervisor.cli.client import EX_INTERRUPTED, Client
from llmsupervisor.cli.client import EX_UNAVAILABLE as EX_UNAVAILABLE  # the daemon is not reachable
from llmsupervisor.cli.start import run
from llmsupervisor.config import DEFAULT_CONFIG_PATH, SupervisorSettings, load_config, state_dir_named_in
from llmsupervisor.errors import EX_CONFIG, ConfigError

SYSTEMD_SOCKET = Path("/run/llm-supervisor/control.sock")
ENGINE_COMMANDS = (
    ("restart", "drain the engine, then restart it"),
    ("drain", "take the engine out of rotation and let in-flight requests finish"),
    ("stop", "drain and stop the engine; it stays stopped"),
    ("start", "start a stopped, FATAL or drained engine"),
)


def _common(parser: argparse.ArgumentParser, *, top: bool, socket: bool = True) -> None:
    """--config and --socket, before or after the subcommand. After it they default to
    SUPPRESS, so that one given before the subcommand is not overwritten."""
    default: Any = DEFAULT_CONFIG_PATH if top else argparse.SUPPRESS
    parser.add_argument(
        "--config", type=Path, default=default, help=f"config file (default {DEFAULT_CONFIG_PATH})"
    )
    if socket:
        parser.add_argument(
            "--socket",
            type=Path,
            default=None if top else argparse.SUPPRESS,
            help="control socket (default: found from --config)",
        )


def _waits(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help="the daemon's reply as JSON, for scripts")
    parser.add_argument(
        "--wait",
        action="store_true",
        help=f"block until {what}, with a live progress line; exit 0 reached, 1 failed",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="with --wait: give up waiting after this long (exit 1)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-supervisor", description="Launch and supervise vLLM engines, one per GPU (or GPU group)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command")
    run_parser = sub.add_parser("run", help="run the daemon in the foreground (the default)")
    run_parser.add_argument(
        "--fake-gpu",
        type=Path,
        metavar="FILE",
        help="testing aid: read GPU telemetry and XID events from a JSON file instead of NVML",
    )
    run_parser.add_argument(
        "--log-format",
        choices=logs.LOG_FORMATS,
        help="auto (journald, JSON lines in a Kubernetes pod, else text), json or text"
        f" (default: ${logs.LOG_FORMAT_ENV}, else auto)",
    )
    _common(run_parser, top=False, socket=False)
    check = sub.add_parser("check-config", help="validate a config file; exit 78 with one line per problem")
    check.add_argument("path", nargs="?", type=Path, help="config file (default: --config)")
    _common(check, top=False, socket=False)
    status = sub.add_parser("status", help="engines, states, restarts; exit 1 if one is down, unasked")
    status.add_argument("names", nargs="*", metavar="NAME", help="only these engines (default: all)")
    status.add_argument("--json", action="store_true", help="machine-readable")
    status.add_argument(
        "-o",
        "--output",
        choices=("wide", "json"),
        help="wide: every column, not fitted to the terminal; json: as --json",
    )
    status.add_argument("--watch", action="store_true", help="redraw in place until Ctrl-C")
    status.add_argument(
        "--interval", type=float, default=2.0, metavar="SECONDS", help="with --watch (default 2)"
    )
    status.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="URL",
        help="a daemon's HTTP listener (e.g. http://gpu-host-01:9400); repeatable: one table for all",
    )
    status.add_argument(
        "--hosts-file", metavar="FILE", help="daemon URLs, one a line (# comments), as --host"
    )
    status.add_argument(
        "--deadline",
        type=float,
        default=fleet.FLEET_DEADLINE_S,
        metavar="SECONDS",
        help=f"with --host: how long each host may take (default {fleet.FLEET_DEADLINE_S:g})",
    )
    _common(status, top=False)
    targets = {"restart": "READY again", "drain": "drained", "stop": "STOPPED", "start": "READY"}
    for name, text in ENGINE_COMMANDS:
        engine_parser = sub.add_parser(name, help=text)
        engine_parser.add_argument(
            "engines",
            nargs="*",
            metavar="NAME",
            help="one or more engines"
            + (" (several: one at a time, each READY before the next)" if name == "restart" else ""),
        )
        engine_parser.add_argument(
            "--all",
            action="store_true",
            help="every engine meant to serve (enabled, or started by hand)"
            + (" that is not stopped" if name == "restart" else ""),
        )
        _waits(engine_parser, f"the engine is {targets[name]}")
        _common(engine_parser, top=False)
    wait_parser = sub.add_parser(
        "wait", help="wait, doing nothing, until engines are ready or stopped (as kubectl wait)"
    )
    wait_parser.add_argument("engines", nargs="+", metavar="NAME")
    wait_parser.add_argument(
        "--for",
        dest="target",
        choices=("ready", "stopped"),
        required=True,
        help="ready: READY or SHEDDING; stopped: STOPPED or FATAL, no process",
    )
    wait_parser.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="give up after this long (exit 1); default: no limit"
    )
    _common(wait_parser, top=False)
    reload_parser = sub.add_parser(
        "reload", help="re-read the config; restart only engines whose spec changed"
    )
    _waits(reload_parser, "every added or changed engine is READY")
    reload_parser.add_argument(
        "--dry-run",
        action="store_true",
        help="say per engine what changed and what a reload would do (restart, stop, start); apply nothing",
    )
    _common(reload_parser, top=False)
    events = sub.add_parser("events", help="recent transitions, findings and actions (the daemon keeps 1000)")
    events.add_argument("engine", nargs="?", metavar="NAME", help="only this engine")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
    events.add_argument("--since", metavar="AGE", help="only events of the last AGE (30s, 10m, 2h, 1d)")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    _common(events, top=False)
    logs_parser = sub.add_parser(
        "logs", help="an engine's recent output, kept by the daemon (under systemd: all of it in the journal)"
    )
    logs_parser.add_argument("engine", metavar="NAME")
    logs_parser.add_argument(
        "--follow", "-f", action="store_true", help="keep printing new lines until Ctrl-C"
    )
    logs_parser.add_argument(
        "--previous", "-p", action="store_true", help="the previous incarnation's (the one that exited)"
    )
    logs_parser.add_argument("-n", "--lines", type=int, metavar="N", help="only the last N lines")
    logs_parser.add_argument("--json", action="store_true", help="one JSON object per line")
    _common(logs_parser, top=False)
    describe_parser = sub.add_parser(
        "describe",
        help="one engine up close: process, placement, state, last restart and why, events, output",
    )
    describe_parser.add_argument("engine", metavar="NAME")
    describe_parser.add_argument("--json", action="store_true", help="machine-readable")
    _common(describe_parser, top=False)
    gpu = sub.add_parser("gpu", help="reset a GPU: release it, take it back; node conditions (docs/gpu.md)")
    gpu_sub = gpu.add_subparsers(dest="gpu_command", required=True)
    release = gpu_sub.add_parser(
        "release",
        help="stop the GPU's engines and close NVML, so that `nvidia-smi -r` can reset it while the"
        " rest serve; prints the command (then `gpu take-back`)",
    )
    release.add_argument("gpu", type=int, metavar="GPU", help="the GPU's NVML index (status's GPU column)")
    release.add_argument(
        "--window",
        type=float,
        metavar="SECONDS",
        help="how long NVML may stay closed before the daemon takes the GPU back by itself (default 600)",
    )
    release.add_argument("--json", action="store_true", help="the release as JSON, once NVML is closed")
    _common(release, top=False)
    take_back = gpu_sub.add_parser(
        "take-back",
        help="after the reset: open NVML again, check the GPU, clear its condition, start its engines",
    )
    take_back.add_argument("gpu", type=int, metavar="GPU", help="the GPU `gpu release` released")
    take_back.add_argument("--json", action="store_true", help="the release as JSON, once judged")
    _common(take_back, top=False)
    clear = gpu_sub.add_parser(
        "clear", help="drop a GPU's gpu_unrecoverable condition after a GPU reset (the daemon stopped)"
    )
    clear.add_argument("uuids", nargs="+", metavar="UUID", help="the GPU UUID (status names it)")
    _common(clear, top=False, socket=False)
    doctor = sub.add_parser(
        "doctor", help="check this machine before the first start: one line per check, exit 1 on any FAIL"
    )
    _common(doctor, top=False, socket=False)
    sub.add_parser("schema", help="print the config's JSON Schema (for editors; docs/configuration.md)")
    completion = sub.add_parser(
        "completion", help='print shell completion: eval "$(llm-supervisor completion bash)"'
    )
    completion.add_argument("shell", choices=("bash", "zsh"))
    sub.add_parser("man", help="print the man page (roff): llm-supervisor man | man -l -")
    sync = sub.add_parser(
        "router-sync",
        help="keep a vLLM router's workers to the engines in rotation (docs/load-balancers.md)",
    )
    sync.add_argument("--daemon", required=True, metavar="URL", help="the daemon's HTTP listener")
    sync.add_argument("--router", required=True, metavar="URL", help="the vllm-router's address")
    sync.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an engine and its URL as the router reaches it; repeatable (default: every engine,"
        " at http://ENGINE_HOST:PORT)",
    )
    sync.add_argument("--engine-host", default="127.0.0.1", help="without --worker (default 127.0.0.1)")
    sync.add_argument(
        "--interval", type=float, default=0.25, metavar="SECONDS", help="between passes (default 0.25)"
    )
    return parser


def _config_state_dir(config_path: Path) -> tuple[Path | None, str | None]:
    """(the state dir the config names, the config's first problem). A missing file is no
    problem (the defaults apply); a broken one is, and a control command says so (exit 78)
    rather than "the daemon is not running"."""
    if not config_path.exists():
        return None, None
    try:
        return load_config(config_path, check_paths=False).supervisor.state_dir, None
    except ConfigError as exc:
        problem = str(exc.problems[0]) if exc.problems else f"{config_path}: does not load"
    # The state dir may still be readable from a config broken elsewhere (read with the
    # loader's bounds: a billion-laughs file must not hang the CLI either).
    return state_dir_named_in(config_path), problem


def _client(args: argparse.Namespace) -> Client:
    state_dir, problem = _config_state_dir(Path(args.config))
    state_dir = (state_dir or SupervisorSettings().state_dir).resolve()
    status_file = state_dir / "status.json"
    if args.socket:
        return Client(args.socket, status_file=status_file, state_dir=state_dir)
    candidates = [SYSTEMD_SOCKET, control.default_socket_path(state_dir)]
    path = next((p for p in candidates if p.exists()), candidates[-1])
    return Client(path, config_problem=problem, status_file=status_file, state_dir=state_dir)


def control_command(args: argparse.Namespace) -> int:
    """A command that talks to the daemon: the fleet's status across hosts, or one command to
    this host's daemon through its handler in ``CONTROL_HANDLERS`` (engine commands otherwise)."""
    if args.command == "status" and args.output == "json":
        args.json = True
    if args.command == "status" and (args.host or args.hosts_file):
        return _fleet_status(args)
    client = _client(args)
    out, err = cli_control.stream()
    handler = CONTROL_HANDLERS.get(args.command, _engine_command)
    return handler(client, args, out, err)


def _fleet_status(args: argparse.Namespace) -> int:
    out, err = cli_control.stream()
    hosts = list(args.host)
    if args.hosts_file:
        try:
            hosts += fleet.read_hosts_file(args.hosts_file)
        except OSError as exc:
            print(f"llm-supervisor: --hosts-file: {exc}", file=err)
            return 2
    if args.watch:
        print("llm-supervisor: --watch is not supported with --host/--hosts-file", file=err)
        return 2
    return fleet.fleet_status(
        hosts,
        args.names,
        as_json=args.json,
        out=out,
        err=err,
        deadline_s=args.deadline,
        wide=args.output == "wide",
    )


def _status(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    wide = args.output == "wide"
    if args.watch:
        interval_s = max(0.2, args.interval)
        return cli_control.watch(client, args.names, interval_s=interval_s, out=out, err=err, wide=wide)
    return cli_control.status(client, args.names, as_json=args.json, out=out, err=err, wide=wide)


def _events(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        since_s = render.parse_since(args.since) if args.since else None
    except ValueError as exc:
        print(f"llm-supervisor: --since: {exc}", file=err)
        return 2
    return cli_control.events(
        client, args.engine, since_s=since_s, follow=args.follow, as_json=args.json, out=out, err=err
    )


def _logs(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    return engine_view.logs(
        client,
        args.engine,
        previous=args.previous,
        lines=args.lines,
        follow=args.follow,
        as_json=args.json,
        out=out,
        err=err,
    )


def _describe(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    return engine_view.describe(client, args.engine, as_json=args.json, out=out, err=err)


def _gpu(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from llmsupervisor.cli.gpu import gpu_command

    window_s = getattr(args, "window", None)
    if window_s is not None and window_s <= 0:
        print("llm-supervisor: --window must be above 0 seconds", file=err)
        return 2
    return gpu_command(
        client, args.gpu_command, args.gpu, window_s=window_s, as_json=args.json, out=out, err=err
    )


def _reload(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.dry_run and args.wait:
        print("llm-supervisor: --dry-run applies nothing: there is nothing to --wait for", file=err)
        return 2
    return cli_control.reload(
        client,
        wait_for=args.wait,
        timeout_s=args.timeout,
        as_json=args.json,
        out=out,
        err=err,
        dry_run=args.dry_run,
    )


def _wait(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    return cli_control.wait_for_state(
        client, args.engines, args.target, timeout_s=args.timeout, out=out, err=err
    )


def _engine_command(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """start, stop, restart, drain: named engines or ``--all``."""
    if (problem := cli_control.names_or_all(args.command, args.engines, every=args.all)) is not None:
        print(f"llm-supervisor: {problem}", file=err)
        return 2
    return cli_control.engine_commands(
        client,
        args.command,
        args.engines,
        every=args.all,
        wait_for=args.wait,
        timeout_s=args.timeout,
        as_json=args.json,
        out=out,
        err=err,
    )


ControlHandler = Callable[[Client, argparse.Namespace, TextIO, TextIO], int]
# The daemon commands that are not engine commands, by name (``control_command``).
CONTROL_HANDLERS: Final[dict[str, ControlHandler]] = {
    "status": _status,
    "events": _events,
    "logs": _logs,
    "describe": _describe,
    "gpu": _gpu,
    "reload": _reload,
    "wait": _wait,
}


def check_config(path: Path) -> int:
    try:
        # This process's environment stands for the daemon's when judging hub ids offline.
        config = load_config(path, hub_env=os.environ)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EX_CONFIG
    for warning in config.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"{path}: OK, {len(config.engines)} engine(s): {', '.join(e.name for e in config.engines)}")
    return 0


def doctor(path: Path) -> int:
    from llmsupervisor import doctor

    results = doctor.run_checks(path)
    for result in results:
        print(result)
    return 1 if doctor.failed(results) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not hasattr(args, "socket"):
        args.socket = None
    if args.command == "doctor":
        return doctor(args.config)
    if args.command == "check-config":
        return check_config(args.path or args.config)
    if args.command == "gpu" and args.gpu_command == "clear":
        from llmsupervisor.cli.gpu import gpu_clear

        return gpu_clear(args.config, args.uuids)
    if args.command == "router-sync":
        from llmsupervisor.cli import router_sync

        try:
            workers = router_sync.parse_workers(args.worker)
        except ValueError as exc:
            print(f"llm-supervisor: {exc}", file=sys.stderr)
            return 2
        sync = router_sync.RouterSync(args.daemon, args.router, workers=workers, engine_host=args.engine_host)
        try:
            return router_sync.run(sync, interval_s=max(0.05, args.interval), err=sys.stderr)
        except KeyboardInterrupt:
            return 0
    if args.command == "schema":
        from llmsupervisor.config.schema import schema_text

        sys.stdout.write(schema_text())
        return 0
    if args.command in ("completion", "man"):
        from llmsupervisor.cli import completion

        parser = _parser()
        if args.command == "man":
            sys.stdout.write(completion.man(parser))
        else:
            sys.stdout.write(completion.bash(parser) if args.shell == "bash" else completion.zsh(parser))
        return 0
    if args.command in (*control.COMMANDS, "describe", "wait", "gpu"):
        try:
            return control_command(args)
        except KeyboardInterrupt:
            return EX_INTERRUPTED
    if getattr(args, "log_format", None):
        # logs.setup reads it; the variable also reaches `run` without a new parameter.
        os.environ[logs.LOG_FORMAT_ENV] = args.log_format
    fake_gpu = getattr(args, "fake_gpu", None)
    # Both before the daemon moves to the config file's directory (``run``).
    return run(args.config.absolute(), fake_gpu.absolute() if fake_gpu is not None else None)


if __name__ == "__main__":
    raise SystemExit(main())
