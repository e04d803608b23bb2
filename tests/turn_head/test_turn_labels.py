"""Targets from a hand-made EasyCom transcript against hand-computed rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minicpmo_rt.errors import InputError
from minicpmo_rt.turn_head import labels as L


def _write(root, session, name, utts):
    d = root / "Speech_Transcriptions" / session
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"Participant_ID": p, "Transcription": "x", "Start_Frame": s, "End_Frame": e,
             "Target_of_Speech": "Group"} for p, s, e in utts]
    (d / f"{name}.json").write_text(json.dumps(rows))


@pytest.fixture
def session(tmp_path):
    # Three files and no media, so durations come from the names: 00-00-000 runs to the next
    # name (2.5 s); after 00-02-500 the names jump 67.5 s (> 61 s), so it gets the nominal
    # 60 s and a cut follows it at media time 62.5 s (inside the bin (62.4, 62.6]); the last
    # file is nominal too: media [62.5, 122.5) for session clock [70.0, 130.0).
    _write(tmp_path, "Session_3", "00-00-000", [
        (2, 1, 21),      # wearer: frames 1..21 -> [0.0, 1.0)
        (3, 25, 41),     # partner 3: [1.2, 2.0)
    ])
    _write(tmp_path, "Session_3", "00-02-500", [
        (3, 3, 11),      # partner 3, local frames 3..11 at media offset 2.5: [2.6, 3.0)
        ("4", 11, 12),   # partner 4 (string id): [3.0, 3.05) -> 0.25 of a bin, inactive
    ])
    _write(tmp_path, "Session_3", "01-10-000", [
        (2, 1, 41),      # wearer [62.5, 64.5) on the media axis
    ])
    return tmp_path


def test_offsets_frames_and_cut(session):
    tr = L.read_session(session, 3)
    assert [s.name for s in tr.segments] == ["00-00-000", "00-02-500", "01-10-000"]
    assert [s.name_start for s in tr.segments] == [0.0, 2.5, 70.0]
    assert [round(s.offset, 6) for s in tr.segments] == [0.0, 2.5, 62.5]
    assert [round(s.duration, 6) for s in tr.segments] == [2.5, 60.0, 60.0]
    assert [s.cut_after for s in tr.segments] == [False, True, False]
    spans = sorted((u.participant, round(u.start, 6), round(u.end, 6)) for u in tr.utterances)
    assert spans == [(2, 0.0, 1.0), (2, 62.5, 64.5), (3, 1.2, 2.0), (3, 2.6, 3.0), (4, 3.0, 3.05)]

    arr = L.build_targets(tr)
    assert arr.dtype == L.TARGET_DTYPE
    assert arr.size == 612  # floor(122.5 / 0.2)
    np.testing.assert_allclose(arr["time"][:3], [0.2, 0.4, 0.6])
    np.testing.assert_allclose(arr["session_time"][[0, 313]], [0.2, 70.3])
    # wearer rows (0, 0.2] .. (0.8, 1.0] active; (1.0, 1.2] not
    assert arr["wearer"][:6].tolist() == [1, 1, 1, 1, 1, 0]
    # partner: (1.2,1.4]..(1.8,2.0] -> rows 6..9; (2.6,2.8],(2.8,3.0] -> rows 13,14;
    # partner 4's 50 ms in (3.0, 3.2] is 0.25 coverage -> inactive
    assert np.nonzero(arr["partner"][:20])[0].tolist() == [6, 7, 8, 9, 13, 14]
    assert arr["partner_frac"][15] == pytest.approx(0.25)
    # future bins of row 0 (t=0.2): wearer (0.2,0.4] yes, (0.4,0.8] yes, (0.8,1.4] 0.2/0.6 no, (1.4,2.2] no
    assert [arr[f"wearer_f{k}"][0] for k in range(4)] == [1, 1, 0, 0]
    # partner at t=0.4: (0.4,0.6] no, (0.6,1.0] no, (1.0,1.6] 0.4/0.6 yes, (1.6,2.4] 0.4/0.8 yes
    assert [arr[f"partner_f{k}"][1] for k in range(4)] == [0, 0, 1, 1]
    # the cut at 62.5: only the straddling row (62.4, 62.6] (index 312) is masked now
    assert arr["valid_now"].sum() == 611 and not arr["valid_now"][312]
    # future window (t, t+2] must not cross it: t=60.4 (301) ok, t=60.6 (302) .. 62.6 masked
    assert arr["valid"][301] and not arr["valid"][302:313].any() and arr["valid"][313]
    # the end of the media (122.5 s) masks futures from t=120.6 (index 602) on
    assert arr["valid"][601] and not arr["valid"][602] and arr["valid_now"][611]
    # last speaker: wearer through row 5, partner 3 from row 6 up to the cut, reset at the
    # cut, the wearer right after it
    assert arr["last_speaker"][5] == 2 and arr["last_speaker"][6] == 3 and arr["last_speaker"][311] == 3
    assert arr["last_speaker"][312] == -1 and arr["last_speaker"][313] == 2


def test_shift_and_hold_events(tmp_path):
    # wearer [0, 2.0), silence [2.0, 2.4), partner 5 [2.4, 4.4), silence [4.4, 4.6),
    # partner 5 again [4.6, 6.0): one shift at row 10 (2.0,2.2], one hold at row 22 (4.4,4.6]
    _write(tmp_path, "Session_7", "00-00-000", [(2, 1, 41), (5, 49, 89), (5, 93, 121)])
    arr = L.build_targets(L.read_session(tmp_path, "Session_7"))
    events = {int(i): (int(arr["event"][i]), int(arr["event_prev"][i]), int(arr["event_next"][i]))
              for i in np.nonzero(arr["event"] >= 0)[0]}
    assert events == {10: (1, 2, 5), 22: (0, 5, 5)}
    # with post = 10 rows (2 s) the hold no longer qualifies (only 7 rows of speech follow)
    arr2 = L.build_targets(L.read_session(tmp_path, "Session_7"), L.LabelConfig(post_rows=10))
    assert np.nonzero(arr2["event"] >= 0)[0].tolist() == [10]


def test_make_targets_atomic_roundtrip(session, tmp_path):
    out = tmp_path / "out" / "Session_3.npy"
    with pytest.raises(InputError, match="does not exist"):
        L.make_targets(session, 3, out)
    assert not out.exists()
    out.parent.mkdir()
    path, meta = L.make_targets(session, "3", out)
    arr = L.load_targets(path)
    assert arr.dtype == L.TARGET_DTYPE and arr.size == 612
    assert meta["columns"] == list(L.COLUMNS)
    assert json.loads((out.parent / "Session_3.meta.json").read_text())["summary"]["rows"] == 612
    back = L.from_matrix(L.as_matrix(arr))
    for c in L.COLUMNS:
        np.testing.assert_allclose(back[c].astype(float), arr[c].astype(float), atol=1e-6)
    assert [p.name for p in out.parent.iterdir()] and not list(out.parent.glob(".*tmp"))


def test_bad_inputs(tmp_path):
    with pytest.raises(InputError, match="Speech_Transcriptions/Session_9"):
        L.read_session(tmp_path, 9)
    _write(tmp_path, "Session_9", "00-00-000", [("two", 1, 5)])
    with pytest.raises(InputError, match="Participant_ID"):
        L.read_session(tmp_path, 9)
    _write(tmp_path, "Session_8", "bad-name", [])
    with pytest.raises(InputError, match="mm-ss-SSS"):
        L.read_session(tmp_path, 8)


def test_no_event_across_a_cut(tmp_path):
    # file 1 (nominal 60 s, a cut at media 60.0 s: a row boundary, so no row is masked):
    # wearer [58.0, 59.8); after the cut, partner 3 at media [60.2, 62.2). The silence
    # (59.8, 60.2] would be a perfect shift if the cut were ignored.
    _write(tmp_path, "Session_5", "00-00-000", [(2, 1161, 1197)])
    _write(tmp_path, "Session_5", "01-10-000", [(3, 5, 45)])
    arr = L.build_targets(L.read_session(tmp_path, 5))
    assert arr["valid_now"].all()
    assert arr["wearer"][294:299].all() and arr["partner"][301:306].all()
    assert not (arr["wearer"][299:301] | arr["partner"][299:301]).any()
    assert (arr["event"] == -1).all()
    assert arr["last_speaker"][299] == 2 and arr["last_speaker"][300] == -1
    assert not arr["valid"][290] and arr["valid"][289]  # (58.2, 60.2] crosses the cut


@pytest.mark.parametrize("flag, value", [("--pre-s", "-1"), ("--post-s", "0"), ("--pre-s", "nan")])
def test_cli_rejects_non_positive_context_seconds(session, tmp_path, flag, value):
    """Before, a negative or zero --pre-s/--post-s was clamped to one row without a word."""
    from typer.testing import CliRunner

    from minicpmo_rt.cli import app

    out = tmp_path / "t.npy"
    res = CliRunner().invoke(app, ["make-targets", "--easycom-root", str(session), "--session", "3", "--output",
                                   str(out), flag, value])
    assert res.exit_code == 2 and f"{flag} {float(value)}: must be a positive number of seconds" in res.output, \
        res.output
    assert not out.exists()
    res = CliRunner().invoke(app, ["make-targets", "--easycom-root", str(session), "--session", "3", "--output",
                                   str(out), flag, "0.4"])
    assert res.exit_code == 0 and out.exists(), res.output
