"""Atomic file output: every artifact, WAV, JSON and .npy the runtime writes goes through here,
so a failure halfway never leaves a partial file and never replaces a good one."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import InputError


def _umask() -> int:
    """The process umask, read without changing it where the OS says it (Linux); elsewhere set and put back,
    which another thread creating a file at that instant could see."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_mode(directory: bool = False) -> int:
    """The mode a plain ``open(..., "w")`` (0o666) or ``mkdir`` (0o777) gives a new file or directory under
    this process's umask: for writers that create their files through a temp file (``tempfile``, safetensors),
    which makes them 0o600."""
    return (0o777 if directory else 0o666) & ~_umask()


def _final_mode(path: Path) -> int:
    """The mode a plain ``open(path, "w")`` would leave: an existing file keeps its own, a new one gets
    0o666 less the umask. ``mkstemp`` creates 0o600, which would hide every output from the user's group."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return plain_mode()


def temp_dir_beside(out: Path, prefix: str, suffix: str = "") -> Path:
    """A new empty directory beside ``out``, to be filled and then renamed onto it, with the mode a plain
    ``mkdir`` would give (``mkdtemp`` makes 0o700)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=out.parent))
    os.chmod(tmp, plain_mode(directory=True))
    return tmp


def check_output_path(path: str | os.PathLike, flag: str, directory: bool = False) -> Path:
    """Fail before any work where an output could not be written at its end: ``path`` names an existing
    directory (a file output) or file (a directory output), or its nearest existing ancestor is a file or
    not writable. Missing directories in between are fine: the writers create them."""
    path = Path(path)
    if not directory and path.is_dir():
        raise InputError(f"{flag} {path}: is a directory; give the path of the file to write")
    if directory and path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path}: is a file; give the path of a directory to write")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is a file, not a directory; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: {parent} is not writable; choose another path")
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(fh)`` on a temp file beside ``path`` (binary mode), fsync it, then rename
    it over ``path``. On any exception the temp file is removed and ``path`` is untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fchmod(fh.fileno(), _final_mode(path))
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_png(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """A matplotlib figure laid out and written to ``path`` as PNG through ``atomic_write``, then closed (also
    when writing fails): the benchmarks' plots."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
    finally:
        plt.close(fig)
