"""The daemon under a real systemd manager: `systemd --user` in a private mount namespace.

docs/host-notes.md §5.4: the user manager quits unless /run/systemd/system exists, so the scenario runs
inside `unshare -m` with a tmpfs there, leaving the host untouched. A user manager has no
journald, no User= and none of the system-only sandboxing, so the unit under test keeps the
shipped unit's lifecycle settings (Type=notify, NotifyAccess, ExecReload, KillMode, Restart,
RestartPreventExitStatus, timeouts) and drops the rest. What this shows: `systemctl start`
returns once the daemon sent READY=1 with its STATUS=, reload reaches the daemon, stop leaves no
engine process, a wedged loop is killed by the watchdog and restarted, and exit 78 is final.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from llmsupervisor import process
from tests.lib.daemon import alive, fake_engine, free_port
from tests.lib.paths import REPO

pytestmark = [
    pytest.mark.systemd,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for unshare -m"),
    pytest.mark.skipif(
        not Path("/lib/systemd/systemd").exists() or shutil.which("unshare") is None,
        reason="systemd or unshare missing",
    ),
]

UNIT = REPO / "systemd" / "llm-supervisor.service"
LIFECYCLE_KEYS = (
    "Type",
    "NotifyAccess",
    "ExecReload",
    "KillMode",
    "Restart",
    "RestartPreventExitStatus",
    "OOMPolicy",
    "TimeoutStartSec",
    "TimeoutStopSec",
)


def test_unit(tmp_path: Path) -> None:
    shipped = {line.split("=", 1)[0]: line for line in UNIT.read_text().splitlines() if "=" in line}
    state = tmp_path / "state"
    good = tmp_path / "good.yaml"
    good.write_text(
        yaml.safe_dump(
            {
                "supervisor": {
                    "state_dir": str(state),
                    "tick_interval_s": 0.3,
                    "http_listen": f"127.0.0.1:{free_port()}",
                },
                "engines": [
                    fake_engine("a", free_port(), fake_child=True),
                    fake_engine("b", free_port(), fake_completion_delay_s=0.0),
                ],
            }
        )
    )
    bad = tmp_path / "bad.yaml"
    # A self-referencing alias: before issue 17 the loader recursed until RecursionError, the
    # reload left systemd in "reloading" and startup exited 1 (restarted) instead of 78.
    bad.write_text("engines:\n  - &e\n    name: a\n    model: m\n    port: [*e]\n")
    units = tmp_path / "config" / "systemd" / "user"
    units.mkdir(parents=True)
    service = "\n".join(shipped[k] for k in LIFECYCLE_KEYS)
    repo = REPO
    for name, config, extra in (
        ("llmsup", good, "WatchdogSec=3s\nTimeoutAbortSec=2s\nRestartSec=1s"),
        ("llmsup-bad", bad, "RestartSec=1s"),
    ):
        (units / f"{name}.service").write_text(
            textwrap.dedent(f"""\
            [Unit]
            StartLimitIntervalSec=1min
            StartLimitBurst=5
            [Service]
            {service.replace(chr(10), chr(10) + "            ")}
            {extra.replace(chr(10), chr(10) + "            ")}
            Environment=PYTHONPATH={repo}
            ExecStart={sys.executable} -m llmsupervisor --config {config}
            StandardOutput=append:{tmp_path}/{name}.log
            StandardError=append:{tmp_path}/{name}.log
            """)
        )
    script = tmp_path / "scenario.sh"
    script.write_text(
        textwrap.dedent(f"""\
        set -u
        mount -t tmpfs tmpfs /run/systemd && mkdir -p /run/systemd/system
        export XDG_RUNTIME_DIR={tmp_path}/xdg XDG_CONFIG_HOME={tmp_path}/config
        mkdir -p $XDG_RUNTIME_DIR && chmod 700 $XDG_RUNTIME_DIR
        /lib/systemd/systemd --user > {tmp_path}/manager.log 2>&1 & SD=$!
        for i in $(seq 100); do systemctl --user is-system-running >/dev/null 2>&1 && break; sleep 0.1; done
        sc() {{ systemctl --user "$@"; }}
        show() {{ sc show "$1" -p ActiveState -p SubState -p Result -p NRestarts -p StatusText -p ExecMainStatus; }}
        sc start llmsup; echo "start_rc=$?"
        show llmsup > {tmp_path}/after-start
        cp {good} {tmp_path}/good.orig
        cp {bad} {good}; sc reload llmsup; sleep 2
        show llmsup > {tmp_path}/after-bad-reload
        sed 's/fake-completion-delay-s: 0.0/fake-completion-delay-s: 0.01/' {tmp_path}/good.orig > {good}
        sc reload llmsup
        for i in $(seq 200); do [ "$(grep -cF "[b] STARTING -> READY" {tmp_path}/llmsup.log)" -ge 2 ] && break; sleep 0.1; done
        sleep 1
        cp {state}/status.json {tmp_path}/status-after-reload.json
        # A wedged loop: the watchdog (3 s) aborts the daemon, systemd restarts it.
        kill -STOP $(sc show llmsup -p MainPID --value)
        for i in $(seq 150); do [ "$(sc show llmsup -p NRestarts --value)" -ge 1 ] && break; sleep 0.1; done
        for i in $(seq 300); do [ "$(sc show llmsup -p SubState --value)" = running ] && break; sleep 0.1; done
        show llmsup > {tmp_path}/after-watchdog
        sc stop llmsup; echo "stop_rc=$?"
        show llmsup > {tmp_path}/after-stop
        sc start llmsup-bad; echo "bad_rc=$?"
        sleep 3
        show llmsup-bad > {tmp_path}/bad
        kill $SD; wait $SD
        """)
    )
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    log = (tmp_path / "llmsup.log").read_text() if (tmp_path / "llmsup.log").exists() else ""
    context = f"{result.stdout}\n{result.stderr}\n--- daemon log tail:\n{log[-3000:]}"

    def props(name: str) -> dict[str, str]:
        return dict(line.split("=", 1) for line in (tmp_path / name).read_text().splitlines() if "=" in line)

    assert "start_rc=0" in result.stdout, context
    started = props("after-start")
    assert started["ActiveState"] == "active" and started["SubState"] == "running", started
    assert started["StatusText"] == "2/2 engines ready", started
    bad_reload = props("after-bad-reload")
    assert bad_reload["ActiveState"] == "active", bad_reload
    assert bad_reload["StatusText"].startswith("reload failed (1 problems), old config kept"), bad_reload
    assert "reload rejected" in log, context
    assert "0 added, 0 removed, 1 changed (b), 1 unchanged" in log, context
    after_reload = json.loads((tmp_path / "status-after-reload.json").read_text())["engines"]
    assert after_reload["a"]["restarts"] == 0, after_reload
    assert after_reload["b"]["restarts_by_reason"] == {"config_change": 1}, after_reload
    after_watchdog = props("after-watchdog")
    assert after_watchdog["NRestarts"] == "1", after_watchdog
    assert after_watchdog["SubState"] == "running", after_watchdog
    assert "stop_rc=0" in result.stdout, context
    stopped = props("after-stop")
    assert stopped["ActiveState"] == "inactive" and stopped["Result"] == "success", stopped
    assert log.count("no engine process left") >= 1
    bad_unit = props("bad")
    assert bad_unit["ExecMainStatus"] == "78", bad_unit
    assert bad_unit["NRestarts"] == "0", bad_unit  # RestartPreventExitStatus=78
    assert bad_unit["ActiveState"] == "failed", bad_unit
    # Nothing of either run is left: not the engines of the aborted daemon, not the new ones.
    assert [p for p in process.marker_processes(state.resolve()) if alive(p)] == []
    for group in process.recorded_groups(state.resolve()):
        assert [p for p in process.recorded_group_members(group) if alive(p)] == []
