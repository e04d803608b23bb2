"""Atomic file output: every artifact, WAV, JSON and .npy the runtime writes goes through here,
so a failure halfway never leaves a partial file and never replaces a good one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(fh)`` on a temp file beside ``path`` (binary mode), fsync it, then rename
    it over ``path``. On any exception the temp file is removed and ``path`` is untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
