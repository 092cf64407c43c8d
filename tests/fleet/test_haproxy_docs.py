"""The complete HAProxy configurations in docs/load-balancers.md are valid for Debian's HAProxy
(``haproxy -c``): a recipe someone copies must load as written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.lib.haproxy import haproxy

pytestmark = pytest.mark.system

DOC = Path(__file__).resolve().parents[2] / "docs" / "load-balancers.md"


def complete_configs() -> list[str]:
    blocks = re.findall(r"```haproxy\n(.*?)```", DOC.read_text(), re.S)
    return [b for b in blocks if b.startswith("global") and "\ndefaults" in b]


def test_the_docs_hold_a_complete_recipe() -> None:
    assert complete_configs(), "docs/load-balancers.md lost its complete HAProxy recipe"


@pytest.mark.parametrize("config", complete_configs())
def test_each_complete_recipe_loads(config: str, tmp_path: Path) -> None:
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    done = subprocess.run([haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
