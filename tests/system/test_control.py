"""The control socket and CLI against the real daemon: status, drain, start, restart, stop, reload."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from llmsupervisor import control
from llmsupervisor.cli import main as cli
from tests.lib.daemon import fake_engine, free_port, wait_for

pytestmark = pytest.mark.system


def test_cli_without_daemon_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["--socket", str(tmp_path / "none.sock"), "status"])
    assert rc == cli.EX_UNAVAILABLE
    assert "the daemon is not running" in capsys.readouterr().err


def test_permission_error_is_explained(tmp_path: Path) -> None:
    """A user outside the daemon's group gets a clear message, not a traceback."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a socket another user cannot open")
    public = Path(tempfile.mkdtemp(prefix="llmsup-perm-"))
    try:
        public.chmod(0o755)
        path = public / "control.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen()
        path.chmod(0o660)  # root:root, as the daemon creates it for its own group
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child becomes nobody and tries the CLI's request
            os.close(read_end)
            message = b"no error"
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                control.request(path, {"command": "status"})
            except control.ControlError as exc:
                message = str(exc).encode()
            except BaseException as exc:
                message = repr(exc).encode()
            os.write(write_end, message)
            os._exit(0)
        os.close(write_end)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read_end, "rb") as f:
            message_text = f.read().decode()
        server.close()
        assert os.waitstatus_to_exitcode(status) == 0
        assert message_text.startswith(f"permission denied on {path}"), message_text
        assert "member of the daemon's group" in message_text
    finally:
        shutil.rmtree(public)


def test_status_drain_start_restart_stop(daemon_factory) -> None:
    p1, p2 = free_port(), free_port()
    d = daemon_factory({"engines": [fake_engine("a", p1), fake_engine("b", p2)]})
    d.start()
    a = d.wait_state("a", "ready")
    d.wait_state("b", "ready")
    sock = d.state_dir / "control.sock"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660

    out = d.cli("status", timeout_s=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # No engine here has a GPU: the GPU columns are hidden (issue 26; `-o wide` shows them).
    assert lines[0].split()[:5] == ["ENGINE", "STATE", "MODEL", "CPUS", "PORT"]
    assert lines[1].split()[:2] == ["a", "READY"]
    status = json.loads(d.cli("status", "--json", timeout_s=30).stdout)
    assert status["engines"]["b"]["port"] == p2

    assert d.cli("drain", "a", timeout_s=30).returncode == 0
    d.wait_state("a", "draining", in_rotation=False)
    assert d.engine("a")["pid"] == a["pid"]  # drained, not restarted
    assert d.cli("start", "a", timeout_s=30).returncode == 0
    d.wait_state("a", "ready", in_rotation=True)

    assert d.cli("restart", "a", timeout_s=30).returncode == 0
    again = d.wait_state("a", "ready", restarts=1)
    assert again["pid"] != a["pid"]
    assert again["restarts_by_reason"] == {"operator": 1}
    assert "[a] READY -> DRAINING: draining: restart requested by operator" in d.log()

    assert d.cli("stop", "b", timeout_s=30).returncode == 0
    d.wait_state("b", "stopped")
    assert d.engine("a")["state"] == "ready"
    bad = d.cli("restart", "nope", timeout_s=30)
    assert bad.returncode == 1 and "no engine named 'nope'" in bad.stderr
    assert d.stop() == 0


def test_reload_restarts_only_changed_engines_and_keeps_old_config_on_error(daemon_factory) -> None:
    p1, p2, p3 = free_port(), free_port(), free_port()
    config = {"engines": [fake_engine("same", p1), fake_engine("changed", p2)]}
    d = daemon_factory(config)
    d.start()
    same = d.wait_state("same", "ready")
    changed = d.wait_state("changed", "ready")

    # An invalid config is rejected whole; nothing is touched.
    d.config_path.write_text(d.config_path.read_text().replace(f"port: {p2}", "port: not-a-port"))
    out = d.cli("reload", timeout_s=30)
    assert out.returncode == 78
    assert "engines[1].port: must be an integer" in out.stderr
    assert "keeps its previous config" in out.stderr
    assert d.engine("changed")["pid"] == changed["pid"]

    # A valid change: one engine's args change, one engine is added, by SIGHUP this time.
    new = yaml.safe_load(d.config_path.read_text().replace("port: not-a-port", f"port: {p2}"))
    new["engines"][1]["args"]["fake-completion-delay-s"] = 0.01
    new["engines"].append(fake_engine("added", p3))
    d.config_path.write_text(yaml.safe_dump(new, sort_keys=False))
    d.signal(signal.SIGHUP)
    d.wait_state("added", "ready")
    restarted = d.wait_state("changed", "ready", restarts=1)
    assert restarted["pid"] != changed["pid"]
    assert restarted["restarts_by_reason"] == {"config_change": 1}
    assert d.engine("same")["pid"] == same["pid"]
    assert d.engine("same")["restarts"] == 0
    assert "1 added, 0 removed, 1 changed (changed), 1 unchanged" in d.log()
    assert httpx.get(f"http://127.0.0.1:{p3}/health", timeout=5).status_code == 200

    # Removing an engine from the config stops it.
    new["engines"] = [e for e in new["engines"] if e["name"] != "added"]
    d.config_path.write_text(yaml.safe_dump(new, sort_keys=False))
    assert d.cli("reload", timeout_s=30).returncode == 0
    wait_for(lambda: "added" not in d.status().get("engines", {}), timeout_s=30, what="engine removed")
    wait_for(
        lambda: not any(p for p in d.engine_processes() if str(p3) in " ".join(_cmd(p))),
        timeout_s=30,
        what="removed engine's processes gone",
    )
    assert d.stop() == 0


def _cmd(pid: int) -> list[str]:
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def test_socket_umask_does_not_leak_to_other_tasks(tmp_path: Path) -> None:
    # Found by the package install test: engine state dirs created while the control socket was
    # being bound came out drw-rw---- (umask 0117) and the engines could not start.
    async def scenario() -> list[int]:
        async def handler(request: dict[str, object]) -> object:
            return None

        server = control.ControlServer(tmp_path / "c.sock", handler)
        seen: list[int] = []

        async def peek() -> None:
            for _ in range(10):
                mask = os.umask(0o022)
                os.umask(mask)
                seen.append(mask)
                await asyncio.sleep(0)

        previous = os.umask(0o022)
        try:
            await asyncio.gather(server.start(), peek())
        finally:
            os.umask(previous)
            await server.close()
        return seen

    assert set(asyncio.run(scenario())) == {0o022}
    assert not (tmp_path / "c.sock").exists()
