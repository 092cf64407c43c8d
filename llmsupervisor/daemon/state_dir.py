"""Whom the state dir lets in, checked before the daemon uses it (issue 38).

The daemon (root, often) creates files in the state dir, and its engines load a compile cache
from it (``engines/NAME/vllm-cache``): whoever can write in it could make root create files
elsewhere through a planted symbolic link (``engines/b`` -> elsewhere), or hand root's engines
code to load. So at start, before the lock (cli/main.py)::

    the state dir is                              the daemon
    ──────────────────────────────────────────────────────────────────────────────────────────
    missing                                       creates it, mode 0750 (its parents as mkdir -p)
    the daemon's user's or root's, writable by    uses it
      no one else
    the daemon's user's, writable by group or     takes the write bits away (chmod g-w,o-w),
      others                                      and warns
    root's, writable by group or others, the      warns loudly, at every start, and uses it: a
      daemon not root                             Kubernetes emptyDir is made so (root's, 0777,
                                                  the pod's fsGroup), and it cannot change it
    another user's                                refuses to start (EX_CONFIG, 78: systemd does
                                                  not restart it in a loop)
    not a directory                               refuses to start (EX_CONFIG)

Refused, not warned, when another user owns it: that user can change anything in it (modes
included), a warning stops nothing, and the fix is one ``chown``. Whatever the top directory,
nothing below it is trusted: files.open_directory opens each directory under its parent's
descriptor without following a link and requires the daemon's own user, state files are opened
``O_NOFOLLOW``, and so is the engine's step heartbeat; a link planted anyway is refused and
logged (a state file not written, an engine that does not start), never followed.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
from pathlib import Path

from llmsupervisor.errors import UnsafeStateDir
from llmsupervisor.files import DIRECTORY_MODE

log = logging.getLogger("llmsupervisor")

OPEN_BITS = stat.S_IWGRP | stat.S_IWOTH


def judge(st: os.stat_result, *, uid: int) -> tuple[str | None, str | None]:
    """(why the daemon running as ``uid`` must not use a state dir with this ``stat``, a warning
    about it); both None when it is fine. Pure: ``prepare`` acts on it, `doctor` reports it."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory", None
    if st.st_uid not in (uid, 0):
        return (
            f"owned by {_user(st.st_uid)}, not by the daemon's user ({_user(uid)}) or root: that user"
            " could redirect the daemon's writes and replace what its engines load; chown it",
            None,
        )
    if st.st_mode & OPEN_BITS and st.st_uid != uid:
        return None, (
            f"writable by {_who(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o}, owned by root): anyone"
            " who can write there can remove the daemon's files (it follows no link in it and uses only"
            " directories of its own); a Kubernetes emptyDir is made so"
        )
    return None, None


def prepare(state_dir: Path) -> list[str]:
    """Create ``state_dir`` (mode 0750) if missing, tighten it if the daemon owns it and others
    may write in it, and return what to warn about. Raises UnsafeStateDir (refused: exit
    EX_CONFIG) or OSError (it cannot be created or looked at)."""
    warnings: list[str] = []
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(state_dir, DIRECTORY_MODE)
        os.chmod(state_dir, DIRECTORY_MODE)  # exactly, whatever the umask
    except FileExistsError:
        pass
    st = os.stat(state_dir)  # the configured path is trusted: its own links are followed
    uid = os.geteuid()
    refusal, warning = judge(st, uid=uid)
    if refusal is not None:
        raise UnsafeStateDir(state_dir, refusal)
    if warning is not None:
        warnings.append(f"state dir {state_dir} is {warning}")
    elif st.st_mode & OPEN_BITS:  # the daemon's own: it closes it
        mode = stat.S_IMODE(st.st_mode)
        os.chmod(state_dir, mode & ~OPEN_BITS)
        warnings.append(
            f"state dir {state_dir} was writable by {_who(st.st_mode)} (mode {mode:04o}); now"
            f" {mode & ~OPEN_BITS:04o}: nobody else may create files where the daemon writes"
        )
    return warnings


def _who(mode: int) -> str:
    return " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others")) if mode & bit)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


__all__ = ["judge", "prepare"]
