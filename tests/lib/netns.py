"""Hosts as network namespaces on one bridge, for the fleet tier: each namespace runs its own
daemon (``HostDaemon``) on the same ports and engine names, as real hosts do (``tests/lib/load.py``
sends completions through whatever stands in front of them).

Needs root and iproute2: ``require_netns`` skips otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.lib.daemon import Daemon, fake_engine
from tests.lib.paths import REPO


def require_netns() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


class Network:
    """A bridge in the root namespace and one namespace per host, each with a veth on it."""

    def __init__(self, hosts: int) -> None:
        tag = os.getpid() % 10000
        self.subnet = f"10.215.{os.getpid() % 250}"
        self.bridge = f"h15br{tag}"
        self.namespaces = [f"h15-{tag}-{i}" for i in range(1, hosts + 1)]
        self.links = [f"h15v{tag}{i}" for i in range(1, hosts + 1)]
        self.addresses = [f"{self.subnet}.{10 + i}" for i in range(1, hosts + 1)]

    def __enter__(self) -> Network:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for ns, link, address in zip(self.namespaces, self.links, self.addresses, strict=True):
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "link", "set", link, "master", self.bridge, "up")
                _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def cut(self, host: int, *, up: bool) -> None:
        """A partition: host's link on the bridge goes down (or up again)."""
        _run("ip", "link", "set", self.links[host], "up" if up else "down")


class HostDaemon(Daemon):
    """The real daemon, started inside a network namespace (``ip netns exec`` execs in place,
    so the pid is the daemon's)."""

    def __init__(
        self, tmp_path: Path, config: dict[str, Any], *, netns: str, run_args: tuple[str, ...] = ()
    ) -> None:
        super().__init__(tmp_path, config, run_args=run_args)
        self.netns = netns

    def start(self, extra_env: dict[str, str] | None = None) -> Daemon:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSUPERVISOR_")}
        env["LLMSUP_LOG_FORMAT"] = "text"  # as Daemon.start: the tests read the text log
        env.update(extra_env or {})
        argv = ["ip", "netns", "exec", self.netns, sys.executable, "-m", "llmsupervisor"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *argv,
                    "--config",
                    str(self.config_path),
                    *(("run", *self.run_args) if self.run_args else ()),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=REPO,
            )
        return self


def crash_loop_hosts(net: Network, folder: Path, **gpu0: Any) -> list[HostDaemon]:
    """A daemon per host of ``net`` (not started; its folder ``folder/hN``), each serving its
    status and /metrics on :9400 and a fake engine ``gpu0`` on :8000 (``gpu0``: more fields for
    it); host 1's also runs ``bad`` on :8001, which crashes 0.2 s after every start and is FATAL
    after two failures."""
    daemons = []
    for i, (ns, address) in enumerate(zip(net.namespaces, net.addresses, strict=True)):
        engines = [fake_engine("gpu0", 8000, host=address, **gpu0)]
        if i == 0:
            engines.append(
                fake_engine(
                    "bad",
                    8001,
                    host=address,
                    fake_crash_after_s=0.2,
                    fake_exit_code=1,
                    max_failures=2,
                )
            )
        host_dir = folder / f"h{i + 1}"
        host_dir.mkdir()
        config = {"supervisor": {"http_listen": "0.0.0.0:9400"}, "engines": engines}
        daemons.append(HostDaemon(host_dir, config, netns=ns))
    return daemons


def stop_hosts(daemons: list[HostDaemon], *, timeout_s: float = 30.0) -> None:
    """SIGTERM each daemon and wait up to ``timeout_s`` for it (one never started is passed
    over), then kill whatever it or its engines left."""
    for d in daemons:
        with contextlib.suppress(Exception):
            d.signal(signal.SIGTERM)
            d.wait_exit(timeout_s=timeout_s)
        d.cleanup()
