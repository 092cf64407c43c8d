"""The daemon as a container's main process, under podman: build
packaging/kubernetes/Containerfile.debian from a local Debian bookworm image (the packaging
tier's debootstrap rootfs, imported: no registry is needed), run it with a fake vLLM engine, and
check /livez and /readyz answer from outside the container and that `podman stop` (SIGTERM to
the daemon as PID 1) ends it with exit code 0 after stopping its engine.

Opt-in: skipped when podman is missing (CI does not install it) or not root. The production
Containerfile (vLLM's CUDA image) is not built here: that image cannot be pulled offline.

This sandbox needs two workarounds, applied whenever they apply (docs/fleet.md, "The container
image"): ``runc`` instead of crun (crun refuses the hybrid cgroup v1/v2 layout), and explicit
``--ulimit`` values at or below the current hard limits (podman's default RLIMIT_NOFILE of
1048576 is above this sandbox's hard limit).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.lib.daemon import free_port, wait_for
from tests.lib.paths import REPO
from tests.lib.rootfs import ensure_rootfs

pytestmark = pytest.mark.packaging

BASE_IMAGE = "localhost/debian-bookworm"


def podman_flags() -> list[str]:
    flags = ["--runtime", "runc"] if shutil.which("runc") else []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 65536)
    nproc = 4096 if nproc == resource.RLIM_INFINITY else min(nproc, 4096)
    return [*flags, "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def podman(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=False, timeout=timeout_s)


@pytest.fixture
def image(tmp_path: Path) -> Iterator[str]:
    if shutil.which("podman") is None:
        pytest.skip("podman not installed (opt-in: apt-get install -y podman runc)")
    if os.geteuid() != 0:
        pytest.skip("rootful podman only here")
    if shutil.which("debootstrap") is None and not Path.home().joinpath(".cache/llm-supervisor").exists():
        pytest.skip("no bookworm rootfs (debootstrap missing)")
    if podman("image", "exists", BASE_IMAGE).returncode != 0:
        rootfs, _ = ensure_rootfs()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            ["podman", "import", "-", BASE_IMAGE], stdin=tar.stdout, capture_output=True
        )
        tar.wait()
        assert imported.returncode == 0, imported.stderr
    context = tmp_path / "context"
    context.mkdir()
    wheels = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(context / "wheels"), str(REPO)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if wheels.returncode != 0:
        pytest.skip(f"cannot build the wheels (offline?): {wheels.stderr[-500:]}")
    shutil.copy(REPO / "tests" / "lib" / "fake_vllm.py", context / "fake_vllm.py")
    tag = f"localhost/llm-supervisor-test:{os.getpid()}"
    built = podman(
        "build",
        *podman_flags(),
        "--network=none",
        "-f",
        str(REPO / "packaging" / "kubernetes" / "Containerfile.debian"),
        "-t",
        tag,
        str(context),
    )
    assert built.returncode == 0, built.stdout + built.stderr
    yield tag
    podman("rmi", "-f", tag)


def test_the_daemon_runs_as_the_containers_main_process(image: str, tmp_path: Path) -> None:
    http_port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "supervisor": {"http_listen": f"127.0.0.1:{http_port}"},
                "engines": [
                    {
                        "name": "gpu0",
                        "model": "tiny",
                        "port": free_port(),
                        "command": ["python3", "/opt/fake_vllm.py"],
                        "drain_grace_s": 0.2,
                    }
                ],
            }
        )
    )
    name = f"llmsup-test-{os.getpid()}"
    started = podman(
        "run",
        *podman_flags(),
        "-d",
        "--name",
        name,
        "--network=host",  # the test reaches /livez on loopback, as a kubelet reaches the pod's IP
        "-v",
        f"{config}:/etc/llm-supervisor/config.yaml:ro",
        image,
    )
    try:
        assert started.returncode == 0, started.stderr
        base = f"http://127.0.0.1:{http_port}"

        def answers(path: str) -> int | None:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(base + path, timeout=2).status_code
            return None

        wait_for(lambda: answers("/livez") == 200, timeout_s=60, what="/livez from the container")
        wait_for(lambda: answers("/readyz") == 200, timeout_s=60, what="/readyz: the engine in rotation")
        assert httpx.get(base + "/status", timeout=2).json()["engines"]["gpu0"]["state"] == "ready"
        stopped = podman("stop", "-t", "30", name)
        assert stopped.returncode == 0, stopped.stderr
        assert podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"
        logs = podman("logs", name).stdout + podman("logs", name).stderr
        assert "all engines stopped; no engine process left" in logs
    finally:
        podman("rm", "-f", name)
