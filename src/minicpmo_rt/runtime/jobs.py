"""File-level jobs behind ``minicpmo-rt talker`` and ``minicpmo-rt speak``.

Every input is checked before a model is loaded, and outputs are written atomically
(temporary file beside the target, then rename), so a failed run leaves no output file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence, Union

from ..atomic import atomic_write, check_output_path
from ..errors import InputError
from .contracts import TurnRequest
from .turn import DEFAULT_PROFILE, TurnPipeline, TurnTrace

REAL_LLM_HIDDEN = 4096  # MiniCPM-o 4.5's Qwen3-8B


def write_json_atomic(path: Path, data) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda fh: fh.write(json.dumps(data).encode()))


def _check_inputs(text: str | None, profile: str, voice: Path | None = None) -> None:
    """``text`` None: the caller checked the words (or there are none)."""
    from ..profiles import load_profile

    if text is not None and not text.strip():
        raise InputError("--text is empty; pass the user's words to answer, e.g. --text \"Hello!\"")
    if voice is not None and not Path(voice).is_file():
        raise InputError(f"--voice {voice}: reference audio not found; pass a WAV of the voice to speak in")
    prof = load_profile(profile)
    if prof.mode != "turn":
        raise InputError(f"--profile {profile}: a {prof.mode} profile; pass a turn-mode profile "
                         f"(e.g. {DEFAULT_PROFILE})")


def _pipeline(model, profile, device, with_code2wav, capacity, min_codes, n_timesteps=None) -> TurnPipeline:
    from ..talker.sampler import SamplingParams

    if min_codes < 0:
        raise InputError(f"--min-codes must be >= 0, got {min_codes}")
    return TurnPipeline.from_snapshot(model, profile, device=device, with_code2wav=with_code2wav,
                                      n_timesteps=n_timesteps, capacity=capacity,
                                      talker_params=SamplingParams(min_codes=min_codes))


class StageBars:
    """Progress bars on stderr for a CLI turn (``TurnPipeline``'s ``progress``): the Thinker's tokens, then the
    Talker's codes (in ``speak`` each is vocoded as it comes, so the codes bar also paces Code2Wav). A stage's
    bar closes when the next one starts. ``disable=None`` (tqdm's own rule): shown only when stderr is a
    terminal, so logs and captured output stay clean."""

    UNITS = {"thinker": "tok", "talker": "code"}

    def __init__(self, disable: bool | None = None):
        self.disable = disable
        self.bars: dict[str, object] = {}
        self.counts: dict[tuple[str, str], int] = {}    # (stage, request) -> its count so far

    def __call__(self, stage: str, request_id: str, count: int) -> None:
        bar = self.bars.get(stage)
        if bar is None:
            from tqdm import tqdm

            self.close()
            bar = self.bars[stage] = tqdm(desc=stage, unit=self.UNITS.get(stage, "it"), disable=self.disable,
                                          leave=False)
        key = (stage, request_id)
        bar.update(count - self.counts.get(key, 0))     # a stage's bar counts every request's
        self.counts[key] = count

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()


def tiny_warning(pipe) -> str | None:
    """The random-weight warning for a pipeline or conversation (anything with a ``thinker``)."""
    h = pipe.thinker.config.llm.hidden_size
    if h < REAL_LLM_HIDDEN:
        return (f"warning: this checkpoint's dims are tiny (LLM hidden {h}, the real model has {REAL_LLM_HIDDEN}): "
                "it is a random-weight test checkpoint, so its text is gibberish and its audio is noise")
    return None


def run_talker(model: str, text: str | None, codes_out: Path, seed: int = 0, profile: str = DEFAULT_PROFILE,
               max_codes: int | None = None, min_codes: int = 50, max_new_tokens: int | None = None,
               capacity: int | None = None, device: str = "cpu", audio: Path | None = None,
               image: Path | None = None) -> dict:
    """Thinker generate -> Talker; writes the codec ids (no EOS) as a JSON list. The turn is the words, a
    recording of the user (``audio``) and a picture (``image``), any of them."""
    (turn,) = _turn_contents([text] if text is not None else [], [Path(audio)] if audio is not None else [],
                             [Path(image)] if image is not None else [])
    _check_inputs(None, profile)
    check_output_path(codes_out, "--codes-out")
    req = TurnRequest.make("cli", turn, None, seed, max_new_tokens, max_codes)
    t = time.perf_counter()
    pipe = _pipeline(model, profile, device, False, capacity, min_codes)
    trace = TurnTrace()
    bars = StageBars()
    try:
        codes = pipe.codes([req], trace, progress=bars)["cli"]
    finally:
        bars.close()
    write_json_atomic(codes_out, codes)
    return {"codes": len(codes), "text": trace.talker_inputs["cli"].text,
            "tokens": len(trace.talker_inputs["cli"].token_ids), "terminator": trace.talker_inputs["cli"].terminator,
            "wall_s": time.perf_counter() - t, "warning": tiny_warning(pipe), "profile": pipe.profile.name,
            "capacity": pipe.talker.capacity}


def _turn_contents(texts: list[str], audios: list[Path], images: list[Path]) -> list:
    """Turn i is the i-th --image, --audio and --text given, in that order (a picture, a spoken question,
    words); every flag that is given must be given once per turn. Files are read here, before any model loads."""
    from .contracts import AudioPart, ImagePart

    given = {flag: vals for flag, vals in (("--text", texts), ("--audio", audios), ("--image", images)) if vals}
    if not given:
        raise InputError("nothing to answer: pass --text and/or --audio (a recording of the question), with an "
                         "optional --image")
    n = max(len(v) for v in given.values())
    if any(len(v) != n for v in given.values()):
        counts = ", ".join(f"{len(v)} {flag}" for flag, v in given.items())
        raise InputError(f"{counts}: turn i is made of the i-th of each flag given, so give each one once per turn")
    for t in texts:
        if not t.strip():
            raise InputError("--text is empty; pass the user's words to answer, e.g. --text \"Hello!\"")
    turns = []
    for i in range(n):
        parts: list = []
        if images:
            parts.append(ImagePart.from_image(images[i], where="--image"))
        if audios:
            parts.append(AudioPart.from_file(audios[i]))
        if texts:
            parts.append(texts[i])
        turns.append(parts[0] if len(parts) == 1 and isinstance(parts[0], str) else
                     [{"role": "user", "content": parts}])
    return turns


def run_speak(model: str, text: Union[str, Sequence[str]], voice: Path, output: Union[Path, Sequence[Path]],
              seed: int = 0, profile: str = DEFAULT_PROFILE, max_codes: int | None = None, min_codes: int = 50,
              max_new_tokens: int | None = None, capacity: int | None = None, n_timesteps: int | None = None,
              device: str = "cpu", codes_out: Path | None = None, audio: Sequence[Path] = (),
              image: Sequence[Path] = ()) -> dict:
    """The whole turn pipeline to 24 kHz float WAVs (and optionally the codes as JSON). Several turns (one
    output each, turn i sampled with seed + i) run as one ``TurnPipeline.run``: they share the Thinker's
    rows, the Talker's slots and Code2Wav's calls. A turn is words, a recording of the question (``audio``),
    a picture (``image``) or a mix. Nothing is written unless every turn succeeded."""
    from ..code2wav.io import write_wav_atomic
    from .turn import collect

    texts = [text] if isinstance(text, str) else list(text or ())
    turns = _turn_contents(texts, [Path(a) for a in audio], [Path(i) for i in image])
    outputs = [Path(output)] if isinstance(output, (str, Path)) else [Path(o) for o in output]
    if len(turns) != len(outputs):
        raise InputError(f"{len(turns)} turns but {len(outputs)} --output; pass one --output per turn, in order")
    if len({o.resolve() for o in outputs}) != len(outputs):
        raise InputError("--output: the same file is given twice; give each turn its own WAV")
    _check_inputs(None, profile, voice)
    for o in outputs:
        check_output_path(o, "--output")
    if codes_out is not None:
        check_output_path(codes_out, "--codes-out")
    if n_timesteps is not None and n_timesteps < 1:
        raise InputError(f"--n-timesteps must be >= 1, got {n_timesteps}")
    ids = ["cli"] if len(turns) == 1 else [f"cli-{i}" for i in range(len(turns))]
    reqs = [TurnRequest.make(rid, t, voice, seed + i, max_new_tokens, max_codes)
            for i, (rid, t) in enumerate(zip(ids, turns))]
    t0 = time.perf_counter()
    pipe = _pipeline(model, profile, device, True, capacity, min_codes, n_timesteps)
    trace = TurnTrace()
    bars = StageBars()
    try:
        chunks = list(pipe.run(reqs, trace, progress=bars))
    finally:
        bars.close()
    wavs = collect(chunks)
    for rid, out in zip(ids, outputs):
        write_wav_atomic(out, wavs[rid])
    if codes_out is not None:
        codes = [trace.codes(rid) for rid in ids]
        write_json_atomic(codes_out, codes[0] if len(ids) == 1 else codes)
    wall = time.perf_counter() - t0
    per = []
    for rid, out in zip(ids, outputs):
        ti = trace.talker_inputs[rid]
        per.append({"output": str(out), "samples": len(wavs[rid]), "seconds": len(wavs[rid]) / 24000,
                    "codes": len(trace.codes(rid)), "chunks": sum(c.request_id == rid for c in chunks),
                    "text": ti.text, "tokens": len(ti.token_ids), "terminator": ti.terminator})
    return {**per[0], "requests": per, "wall_s": wall, "warning": tiny_warning(pipe), "profile": pipe.profile.name,
            "capacity": pipe.talker.capacity, "n_timesteps": pipe.code2wav.n_timesteps}


def video_frames_per_second(path: Path, seconds: int) -> list:
    """One RGB frame (HxWx3 uint8) per unit: the last frame shown at or before the end of each
    second ``k + 1`` (what a camera would have shown when the unit closed); None before the first
    frame. Decoded sequentially with PyAV."""
    try:
        import av
    except ImportError:
        raise InputError(f"--video {path}: reading video needs PyAV; install it with `pip install av` "
                         "(scripts/setup.sh does)") from None
    try:
        container = av.open(str(path))
    except Exception as exc:  # av.error.*: corrupt or foreign files
        raise InputError(f"--video {path}: cannot be opened as a video ({type(exc).__name__}: {exc})") from None
    out, latest, k = [], None, 0
    with container:
        if not container.streams.video:
            raise InputError(f"--video {path}: has no video stream")
        stream = container.streams.video[0]
        for frame in container.decode(stream):
            if frame.time is None:
                continue
            while k < seconds and frame.time > k + 1:
                out.append(latest)
                k += 1
            if k >= seconds:
                break
            latest = frame.to_ndarray(format="rgb24")
    out += [latest] * (seconds - len(out))
    return out


def duplex_options(profile: str, decode: str, force_listen_units: int, max_units: int | None,
                   n_timesteps: int | None, device: str, dtype: str):
    """The duplex jobs' (and ``serve --mode duplex``'s) checked flags -> (profile, torch dtype,
    DuplexDecodeConfig), before any model loads."""
    import torch

    from ..profiles import load_profile
    from ..thinker.duplex import DuplexDecodeConfig

    prof = load_profile(profile)
    if prof.mode != "duplex":
        raise InputError(f"--profile {profile}: a {prof.mode} profile; pass a duplex profile "
                         "(e.g. minicpmo_4_5_duplex_h200)")
    if max_units is not None and max_units < 1:
        raise InputError(f"--max-units must be >= 1, got {max_units}")
    if n_timesteps is not None and n_timesteps < 1:
        raise InputError(f"--n-timesteps must be >= 1, got {n_timesteps}")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype != "auto" and dtype not in dtypes:
        raise InputError(f"--dtype {dtype!r}: choose auto (bfloat16 on CUDA, float32 on the CPU), "
                         f"{', '.join(dtypes)}")
    torch_dtype = dtypes.get(dtype, torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    return prof, torch_dtype, DuplexDecodeConfig(mode=decode, force_listen_units=force_listen_units)


def _unit_records(units, tok) -> list[dict]:
    """A transcript's record per DuplexUnit."""
    return [{"unit": u.index, "input_end_s": u.index + 1.0, "listen": u.listen, "text": u.text,
             "terminator": tok.decode([u.terminator]), "turn_end": u.turn_end, "interrupted": u.interrupted,
             "codes": len(u.codes), "audio_s": round(u.seconds, 4)} for u in units]


def run_duplex(model: str, input_audio: Path, voice: Path, output: Path, transcript: Path | None = None,
               seed: int = 0, profile: str = "minicpmo_4_5_duplex_h200", decode: str = "greedy",
               force_listen_units: int = 0, max_units: int | None = None, n_timesteps: int | None = None,
               device: str = "cpu", video: Path | None = None, dtype: str = "auto") -> dict:
    """A recorded user side through a duplex conversation, one unit per second (upstream's offline
    ``duplex_chat``: the last partial second is zero-padded to 1 s), with one video frame per unit
    when ``video`` is given. Writes the model's side as one 24 kHz track (a listening second is 1 s
    of silence) and, optionally, a JSON record per unit."""
    import numpy as np
    from tqdm import tqdm

    from ..code2wav.io import write_wav_atomic
    from .duplex import DuplexConversation, conversation_track, read_audio_16k

    for flag, path in (("--input", input_audio), ("--voice", voice)) + ((("--video", video),) if video else ()):
        if not Path(path).is_file():
            raise InputError(f"{flag} {path}: file not found; pass a WAV (any sample rate, mono or stereo)")
    prof, torch_dtype, cfg = duplex_options(profile, decode, force_listen_units, max_units, n_timesteps,
                                            device, dtype)
    check_output_path(output, "--output")
    if transcript is not None:
        check_output_path(transcript, "--transcript")
    x = read_audio_16k(input_audio)
    n = -(-len(x) // 16000)
    if max_units is not None:
        n = min(n, max_units)
    x = np.pad(x, (0, max(0, n * 16000 - len(x))))
    frames = video_frames_per_second(video, n) if video is not None else [None] * n
    t = time.perf_counter()
    conv = DuplexConversation.from_snapshot(model, voice, profile=profile, device=device, dtype=torch_dtype,
                                            n_timesteps=n_timesteps, decode=cfg, seed=seed)
    units = []
    try:
        for k in tqdm(range(n), desc="duplex", unit="s", disable=None, leave=False):
            units.append(conv.step(x[16000 * k:16000 * (k + 1)], frames[k]))
        tail = conv.flush()   # the model's last words, if it was still speaking when the input ended
    finally:
        conv.close()
    track = np.concatenate([conversation_track(units), tail])
    tok = conv.tokenizer
    records = _unit_records(units, tok)
    write_wav_atomic(output, track)
    n_frames = sum(f is not None for f in frames)
    if transcript is not None:
        write_json_atomic(transcript, {"input": str(input_audio), "video": None if video is None else str(video),
                                       "frames": n_frames, "voice": str(voice), "profile": prof.name,
                                       "decode": decode, "seed": seed, "units": records})
    return {"units": len(units), "spoke": sum(not u.listen or u.turn_end for u in units),
            "turns": sum(u.turn_end for u in units), "frames": n_frames, "text": "".join(u.text for u in units),
            "seconds": len(track) / 24000, "tail_s": len(tail) / 24000, "wall_s": time.perf_counter() - t,
            "warning": tiny_warning(conv),
            "profile": prof.name, "dtype": str(torch_dtype).replace("torch.", "")}


def run_duplex_batch(model: str, inputs: list[Path], voices: list[Path], outputs: list[Path],
                     transcript: Path | None = None, seed: int = 0, profile: str = "minicpmo_4_5_duplex_h200",
                     decode: str = "greedy", force_listen_units: int = 0, max_units: int | None = None,
                     n_timesteps: int | None = None, device: str = "cpu", dtype: str = "auto") -> dict:
    """Several recorded user sides as concurrent duplex conversations on one set of models
    (``DuplexBatch``: one second of every conversation per step). Conversation i reads ``inputs[i]``,
    speaks in ``voices[i]`` (or the one voice given) with seed ``seed + i``, and writes ``outputs[i]``
    as ``run_duplex`` writes one; a conversation whose input has ended stops stepping while the
    others go on. Every path is checked before any model loads; nothing is written unless every
    conversation ran to its end."""
    import numpy as np
    from tqdm import tqdm

    from ..code2wav.io import write_wav_atomic
    from .duplex import DuplexBatch, DuplexInput, conversation_track, read_audio_16k

    n = len(inputs)
    if n == 0:
        raise InputError("--input: give one recording per conversation (repeat --input)")
    if len(outputs) != n:
        raise InputError(f"--output: {len(outputs)} given for {n} --input; give one output WAV per conversation")
    if len(voices) not in (1, n):
        raise InputError(f"--voice: {len(voices)} given for {n} --input; give one voice for all or one per "
                         "conversation")
    voices = list(voices) * n if len(voices) == 1 else list(voices)
    for flag, paths in (("--input", inputs), ("--voice", voices)):
        for path in paths:
            if not Path(path).is_file():
                raise InputError(f"{flag} {path}: file not found; pass a WAV (any sample rate, mono or stereo)")
    if len({Path(o).resolve() for o in outputs}) != n:
        raise InputError("--output: two conversations would write the same file; give distinct paths")
    prof, torch_dtype, cfg = duplex_options(profile, decode, force_listen_units, max_units, n_timesteps,
                                            device, dtype)
    for out in outputs:
        check_output_path(out, "--output")
    if transcript is not None:
        check_output_path(transcript, "--transcript")
    audio = [read_audio_16k(p) for p in inputs]
    seconds = [-(-len(x) // 16000) for x in audio]
    if max_units is not None:
        seconds = [min(k, max_units) for k in seconds]
    audio = [np.pad(x, (0, max(0, k * 16000 - len(x)))) for x, k in zip(audio, seconds)]
    t = time.perf_counter()
    batch = DuplexBatch.from_snapshot(model, voices, profile=profile, device=device, dtype=torch_dtype,
                                      n_timesteps=n_timesteps, decode=cfg, seeds=[seed + i for i in range(n)])
    units: list[list] = [[] for _ in range(n)]
    try:
        for k in tqdm(range(max(seconds)), desc="duplex batch", unit="s", disable=None, leave=False):
            step = [DuplexInput(x[16000 * k:16000 * (k + 1)]) if k < m else None for x, m in zip(audio, seconds)]
            for i, u in enumerate(batch.step(step)):
                if u is not None:
                    units[i].append(u)
        tails = batch.flush()      # each conversation's last words, if it was still speaking when its input ended
    finally:
        batch.close()
    tok = batch.conversations[0].tokenizer
    tracks = [np.concatenate([conversation_track(us), tail]) for us, tail in zip(units, tails)]
    for out, track in zip(outputs, tracks):
        write_wav_atomic(out, track)
    if transcript is not None:
        write_json_atomic(transcript, {"profile": prof.name, "decode": decode, "conversations": [
            {"input": str(inp), "voice": str(v), "output": str(out), "seed": seed + i,
             "units": _unit_records(us, tok)}
            for i, (inp, v, out, us) in enumerate(zip(inputs, voices, outputs, units))]})
    return {"conversations": n, "units": [len(us) for us in units],
            "spoke": [sum(not u.listen or u.turn_end for u in us) for us in units],
            "seconds": [len(tr) / 24000 for tr in tracks], "wall_s": time.perf_counter() - t,
            "warning": tiny_warning(batch.conversations[0]), "profile": prof.name,
            "dtype": str(torch_dtype).replace("torch.", "")}
