"""Fixtures for every tier (their code lives in tests/lib)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lib.daemon import Daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    made: list[Daemon] = []

    def make(config: dict[str, Any], *, name: str = "daemon", run_args: tuple[str, ...] = ()) -> Daemon:
        d = Daemon(tmp_path, config, name=name, run_args=run_args)
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()
