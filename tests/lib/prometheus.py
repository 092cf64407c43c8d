"""Prometheus and Alertmanager for the fleet tier: the tools (skipped where missing, failed under
LLMSUP_REQUIRE_TOOLS=1) and the shipped alert rules made quick."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

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
