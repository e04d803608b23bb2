"""5 Hz turn-taking targets from EasyCom ``Speech_Transcriptions`` (``minicpmo-rt make-targets``).

Timeline: the feature extractor's *media time* (features/easycom.py). The session's
one-minute files, ordered by their ``mm-ss-SSS`` names, are concatenated; each lasts its own
media (``frames / 20`` s, frames = min(video frames, whole 20 fps frames of audio), read by
``features.easycom.build_timeline`` from ``Video_Compressed/Session_N``). Transcript frames are
20 fps, 1-based and local to their file, so frame ``f`` of a file starting at media time ``m``
is ``m + (f - 1) / 20`` (both ``Start_Frame`` and ``End_Frame``, as ESPnet's EasyCom recipe
converts them); utterances are clipped to their file. Redacted minutes are skipped, not
filled: where the next name starts more than 1 s after the previous file's media ends there
is a *cut* on the media axis. Without the session's videos the durations are guessed from the
names (the distance to the next name if it is at most 61 s, else a nominal 60 s, which also
ends the last file) and ``<stem>.meta.json`` says so; such targets may not line up with an
artifact.

Grid. Row ``i`` covers the half-open bin ``(0.2*i, 0.2*(i+1)]`` of media time and its
``time`` is ``0.2*(i+1)``: the same grid as a feature artifact's ``times`` (first row 0.2 s).
The last row is the last complete bin of the media. Gaps have no rows (media time skips them);
a row whose bin straddles a cut is masked (``valid_now`` False), and a row whose 2 s future
window crosses a cut or the session end is masked for the future targets (``valid`` False).
Nothing spans a cut: events and ``last_speaker`` restart after one.

Per-row rule (VAP's): a channel is *active* in a bin when utterances cover >= 0.5 of it.
The wearer is participant 2; *partner* is the union of every other participant.

Fields of the structured array (``TARGET_DTYPE``, one record per row, row order):

==================  =====  ==================================================================
name                dtype  meaning
==================  =====  ==================================================================
time                f8     row end time, media seconds (0.2, 0.4, ...)
session_time        f8     the same instant on the session clock of the file names
valid_now           ?      the row's bin does not straddle a cut (a redaction gap)
valid               ?      valid_now, and the 2 s future window ``(time, time+2]`` neither
                           crosses a cut nor runs past the end of the media
wearer              ?      wearer active in the row's bin
partner             ?      any partner active (union of partners covers >= 0.5 of the bin)
wearer_frac         f4     fraction of the bin covered by wearer speech
partner_frac        f4     fraction of the bin covered by the union of partner speech
wearer_f0..f3       ?      wearer active in future bins (0,0.2] (0.2,0.6] (0.6,1.2] (1.2,2.0]
                           seconds after ``time`` (>= 0.5 coverage of each bin)
partner_f0..f3      ?      the same for the partner union
event               i1     -1 no event at this row; 0 hold; 1 shift (see below)
event_prev          i2     participant who held the turn before the event's silence (-1)
event_next          i2     participant who speaks after it (-1)
last_speaker        i2     participant active alone in the most recent such row <= this row
                           (reset to -1 in gaps; rows with overlap keep the previous value)
n_active            i1     number of participants individually active in the bin
==================  =====  ==================================================================

On disk (``make-targets``) the rows are this structured array; ``--matrix`` writes
``as_matrix(rows)`` instead, float64 ``[T, len(COLUMNS)]`` in ``COLUMNS`` order (booleans 0/1),
for consumers that need a plain numeric array (the extractor's ``--target`` stores a tensor).
``load_targets`` / ``coerce_targets`` read either form back into records.

Shift/hold events, on per-participant activity (each participant's own >= 0.5 rule). A row is
*silent* when it is valid_now and neither channel is active; a row is *p alone* when p is the
only active participant. A mutual silence is a maximal run of silent rows ``[s, e)`` with
``e - s >= min_silence`` rows (default 1 row = 200 ms). It is an event when the ``pre`` rows
before it (default 5 = 1 s, as VAP) are all valid and all ``A alone`` for one participant A, and
the ``post`` rows after it (default 5 = 1 s) are all valid and all ``B alone``, with no cut
anywhere in between. The event is
stored on the silence's first row ``s`` (the first row at which the silence is observable):
``event = 1`` (shift) if B != A, else 0 (hold). Partner-to-partner changes are shifts.
Utterance-level transcripts hide pauses inside an utterance, so holds are under-counted.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..atomic import atomic_write, check_output_path
from ..errors import InputError

WEARER_ID = 2
STEP = 0.2
FUTURE_EDGES = (0.0, 0.2, 0.6, 1.2, 2.0)

TARGET_DTYPE = np.dtype(
    [("time", "f8"), ("session_time", "f8"), ("valid_now", "?"), ("valid", "?"), ("wearer", "?"), ("partner", "?"),
     ("wearer_frac", "f4"), ("partner_frac", "f4")]
    + [(f"wearer_f{k}", "?") for k in range(4)]
    + [(f"partner_f{k}", "?") for k in range(4)]
    + [("event", "i1"), ("event_prev", "i2"), ("event_next", "i2"), ("last_speaker", "i2"),
       ("n_active", "i1")])
COLUMNS: tuple[str, ...] = tuple(TARGET_DTYPE.names)

_SEGMENT_RE = re.compile(r"^(\d{2})-(\d{2})-(\d{3})$")


@dataclass(frozen=True)
class LabelConfig:
    wearer_id: int = WEARER_ID
    fps: float = 20.0
    active_ratio: float = 0.5
    min_silence_rows: int = 1
    pre_rows: int = 5
    post_rows: int = 5
    nominal_segment_s: float = 60.0
    max_contiguous_s: float = 61.0


@dataclass(frozen=True)
class Utterance:
    participant: int
    start: float  # session seconds
    end: float


@dataclass(frozen=True)
class Segment:
    name: str
    name_start: float      # session clock, from the file name
    offset: float          # media time of the file's first frame
    duration: float        # media seconds
    duration_source: str   # "media" (build_timeline) or "names" (guessed)
    cut_after: bool = False  # a redaction gap follows this file

    @property
    def end(self) -> float:
        return self.offset + self.duration


@dataclass
class SessionTranscript:
    session: str
    segments: list[Segment]
    utterances: list[Utterance]
    skipped: list[str] = field(default_factory=list)


def segment_offset(name: str) -> float:
    """``mm-ss-SSS`` -> seconds from the session start."""
    m = _SEGMENT_RE.match(name)
    if m is None:
        raise InputError(f"{name!r}: EasyCom segment names are mm-ss-SSS (e.g. 01-00-288); rename or remove it")
    return int(m.group(1)) * 60 + int(m.group(2)) + int(m.group(3)) / 1000.0


def _participant(value: Any, where: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise InputError(f"{where}: Participant_ID {value!r} is not an integer id; fix the transcript") from None


def read_transcript_file(path: Path, offset: float, duration: float, cfg: LabelConfig,
                         skipped: list[str]) -> list[Utterance]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read transcript JSON ({exc}); restore the file") from exc
    if not isinstance(entries, list):
        raise InputError(f"{path}: expected a JSON list of utterances, got {type(entries).__name__}")
    out = []
    for k, e in enumerate(entries):
        where = f"{path}[{k}]"
        if not isinstance(e, dict) or not {"Participant_ID", "Start_Frame", "End_Frame"} <= e.keys():
            raise InputError(f"{where}: an utterance needs Participant_ID, Start_Frame and End_Frame")
        pid = _participant(e["Participant_ID"], where)
        try:
            s, f = int(e["Start_Frame"]), int(e["End_Frame"])
        except (TypeError, ValueError):
            raise InputError(f"{where}: Start_Frame/End_Frame must be integers") from None
        if s < 1 or f < s:
            skipped.append(f"{where}: frames {s}..{f} (1-based, start <= end expected)")
            continue
        a = offset + (s - 1) / cfg.fps
        b = min(offset + (f - 1) / cfg.fps, offset + duration)
        if b <= a:
            skipped.append(f"{where}: empty after clipping to the file ({s}..{f})")
            continue
        out.append(Utterance(pid, a, b))
    return out


def _session_name(session: str | int) -> str:
    s = str(session)
    return f"Session_{s}" if s.isdigit() else s


def _segments_from_media(video_dir: Path, names: list[str]) -> list[Segment]:
    from ..features.easycom import build_timeline

    tl = build_timeline(video_dir)
    gap_after = {g.after for g in tl.gaps}
    by_name = {s.name: s for s in tl.segments}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise InputError(f"{video_dir}: transcripts {missing} have no video segment of the same name; "
                         f"the media axis cannot place them (restore the mp4s or remove the JSONs)")
    return [Segment(s.name, s.name_start, s.media_start, s.duration, "media", s.name in gap_after)
            for s in tl.segments]


def _segments_from_names(names: list[str], cfg: LabelConfig) -> list[Segment]:
    starts = [segment_offset(n) for n in names]
    out, media = [], 0.0
    for k, (n, st) in enumerate(zip(names, starts)):
        nxt = starts[k + 1] - st if k + 1 < len(names) else None
        cut = nxt is not None and nxt > cfg.max_contiguous_s
        dur = nxt if nxt is not None and not cut else cfg.nominal_segment_s
        out.append(Segment(n, st, media, dur, "names", cut))
        media += dur
    return out


def read_session(easycom_root: str | os.PathLike, session: str | int,
                 cfg: LabelConfig = LabelConfig()) -> SessionTranscript:
    """Read every transcript file of a session and place it on the media timeline."""
    root = Path(easycom_root)
    name = _session_name(session)
    if not (root / "Speech_Transcriptions").is_dir() and (root / "Main" / "Speech_Transcriptions").is_dir():
        root = root / "Main"
    tdir = root / "Speech_Transcriptions" / name
    if not tdir.is_dir():
        raise InputError(f"{tdir}: no transcript directory; --easycom-root must hold "
                         f"Speech_Transcriptions/{name}/ (the EasyCom Main/ folder)")
    files = {p.stem: p for p in tdir.glob("*.json")}
    if not files:
        raise InputError(f"{tdir}: no mm-ss-SSS.json transcript files in it")
    names = sorted(files, key=segment_offset)
    video_dir = root / "Video_Compressed" / name
    segments = _segments_from_media(video_dir, names) if video_dir.is_dir() else _segments_from_names(names, cfg)
    skipped: list[str] = []
    utts: list[Utterance] = []
    for seg in segments:
        if seg.name in files:
            utts.extend(read_transcript_file(files[seg.name], seg.offset, seg.duration, cfg, skipped))
        else:
            skipped.append(f"{seg.name}: video segment without a transcript (its rows are labelled silent)")
    return SessionTranscript(name, segments, utts, skipped)


def _merge(intervals: Iterable[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    arr = np.asarray(merged, dtype=np.float64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


class Coverage:
    """Length of a union of intervals inside ``[0, t]``, for many ``t`` at once."""

    def __init__(self, intervals: Iterable[tuple[float, float]]):
        self.starts, self.ends = _merge(intervals)
        lengths = self.ends - self.starts
        self.before = np.concatenate([[0.0], np.cumsum(lengths)])[:-1]

    def upto(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        if self.starts.size == 0:
            return np.zeros_like(t)
        k = np.searchsorted(self.starts, t, side="right") - 1
        kc = np.clip(k, 0, None)
        inside = np.minimum(t - self.starts[kc], self.ends[kc] - self.starts[kc])
        return np.where(k < 0, 0.0, self.before[kc] + np.maximum(inside, 0.0))

    def fraction(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Covered fraction of each ``(a, b]``."""
        return (self.upto(b) - self.upto(a)) / (np.asarray(b) - np.asarray(a))


