"""The shipped unit, checked by the real systemd tools (docs/host-notes.md §5.1, §5.2)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.lib.paths import REPO

UNIT = REPO / "systemd" / "llm-supervisor.service"

pytestmark = [
    pytest.mark.systemd,
    pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"),
]


def verifiable_copy(tmp_path: Path) -> Path:
    # verify needs an existing ExecStart; the daemon's venv does not exist on a build host.
    text = re.sub(r"^ExecStart=.*$", "ExecStart=/bin/true", UNIT.read_text(), flags=re.M)
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    return copy


def test_verify_has_empty_stderr(tmp_path: Path) -> None:
    # systemd-analyze verify exits 0 on unknown keys and bad values: stderr is the verdict.
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(verifiable_copy(tmp_path))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    assert result.stderr == ""


def test_security_exposure_is_ok_or_better(tmp_path: Path) -> None:
    # --threshold is in tenths on systemd 252: 3.5 fails 4 and passes 35 (docs/host-notes.md §5.2).
    # 31 keeps the score at or below 3.1 "OK" (3.5 before issue 17's hardening) as a regression
    # gate; docs/reliability.md lists what stands between it and a lower one.
    result = subprocess.run(
        [
            "systemd-analyze",
            "security",
            "--offline=true",
            "--man=no",
            "--threshold=31",
            str(verifiable_copy(tmp_path)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert re.search(r"Overall exposure level for \S+: \d\.\d (OK|SAFE|PERFECT)", result.stdout)


def test_settings_the_daemon_relies_on() -> None:
    text = UNIT.read_text()
    for line in (
        "Type=notify",
        "KillMode=mixed",
        "OOMPolicy=continue",
        "RestartPreventExitStatus=75 78",
        "NotifyAccess=main",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "DevicePolicy=closed",
        "DeviceAllow=char-nvidia* rw",
    ):
        assert f"\n{line}\n" in text, line
    assert "MemoryDenyWriteExecute" not in text.replace("# Not set, on purpose: MemoryDenyWriteExecute=", "")


def test_hardening_that_does_not_touch_cuda() -> None:
    # Issue 17: what closes exposure without a GPU run to validate it (docs/reliability.md).
    text = UNIT.read_text()
    for line in (
        "IPAddressDeny=any",
        "IPAddressAllow=localhost",
        "PrivateMounts=yes",
        "RemoveIPC=yes",
        "ProtectHome=yes",
        "UMask=0077",
    ):
        assert f"\n{line}\n" in text, line


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers missing")
def test_sysusers_and_tmpfiles_into_a_scratch_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for sub in ("usr/lib/sysusers.d", "usr/lib/tmpfiles.d", "etc"):
        (root / sub).mkdir(parents=True)
    (root / "etc/group").write_text("root:x:0:\nvideo:x:44:\n")
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    src = UNIT.parent
    shutil.copy(src / "llm-supervisor.sysusers.conf", root / "usr/lib/sysusers.d/llm-supervisor.conf")
    shutil.copy(src / "llm-supervisor.tmpfiles.conf", root / "usr/lib/tmpfiles.d/llm-supervisor.conf")
    subprocess.run(["systemd-sysusers", f"--root={root}"], check=True, capture_output=True)
    passwd = (root / "etc/passwd").read_text()
    assert "llm-supervisor:x:" in passwd and ":/var/lib/llm-supervisor:/usr/sbin/nologin" in passwd
    video = next(line for line in (root / "etc/group").read_text().splitlines() if line.startswith("video:"))
    assert video.endswith("llm-supervisor")
    subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create"], check=True, capture_output=True)
    models = root / "var/lib/llm-supervisor/models"
    assert models.is_dir()
    assert oct(models.stat().st_mode & 0o777) == "0o750"
