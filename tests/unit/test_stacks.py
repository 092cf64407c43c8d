"""The py-spy dumper (stacks.py) without a process to dump: no py-spy is an answer, not an error.
py-spy over real processes (live, stopped, gone; a stuck py-spy cut at its deadline) is a system
test, tests/system/test_stack_dumps.py; what an engine's evidence does with the stacks:
tests/unit/engine/test_evidence.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from llmsupervisor.stacks import dump_stacks


def test_no_py_spy_is_none_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llmsupervisor.stacks.find_py_spy", lambda: None)
    assert asyncio.run(dump_stacks([os.getpid()], timeout_s=1)) is None
