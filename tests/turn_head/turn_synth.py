"""Synthetic feature artifacts in the real schema (written with features.artifact.save_artifact)
and matching make-targets rows built from random synthetic transcripts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from minicpmo_rt.features.artifact import grid_times, held_alignment, save_artifact
from minicpmo_rt.turn_head import labels as L
from minicpmo_rt.turn_head.data import TARGET_NAMES, label_matrix


def random_transcript(name: str, seconds: float, rng: np.random.Generator) -> L.SessionTranscript:
    """Turns of 0.6-3 s by the wearer (2) or partners 3/4, pauses 0.2-1.2 s, some overlap."""
    utts, t = [], 0.3
    while t < seconds - 0.5:
        pid = int(rng.choice([2, 3, 4]))
        dur = float(rng.uniform(0.6, 3.0))
        utts.append(L.Utterance(pid, t, min(t + dur, seconds)))
        t += dur + (float(rng.uniform(0.2, 1.2)) if rng.random() < 0.8 else -0.3)
    return L.SessionTranscript(name, [L.Segment("00-00-000", 0.0, 0.0, seconds, "media")], utts)


def write_root(root: Path, sessions: list[int], rows: int = 600, dim: int = 16, *, signal: float = 3.0,
               seed: int = 0, store_targets: bool = True, targets_root: Path | None = None,
               native: tuple[int, ...] = (), dims: dict[int, int] | None = None,
               unverified: tuple[int, ...] = ()) -> None:
    """One artifact per session. states = noise + signal * y (target j planted on feature j)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for n in sessions:
        name = f"Session_{n}"
        targets = L.build_targets(random_transcript(name, rows * L.STEP, rng))
        assert targets.size == rows
        if targets_root is not None:
            targets_root.mkdir(parents=True, exist_ok=True)
            L.save_targets(targets_root / f"{name}.npy", targets)
        d = (dims or {}).get(n, dim)
        times = grid_times(rows)
        if n in native:
            src, upd, init = held_alignment(rows)
            mode = "native-1hz-hold"
        else:
            src, upd, init = times.clone(), torch.tensor([(k + 1) % 5 == 0 for k in range(rows)]), \
                torch.zeros(rows, dtype=torch.bool)
            mode = "cached-partial-5hz"
        y, mask = label_matrix(targets, init.numpy())
        states = rng.standard_normal((rows, d)).astype(np.float32)
        states[:, :len(TARGET_NAMES)] += signal * y * mask
        states[init.numpy()] = 0.0
        bad = n in unverified
        payload = {
            "format": "minicpmo-rt-features", "format_version": 1,
            "mode": "minicpmo-unverified-partial-tail" if bad else "causal-prefix",
            "extractor_mode": mode, "states": torch.from_numpy(states), "times": times,
            "state_source_times": src, "native_update_mask": upd, "initialization_mask": init,
            "partial_tail_admissible": (mode == "cached-partial-5hz") and not bad,
            "verification": {"synthetic": {"passed": not bad}}, "provenance": {"session": name},
            "session": name, "window": {}, "pruning": [],
            "targets": torch.from_numpy(L.as_matrix(targets)) if store_targets else None,
            "target_info": {"columns": list(L.COLUMNS)} if store_targets else None,
        }
        save_artifact(root / f"{name}.pt", payload)
