"""Prometheus and Alertmanager for the fleet tier: the tools (skipped where missing, failed under
LLMSUP_REQUIRE_TOOLS=1), the shipped alert rules made quick, each server started on a free port
with its log in the test's folder, and ``Posts``, a local endpoint that keeps what is posted to
it (Alertmanager's webhook receiver, or a stand-in for Alertmanager itself)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.lib.daemon import free_port
from tests.lib.paths import REPO

ALERTS = REPO / "packaging" / "prometheus" / "alerts.yml"


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("LLMSUP_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{name} is required (LLMSUP_REQUIRE_TOOLS=1): apt-get install -y {package}")
        pytest.skip(f"{name} not installed (apt-get install -y {package})")
    return path


def fast_rules(path: Path) -> None:
    """alerts.yml with every ``for:`` cut to 2 s: the expressions are the shipped ones."""
    text = re.sub(r"^(\s+for:) \S+$", r"\1 2s", ALERTS.read_text(), flags=re.MULTILINE)
    path.write_text(text)
    assert yaml.safe_load(text)["groups"]


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A helper server, its stderr to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out)


def start_prometheus(
    binary: str, folder: Path, *, targets: list[str], alertmanager_port: int
) -> tuple[subprocess.Popen[bytes], str]:
    """Prometheus scraping ``targets`` (job ``llm-supervisor``) every second with the shipped rules
    made quick, evaluated every second and sent to the Alertmanager on ``alertmanager_port``
    (re-sent every second); its data and log in ``folder``. The process and its URL."""
    rules = folder / "rules.yml"
    fast_rules(rules)
    port = free_port()
    config = folder / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "alerting": {
                    "alertmanagers": [
                        {
                            "api_version": "v2",
                            "static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}],
                        }
                    ]
                },
                "scrape_configs": [
                    {
                        "job_name": "llm-supervisor",
                        "scrape_timeout": "1s",
                        "static_configs": [{"targets": targets}],
                    }
                ],
            }
        )
    )
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={folder / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--rules.alert.resend-delay=1s",
    ]
    return start(argv, folder / "prometheus.log"), f"http://127.0.0.1:{port}"


def start_alertmanager(
    binary: str, folder: Path, *, webhook_port: int
) -> tuple[subprocess.Popen[bytes], int]:
    """A single Alertmanager (no gossip mesh) that groups by alert, instance and engine, waits
    1 s before a group's first notification, and posts every one (resolved too) to the webhook
    on ``webhook_port``; its data and log in ``folder``. The process and its port."""
    port = free_port()
    config = folder / "alertmanager.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "route": {
                    "receiver": "test",
                    "group_by": ["alertname", "instance", "engine"],
                    "group_wait": "1s",
                    "group_interval": "1s",
                    "repeat_interval": "1h",
                },
                "receivers": [
                    {
                        "name": "test",
                        "webhook_configs": [
                            {"url": f"http://127.0.0.1:{webhook_port}/hook", "send_resolved": True}
                        ],
                    }
                ],
            }
        )
    )
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.path={folder / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",  # a single Alertmanager: no gossip mesh
    ]
    return start(argv, folder / "alertmanager.log"), port


class Posts:
    """A local HTTP endpoint that answers every POST 200 and keeps its body, with the time it
    arrived (monotonic) and its path."""

    def __init__(self) -> None:
        self._posts: list[tuple[float, str, bytes]] = []
        self._lock = threading.Lock()
        posts = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with posts._lock:
                    posts._posts.append((time.monotonic(), self.path, body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def bodies(self, path: str | None = None) -> list[tuple[float, Any]]:
        """(arrived, the JSON body) of each post so far, in order; only to ``path`` if given."""
        with self._lock:
            posts = list(self._posts)
        return [(arrived, json.loads(body)) for arrived, at, body in posts if path is None or at == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
