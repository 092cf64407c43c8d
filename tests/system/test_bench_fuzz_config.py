"""bench/fuzz_config.py (issue 17) run as a command, bounded: a fixed seed and a fixed count of
inputs, none of which may end in anything but a ``ConfigError`` naming file and line. Each class
of input it found is a unit test (tests/unit/config/test_config_fuzz_cases.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.lib.paths import REPO


def test_a_bounded_run_of_the_fuzzer_finds_nothing(tmp_path: Path) -> None:
    """The fuzzer itself, in CI: a fixed seed and a fixed count (seconds on 2 cores), so every
    run tries the same inputs; `bench/fuzz_config.py --seconds N` is the open-ended hunt."""
    fuzzer = REPO / "bench" / "fuzz_config.py"
    counts = tmp_path / "counts.json"
    done = subprocess.run(
        [
            sys.executable,
            str(fuzzer),
            "--inputs",
            "1000",
            "--seed",
            "17",
            "--seconds",
            "600",
            "--json",
            str(counts),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failures: 0" in done.stdout
