"""File-level Code2Wav job behind ``minicpmo-rt code2wav`` (reads JSON codes, writes a WAV atomically)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..atomic import atomic_write, check_output_path
from ..errors import InputError
from .pipeline import SAMPLE_RATE, Code2Wav, check_codes


def read_codes(path: Path) -> list[int]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: codes file not found") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc}); expected a list of integers") from None
    if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        raise InputError(f"{path}: expected a JSON list of integers (codec ids 0..6560)")
    check_codes(data, str(path))
    return data


def write_wav_atomic(path: Path, wav: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write next to ``path`` then rename: a failure never leaves a partial or clobbered file."""
    import soundfile as sf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda fh: sf.write(fh, np.asarray(wav, dtype=np.float32), sample_rate,
                                           format="WAV", subtype="FLOAT"))


def run_code2wav(model: str, codes_path: Path, voice: Path, output: Path, stream: bool = False,
                 device: str = "cpu", n_timesteps: int = 10) -> dict:
    if n_timesteps < 1:
        raise InputError(f"--n-timesteps must be >= 1, got {n_timesteps}")
    check_output_path(output, "--output")
    codes = read_codes(codes_path)
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available here; use --device cpu")
    c2w = Code2Wav.from_snapshot(model, device=device, n_timesteps=n_timesteps)
    feats = c2w.features(voice)  # reads and validates the reference before any work
    t = time.perf_counter()
    if stream:
        from tqdm import tqdm

        # on a terminal only (tqdm's disable=None), like the turn jobs' bars
        with tqdm(total=len(codes), desc="code2wav", unit="code", disable=None, leave=False) as bar:
            wav = c2w.stream_codes(codes, feats, progress=lambda n: bar.update(n - bar.n))
    else:
        wav = c2w.synthesize(codes, feats)      # one solve of the whole utterance: nothing to count
    wall = time.perf_counter() - t
    write_wav_atomic(output, wav)
    seconds = len(wav) / SAMPLE_RATE
    return {"samples": len(wav), "seconds": seconds, "codes": len(codes), "wall_s": wall,
            "rtf": wall / max(seconds, 1e-9), "vocoder": c2w.vocoders.stream.variant if stream
            else c2w.vocoders.whole.variant}
