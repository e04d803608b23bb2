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


def test_check_output_path_names_what_cannot_be_written(tmp_path):
    from minicpmo_rt.atomic import check_output_path
    from minicpmo_rt.errors import InputError

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert check_output_path(tmp_path / "new" / "deeper" / "out.wav", "--output") == tmp_path / "new/deeper/out.wav"
    assert check_output_path(tmp_path / "run", "--out", directory=True) == tmp_path / "run"
    with pytest.raises(InputError, match=r"--output .*afile is a file, not a directory"):
        check_output_path(afile / "sub" / "out.wav", "--output")
    with pytest.raises(InputError, match=r"--output .*: is a directory; give the path of the file"):
        check_output_path(tmp_path, "--output")
    with pytest.raises(InputError, match=r"--out .*afile: is a file; give the path of a directory"):
        check_output_path(afile, "--out", directory=True)
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user that may write anywhere (root): the permission check cannot fail here")
        with pytest.raises(InputError, match="is not writable"):
            check_output_path(locked / "out.wav", "--output")
    finally:
        os.chmod(locked, 0o755)


def test_jobs_check_their_outputs_before_any_work(tiny_ckpt, tmp_path):
    """An output under a file failed with FileExistsError after the whole Thinker -> Talker run (or the
    Code2Wav solve, the targets, the training); now each job names it before loading anything."""
    from typer.testing import CliRunner

    from minicpmo_rt.cli import app

    afile = tmp_path / "afile"
    afile.write_text("x")
    bad = str(afile / "out")
    voice = str(tmp_path / "v.wav")       # never read: the output check comes first
    codes = tmp_path / "codes.json"
    codes.write_text("[1, 2, 3]")
    cases = [
        ["talker", "--model", str(tiny_ckpt), "--text", "hi", "--codes-out", bad + ".json"],
        ["code2wav", "--model", str(tiny_ckpt), "--codes", str(codes), "--voice", voice, "--output", bad + ".wav"],
        ["make-targets", "--easycom-root", str(tmp_path), "--session", "1", "--output", bad + ".npy"],
        ["make-tiny", bad],
        ["train-turn-head", "--feature-root", str(tmp_path), "--out", bad],
        ["features", "--model-id", str(tiny_ckpt), "--easycom-session-dir", str(tmp_path), "--mode", "native-1hz-hold",
         "--output", bad + ".pt"],
    ]
    for argv in cases:
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 2 and "afile is a file, not a directory" in res.output, (argv[0], res.output)


def test_speak_checks_both_outputs_before_any_work(tiny_ckpt, voice, tmp_path):
    from typer.testing import CliRunner

    from minicpmo_rt.cli import app

    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["speak", "--model", str(tiny_ckpt), "--text", "hi", "--voice", str(voice)]
    for extra in (["--output", str(afile / "o.wav")],
                  ["--output", str(tmp_path / "o.wav"), "--codes-out", str(afile / "c.json")]):
        res = CliRunner().invoke(app, base + extra)
        assert res.exit_code == 2 and "afile is a file, not a directory" in res.output, res.output
    assert not (tmp_path / "o.wav").exists()


def test_save_png_writes_whole_or_not_at_all_and_closes_the_figure(tmp_path):
    """The benchmarks' plots: a PNG in place and the figure closed; a figure that fails to draw leaves the
    previous file as it was, no temp file beside it, and is closed too."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from minicpmo_rt.atomic import save_png

    out = tmp_path / "p.png"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_png(fig, out)
    good = out.read_bytes()
    assert good[:8] == b"\x89PNG\r\n\x1a\n" and not plt.fignum_exists(fig.number)
    bad, ax = plt.subplots()
    ax.text(0.5, 0.5, "$\\notacommand$")     # mathtext fails at draw time
    with pytest.raises(ValueError):
        save_png(bad, out)
    assert out.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["p.png"]
    assert not plt.fignum_exists(bad.number)