def build_targets(transcript: SessionTranscript, cfg: LabelConfig = LabelConfig()) -> np.ndarray:
    """The structured target rows of one session (see the module docstring)."""
    segs = transcript.segments
    session_end = segs[-1].end
    n = int(math.floor(session_end / STEP + 1e-6))
    if n == 0:
        raise InputError(f"{transcript.session}: the session is shorter than one 0.2 s row")
    out = np.zeros(n, dtype=TARGET_DTYPE)
    idx = np.arange(n)
    t = np.round(STEP * (idx + 1), 9)
    out["time"] = t
    starts = np.array([s.offset for s in segs])
    k = np.clip(np.searchsorted(starts, t - 1e-9, side="right") - 1, 0, None)
    out["session_time"] = np.array([s.name_start for s in segs])[k] + (t - starts[k])
    cuts = np.array([s.end for s in segs if s.cut_after], dtype=np.float64)
    tol = 1e-6
    # stretch = number of cuts before the row's bin ends; a cut strictly inside a window breaks it
    stretch = np.searchsorted(cuts, t - tol, side="right")
    inside_now = np.searchsorted(cuts, t - tol, side="left") - np.searchsorted(cuts, t - STEP + tol, side="right")
    horizon = FUTURE_EDGES[-1]
    inside_future = np.searchsorted(cuts, t + horizon - tol, side="left") - np.searchsorted(cuts, t + tol, side="right")
    out["valid_now"] = inside_now == 0
    out["valid"] = out["valid_now"] & (inside_future == 0) & (t + horizon <= session_end + tol)

    wearer = Coverage((u.start, u.end) for u in transcript.utterances if u.participant == cfg.wearer_id)
    partner = Coverage((u.start, u.end) for u in transcript.utterances if u.participant != cfg.wearer_id)
    thr = cfg.active_ratio - 1e-9
    for name, cov in (("wearer", wearer), ("partner", partner)):
        frac = cov.fraction(t - STEP, t)
        out[f"{name}_frac"] = frac
        out[name] = frac >= thr
        for k in range(4):
            out[f"{name}_f{k}"] = cov.fraction(t + FUTURE_EDGES[k], t + FUTURE_EDGES[k + 1]) >= thr

    ids = sorted({u.participant for u in transcript.utterances})
    act = np.zeros((len(ids), n), dtype=bool)
    for j, pid in enumerate(ids):
        cov = Coverage((u.start, u.end) for u in transcript.utterances if u.participant == pid)
        act[j] = cov.fraction(t - STEP, t) >= thr
    n_active = act.sum(0)
    out["n_active"] = n_active
    valid_now = out["valid_now"]
    alone = np.full(n, -1, dtype=np.int64)  # participant id active alone, else -1
    if ids:
        single = valid_now & (n_active == 1)
        alone[single] = np.asarray(ids)[act[:, single].argmax(0)]

    last = np.full(n, -1, dtype=np.int16)
    cur = -1
    for i in range(n):
        if not valid_now[i] or (i > 0 and stretch[i] != stretch[i - 1]):
            cur = -1
        elif alone[i] >= 0:
            cur = int(alone[i])
        last[i] = cur
    out["last_speaker"] = last

    out["event"] = -1
    out["event_prev"] = -1
    out["event_next"] = -1
    silent = valid_now & ~out["wearer"] & ~out["partner"]
    i = 0
    while i < n:
        if not silent[i]:
            i += 1
            continue
        s = i
        while i < n and silent[i]:
            i += 1
        e = i
        if e - s < cfg.min_silence_rows or s - cfg.pre_rows < 0 or e + cfg.post_rows > n:
            continue
        if stretch[s - cfg.pre_rows] != stretch[e + cfg.post_rows - 1]:
            continue
        pre, post = alone[s - cfg.pre_rows:s], alone[e:e + cfg.post_rows]
        if pre[0] < 0 or post[0] < 0 or (pre != pre[0]).any() or (post != post[0]).any():
            continue
        out["event"][s] = int(pre[0] != post[0])
        out["event_prev"][s] = pre[0]
        out["event_next"][s] = post[0]
    return out


