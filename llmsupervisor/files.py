"""Small state files: written atomically (a reader never sees half a file), read forgivingly."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON to a temporary file beside ``path``, then rename it over ``path``.
    Raises OSError (a full or read-only disk): the caller decides whether that matters."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=indent) + "\n")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path, default: Any = None) -> Any:
    """The file's JSON, or ``default`` when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default
