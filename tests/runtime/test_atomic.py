"""Atomic outputs get the modes a plain write would give.

``tempfile.mkstemp`` and ``mkdtemp`` create 0o600 files and 0o700 directories; renamed into place as they
were, every WAV, feature artifact, tiny checkpoint and turn-head run was unreadable to the user's group.
"""
import os
import stat

import pytest

from minicpmo_rt.atomic import atomic_write, temp_dir_beside

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_new_file_gets_0666_less_the_umask(tmp_path, umask_022):
    out = atomic_write(tmp_path / "a.bin", lambda fh: fh.write(b"x"))
    assert out.read_bytes() == b"x" and _mode(out) == 0o644


def test_a_replaced_file_keeps_its_own_mode(tmp_path, umask_022):
    out = tmp_path / "b.bin"
    out.write_bytes(b"old")
    os.chmod(out, 0o640)
    atomic_write(out, lambda fh: fh.write(b"new"))
    assert out.read_bytes() == b"new" and _mode(out) == 0o640


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, umask_022):
    out = tmp_path / "c.bin"
    out.write_bytes(b"good")

    def boom(fh):
        fh.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(out, boom)
    assert out.read_bytes() == b"good" and sorted(p.name for p in tmp_path.iterdir()) == ["c.bin"]


def test_a_temp_dir_gets_0777_less_the_umask(tmp_path, umask_022):
    d = temp_dir_beside(tmp_path / "run", prefix=".run.", suffix=".tmp")
    assert d.parent == tmp_path and d.name.startswith(".run.") and d.name.endswith(".tmp")
    assert _mode(d) == 0o755


def test_the_tiny_checkpoint_is_readable_by_the_group(tmp_path, umask_022):
    from minicpmo_rt.snapshot_tools import make_tiny

    out = make_tiny(tmp_path / "tiny", seed=0)
    assert _mode(out) == 0o755
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and all(_mode(p) & 0o044 == 0o044 for p in files), [(p.name, oct(_mode(p))) for p in files]