def summarize(arr: np.ndarray) -> dict[str, Any]:
    ev = arr["event"]
    return {"rows": int(arr.size), "valid_now": int(arr["valid_now"].sum()), "valid": int(arr["valid"].sum()),
            "wearer_rate": float(arr["wearer"][arr["valid_now"]].mean()) if arr["valid_now"].any() else 0.0,
            "partner_rate": float(arr["partner"][arr["valid_now"]].mean()) if arr["valid_now"].any() else 0.0,
            "shifts": int((ev == 1).sum()), "holds": int((ev == 0).sum())}


def save_targets(path: str | os.PathLike, arr: np.ndarray, meta: dict[str, Any] | None = None,
                 matrix: bool = False) -> Path:
    """Write ``arr`` to ``path`` (.npy) atomically, and ``meta`` beside it as ``<stem>.meta.json``.

    ``matrix=True`` writes ``as_matrix(arr)`` (float64 [T, len(COLUMNS)]) instead of records:
    the form a consumer that needs a plain numeric array (``torch.from_numpy``) can take.
    """
    path = Path(path)
    if arr.dtype != TARGET_DTYPE:
        raise InputError(f"{path}: refusing to save targets of dtype {arr.dtype}; build them with build_targets")
    if not path.parent.is_dir():
        raise InputError(f"{path}: output directory {path.parent} does not exist; create it first")
    data = as_matrix(arr) if matrix else arr
    atomic_write(path, lambda fh: np.save(fh, data, allow_pickle=False))
    if meta is not None:
        side = path.with_name(path.stem + ".meta.json")
        atomic_write(side, lambda fh: fh.write(json.dumps(meta, indent=2).encode()))
    return path


