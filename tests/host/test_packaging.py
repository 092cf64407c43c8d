"""The .deb and .rpm: built by packaging/build, their contents checked, and the .deb installed for
real in a Debian 12 container booted with systemd-nspawn.

1. ``packaging/build`` into a temp dir, release 1 and release 2 (for the upgrade) from one venv. The deb
   through ``dpkg-deb -f/-c/-e/-x`` (fields, files and modes, conffiles, maintainer scripts, and
   the relocated venv run from the extracted tree); the rpm through ``rpm -qp`` (files, config
   flags, requirements, scriptlets), which must list the same files as the deb.
2. A bookworm rootfs from ``debootstrap --variant=minbase`` (docs/host-notes.md §5.6), cached in
   ``~/.cache/llm-supervisor/rootfs-bookworm``: built once into a temp dir and renamed when
   complete. Each run boots it with ``systemd-nspawn --volatile=overlay -b`` (docs/host-notes.md §5.5:
   ``--register=no --keep-unit`` on a host whose PID 1 is not systemd), so the cached tree is never
   written, with the two .debs, ``tests/lib/fake_vllm.py`` (stdlib only, so the container's python3
   runs it) and ``tests/host/package_scenario.sh`` bound in read-only, and a oneshot unit that powers the
   container off when the scenario ends. The scenario
   installs, configures two fake engines, starts, upgrades, removes and purges; it writes what it
   saw to the bound ``/out``, and the assertions are made here.

The tools (nfpm comes with the dev extras; dpkg-deb, rpm, debootstrap, systemd-nspawn) are skipped
when missing, or fail the run with ``LLMSUP_REQUIRE_TOOLS=1`` (CI); scripts/test installs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.lib.paths import REPO
from tests.lib.rootfs import ensure_rootfs, require, run

pytestmark = pytest.mark.packaging

VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
PREFIX = "/opt/llm-supervisor/venv"
BOOT_TIMEOUT_S = 300.0

# Everything the package installs outside the venv.
SYSTEM_FILES = {
    "/usr/bin/llm-supervisor": "-rwxr-xr-x",
    "/usr/lib/systemd/system/llm-supervisor.service": "-rw-r--r--",
    "/usr/lib/sysusers.d/llm-supervisor.conf": "-rw-r--r--",
    "/usr/lib/tmpfiles.d/llm-supervisor.conf": "-rw-r--r--",
    "/usr/share/llm-supervisor/config.schema.json": "-rw-r--r--",
    "/etc/llm-supervisor/config.yaml": "-rw-r-----",
}


@dataclass(frozen=True)
class Packages:
    python: str  # the build interpreter's minor version, "3.11": the venv's and the Depends
    deb: Path  # release 1
    deb_upgrade: Path  # release 2: the same version rebuilt
    rpm: Path
    build_s: float


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Packages:
    require("dpkg-deb")
    python = run(
        os.environ.get("PYTHON", "/usr/bin/python3"),
        "-c",
        "import sys; print('%d.%d' % sys.version_info[:2])",
    )
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PKG_OUT": str(out)}
    nfpm = Path(sys.executable).parent / "nfpm"  # the dev extras install it into the test venv
    if nfpm.exists():
        env["NFPM"] = str(nfpm)
    started = time.monotonic()
    run(REPO / "packaging" / "build", env={**env, "PKG_RELEASE": "1 2"}, timeout=600)
    build_s = time.monotonic() - started
    return Packages(
        python=python.strip(),
        deb=out / f"llm-supervisor_{VERSION}-1_amd64.deb",
        deb_upgrade=out / f"llm-supervisor_{VERSION}-2_amd64.deb",
        rpm=out / f"llm-supervisor-{VERSION}-1.x86_64.rpm",
        build_s=build_s,
    )


@pytest.fixture(scope="module")
def extracted(packages: Packages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deb-root")
    run("dpkg-deb", "-x", packages.deb, root)
    return root


def deb_listing(deb: Path) -> dict[str, tuple[str, str, str]]:
    """path -> (mode string, owner/group, link target or '') from ``dpkg-deb -c``."""
    entries = {}
    for line in run("dpkg-deb", "-c", deb).splitlines():
        mode, owner, _size, _date, _time, name = line.split(None, 5)
        name, _, target = name.partition(" -> ")
        entries[name.removeprefix(".").rstrip("/") or "/"] = (mode, owner, target)
    return entries


# ---- the .deb ---------------------------------------------------------------------------------


def test_deb_fields(packages: Packages) -> None:
    py = packages.python
    fields = dict(
        line.split(": ", 1)
        for line in run(
            "dpkg-deb", "-f", packages.deb, "Package", "Version", "Architecture", "Depends"
        ).splitlines()
    )
    assert fields == {
        "Package": "llm-supervisor",
        "Version": f"{VERSION}-1",
        "Architecture": "amd64",
        "Depends": f"python{py}, systemd (>= 249)",
    }
    # The daemon's venv is a few MB; vLLM, torch and CUDA would be gigabytes.
    assert int(run("dpkg-deb", "-f", packages.deb, "Installed-Size")) < 30_000  # KiB
    assert run("dpkg-deb", "-f", packages.deb_upgrade, "Version").strip() == f"{VERSION}-2"
    print(f"packaging/build, two releases (deb + rpm each): {packages.build_s:.1f} s")


def test_deb_files_and_modes(packages: Packages) -> None:
    py = packages.python
    entries = deb_listing(packages.deb)
    for path, mode in SYSTEM_FILES.items():
        assert entries[path][0] == mode, (path, entries.get(path))
    assert all(owner == "root/root" for _mode, owner, _target in entries.values())
    outside = {p for p in entries if not p.startswith(PREFIX)} - set(SYSTEM_FILES)
    assert outside <= {
        "/",
        "/etc",
        "/etc/llm-supervisor",
        "/opt",
        "/opt/llm-supervisor",
        "/usr",
        "/usr/bin",
        "/usr/lib",
        "/usr/lib/systemd",
        "/usr/lib/systemd/system",
        "/usr/lib/sysusers.d",
        "/usr/lib/tmpfiles.d",
        "/usr/share",
        "/usr/share/llm-supervisor",
    }, outside
    site = f"{PREFIX}/lib/python{py}/site-packages"
    for module in (
        "llmsupervisor/__main__.py",
        "llmsupervisor/doctor.py",
        "yaml/__init__.py",
        "psutil/__init__.py",
        "httpx/__init__.py",
        "pynvml.py",
        "prometheus_client/__init__.py",
        "sdnotify/__init__.py",
    ):
        assert f"{site}/{module}" in entries, module
    # The interpreter is the system's, by its versioned name; the package depends on exactly it.
    assert entries[f"{PREFIX}/bin/python{py}"][2] == f"/usr/bin/python{py}"
    assert entries[f"{PREFIX}/bin/python"][2] in ("python3", f"python{py}")
    assert not [p for p in entries if "__pycache__" in p or p.endswith(".pyc")]
    top_level = {
        p.removeprefix(site + "/").split("/")[0].split("-")[0] for p in entries if p.startswith(site + "/")
    }
    assert not top_level & {"vllm", "torch", "pip", "setuptools", "_distutils_hack"}, top_level


def test_deb_control_conffiles_and_scripts(packages: Packages, tmp_path: Path) -> None:
    run("dpkg-deb", "-e", packages.deb, tmp_path / "control")
    control = tmp_path / "control"
    assert (control / "conffiles").read_text().split() == ["/etc/llm-supervisor/config.yaml"]
    for script in ("postinst", "prerm", "postrm"):
        run("sh", "-n", control / script)  # syntax
        assert os.access(control / script, os.X_OK)
    postinst = (control / "postinst").read_text()
    for needed in (
        "systemd-sysusers /usr/lib/sysusers.d/llm-supervisor.conf",
        "systemd-tmpfiles --create /usr/lib/tmpfiles.d/llm-supervisor.conf",
        "if [ -d /run/systemd/system ]; then",
        "systemctl try-restart llm-supervisor.service",
    ):
        assert needed in postinst, needed
    # Never enabled or started by the package.
    assert not re.search(r"systemctl (--\S+ )*(enable|start|restart|reload-or-restart)\b", postinst)
    prerm = (control / "prerm").read_text()
    assert re.search(r"remove \| 0\)\s+if \[ -d /run/systemd/system \]; then\s+systemctl stop", prerm)


def test_relocated_venv_is_self_contained(extracted: Path) -> None:
    venv = extracted / PREFIX.lstrip("/")
    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines())
    assert cfg["home"] == "/usr/bin"
    assert cfg["command"].endswith(f"-m venv {PREFIX}")
    for script in (venv / "bin").iterdir():
        if script.is_symlink() or not os.access(script, os.X_OK):
            continue
        if script.read_bytes()[:4] == b"\x7fELF":
            continue  # a compiled program from a wheel (py-spy): no interpreter line to rewrite
        assert script.read_text().startswith(f"#!{PREFIX}/bin/python"), script
    for path in venv.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert b"build/pkg" not in data and str(REPO).encode() not in data, path
    # The tree runs where it lies (a venv finds its site-packages next to bin/), on the system python.
    probe = (
        "import llmsupervisor, yaml, psutil, httpx, pynvml, prometheus_client, sdnotify, sys; "
        "print(llmsupervisor.__file__); print(sys.prefix)"
    )
    done = subprocess.run(
        [venv / "bin" / "python", "-I", "-B", "-c", probe], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    module_file, prefix = done.stdout.split()
    assert module_file.startswith(str(venv)) and prefix == str(venv)
    wrapper = (extracted / "usr/bin/llm-supervisor").read_text()
    assert f"exec {PREFIX}/bin/python -I -m llmsupervisor" in wrapper
    unit = (extracted / "usr/lib/systemd/system/llm-supervisor.service").read_text()
    assert unit == (REPO / "systemd/llm-supervisor.service").read_text()
    assert f"ExecStart={PREFIX}/bin/python -m llmsupervisor" in unit
    assert (extracted / "etc/llm-supervisor/config.yaml").read_bytes() == (
        REPO / "etc/llm-supervisor/config.yaml"
    ).read_bytes()


# ---- the .rpm ---------------------------------------------------------------------------------


def rpm_query(rpm: Path, *args: str) -> str:
    return run("rpm", "-qp", *args, rpm, env={**os.environ, "LC_ALL": "C"})


def test_rpm_metadata_files_and_config(packages: Packages) -> None:
    require("rpm")
    name = rpm_query(packages.rpm, "--qf", "%{NAME} %{VERSION} %{RELEASE} %{ARCH}")
    assert name == f"llm-supervisor {VERSION} 1 x86_64"
    requires = rpm_query(packages.rpm, "-R").splitlines()
    assert f"python{packages.python}" in requires and "systemd >= 249" in requires
    assert rpm_query(packages.rpm, "-c").split() == ["/etc/llm-supervisor/config.yaml"]
    flags = {
        name: (fflags, perms)
        for name, fflags, perms in (
            line.split("\t")
            for line in rpm_query(
                packages.rpm, "--qf", "[%{FILENAMES}\t%{FILEFLAGS:fflags}\t%{FILEMODES:perms}\n]"
            ).splitlines()
        )
    }
    assert flags["/etc/llm-supervisor/config.yaml"] == ("cn", "-rw-r-----")  # %config(noreplace)
    for path, mode in SYSTEM_FILES.items():
        assert flags[path][1] == mode, path
    # The same files as the .deb (the deb also lists shared parents such as /usr/lib).
    rpm_files = set(rpm_query(packages.rpm, "-l").split())
    deb_files = set(deb_listing(packages.deb))
    assert rpm_files <= deb_files, rpm_files - deb_files
    assert {
        p for p in deb_files - rpm_files if p.startswith(("/opt/llm-supervisor", "/etc/llm-supervisor"))
    } == set()
    scripts = rpm_query(packages.rpm, "--scripts")
    for section in ("postinstall scriptlet", "preuninstall scriptlet", "postuninstall scriptlet"):
        assert section in scripts, section


# ---- a real install ---------------------------------------------------------------------------


SCENARIO_UNIT_NAME = "llmsup-scenario.service"
SCENARIO_UNIT = """\
[Unit]
Description=llm-supervisor package scenario (tests/host/test_packaging.py)
After=multi-user.target
SuccessAction=poweroff
FailureAction=poweroff

