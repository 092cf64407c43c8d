"""Issue 39 (3, 4, 5): the CLI agrees with what the operator asked, through the real CLI against a
daemon over fake engines: `status` exits 0 when every engine is where the operator put it, `wait
--for ready` on a held engine ends at once, `stop` on a FATAL engine records the stop, `restart
--all NAME` and `status gpu9` say what is wrong, a dry run does not stop a stopped engine, `logs
--previous` says how that incarnation ended, `reload --wait` counts an engine done only once it
serves its new spec; the table at 80 and 100 columns in a pty keeps STATE, FOR, RESTARTS, LAST
EXIT and ROTATION and cuts the reason. A hang's finding read for a person in `events` and
`describe` (point 5): tests/system/test_cli_system.py, beside its other findings checks."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from typing import Any

import pytest
import yaml

from tests.lib.daemon import Daemon, cli, fake_engine, free_port

pytestmark = pytest.mark.system

KEPT = ("ENGINE", "STATE", "FOR", "RESTARTS", "LAST EXIT", "ROTATION", "FINDINGS / REASON")


def failing_engine(name: str) -> dict[str, Any]:
    """An engine whose every start fails at once: FATAL after its first failure."""
    code = "import sys; print('ValueError: no such model', file=sys.stderr); sys.exit(3)"
    return fake_engine(name, free_port(), command=[sys.executable, "-c", code], max_failures=1)


def status_in_a_pty(d: Daemon, columns: int) -> str:
    """`llm-supervisor status` as a terminal ``columns`` wide shows it (no $COLUMNS: the size is
    the terminal's own, as an operator's)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmsupervisor", "status", "--config", str(d.config_path)],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        close_fds=True,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's other side is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    proc.wait(timeout=60)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_commands_agree_with_what_the_operator_asked(daemon_factory) -> None:
    d = daemon_factory(
        {"engines": [fake_engine("a", free_port()), fake_engine("b", free_port()), failing_engine("c")]}
    )
    d.start()
    d.wait_state("a", "ready")
    d.wait_state("b", "ready")
    d.wait_state("c", "fatal")

    # Nobody asked for FATAL: exit 1. The operator's stop of it is recorded: STOPPED, held.
    out = cli(d, "status")
    assert out.returncode == 1 and out.stderr == "llm-supervisor: c is FATAL\n", out.stderr
    out = cli(d, "stop", "c")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "c: stop accepted; was FATAL: now STOPPED, held until `start`\n"
    c = d.wait_state("c", "stopped")
    assert c["hold"]["hold"] == "stop" and c["held_by_operator"] and not c["running"]

    # Stopped and drained on purpose: where the operator put them, exit 0.
    assert cli(d, "drain", "a", "--wait", "--timeout", "30").returncode == 0
    assert cli(d, "stop", "b", "--wait", "--timeout", "30").returncode == 0
    for args in (("status",), ("status", "a", "b", "c")):
        out = cli(d, *args)
        assert out.returncode == 0 and out.stderr == "", (args, out.stderr)

    # A hold is as final as FATAL: `wait --for ready` ends at once, saying how to release it.
    started = time.monotonic()
    for name in ("a", "b"):
        out = cli(d, "wait", name, "--for", "ready")
        assert out.returncode == 1, out
        assert re.fullmatch(
            rf"{name}: held by the operator since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \((drain|stop) by .+\);"
            rf" `llm-supervisor start {name}` to release\n",
            out.stderr,
        ), out.stderr
    assert time.monotonic() - started < 30  # not a wait: two CLI runs

    out = cli(d, "restart", "--all", "a")
    assert out.returncode == 2
    assert (
        out.stderr
        == "llm-supervisor: restart: --all or engine names, not both: `restart --all` or `restart a`\n"
    )
    out = cli(d, "status", "gpu9")
    assert out.returncode == 1 and out.stdout == "", out.stdout  # no empty header before the error
    assert out.stderr == "llm-supervisor: no engine named 'gpu9'; engines: a, b, c\n"

    # A crash shows in LAST EXIT; `logs --previous` says how that incarnation ended.
    assert cli(d, "start", "b", "--wait", "--timeout", "60").returncode == 0
    os.kill(d.engine("b")["pid"], signal.SIGKILL)
    d.wait_state("b", "ready", restarts=1)
    out = cli(d, "logs", "b", "--previous")
    assert out.returncode == 0 and out.stdout, out
    ended = out.stderr.splitlines()[0]
    assert re.match(
        r"llm-supervisor: pid \d+ ended \d\d:\d\d:\d\d: READY -> (BACKOFF|STOPPING): .*SIGKILL", ended
    )

    # The table at 80 and 100 columns keeps what says what happened and cuts the reason.
    for columns in (80, 100):
        table = status_in_a_pty(d, columns)
        lines = table.splitlines()
        assert all(len(line) <= columns for line in lines), table
        header = lines[0]
        assert all(title in header for title in KEPT), table
        rows = {line.split()[0]: line for line in lines[1:]}
        assert "SIGKILL" in rows["b"] and " ago" in rows["b"], table
        # The hold in a few characters; a narrow table's ROTATION says "held" for it.
        assert "held" in rows["a"].split() and re.search(r"\bdrain \(\w+, \w+\)", rows["a"]), table
        assert "held" in rows["c"].split() and re.search(r"\bstop \(\w+, \w+\)", rows["c"]), table
    wide = cli(d, "status", "-o", "wide").stdout
    assert "drain hold by " in wide and "crashed (SIGKILL)" in wide

    # A reason describes the present: back in rotation, READY's reason is "ready".
    assert cli(d, "start", "a", "--wait", "--timeout", "30").returncode == 0
    assert re.search(r"\nReason: +ready\n", cli(d, "describe", "a").stdout)
    assert "DRAINING -> READY: drain cancelled: back in rotation" in cli(d, "events", "a").stdout

    # A dry run does not say it would stop an engine that is stopped.
    new = yaml.safe_load(d.config_path.read_text())
    new["engines"][2]["enabled"] = False
    d.config_path.write_text(yaml.safe_dump(new, sort_keys=False))
    out = cli(d, "reload", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "dry run, nothing applied; a reload would be: nothing changes"
    assert "  c: nothing (disabled, not running): enabled: true -> false" in out.stdout.splitlines()
    assert d.stop() == 0


def test_reload_wait_counts_an_engine_done_only_once_it_serves_its_new_spec(daemon_factory) -> None:
    """The engine is still starting its old spec when the reload comes: that start's READY is not
    the reload's."""
    d = daemon_factory({"engines": [fake_engine("a", free_port(), fake_load_s=4.0)]})
    d.start()
    d.wait_state("a", "starting")
    new = yaml.safe_load(d.config_path.read_text())
    new["engines"][0]["args"]["fake-completion-delay-s"] = 0.01
    d.config_path.write_text(yaml.safe_dump(new, sort_keys=False))
    out = cli(d, "reload", "--wait", "--timeout", "120")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "a: READY (reload done)"
    a = d.engine("a")
    assert a["state"] == "ready" and a["config_roll"] is None, a  # the new spec, not the old start's
    assert a["incarnation"] >= 2
    assert d.stop() == 0