def load_targets(path: str | os.PathLike) -> np.ndarray:
    """Read a ``make-targets`` .npy; raise InputError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: target file not found; write it with `minicpmo-rt make-targets`")
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as exc:
        raise InputError(f"{path}: cannot be read as a .npy ({exc}); rewrite it with make-targets") from exc
    return coerce_targets(arr, str(path))


def as_matrix(arr: np.ndarray) -> np.ndarray:
    """float64 [T, len(COLUMNS)] in ``COLUMNS`` order (for storing the rows in a tensor)."""
    return np.stack([arr[c].astype(np.float64) for c in COLUMNS], axis=1)


def from_matrix(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m)
    out = np.zeros(m.shape[0], dtype=TARGET_DTYPE)
    for j, c in enumerate(COLUMNS):
        out[c] = np.round(m[:, j]) if TARGET_DTYPE[c].kind in "bi" else m[:, j]
    return out


def coerce_targets(arr: Any, where: str) -> np.ndarray:
    """Accept the structured array or its ``as_matrix`` form (a tensor or array [T, C])."""
    if hasattr(arr, "detach"):
        arr = arr.detach().cpu().numpy()
    arr = np.asarray(arr)
    if arr.dtype.names is not None:
        missing = [c for c in COLUMNS if c not in arr.dtype.names]
        if missing:
            raise InputError(f"{where}: target rows lack fields {missing}; rebuild them with make-targets")
        return arr.astype(TARGET_DTYPE)
    if arr.ndim == 2 and arr.shape[1] == len(COLUMNS):
        return from_matrix(arr)
    raise InputError(f"{where}: targets of shape {arr.shape} / dtype {arr.dtype} are neither make-targets "
                     f"records nor a [T, {len(COLUMNS)}] matrix in labels.COLUMNS order")


def make_targets(easycom_root: str | os.PathLike, session: str | int, output: str | os.PathLike,
                 cfg: LabelConfig = LabelConfig(), matrix: bool = False) -> tuple[Path, dict[str, Any]]:
    check_output_path(output, "--output")
    transcript = read_session(easycom_root, session, cfg)
    arr = build_targets(transcript, cfg)
    summary = summarize(arr)
    meta = {"session": transcript.session, "easycom_root": str(Path(easycom_root).resolve()),
            "format": "matrix float64 [T, len(columns)]" if matrix else "structured records (labels.TARGET_DTYPE)",
            "columns": list(COLUMNS), "config": asdict(cfg), "step_s": STEP,
            "future_edges_s": list(FUTURE_EDGES),
            "segments": [asdict(s) for s in transcript.segments],
            "utterances": len(transcript.utterances), "skipped_utterances": transcript.skipped,
            "summary": summary}
    path = save_targets(output, arr, meta, matrix=matrix)
    return path, meta


def row_index(times: Sequence[float] | np.ndarray) -> np.ndarray:
    """Artifact ``times`` -> target row indices (row i ends at 0.2*(i+1))."""
    return np.rint(np.asarray(times, dtype=np.float64) / STEP).astype(np.int64) - 1