[Service]
Type=oneshot
ExecStart=/bin/bash /srv/llmsup-test/scenario.sh
TimeoutStartSec=240
"""


@contextlib.contextmanager
def nspawn_leftovers_removed(machine: str) -> Iterator[None]:
    # --register=no leaves /run/systemd/nspawn behind (docs/host-notes.md §5.5); remove what this run
    # made, and the shared directories only when empty, so a concurrent container keeps its own.
    base = Path("/run/systemd/nspawn")
    existed = base.exists()
    try:
        yield
    finally:
        shutil.rmtree(base / "propagate" / machine, ignore_errors=True)
        if not existed:
            for directory in (base / "propagate", base / "locks", base):
                with contextlib.suppress(OSError):
                    directory.rmdir()


def boot(rootfs: Path, binds: list[str], machine: str) -> tuple[int, str, float]:
    """Boot the container until the scenario powers it off; (exit code, console, seconds).

    ``--volatile=overlay``: every write lands in a tmpfs over the cached tree, which stays as
    debootstrap left it, so no per-run copy (300 MB, and dpkg's fsyncs behind its writeback).
    """
    argv = [
        "systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--private-network",
        "--volatile=overlay", f"--machine={machine}", f"--directory={rootfs}", *binds,
        "--console=pipe", "--boot",
        # Arguments to the container's systemd, read like a kernel command line: start the scenario.
        f"systemd.wants={SCENARIO_UNIT_NAME}",
    ]  # fmt: skip
    started = time.monotonic()
    with nspawn_leftovers_removed(machine):
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            console, _ = proc.communicate(timeout=BOOT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM asks the container to halt, a second one terminates it; SIGKILL would orphan
            # the container's init.
            for sig, grace_s in ((signal.SIGTERM, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                proc.send_signal(sig)
                try:
                    console, _ = proc.communicate(timeout=grace_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            console = (
                f"(timed out after {BOOT_TIMEOUT_S:g} s)\n{console if proc.returncode is not None else ''}"
            )
    return proc.wait(), console, time.monotonic() - started


def test_install_start_upgrade_remove_purge_in_a_booted_debian(packages: Packages, tmp_path: Path) -> None:
    require("debootstrap", "systemd-nspawn", root=True)
    rootfs, built_s = ensure_rootfs()
    inputs = tmp_path / "in"  # /srv/llmsup-test in the container, read-only
    (inputs / "pkgs").mkdir(parents=True)
    for deb in (packages.deb, packages.deb_upgrade):
        shutil.copy(deb, inputs / "pkgs")
    shutil.copy(REPO / "tests/lib/fake_vllm.py", inputs)
    shutil.copy(REPO / "tests/host/package_scenario.sh", inputs / "scenario.sh")
    (inputs / SCENARIO_UNIT_NAME).write_text(SCENARIO_UNIT)
    inputs.chmod(0o755)  # the service user runs the fake engine from here
    out, journal_dir = tmp_path / "out", tmp_path / "journal"
    out.mkdir()
    journal_dir.mkdir()
    binds = [
        f"--bind-ro={inputs}:/srv/llmsup-test",
        f"--bind-ro={inputs / SCENARIO_UNIT_NAME}:/etc/systemd/system/{SCENARIO_UNIT_NAME}",
        f"--bind={out}:/out",
        # The container's persistent journal, kept here for a failing run's post-mortem.
        f"--bind={journal_dir}:/var/log/journal",
    ]

    rc, console, boot_s = boot(rootfs, binds, f"llmsup-pkg-{os.getpid()}")
    print(f"rootfs build {built_s:.0f} s (0: cached), boot + scenario + poweroff {boot_s:.1f} s")
    scenario_log = (out / "scenario.log").read_text() if (out / "scenario.log").exists() else "(none)"
    context = (
        f"nspawn rc={rc}\n{console[-2000:]}\n--- scenario:\n{scenario_log[-6000:]}\n"
        f"--- container journal: journalctl --directory={journal_dir}"
    )
    assert rc == 0, context
    results = dict(line.split("=", 1) for line in (out / "results").read_text().splitlines() if "=" in line)
    assert results.get("done") == "1", context
    r = results

    # Installed: the user (in video for /dev/nvidia*), directories, config readable by the service.
    assert r["python"] == "3.11" and r["install_rc"] == "0", context
    assert re.fullmatch(
        r"uid=\d+\(llm-supervisor\) gid=\d+\(llm-supervisor\) groups=.*\bvideo\b.*", r["user"]
    ), r
    assert r["config_stat"] == "640 root:llm-supervisor"
    assert r["state_dir_stat"] == r["models_dir_stat"] == "750 llm-supervisor:llm-supervisor"
    assert r["venv_python"] == "/usr/bin/python3.11"
    assert int(r["pycache_count"]) > 50  # compiled by postinstall
    assert r["version_output"] == f"llm-supervisor {VERSION}"
    # Never enabled or started by the package.
    assert (r["enabled_after_install"], r["active_after_install"]) == ("disabled", "inactive"), r

    # doctor: the shipped example points at engines and GPUs that are not here; the real config passes.
    example = (out / "doctor-example.txt").read_text()
    assert r["doctor_example_rc"] == "1" and "FAIL  config: /etc/llm-supervisor/config.yaml:" in example, (
        example
    )
    doctor = (out / "doctor.txt").read_text()
    assert r["doctor_rc"] == "0", doctor
    assert "ok    user: checking for llm-supervisor" in doctor
    assert "ok    state_dir: /var/lib/llm-supervisor writable by llm-supervisor" in doctor
    assert "warn  nvml: no NVIDIA driver here" in doctor and "warn  devices:" in doctor

    # Started under systemd: READY=1 with STATUS=, running as the service user, both engines ready.
    assert (r["start_rc"], r["ready_rc"], r["active"]) == ("0", "0", "active"), context
    assert r["status_text"] == "2/2 engines ready"
    assert r["main_user"] == "llm-supervisor"
    assert r["status_rc"] == "0", (out / "status-err.txt").read_text()
    status = json.loads((out / "status.json").read_text())
    assert {n: (e["state"], e["port"]) for n, e in status["engines"].items()} == {
        "fake0": ("ready", 8000),
        "fake1": ("ready", 8001),
    }

    # journald: the unit's journal has both engines' forwarded lines; ENGINE=fake0 only fake0's.
    unit_journal = [json.loads(line) for line in (out / "journal.json").read_text().splitlines()]
    fake0 = [json.loads(line) for line in (out / "journal-fake0.json").read_text().splitlines()]
    assert {e.get("ENGINE") for e in unit_journal} >= {"fake0", "fake1"}
    assert fake0 and {e["ENGINE"] for e in fake0} == {"fake0"}
    assert {e["_SYSTEMD_UNIT"] for e in fake0} == {"llm-supervisor.service"}
    forwarded = [e for e in fake0 if e.get("SYSLOG_IDENTIFIER") == "vllm-fake0"]
    assert any("Starting vLLM server on http://127.0.0.1:8000" in e["MESSAGE"] for e in forwarded), fake0
    assert all(e.get("ENGINE_PID") == str(status["engines"]["fake0"]["pid"]) for e in forwarded)
    own = [e["MESSAGE"] for e in fake0 if e.get("SYSLOG_IDENTIFIER") == "llm-supervisor"]
    assert "STARTING -> READY: ready" in own, own
    assert len(fake0) < len([e for e in unit_journal if e.get("ENGINE")])

    # Upgrade to the rebuilt package: the admin's config stays, the running daemon restarts.
    assert (r["enable_rc"], r["upgrade_rc"], r["upgraded_version"]) == ("0", "0", f"{VERSION}-2"), context
    assert r["config_kept"] == "0" and r["config_stat_after_upgrade"] == "640 root:llm-supervisor"
    assert r["dpkg_dist_files"].split() == ["config.yaml"]  # no .dpkg-dist/.dpkg-new beside it
    assert (r["ready_after_upgrade_rc"], r["active_after_upgrade"], r["restarted_on_upgrade"]) == (
        "0",
        "active",
        "0",
    )

    # Remove: stopped, disabled, no process left, files gone; the conffile stays until purge.
    assert r["remove_rc"] == "0", (out / "remove.txt").read_text()
    assert r["leftovers_after_remove"].strip() == ""
    assert (r["active_after_remove"], r["load_state_after_remove"]) == ("inactive", "not-found")
    assert r["wants_link_after_remove"] == "0"
    assert "No such file or directory" in r["opt_after_remove"], r["opt_after_remove"]
    assert "No such file or directory" in r["wrapper_after_remove"]
    assert r["config_after_remove"].split() == ["config.yaml"]

    # Purge: the config is gone too, systemd knows no such unit, nothing runs.
    assert r["purge_rc"] == "0", (out / "purge.txt").read_text()
    assert "no packages found" in r["dpkg_status_after_purge"]
    assert "No such file or directory" in r["etc_after_purge"]
    assert r["unit_files_after_purge"] == "0"
    assert r["leftovers_after_purge"].strip() == ""
