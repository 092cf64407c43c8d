"""Fixtures for every tier (their code lives in tests/lib)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lib.daemon import Daemon
from tests.lib.sd_notify import Receiver


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


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(tmp_path / "notify")
    yield r
    r.close()
