"""Command line: ``llm-supervisor [run] [--config PATH]``, ``check-config [PATH]``. No logic here."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from llmsupervisor import __version__, logs
from llmsupervisor.config import DEFAULT_CONFIG_PATH, load_config
from llmsupervisor.errors import EX_CONFIG, ConfigError


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
    sub.add_parser("run", help="run the daemon in the foreground (the default)")
    check = sub.add_parser("check-config", help="validate a config file; exit 78 with one line per problem")
    check.add_argument("path", nargs="?", type=Path, help="config file (default: --config)")
    return parser


def check_config(path: Path) -> int:
    try:
        config = load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EX_CONFIG
    print(f"{path}: OK, {len(config.engines)} engine(s): {', '.join(e.name for e in config.engines)}")
    return 0


def run(path: Path) -> int:
    try:
        config = load_config(path)
    except ConfigError as exc:
        logs.setup("info")
        for problem in exc.problems:
            logging.getLogger("llmsupervisor").error("%s", problem)
        logging.getLogger("llmsupervisor").critical("invalid config, not starting (exit %d)", EX_CONFIG)
        return EX_CONFIG
    logs.setup(config.supervisor.log_level)
    from llmsupervisor.supervisor import Supervisor

    return asyncio.run(Supervisor(config).run())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return check_config(args.path or args.config)
    return run(args.config)


if __name__ == "__main__":
    raise SystemExit(main())
