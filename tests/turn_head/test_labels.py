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
    # Three files, no media, so durations come from the layout: 00-00-000 runs to the next
    # file's start (2.4 s); 00-02-400 is followed by a 67.6 s jump (> 61 s), so it gets the
    # nominal 60 s, [2.4, 62.4), and [62.4, 70.0) is a redaction gap; the last file is nominal.
    _write(tmp_path, "Session_3", "00-00-000", [
        (2, 1, 21),      # wearer: frames 1..21 -> [0.0, 1.0)
        (3, 25, 41),     # partner 3: [1.2, 2.0)
    ])
    _write(tmp_path, "Session_3", "00-02-400", [
        (3, 1, 9),       # partner 3 at offset 2.4: [2.4, 2.8)
        ("4", 13, 14),   # partner 4 (string id): [3.0, 3.05) -> 0.25 of a bin, inactive
    ])
    _write(tmp_path, "Session_3", "01-10-000", [
        (2, 1, 41),      # wearer [70.0, 72.0)
    ])
    return tmp_path


def test_offsets_frames_and_gap(session):
    tr = L.read_session(session, 3)
    assert [s.name for s in tr.segments] == ["00-00-000", "00-02-400", "01-10-000"]
    assert [s.offset for s in tr.segments] == [0.0, 2.4, 70.0]
    assert [round(s.duration, 6) for s in tr.segments] == [2.4, 60.0, 60.0]
    assert [s.duration_source for s in tr.segments] == ["next-file-start", "nominal", "nominal"]
    spans = sorted((u.participant, round(u.start, 6), round(u.end, 6)) for u in tr.utterances)
    assert spans == [(2, 0.0, 1.0), (2, 70.0, 72.0), (3, 1.2, 2.0), (3, 2.4, 2.8), (4, 3.0, 3.05)]

    arr = L.build_targets(tr)
    assert arr.dtype == L.TARGET_DTYPE
    assert arr.size == 650  # last file ends at 130.0 s
    np.testing.assert_allclose(arr["time"][:3], [0.2, 0.4, 0.6])
    # wearer rows (0, 0.2] .. (0.8, 1.0] active; (1.0, 1.2] not
    assert arr["wearer"][:6].tolist() == [1, 1, 1, 1, 1, 0]
    # partner: (1.2,1.4]..(1.8,2.0] -> rows 6..9; (2.4,2.6],(2.6,2.8] -> rows 12,13;
    # partner 4's 50 ms in (3.0, 3.2] is 0.25 coverage -> inactive
    part = np.nonzero(arr["partner"][:20])[0].tolist()
    assert part == [6, 7, 8, 9, 12, 13]
    assert arr["partner_frac"][15] == pytest.approx(0.25)
    # future bins of row 0 (t=0.2): wearer (0.2,0.4] yes, (0.4,0.8] yes, (0.8,1.4] 0.2/0.6 no, (1.4,2.2] no
    assert [arr[f"wearer_f{k}"][0] for k in range(4)] == [1, 1, 0, 0]
    # partner at t=0.4: (0.4,0.6] no, (0.6,1.0] no, (1.0,1.6] 0.4/0.6 yes, (1.6,2.4] 0.4/0.8 yes
    assert [arr[f"partner_f{k}"][1] for k in range(4)] == [0, 0, 1, 1]
    # gap (62.4, 70.0): row ending at 62.4 (index 311) valid_now, 62.6 (312) not, 70.2 (350) again
    assert arr["valid_now"][311] and not arr["valid_now"][312] and not arr["valid_now"][349]
    assert arr["valid_now"][350]
    # future window (t, t+2] must avoid the gap: t=60.4 (index 301) ok, t=60.6 (302) crosses it
    assert arr["valid"][301] and not arr["valid"][302]
    # the session end (130.0 s) masks the last 10 rows' futures
    assert arr["valid"][639] and not arr["valid"][640] and arr["valid_now"][649]
    # last speaker: wearer through row 5, partner 3 from row 6, reset in the gap, wearer after it
    assert arr["last_speaker"][5] == 2 and arr["last_speaker"][6] == 3
    assert arr["last_speaker"][312] == -1 and arr["last_speaker"][351] == 2


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
    assert arr.dtype == L.TARGET_DTYPE and arr.size == 650
    assert meta["columns"] == list(L.COLUMNS)
    assert json.loads((out.parent / "Session_3.meta.json").read_text())["summary"]["rows"] == 650
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
