"""A state filesystem with no free block, for unit tests: every write of a regular file fails
with ENOSPC at its ``fsync`` (where a filesystem with delayed allocation reports it) until
``free()``. Removing a file, opening a directory and renaming still work, as on a real full disk.
The system tier fills a real tmpfs instead (tests/system/test_full_disk_system.py)."""

from __future__ import annotations

import errno
import os
import stat
import threading

import pytest


class FullDisk:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, full: bool = True) -> None:
        self._full = threading.Event()
        if full:
            self._full.set()
        self.refused = 0  # writes refused so far (the writers' attempts while full)
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if self._full.is_set() and stat.S_ISREG(os.fstat(fd).st_mode):
                self.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def fill(self) -> None:
        self._full.set()

    def free(self) -> None:
        self._full.clear()
