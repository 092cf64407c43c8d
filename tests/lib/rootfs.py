"""Host tools for the packaging tier, and the Debian 12 rootfs it boots (built once with debootstrap
into ~/.cache/llm-supervisor/rootfs-bookworm; the container test imports it as a base image)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

ROOTFS_CACHE = Path(
    os.environ.get("LLMSUP_ROOTFS_CACHE", Path.home() / ".cache/llm-supervisor/rootfs-bookworm")
)
ROOTFS_INCLUDE = ("systemd", "systemd-sysv", "dbus", "python3", "procps")
DEBIAN_MIRROR = os.environ.get("LLMSUP_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def require(*tools: str, root: bool = False) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if root and os.geteuid() != 0:
        missing.append("root")
    if not missing:
        return
    message = (
        f"needs {', '.join(missing)} (scripts/test installs the tools: debootstrap systemd-container rpm)"
    )
    if os.environ.get("LLMSUP_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{message}; required with LLMSUP_REQUIRE_TOOLS=1")
    pytest.skip(message)


def run(*argv: str | Path, **kwargs: Any) -> str:
    done: subprocess.CompletedProcess[str] = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, check=False, **kwargs
    )
    assert done.returncode == 0, (
        f"{argv} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def ensure_rootfs() -> tuple[Path, float]:
    """The cached bookworm rootfs, built now if missing; (path, seconds spent building it)."""
    stamp_text = " ".join(ROOTFS_INCLUDE) + "\n"
    stamp = ROOTFS_CACHE / ".llmsup-rootfs"
    if stamp.exists() and stamp.read_text() == stamp_text:
        return ROOTFS_CACHE, 0.0
    ROOTFS_CACHE.parent.mkdir(parents=True, exist_ok=True)
    with open(ROOTFS_CACHE.parent / f"{ROOTFS_CACHE.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others wait and reuse it
        if stamp.exists() and stamp.read_text() == stamp_text:
            return ROOTFS_CACHE, 0.0
        for stale in ROOTFS_CACHE.parent.glob(f"{ROOTFS_CACHE.name}.tmp-*"):
            shutil.rmtree(stale)  # a build that was killed; ours holds the lock
        tmp = ROOTFS_CACHE.parent / f"{ROOTFS_CACHE.name}.tmp-{os.getpid()}"
        started = time.monotonic()
        run(
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(ROOTFS_INCLUDE)}",
            "bookworm",
            tmp,
            DEBIAN_MIRROR,
            timeout=1800,
        )
        assert (tmp / "usr/bin/python3.11").exists(), "bookworm's python3 is 3.11"
        (tmp / ".llmsup-rootfs").write_text(stamp_text)
        if ROOTFS_CACHE.exists():  # an older include list
            old = ROOTFS_CACHE.parent / f"{ROOTFS_CACHE.name}.tmp-old-{os.getpid()}"
            ROOTFS_CACHE.rename(old)
            shutil.rmtree(old)
        tmp.rename(ROOTFS_CACHE)
        return ROOTFS_CACHE, time.monotonic() - started
