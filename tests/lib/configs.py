"""A config file written for a test of the CLI or doctor: the given engines, a state dir and an
HTTP listener of the test's own (shared by tests/unit/cli/test_doctor.py and test_doctor_nvml.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.lib.daemon import free_port


def write_config(tmp_path: Path, engines: list[dict[str, object]], **supervisor: object) -> Path:
    path = tmp_path / "config.yaml"
    settings = {"state_dir": str(tmp_path / "state"), "http_listen": f"127.0.0.1:{free_port()}", **supervisor}
    path.write_text(yaml.safe_dump({"supervisor": settings, "engines": engines}, sort_keys=False))
    return path
