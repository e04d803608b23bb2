"""The ``minicpmo-rt`` command. Each subcommand parses its flags and calls a package."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import InputError, MiniCPMORTError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="minicpmo-rt: a streaming runtime for MiniCPM-o 4.5.")


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=2)


@app.command("make-tiny")
def make_tiny_cmd(
    out: Path = typer.Argument(..., help="Directory to create (must not exist or be empty)."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    force: bool = typer.Option(False, help="Replace an existing non-empty OUT."),
) -> None:
    """Write a tiny random-weight checkpoint in the real MiniCPM-o 4.5 layout."""
    from .snapshot_tools import make_tiny

    try:
        path = make_tiny(out, seed=seed, force=force)
    except MiniCPMORTError as exc:
        _fail(exc)
    typer.echo(f"wrote tiny checkpoint (RANDOM weights: text is gibberish, audio is noise) to {path}")


@app.command("inspect")
def inspect_cmd(
    model: Optional[str] = typer.Option(None, "--model", help="Snapshot dir, HF cache repo dir or cached hub id."),
    revision: Optional[str] = typer.Option(None, help="Immutable revision to record."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    config: Optional[Path] = typer.Option(None, "--config", help="config.json to build parts from (with --meta)."),
    meta: bool = typer.Option(False, "--meta", help="Build the implemented parts on the meta device."),
    check_manifest: Optional[Path] = typer.Option(None, "--check-manifest", help="Manifest JSON to compare with."),
) -> None:
    """Describe a snapshot, or check implemented parts against a key manifest."""
    from .snapshot_tools import check_manifest as run_check, inspect_snapshot

    try:
        if check_manifest is not None or meta:
            if check_manifest is None or config is None or not meta:
                raise typer.BadParameter("the manifest check needs --config CONFIG.json --meta --check-manifest MANIFEST.json")
            result = run_check(config, check_manifest)
            total = result.total
            if as_json:
                typer.echo(json.dumps({
                    "parts": {k: {"matched": r.matched, "missing": r.missing, "unexpected": r.unexpected,
                                  "mismatched": [list(m) for m in r.mismatched]} for k, r in result.reports.items()},
                    "skipped": result.skipped, "ok": result.ok}, indent=2))
            else:
                for name, rep in result.reports.items():
                    typer.echo(f"{name:28s} {rep.summary()}")
                    if not rep.ok:
                        typer.echo(rep.details())
                if result.skipped:
                    typer.echo(f"skipped (not implemented yet): {', '.join(result.skipped)}")
                typer.echo(f"missing {len(total.missing)}  unexpected {len(total.unexpected)}  "
                           f"mismatched {len(total.mismatched)}")
            if not result.ok:
                raise typer.Exit(code=1)
            return
        if model is None:
            raise typer.BadParameter("pass --model DIR, or --config/--meta/--check-manifest")
        info = inspect_snapshot(model, revision)
    except MiniCPMORTError as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(f"snapshot  {info['path']}")
    typer.echo(f"model     {info['model_id']}  revision {info['revision']} ({info['revision_source']})")
    typer.echo(f"version   {info['version']}  torch_dtype {info['torch_dtype']}")
    for prefix, e in info["parts"].items():
        typer.echo(f"  {prefix:26s} {e['keys']:5d} keys {e['parameters']:>15,d} params  {','.join(e['dtypes'])}")
    typer.echo(f"  {'total':26s} {'':5s}      {info['total_parameters']:>15,d} params")
    typer.echo(f"token2wav assets: {', '.join(info['token2wav_assets']) or 'none'}")
    for dev, line in info.get("code2wav_choice", {}).items():
        typer.echo(f"code2wav on {dev}: {line}")
    for dev, line in info.get("talker_choice", {}).items():
        typer.echo(f"talker on {dev}: {line}")
    graphs = info.get("code2wav_graphs")
    if graphs:
        typer.echo(f"code2wav graphs on CUDA: at most {graphs['max_graphs']} Whole-Euler graphs (cfm_max_graphs), "
                   + ("precaptured, with the encoder and HiFT graphs, for the first stream's voice"
                      if graphs["precapture"] and graphs["max_graphs"]
                      else "each captured at its first solve") + " (cfm_graph_precapture)")


@app.command("code2wav")
def code2wav_cmd(
    model: str = typer.Option(..., "--model", help="Snapshot dir (its assets/token2wav/ is used)."),
    codes: Path = typer.Option(..., "--codes", help="JSON list of codec ids (0..6560), 25 per second."),
    voice: Path = typer.Option(..., "--voice", help="Reference voice recording (any rate; normalised to 6 s)."),
    output: Path = typer.Option(..., "--output", help="WAV to write (24 kHz, float32)."),
    stream: bool = typer.Option(False, "--stream", help="Decode through the 3 + 25 streaming protocol."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    n_timesteps: int = typer.Option(10, "--n-timesteps", help="Euler steps of the flow solve."),
) -> None:
    """Codec ids -> 24 kHz WAV (Code2Wav: the reference path on CPU, the fast CFM path on CUDA)."""
    from .code2wav.io import run_code2wav

    try:
        info = run_code2wav(model, codes, voice, output, stream=stream, device=device, n_timesteps=n_timesteps)
    except MiniCPMORTError as exc:
        _fail(exc)
    typer.echo(f"wrote {output}: {info['samples']} samples ({info['seconds']:.2f} s at 24 kHz) from "
               f"{info['codes']} codes in {info['wall_s']:.2f} s (RTF {info['rtf']:.2f}); "
               f"vocoder {info['vocoder']}, {'streamed' if stream else 'whole utterance'}")


@app.command("talker")
def talker_cmd(
    model: str = typer.Option(..., "--model", help="Snapshot dir (Thinker, tokenizer and tts.* weights)."),
    text: Optional[str] = typer.Option(None, "--text", help="The user's words; the Thinker answers and the Talker "
                                       "voices it."),
    audio: Optional[Path] = typer.Option(None, "--audio", help="A recording of the user (WAV/FLAC/OGG, any rate)."),
    image: Optional[Path] = typer.Option(None, "--image", help="A picture (PNG/JPEG) the turn is about."),
    codes_out: Path = typer.Option(..., "--codes-out", help="JSON list of codec ids (0..6560, no EOS) to write."),
    seed: int = typer.Option(0, "--seed", help="Seed of the Thinker and Talker sampling."),
    profile: str = typer.Option("minicpmo_4_5_turn_mrv2", "--profile", help="Turn-mode deploy profile (name or YAML)."),
    max_codes: Optional[int] = typer.Option(None, "--max-codes", help="Talker code limit (default 2048)."),
    min_codes: int = typer.Option(50, "--min-codes", help="Codes before EOS may be drawn (upstream 50)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Thinker text token limit (default 256)."),
    capacity: Optional[int] = typer.Option(None, "--capacity", help="Talker slots (default: the profile's)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
) -> None:
    """Words, speech and a picture -> Thinker (text + hidden states) -> Talker -> codec ids (JSON)."""
    from .runtime.jobs import run_talker

    try:
        info = run_talker(model, text, codes_out, seed=seed, profile=profile, max_codes=max_codes,
                          min_codes=min_codes, max_new_tokens=max_new_tokens, capacity=capacity, device=device,
                          audio=audio, image=image)
    except MiniCPMORTError as exc:
        _fail(exc)
    if info["warning"]:
        typer.echo(info["warning"])
    typer.echo(f"thinker: {info['tokens']} tokens ({'stopped by ' + str(info['terminator']) if info['terminator'] else 'token limit'}): {info['text']!r}")
    typer.echo(f"wrote {codes_out}: {info['codes']} codes ({info['codes'] / 25:.2f} s at 25 Hz) in {info['wall_s']:.2f} s "
               f"(profile {info['profile']}, {info['capacity']} talker slots)")


@app.command("speak")
def speak_cmd(
    model: str = typer.Option(..., "--model", help="Snapshot dir (all weights, tokenizer, assets/token2wav/)."),
    text: Optional[list[str]] = typer.Option(None, "--text", help="The user's words; the answer is spoken. Repeat "
                                             "the flag (with one --output each) to answer several turns at once."),
    audio: Optional[list[Path]] = typer.Option(None, "--audio", help="A recording of the user (WAV/FLAC/OGG, any "
                                               "rate): a spoken question, or sound to talk about; one per turn."),
    image: Optional[list[Path]] = typer.Option(None, "--image", help="A picture (PNG/JPEG) the turn is about; one "
                                               "per turn. Turn i is the i-th --image, --audio and --text given."),
    voice: Path = typer.Option(..., "--voice", help="Reference recording of the voice to speak in."),
    output: list[Path] = typer.Option(..., "--output", help="WAV to write (24 kHz, float32), one per turn."),
    seed: int = typer.Option(0, "--seed", help="Seed of the Thinker and Talker sampling (turn i: seed + i)."),
    profile: str = typer.Option("minicpmo_4_5_turn_mrv2", "--profile", help="Turn-mode deploy profile (name or YAML)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Thinker text token limit (default 256)."),
    max_codes: Optional[int] = typer.Option(None, "--max-codes", help="Talker code limit (default 2048)."),
    min_codes: int = typer.Option(50, "--min-codes", help="Codes before EOS may be drawn (upstream 50)."),
    capacity: Optional[int] = typer.Option(None, "--capacity", help="Talker slots (default: the profile's)."),
    n_timesteps: Optional[int] = typer.Option(None, "--n-timesteps", help="Euler steps of the flow (default: the profile's)."),
    codes_out: Optional[Path] = typer.Option(None, "--codes-out", help="Also write the codec ids as JSON (one list "
                                             "per --text when several)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
) -> None:
    """Spoken turns: words, speech and pictures -> Thinker -> Talker -> Code2Wav -> 24 kHz WAV (several turns share
    each stage)."""
    from .runtime.jobs import run_speak

    try:
        info = run_speak(model, text or [], voice, output, seed=seed, profile=profile, max_codes=max_codes,
                         min_codes=min_codes, max_new_tokens=max_new_tokens, capacity=capacity,
                         n_timesteps=n_timesteps, device=device, codes_out=codes_out, audio=audio or [],
                         image=image or [])
    except MiniCPMORTError as exc:
        _fail(exc)
    if info["warning"]:
        typer.echo(info["warning"])
    for r in info["requests"]:
        stop = "stopped by " + str(r["terminator"]) if r["terminator"] else "token limit"
        typer.echo(f"thinker: {r['tokens']} tokens ({stop}): {r['text']!r}")
        typer.echo(f"talker: {r['codes']} codes; code2wav: {r['chunks']} chunks, {info['n_timesteps']} Euler steps")
        typer.echo(f"wrote {r['output']}: {r['samples']} samples ({r['seconds']:.2f} s at 24 kHz)")
    typer.echo(f"{len(info['requests'])} turn(s) in {info['wall_s']:.2f} s (profile {info['profile']}, "
               f"{info['capacity']} talker slots)")


@app.command("duplex")
def duplex_cmd(
    model: str = typer.Option(..., "--model", help="Snapshot dir (all weights, tokenizer, assets/token2wav/)."),
    input_audio: Path = typer.Option(..., "--input", help="The user's side: a recording, fed one second per unit."),
    voice: Path = typer.Option(..., "--voice", help="Reference recording of the voice to speak in (also the "
                                                     "system prompt's voice reference)."),
    output: Path = typer.Option(..., "--output", help="WAV to write: the model's side, 24 kHz float32 (a "
                                                       "listening second is 1 s of silence)."),
    video: Optional[Path] = typer.Option(None, "--video", help="The user's camera: one frame per unit (the last "
                                         "frame shown when each second ends) goes in with its audio."),
    transcript: Optional[Path] = typer.Option(None, "--transcript", help="Also write a JSON record per unit "
                                              "(listen or speak, text, terminator, turn end, codes)."),
    decode: str = typer.Option("greedy", "--decode", help="greedy (upstream's offline duplex_chat) or sampling "
                                                          "(temperature 0.7, top-k 20, top-p 0.8)."),
    force_listen_units: int = typer.Option(0, "--force-listen-units", help="The first N units listen without "
                                           "decoding (upstream's service uses 3)."),
    max_units: Optional[int] = typer.Option(None, "--max-units", help="Stop after this many seconds of input."),
    seed: int = typer.Option(0, "--seed", help="Seed of the Thinker's and the Talker's sampling."),
    profile: str = typer.Option("minicpmo_4_5_duplex_h200", "--profile", help="Duplex deploy profile (name or YAML)."),
    n_timesteps: Optional[int] = typer.Option(None, "--n-timesteps", help="Euler steps of the flow (default: the profile's)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (the fast paths on CUDA)."),
    dtype: str = typer.Option("auto", "--dtype", help="Thinker and Talker weights: auto (bfloat16 on CUDA, float32 "
                                                      "on the CPU), float32, bfloat16 or float16."),
) -> None:
    """A duplex conversation over a recorded user side: each second the model listens or speaks."""
    from .runtime.jobs import run_duplex

    try:
        info = run_duplex(model, input_audio, voice, output, transcript, seed=seed, profile=profile, decode=decode,
                          force_listen_units=force_listen_units, max_units=max_units, n_timesteps=n_timesteps,
                          device=device, video=video, dtype=dtype)
    except MiniCPMORTError as exc:
        _fail(exc)
    if info["warning"]:
        typer.echo(info["warning"])
    typer.echo(f"duplex: {info['units']} units ({info['frames']} with a frame), spoke in {info['spoke']}, "
               f"{info['turns']} turn(s) ended: {info['text']!r}")
    typer.echo(f"wrote {output}: {info['seconds']:.2f} s at 24 kHz in {info['wall_s']:.2f} s (profile {info['profile']}, "
               f"{info['dtype']})")


@app.command("duplex-batch")
def duplex_batch_cmd(
    model: str = typer.Option(..., "--model", help="Snapshot dir (all weights, tokenizer, assets/token2wav/)."),
    inputs: list[Path] = typer.Option(..., "--input", help="One user's side per conversation (repeat the flag)."),
    voices: list[Path] = typer.Option(..., "--voice", help="The voice of each conversation, or one for all."),
    outputs: list[Path] = typer.Option(..., "--output", help="One WAV per conversation (24 kHz float32), in "
                                       "--input's order."),
    transcript: Optional[Path] = typer.Option(None, "--transcript", help="Also write one JSON with each "
                                              "conversation's records per unit."),
    decode: str = typer.Option("greedy", "--decode", help="greedy or sampling (temperature 0.7, top-k 20, top-p 0.8)."),
    force_listen_units: int = typer.Option(0, "--force-listen-units", help="The first N units of each "
                                           "conversation listen without decoding."),
    max_units: Optional[int] = typer.Option(None, "--max-units", help="Stop each conversation after this many seconds."),
    seed: int = typer.Option(0, "--seed", help="Conversation i samples with seed + i."),
    profile: str = typer.Option("minicpmo_4_5_duplex_h200", "--profile", help="Duplex deploy profile (name or YAML)."),
    n_timesteps: Optional[int] = typer.Option(None, "--n-timesteps", help="Euler steps of the flow (default: the profile's)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (the fast paths and the shared decode on CUDA)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on CUDA, float32 on the CPU), float32, "
                                                      "bfloat16 or float16."),
) -> None:
    """Several duplex conversations at once on one set of models (one second of each per step)."""
    from .runtime.jobs import run_duplex_batch

    try:
        info = run_duplex_batch(model, inputs, voices, outputs, transcript, seed=seed, profile=profile,
                                decode=decode, force_listen_units=force_listen_units, max_units=max_units,
                                n_timesteps=n_timesteps, device=device, dtype=dtype)
    except MiniCPMORTError as exc:
        _fail(exc)
    if info["warning"]:
        typer.echo(info["warning"])
    for out, units, spoke, sec in zip(outputs, info["units"], info["spoke"], info["seconds"]):
        typer.echo(f"wrote {out}: {units} units, spoke in {spoke}, {sec:.2f} s at 24 kHz")
    typer.echo(f"duplex batch: {info['conversations']} conversations in {info['wall_s']:.2f} s "
               f"(profile {info['profile']}, {info['dtype']})")


@app.command("serve")
def serve_cmd(
    model: str = typer.Option(..., "--model", help="Snapshot dir (all weights, tokenizer, assets/token2wav/)."),
    voices: list[str] = typer.Option(..., "--voice", help="A voice to speak in: PATH (named by its stem) or "
                                     "NAME=PATH; repeat for several. The first is the default."),
    mode: str = typer.Option("turn", "--mode", help="turn: OpenAI-style /v1/chat/completions; duplex: duplex "
                             "sessions fed one second of audio (and a camera frame) at a time."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one, printed at start)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Deploy profile (name or YAML; default: "
                                          "minicpmo_4_5_turn_mrv2, or minicpmo_4_5_duplex_h200 with --mode duplex)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="Turn mode: spoken requests answered "
                                            "together (default: the profile's Talker capacity)."),
    seats: int = typer.Option(4, "--seats", help="Duplex mode: sessions open at once (each a seat of one "
                                                "batch; their seconds step together)."),
    idle_timeout: float = typer.Option(60.0, "--idle-timeout", help="Duplex mode: seconds without input after "
                                       "which a session is closed and its seat freed."),
    dtype: str = typer.Option("auto", "--dtype", help="Duplex mode's Thinker and Talker weights: auto (bfloat16 on "
                                                      "CUDA, float32 on the CPU), float32, bfloat16 or float16."),
    min_codes: int = typer.Option(50, "--min-codes", help="Turn mode: codes before EOS may be drawn (upstream 50)."),
    n_timesteps: Optional[int] = typer.Option(None, "--n-timesteps", help="Euler steps of the flow (default: the "
                                              "profile's)."),
    served_name: str = typer.Option("minicpm-o-4.5", "--served-model-name", help="The model id the API reports."),
    warm_up: bool = typer.Option(False, "--warm-up", help="Make graphs and kernels before listening (turn: short "
                                 "turns in every voice; duplex: a few seconds on every seat)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MINICPMO_RT_API_KEY", show_default=False,
                                          help="Require 'Authorization: Bearer KEY' on every route but /health "
                                          "(also from $MINICPMO_RT_API_KEY)."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM certificate (chain): serve HTTPS, wss://."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="The certificate's PEM private key."),
    join_running: bool = typer.Option(False, "--join-running", help="Turn mode: a spoken request that arrives "
                                      "while a batch runs joins it instead of waiting for the next (opt-in: on the "
                                      "H200 it gave long answers' requests their first audio sooner, short ones' "
                                      "later)."),
    talker_lead: Optional[float] = typer.Option(None, "--talker-lead", help="With --join-running: the Thinker goes "
                                                "first while every speaking request is this many seconds of audio "
                                                "ahead of real time (e.g. 1.0)."),
) -> None:
    """Serve over HTTP: OpenAI-style chat completions (turn mode) or duplex sessions (duplex mode)."""
    from .serving.http import serve
    from .serving.voices import parse_voices

    def ready(server) -> None:
        typer.echo(f"serving {served_name} ({server.mode} mode) on {server.url} (voices: {', '.join(server.voices)}; "
                   "GET /health lists the routes' state); Ctrl-C or SIGTERM stops")

    try:
        if max_batch is not None and max_batch < 1:
            raise InputError(f"--max-batch must be >= 1, got {max_batch}")
        if not (idle_timeout > 0 and math.isfinite(idle_timeout)):
            raise InputError(f"--idle-timeout must be a positive number of seconds, got {idle_timeout}")
        serve(model, parse_voices(voices), host, port, mode, profile, device, max_batch, seats, min_codes,
              n_timesteps, dtype, served_name, warm_up, idle_timeout, api_key, ready,
              None if tls_cert is None else str(tls_cert), None if tls_key is None else str(tls_key), join_running,
              talker_lead)
    except MiniCPMORTError as exc:
        _fail(exc)
    except OSError as exc:
        _fail(InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port or --host"))
    # Stopped cleanly: the socket is closed and the worker joined. Leave without the interpreter's teardown, in
    # which a native library's thread state aborted the process ("terminate called without an active exception",
    # exit -6) in 1 of 12 Ctrl-C stops under CPU contention; nothing is left to write.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@app.command("make-targets")
def make_targets_cmd(
    easycom_root: Path = typer.Option(..., "--easycom-root", help="EasyCom Main/ folder (holds Speech_Transcriptions/)."),
    session: str = typer.Option(..., "--session", help="Session number (4) or name (Session_4)."),
    output: Path = typer.Option(..., "--output", help="Output .npy (a <stem>.meta.json is written beside it)."),
    pre_s: float = typer.Option(1.0, help="Seconds one speaker must hold the floor alone before a shift/hold silence (0.2-s rows)."),
    post_s: float = typer.Option(1.0, help="Seconds one speaker must hold the floor alone after it."),
    matrix: bool = typer.Option(False, "--matrix", help="Write a float64 [T, C] matrix (labels.COLUMNS order) instead of records, e.g. for the extractor's --target."),
) -> None:
    """5 Hz turn-taking targets (now, future bins, shift/hold) from Speech_Transcriptions."""
    from .turn_head.labels import LabelConfig, make_targets

    try:
        for flag, value in (("--pre-s", pre_s), ("--post-s", post_s)):
            if not (math.isfinite(value) and value > 0):
                raise InputError(f"{flag} {value}: must be a positive number of seconds (rounded to 0.2-s rows, "
                                 "at least one)")
        cfg = LabelConfig(pre_rows=max(1, round(pre_s / 0.2)), post_rows=max(1, round(post_s / 0.2)))
        path, meta = make_targets(easycom_root, session, output, cfg, matrix=matrix)
    except MiniCPMORTError as exc:
        _fail(exc)
    s = meta["summary"]
    typer.echo(f"wrote {s['rows']} rows ({s['valid_now']} valid, {s['valid']} with a valid 2 s future; "
               f"{s['shifts']} shifts, {s['holds']} holds) to {path}")


@app.command("train-turn-head", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                                  "help_option_names": []}, add_help_option=False)
def train_turn_head_cmd(ctx: typer.Context) -> None:
    """Train and evaluate a turn head on feature artifacts (the flags of train_turn_head.py; --help lists them)."""
    from .turn_head.train import main as train_main

    raise typer.Exit(code=train_main(list(ctx.args), prog="minicpmo-rt train-turn-head"))


@app.command("features", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                           "help_option_names": []}, add_help_option=False)
def features_cmd(ctx: typer.Context) -> None:
    """Causal MiniCPM-o features of an EasyCom session (the flags of streaming_minicpmo_features_directly.py; --help lists them)."""
    from .features.extract import main as features_main

    raise typer.Exit(code=features_main(list(ctx.args), prog="minicpmo-rt features"))


@app.command("make-session")
def make_session_cmd(
    out: Path = typer.Argument(..., help="Root to write Video_Compressed/, Glasses_Microphone_Array_Audio/, Speech_Transcriptions/ under."),
    seconds: float = typer.Option(..., "--seconds", help="Media seconds (whole 20 fps frames)."),
    session: int = typer.Option(1, "--session", help="N of Session_N."),
    width: int = typer.Option(320, help="Frame width (even)."),
    height: int = typer.Option(180, help="Frame height (even)."),
    segment_seconds: Optional[float] = typer.Option(None, "--segment-seconds", help="Segment length (default: a third of the session, >= 1 s)."),
    gap_seconds: float = typer.Option(60.0, "--gap-seconds", help="Redacted gap after the first segment."),
    seed: int = typer.Option(0, help="Seed of the synthetic content."),
    no_wav: bool = typer.Option(False, "--no-wav", help="Write no WAVs (use with --mp4-audio)."),
    mp4_audio: bool = typer.Option(False, "--mp4-audio", help="Also mux an AAC track into each mp4."),
) -> None:
    """Write a synthetic session in the EasyCom layout (segments, one gap, speech-like audio, transcripts)."""
    from .features.easycom import build_timeline
    from .features.synthetic import make_session

    try:
        vdir = make_session(out, seconds, session=session, width=width, height=height,
                            segment_seconds=segment_seconds, gap_seconds=gap_seconds, seed=seed,
                            wavs=not no_wav, mp4_audio=mp4_audio)
        typer.echo(f"wrote {vdir}")
        typer.echo(build_timeline(vdir).summary())
    except MiniCPMORTError as exc:
        _fail(exc)


def main() -> None:
    try:
        app()
    except MiniCPMORTError as exc:  # errors raised outside a command's own handler
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
