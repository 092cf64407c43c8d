"""The fleet view against real daemons: `llm-supervisor status --host URL ...` (and
``--hosts-file``) reads two daemons' /status over HTTP, with fake vLLM engines, plus a URL where
nothing listens: one table with a HOST column, the unreachable host a row, exit code 1."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lib.daemon import Daemon, fake_engine, free_port

pytestmark = pytest.mark.system


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmsupervisor", "status", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


@pytest.fixture
def two_daemons(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    """Two hosts' daemons: each its own state dir and HTTP listener, as on two machines."""
    (tmp_path / "h1").mkdir()
    (tmp_path / "h2").mkdir()
    h1 = Daemon(tmp_path / "h1", {"engines": [fake_engine("gpu0", free_port())]})
    h2 = Daemon(
        tmp_path / "h2",
        {
            "engines": [
                fake_engine("gpu0", free_port()),
                fake_engine("bad", free_port(), fake_crash_after_s=0.2, fake_exit_code=1, max_failures=2),
            ]
        },
    )
    yield h1, h2
    for d in (h1, h2):
        d.cleanup()


def test_one_table_for_two_daemons_and_an_unreachable_host(two_daemons, tmp_path: Path) -> None:
    h1, h2 = two_daemons
    h1.start()
    h2.start()
    h1.wait_state("gpu0", "ready")
    h2.wait_state("gpu0", "ready")
    nowhere = f"http://127.0.0.1:{free_port()}"

    both = status("--host", h1.http_url, "--host", h2.http_url, "gpu0")
    assert both.returncode == 0, both.stdout + both.stderr
    rows = [line.split()[:3] for line in both.stdout.splitlines()]
    assert rows == [
        ["HOST", "ENGINE", "STATE"],
        [h1.http_url, "gpu0", "READY"],
        [h2.http_url, "gpu0", "READY"],
    ]

    h2.wait_state("bad", "fatal")
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(f"# the fleet\n{h1.http_url}\n{h2.http_url}  # two engines\n{nowhere}\n")
    fleet = status("--hosts-file", str(hosts_file), "--deadline", "2")
    assert fleet.returncode == 1
    rows = [line.split()[:3] for line in fleet.stdout.splitlines()[1:]]
    assert rows == [
        [h1.http_url, "gpu0", "READY"],
        [h2.http_url, "gpu0", "READY"],
        [h2.http_url, "bad", "FATAL"],
        [nowhere, "-", "unreachable"],
    ]
    assert f"{nowhere}: unreachable:" in fleet.stderr and f"{h2.http_url}: bad is FATAL" in fleet.stderr

    as_json = json.loads(status("--host", h1.http_url, "--host", nowhere, "--json").stdout)
    assert as_json[h1.http_url]["engines"]["gpu0"]["state"] == "ready"
    assert "unreachable" in as_json[nowhere]
    for d in (h1, h2):
        assert d.stop() == 0
