"""A disk that holds a write: ``os.fsync`` blocks until the test releases it, as when the kernel is
flushing for another writer (on CI an ext4 journal commit behind an engine's compile cache held a
ladder write ~7 s). For the tests that a save never waits on the event loop."""

from __future__ import annotations

import os
import threading

import pytest


class HeldDisk:
    """``os.fsync`` held until ``release()``; ``entered`` is set once a write reached it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            self.entered.set()
            if not self._released.wait(30):
                raise AssertionError("the disk was never released: save() waited on the loop")
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def release(self) -> None:
        self._released.set()
