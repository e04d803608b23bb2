"""The server's voices: named reference recordings, checked before any client is served."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ..errors import InputError


def parse_voices(specs: list[str]) -> dict[str, Path]:
    """``NAME=PATH`` or ``PATH`` (named by the file's stem) -> {name: Path}; the first is the default voice."""
    voices: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = (name, path) if sep else (Path(spec).stem, spec)
        if not name or not path:
            raise InputError(f"--voice {spec!r}: pass PATH or NAME=PATH")
        if name in voices:
            raise InputError(f"--voice {spec!r}: the name {name!r} is taken; give each voice its own NAME=")
        if not Path(path).is_file():
            raise InputError(f"--voice {spec!r}: {path} is not a file; pass a reference recording (WAV)")
        voices[name] = Path(path)
    if not voices:
        raise InputError("pass at least one --voice (a reference recording to speak in)")
    return voices


def check_voices(voices: Mapping, owner: str) -> dict:
    """A service's voices (name -> reference WAV, or any voice ``Code2Wav.open_stream`` takes, such as prompt
    features), each recording read once: one that cannot be read fails at start-up, not in a client's turn."""
    from ..code2wav.frontend import read_audio

    if not voices:
        raise ValueError(f"{owner}: register at least one voice (name -> reference WAV)")
    for path in voices.values():
        if isinstance(path, (str, Path)):
            read_audio(path)
    return dict(voices)
