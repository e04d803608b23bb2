"""Turn-mode spoken conversation: text, speech and images in, 24 kHz speech out, through three decoupled stages.

    pipe = TurnPipeline.from_snapshot("/path/to/MiniCPM-o-4_5")     # profile: generic MRv2
    for pcm in pipe.respond("Hello!", voice="ref.wav", seed=0):    # PcmChunk, in order
        play(pcm.samples)

1. Thinker: prompt (system + user + ``...<|tts_bos|>``) is prefilled, then ``thinker.generate``
   samples text; every token becomes a ``ThinkerStep`` with its final-norm hidden row. A turn
   terminator ends the text and never reaches the Talker.
2. Talker: the steps of a request are collected into a ``TalkerInput`` and submitted to the
   ``TalkerEngine`` (fixed slots, so several requests share each decode step); it emits
   ``CodecChunk``s (3 context codes + window, final flag).
3. Code2Wav: each chunk is pushed into its request's stream; the audio comes out as
   ``PcmChunk``s aligned to the codes (the vocoder's lead-in and the 3 silence context codes
   of the first payload are cut, so a request yields exactly 960 samples per code).

Stages hand over through ``snapshot.SnapshotPublisher``s (Thinker steps per request, codec
chunks for all requests) and touch nothing but the contracts. Here they run one after the
other on the calling thread; the Thinker runs every request before the Talker starts, unless
``overlap_stages`` (opt-in) sends each request to the Talker as soon as its text is done and
steps the Talker once per Thinker decode step meanwhile.

The chunks one Talker step emits (every live slot reaches its window boundary on the same step
when requests start together) go to Code2Wav as one ``push_many`` call (``batch_code2wav``), so
concurrent requests share each CFM solve and HiFT call instead of one per stream; on CUDA the
Talker's decode step runs on fused Triton kernels and replays from a CUDA graph (``talker_graph``).
The prompts admitted together are prefilled together, in the Thinker's rows and the Talker's slots.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, Union

import numpy as np
import torch

from ..errors import InputError
from ..sdpa_backend import no_cudnn_sdpa
from ..talker.engine import CONTEXT_CODES, TalkerEngine, TalkerRequest
from ..thinker.prompt import audio_piece_counts
from .contracts import AudioPart, CodecChunk, ImagePart, Message, PcmChunk, TalkerInput, ThinkerStep, TurnRequest
from .snapshot import SnapshotPublisher, SnapshotReader

DEFAULT_PROFILE = "minicpmo_4_5_turn_mrv2"
SAMPLES_PER_CODE = 960  # 24 kHz / 25 Hz
SAMPLE_RATE = 24_000
TICK = (None, [], False)  # what the Thinker's producers yield after each decode step
# progress(stage, request_id, count): "thinker" with the request's tokens generated so far (the terminator not
# counted), then "talker" with its codes emitted so far (context codes not counted); for progress bars
Progress = Callable[[str, str, int], None]
# admit(): requests that join a run in progress (an empty list when none); asked before every step
Admit = Callable[[], Sequence[TurnRequest]]


@dataclass
class TurnTrace:
    """What crossed each stage boundary, per request (for callers that report or test it)."""

    steps: dict[str, list[ThinkerStep]] = field(default_factory=dict)
    talker_inputs: dict[str, TalkerInput] = field(default_factory=dict)
    talker_requests: dict[str, TalkerRequest] = field(default_factory=dict)
    chunks: dict[str, list[CodecChunk]] = field(default_factory=dict)
    # hears each request's ThinkerSteps as the Thinker publishes them (before the Talker has its text), e.g. a
    # server streaming the transcript ahead of the audio; called on the thread that runs the pipeline
    on_steps: Callable[[str, list[ThinkerStep]], None] | None = None

    def codes(self, request_id: str) -> list[int]:
        """The request's codec ids in order (context and EOS excluded)."""
        return [c for ch in self.chunks.get(request_id, []) for c in ch.codes[ch.n_context:]]


def media_parts(messages: Sequence[Message]) -> list:
    """The messages' audio and images in prompt order (the order their slots are filled in)."""
    return [p for m in messages if not isinstance(m["content"], str) for p in m["content"] if not isinstance(p, str)]


def fed_audio(messages: Sequence[Message]) -> list[np.ndarray]:
    """Each audio part's samples as upstream's ``streaming_prefill`` feeds them, in prompt order: the
    conversation's first recording front-padded with zeros to 1035 ms when shorter."""
    from ..thinker.session import FIRST_CHUNK_PAD_SAMPLES

    out: list[np.ndarray] = []
    for p in media_parts(messages):
        if isinstance(p, AudioPart):
            x = p.samples
            if not out and x.size < FIRST_CHUNK_PAD_SAMPLES:
                x = np.concatenate([np.zeros(FIRST_CHUNK_PAD_SAMPLES - x.size, np.float32), x])
            out.append(x)
    return out


def _content_text(content, audio_lengths: Iterator[int]) -> str:
    """A message's content as prompt text: its parts joined with nothing between them (upstream's
    ``streaming_prefill`` in its default omni mode), an image as ``<image>`` + 64 ``<unk>`` + ``</image>`` (and
    its slices), an audio as one ``<|audio_start|>`` + 10 ``<unk>`` a second + ``<|audio_end|>`` block for the
    samples fed (the processor's placeholder when the audio is not streamed)."""
    from ..thinker.image_processor import image_placeholder
    from ..thinker.prompt import audio_placeholder

    if isinstance(content, str):
        return content
    return "".join(p if isinstance(p, str) else image_placeholder(p.image.grid) if isinstance(p, ImagePart)
                   else audio_placeholder(next(audio_lengths)) for p in content)


def turn_prompt(builder, messages: Sequence[Message], fed: list[np.ndarray] | None = None):
    """System (the default one unless given) + earlier turns through the chat template, then
    ``<|im_start|>user\\n{content}`` and the assistant bos ending in ``<|tts_bos|>`` (upstream's
    streaming turn layout, ``streaming_prefill`` + ``streaming_generate``; no reference audio is fed to the
    Thinker). Audio and images in the content become placeholders whose slots ``TurnPipeline`` fills with
    their encodings (``media_parts`` order; audio as ``fed_audio`` gives it, or ``fed`` when the caller has it)."""
    from ..thinker.prompt import DEFAULT_SYSTEM_PROMPT, apply_chat_template

    fed = fed_audio(messages) if fed is None else fed
    lengths = iter([x.size for x in fed])
    msgs = [{**m, "content": _content_text(m["content"], lengths)} for m in messages]
    if msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": DEFAULT_SYSTEM_PROMPT})
    piece = builder.from_text(apply_chat_template(msgs[:-1]) + builder.user_prefix() + msgs[-1]["content"])
    images = sum(p.image.num_sub_images for p in media_parts(messages) if isinstance(p, ImagePart))
    audio = sum(sum(audio_piece_counts(x.size)) for x in fed)
    if [s.kind for s in piece.slots].count("image") != images or \
            sum(s.length for s in piece.slots if s.kind == "audio") != audio:
        raise InputError("the prompt's audio/image slots do not match the request's audio and images; send media "
                         "as parts, with no placeholder text (<|audio_start|>, <image>...) in the words")
    return piece + builder.assistant_bos()


def prompt_embeds(thinker, builder, messages: Sequence[Message]):
    """The turn prompt and its input rows: token embeddings, with the audio (each recording whole, Whisper with
    full attention) and the images (all in one vision pass) encoded into their slots."""
    fed = fed_audio(messages)
    piece = turn_prompt(builder, messages, fed)
    media = media_parts(messages)
    if not media:
        return piece, thinker.embed_tokens(piece.ids)
    images = [p.image for p in media if isinstance(p, ImagePart)]
    with no_cudnn_sdpa():   # each recording's and picture's own length: no per-shape cuDNN plan (36-60 ms each)
        audio = [thinker.embed_audio(x, chunk_length=None) for x in fed]
        image_rows = [thinker.embed_image(images)] if images else []
    return piece, thinker.fill_slots(piece, image_rows, torch.cat(audio) if audio else None)


class _CopiedStep:
    """A stepper whose outputs are copied out of the decoder's static (CUDA-graph) buffers,
    which the next replay overwrites; the hidden rows must outlive it (DESIGN contract)."""

    def __init__(self, stepper):
        self.stepper = stepper

    def __call__(self, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, logits = self.stepper(token)
        return h.clone(), logits.clone()


class _Steps:
    """One request's ThinkerSteps from its generation chunks, in order (a text piece waits for the rest of
    a UTF-8 character split across tokens; a terminator is a step without a hidden row)."""

    def __init__(self, request_id: str, tokenizer, position: int):
        self.request_id, self.tokenizer, self.position = request_id, tokenizer, position
        self.ids: list[int] = []
        self.said = ""

    def __call__(self, chunk) -> list[ThinkerStep]:
        # one copy per chunk out of the decoder's buffers, on the Thinker's device (the Talker reads the rows
        # there: a round trip through the host stalled a 16-request admission by up to 80 ms on the H200)
        rows = chunk.hidden.detach().to(torch.float32, copy=True)     # one copy, whatever the decoder's dtype
        steps = []
        for i, tok in enumerate(chunk.token_ids):
            self.ids.append(tok)
            text = self.tokenizer.decode(self.ids)
            piece_text = ""
            if not text.endswith("\ufffd"):  # wait for the rest of a split UTF-8 character
                piece_text, self.said = text[len(self.said):], text
            steps.append(ThinkerStep(self.request_id, self.position, tok, piece_text, rows[i], False))
            self.position += 1
        if chunk.terminator is not None:
            steps.append(ThinkerStep(self.request_id, self.position, chunk.terminator,
                                     self.tokenizer.decode([chunk.terminator]), None, True))
        return steps


class TurnPipeline:
    """``decoder``: an optional ``thinker.decode.StaticDecoder`` of ``thinker.llm`` (the static-KV
    fast path, through CUDA graphs when ``use_graph``); without it the Thinker decodes on
    transformers' DynamicCache (the plain path)."""

    def __init__(self, thinker, tokenizer, talker_engine: TalkerEngine, code2wav=None, profile=None,
                 sampling=None, decoder=None, use_graph: bool = False, batch_code2wav: bool = True, rows=None,
                 overlap_stages: bool = False, talker_lead_s: float | None = None):
        from ..thinker.generate import SamplingConfig, forbidden_token_ids
        from ..thinker.prompt import PromptBuilder

        if profile is not None and profile.mode != "turn":
            raise InputError(f"profile {profile.name!r} is a {profile.mode} profile; the turn pipeline needs a "
                             f"turn-mode profile (e.g. {DEFAULT_PROFILE})")
        self.thinker, self.tokenizer, self.talker, self.code2wav = thinker, tokenizer, talker_engine, code2wav
        self.profile = profile
        self.decoder, self.use_graph = decoder, use_graph
        self.batch_code2wav = batch_code2wav
        self.rows = rows
        # Opt-in (on the H200 it measured the same as without it, session 45): each request enters the Talker
        # when its text is done, and the Talker steps between the Thinker's (``codec_rounds``).
        self.overlap_stages = overlap_stages
        # With the stages overlapped (``overlap_stages`` or requests joining a run), the Talker lets the Thinker
        # go first while every request it holds has at least this much audio out beyond real time (seconds of
        # PCM yielded less the seconds since its first PCM): a request that joins while others speak then gets
        # its text at the Thinker's own pace instead of one Talker step per token. None: one Talker step per
        # Thinker step (``codec_rounds``).
        if talker_lead_s is not None and not talker_lead_s >= 0:
            raise InputError(f"talker_lead_s must be >= 0 seconds (or None), got {talker_lead_s!r}")
        self.talker_lead_s = talker_lead_s
        self.clock: Callable[[], float] = time.perf_counter    # the lead's clock (tests replace it)
        # With the stages overlapped on CUDA, the Talker's work goes to a stream of its own, so that its decode
        # step (a graph replay that waits for nothing until a window is due) runs beside the Thinker's on the
        # device instead of after it in one stream (``codec_rounds``).
        self.talker_side_stream = False
        self._side: torch.cuda.Stream | None = None
        # think_rows draws every row's token in one batch (thinker.generate.draw_many, one wait on the device
        # per step); False draws row by row as ``think`` does (the same tokens; for benchmarks' before form)
        self.batched_draws = True
        # ... and prefills the prompts admitted together in one forward (False: one at a time, as before)
        self.batched_prefill = True
        self.sampling = sampling or SamplingConfig()
        self.builder = PromptBuilder(tokenizer)
        self.forbidden = forbidden_token_ids(tokenizer)  # upstream masks these while speaking

    @classmethod
    def from_snapshot(cls, model: Union[str, Path], profile: str = DEFAULT_PROFILE, device: str = "cpu",
                      dtype: torch.dtype = torch.float32, with_code2wav: bool = True,
                      n_timesteps: int | None = None, capacity: int | None = None,
                      talker_params=None, sampling=None, thinker_fast: bool | None = None,
                      thinker_max_len: int = 4096, prepare_voice=None, talker_graph: bool | None = None,
                      batch_code2wav: bool = True, thinker_rows: int | None = None,
                      overlap_stages: bool = False, talker_lead_s: float | None = None) -> "TurnPipeline":
        """Load every stage from a snapshot; ``capacity``/``n_timesteps`` override the profile.
        ``thinker_fast`` (default: on CUDA) decodes the Thinker on a static KV cache of
        ``thinker_max_len`` positions through CUDA graphs. ``prepare_voice`` (a reference WAV): capture
        Code2Wav's graphs for that voice now (``Code2Wav.prepare``) instead of when its first stream opens.
        ``talker_graph`` (default: on CUDA) captures the Talker's decode step here (its fused kernels on CUDA:
        one graph for every position).
        ``batch_code2wav``: each Talker step's chunks go to Code2Wav in one ``push_many`` call.
        ``thinker_rows`` (default with ``thinker_fast``: the Talker's capacity; 0 for none): decode that many
        requests' Thinker steps together on the rows of one static decoder (``think_rows``; each row holds
        ``thinker_max_len`` positions of KV cache). ``overlap_stages`` (opt-in): a request enters the Talker
        as soon as its text is done, and the Talker steps once per Thinker decode step meanwhile.
        ``talker_lead_s``: see ``TurnPipeline.talker_lead_s``."""
        from ..checkpoint.snapshot import resolve_snapshot
        from ..checkpoint.tokenizer import load_tokenizer
        from ..code2wav.pipeline import Code2Wav
        from ..profiles import load_profile
        from ..talker.load import load_talker
        from ..talker.sampler import SamplingParams
        from ..thinker.model import Thinker

        prof = load_profile(profile)
        if prof.mode != "turn":
            raise InputError(f"profile {prof.name!r} is a {prof.mode} profile; pass a turn-mode profile "
                             f"(e.g. {DEFAULT_PROFILE})")
        if capacity is not None and capacity < 1:
            raise InputError(f"talker capacity must be >= 1, got {capacity}")
        snap = resolve_snapshot(model)
        thinker = Thinker.from_snapshot(snap.path, dtype=dtype, device=device)
        tokenizer = load_tokenizer(snap.path)
        engine = TalkerEngine(load_talker(snap.path, dtype, device), capacity or prof.talker.capacity,
                              prof.talker.kv_cache_bytes, talker_params or SamplingParams(),
                              prof.talker.window, prof.talker.first_window)
        if talker_graph if talker_graph is not None else torch.device(device).type == "cuda":
            engine.capture_cuda_graph()     # raises a named error off CUDA
        c2w = None
        if with_code2wav:
            c2w = Code2Wav.from_snapshot(snap.path, device=device,
                                         n_timesteps=n_timesteps or prof.code2wav.n_timesteps,
                                         extra=prof.code2wav.extra)
            if prepare_voice is not None:
                c2w.prepare(prepare_voice)
        decoder = rows = None
        fast = thinker_fast if thinker_fast is not None else torch.device(device).type == "cuda"
        n_rows = (engine.capacity if fast else 0) if thinker_rows is None else thinker_rows
        if n_rows < 0:
            raise InputError(f"thinker_rows must be >= 0, got {n_rows}")
        if n_rows:
            from ..thinker.llm_cache import StaticRows

            rows = StaticRows(thinker, n_rows, thinker_max_len, kernels="auto" if fast else "torch")
        elif fast:
            from ..thinker.decode import StaticDecoder

            decoder = StaticDecoder(thinker.llm, thinker_max_len)
        return cls(thinker, tokenizer, engine, c2w, prof, sampling, decoder,
                   use_graph=fast and torch.device(device).type == "cuda", batch_code2wav=batch_code2wav,
                   rows=rows, overlap_stages=overlap_stages, talker_lead_s=talker_lead_s)

    # ---- stage 1: Thinker ---------------------------------------------------------------------
    def _prefill(self, req: TurnRequest):
        """The request's prompt through the Thinker on a fresh DynamicCache -> (prompt length, last logits,
        cache, sampling config, generator)."""
        th = self.thinker
        piece, embeds = self._prompt(req)
        cache = th.new_cache()
        with no_cudnn_sdpa():       # each prompt's own length: no per-shape cuDNN plan
            prefill = th.forward_embeds(embeds, cache, logits=True)
        gen = torch.Generator(device=prefill.logits.device).manual_seed(req.seed)
        return len(piece), prefill.logits, cache, self._sampling(req), gen

    def _prompt(self, req: TurnRequest):
        return prompt_embeds(self.thinker, self.builder, req.messages)

    def _sampling(self, req: TurnRequest):
        """The pipeline's sampling config with the request's own token limit."""
        if req.max_new_tokens is None:
            return self.sampling
        return replace(self.sampling, max_new_tokens=req.max_new_tokens)

    @staticmethod
    def _fits(req: TurnRequest, position: int, sampling, max_len: int) -> None:
        if position + sampling.max_new_tokens + 1 > max_len:
            raise InputError(f"request {req.request_id!r}: prompt ({position} tokens) + max_new_tokens "
                             f"({sampling.max_new_tokens}) exceed the Thinker's static cache "
                             f"({max_len}); shorten the input or lower max_new_tokens")

    @torch.no_grad()
    def think(self, req: TurnRequest) -> Iterator[list[ThinkerStep]]:
        """Prefill the turn prompt and generate; yields the ThinkerSteps of each generation chunk."""
        from ..thinker.generate import iter_generate

        position, logits, cache, sampling, gen = self._prefill(req)
        stepper = None
        if self.decoder is not None:
            from ..thinker.generate import StaticStepper, load_dynamic_cache

            self._fits(req, position, sampling, self.decoder.max_len)
            stepper = _CopiedStep(StaticStepper(self.decoder, load_dynamic_cache(self.decoder, cache),
                                                use_graph=self.use_graph))
            cache = None
        steps = _Steps(req.request_id, self.tokenizer, position)
        for chunk in iter_generate(self.thinker.llm, cache, logits, sampling, forbidden_ids=self.forbidden,
                                   generator=gen, stepper=stepper):
            yield steps(chunk)

    @torch.no_grad()
    def think_rows(self, requests: Sequence[TurnRequest]) -> Iterator[tuple[str | None, list[ThinkerStep], bool]]:
        """``think`` for several requests at once on the rows of ``self.rows`` (a ``StaticRows``): each
        request's prompt is prefilled into a free row (the prompts admitted together in one forward per run
        of consecutive rows, ``StaticRows.prefill_many``), then every decode step feeds all live rows in one
        forward (a CUDA graph on CUDA), each row drawing its own token (its sampling, seed and repetition
        history, as ``think``; all rows' draws in one batch). A request takes a row as soon as one is free.
        Yields (request id, the ThinkerSteps of one generation chunk, whether the request's text is done),
        requests interleaved, and ``TICK`` after each decode step (for a caller that interleaves other
        work per step). ``requests`` may be a deque that the caller extends between steps: a request added
        takes a row at the next step that has one free."""
        from ..thinker.generate import Generation, GenerationChunk, draw_many

        rows, th = self.rows, self.thinker
        waiting = requests if isinstance(requests, deque) else deque(requests)     # a caller may extend it
        live: dict[int, list] = {}      # row -> [request, Generation, _Steps, next position, row view]
        try:
            while waiting or live:
                admitted: list[tuple] = []      # (request, prompt, sampling, row view, input rows)
                try:
                    while waiting and len(live) + len(admitted) < rows.batch:
                        req = waiting.popleft()
                        piece, embeds = self._prompt(req)
                        sampling = self._sampling(req)
                        self._fits(req, len(piece), sampling, rows.capacity)
                        admitted.append((req, piece, sampling, rows.acquire(rows.capacity), embeds))
                    if admitted:
                        # the prompts go straight into their rows through the decoder's own kernels, those of
                        # consecutive rows in one forward (one prompt at a time, each read the weights and
                        # launched every layer's kernels again: ~12 ms a request on the H200, most of the
                        # Thinker's time once the decode steps were shared)
                        views, prompts = [a[3] for a in admitted], [a[4] for a in admitted]
                        hidden = rows.prefill_many(views, prompts, join=self.batched_prefill)
                        logits = th.llm.lm_head(hidden).float()
                except BaseException:
                    for a in admitted:
                        rows.release(a[3])
                    raise
                for j, (req, piece, sampling, view, _) in enumerate(admitted):
                    gen = torch.Generator(device=logits.device).manual_seed(req.seed)
                    live[view.row] = [req, Generation(th.llm, logits[j:j + 1], sampling,
                                                      forbidden_ids=self.forbidden, generator=gen),
                                      _Steps(req.request_id, self.tokenizer, len(piece)), len(piece), view]
                feeds: dict[int, tuple[int, int]] = {}
                entries = list(live.items())
                drawn = draw_many([e[1] for _, e in entries]) if self.batched_draws else \
                    [e[1].draw() for _, e in entries]
                for (row, (req, gen, steps, position, _)), tok in zip(entries, drawn):
                    if isinstance(tok, GenerationChunk):
                        rows.release(live.pop(row)[4])
                        yield req.request_id, steps(tok), True
                    else:
                        feeds[row] = (tok, position)
                if not feeds:
                    continue
                out = rows.step_logits(feeds)
                for i, row in enumerate(out.rows):
                    entry = live[row]
                    entry[3] += 1
                    chunk = entry[1].feed(feeds[row][0], out.hidden[i:i + 1], out.logits[i:i + 1].float())
                    if chunk is not None:
                        done = entry[1].done
                        if done:
                            rows.release(live.pop(row)[4])
                        yield entry[0].request_id, entry[2](chunk), done
                yield TICK
        finally:
            for entry in live.values():
                rows.release(entry[4])

    # ---- stages 1 + 2: text and codec chunks ----------------------------------------------------
    def _check(self, requests: Sequence[TurnRequest], need_voice: bool, taken: Iterable[str] = ()) -> None:
        if not requests:
            raise InputError("no requests; pass at least one TurnRequest")
        busy = set(taken) | {s.request.request_id for s in self.talker.slots.values()} | \
               {p.request_id for p in self.talker.pending}
        seen: set[str] = set()
        for r in requests:
            if r.request_id in seen or r.request_id in busy:
                raise InputError(f"request id {r.request_id!r} is used twice; give every request its own id")
            seen.add(r.request_id)
            if need_voice:
                if r.voice is None:
                    raise InputError(f"request {r.request_id!r}: no voice; pass a reference recording (WAV)")
                self.code2wav.features(r.voice)  # reads and validates it before any model work

    def codec_chunks(self, requests: Sequence[TurnRequest], trace: TurnTrace | None = None,
                     progress: Progress | None = None) -> Iterator[CodecChunk]:
        """Stages 1 and 2: every request through the Thinker, then all of them through the
        Talker's slots together; yields CodecChunks as the engine emits them."""
        for chunks in self.codec_rounds(requests, trace, progress):
            yield from chunks

    def codec_rounds(self, requests: Sequence[TurnRequest], trace: TurnTrace | None = None,
                     progress: Progress | None = None, admit: Admit | None = None,
                     talker_may_wait: Callable[[], bool] | None = None) -> Iterator[list[CodecChunk]]:
        """``codec_chunks`` grouped by the Talker step that emitted them (steps that emit nothing
        are skipped): the chunks of one round belong to different requests. ``admit`` (optional) is asked
        before every step for requests that join the run (checked by the caller); with it the stages overlap
        as with ``overlap_stages``, so a request that joins while others speak starts at once. With the stages
        overlapped, ``talker_may_wait`` (optional) is asked after each Thinker decode step; True skips the
        Talker step due then (the Thinker goes on), so it must turn False in time (it is not asked while the
        Thinker is idle)."""
        trace = trace if trace is not None else TurnTrace()
        outs: dict[str, SnapshotPublisher[ThinkerStep]] = {}
        readers: dict[str, SnapshotReader] = {}
        by_id: dict[str, TurnRequest] = {}
        tokens: dict[str, int] = {}
        emitted: dict[str, int] = {}
        waiting: deque[TurnRequest] = deque()     # requests the Thinker has not taken yet

        def register(reqs: Iterable[TurnRequest]) -> None:
            for req in reqs:
                rid = req.request_id
                outs[rid] = SnapshotPublisher(f"thinker[{rid}]")
                readers[rid] = SnapshotReader(outs[rid])
                by_id[rid], tokens[rid], emitted[rid] = req, 0, 0
                waiting.append(req)

        def thinker() -> Iterator[tuple[str | None, list[ThinkerStep], bool]]:
            return self.think_rows(waiting) if self.rows is not None else self._think_each(waiting)

        register(requests)
        ids = by_id.keys()          # a live view: requests that join are abandoned too if the run stops
        produced = thinker()
        overlapped = self.overlap_stages or admit is not None
        side = self._talker_stream() if overlapped else None

        def on_talker():
            """The Talker's stream, after everything queued so far on the caller's (its input rows)."""
            if side is None:
                return nullcontext()
            side.wait_stream(torch.cuda.current_stream(side.device))
            return torch.cuda.stream(side)

        def publish(rid: str, steps: list[ThinkerStep]) -> None:
            outs[rid].publish(*steps)
            if trace.on_steps is not None and steps:
                trace.on_steps(rid, steps)
            if progress is not None:
                tokens[rid] += sum(not s.is_terminator for s in steps)
                progress("thinker", rid, tokens[rid])

        def stage(rid: str) -> TalkerRequest:
            """The request's text is done: its TalkerInput and TalkerRequest, recorded in the trace."""
            outs[rid].close()
            steps = list(readers[rid].poll())
            talker_input = TalkerInput.from_steps(rid, steps)
            talker_req = talker_input.to_request(by_id[rid].seed, by_id[rid].max_codes)
            trace.steps[rid] = steps
            trace.talker_inputs[rid] = talker_input
            trace.talker_requests[rid] = talker_req
            trace.chunks[rid] = []
            return talker_req

        def submit(req: TalkerRequest) -> None:
            with on_talker():
                if side is not None and req.hidden.is_cuda:
                    req.hidden.record_stream(side)      # read by the Talker's admission on its own stream
                self.talker.submit(req)

        def talker_step() -> list[CodecChunk]:
            if side is not None:
                with torch.cuda.stream(side):
                    chunks = self.talker.step()
            else:
                chunks = self.talker.step()
            for ch in chunks:
                if ch.request_id in ids:
                    trace.chunks[ch.request_id].append(ch)
                    if progress is not None:
                        emitted[ch.request_id] += len(ch.codes) - ch.n_context
                        progress("talker", ch.request_id, emitted[ch.request_id])
            return chunks

        try:
            if not overlapped:
                for rid, steps, _ in produced:
                    if rid is not None:
                        publish(rid, steps)
                staged = [stage(req.request_id) for req in requests]
                for talker_req in staged:  # a request that can never fit fails before any is admitted
                    if self.talker.need_tokens(talker_req) > self.talker.max_len:
                        self.talker.submit(talker_req)  # raises the engine's named error
                for talker_req in staged:
                    self.talker.submit(talker_req)
            else:
                # each request goes to the Talker as soon as its text is done, and the Talker steps once
                # per Thinker decode step (its TICKs) while the Thinker works, alone when it has nothing
                while True:
                    if admit is not None:
                        register(admit())
                    item = next(produced, None)
                    if item is None and waiting:        # joined after the Thinker ran out of requests
                        produced = thinker()
                        continue
                    rid, steps, done = item if item is not None else TICK
                    if rid is not None:
                        publish(rid, steps)
                        if done:
                            submit(stage(rid))     # raises the engine's named error if it never fits
                    elif self.talker.pending or self.talker.slots:
                        if item is not None and talker_may_wait is not None and talker_may_wait():
                            continue
                        chunks = talker_step()
                        if chunks:
                            yield chunks
                    elif item is None:
                        break
            while self.talker.pending or self.talker.slots:
                chunks = talker_step()
                if chunks:
                    yield chunks
        finally:
            produced.close()        # a Thinker cut short hands its rows back
            if side is not None:    # the caller's stream (and _abandon's writes) after the Talker's last step
                torch.cuda.current_stream(side.device).wait_stream(side)
            self._abandon(set(ids))

    def _talker_stream(self) -> torch.cuda.Stream | None:
        """The Talker's own CUDA stream (``talker_side_stream``), made once; None off CUDA or when off."""
        dev = torch.device(self.talker.device)
        if not self.talker_side_stream or dev.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(dev)
        return self._side

    def _think_each(self, requests: Sequence[TurnRequest]) -> Iterator[tuple[str, list[ThinkerStep], bool]]:
        """``think`` for each request in turn, as ``think_rows`` yields: (id, steps, whether it is done),
        then a ``TICK`` per token of those steps. ``requests`` may be a deque that the caller extends."""
        def ticks(steps):      # one per decode step that made them
            return [TICK] * sum(not s.is_terminator for s in steps)

        waiting = requests if isinstance(requests, deque) else deque(requests)
        while waiting:
            req = waiting.popleft()
            last = None
            for steps in self.think(req):
                if last is not None:
                    yield req.request_id, last, False
                    yield from ticks(last)
                last = steps
            yield req.request_id, last if last is not None else [], True
            yield from ticks(last or [])

    def _abandon(self, ids: set[str]) -> None:
        """Free the slots of requests whose consumer stopped early (or failed), so the engine
        can serve the next call; finished rows are skipped by every later decode step."""
        eng = self.talker
        eng.pending = type(eng.pending)(r for r in eng.pending if r.request_id not in ids)
        for slot, s in list(eng.slots.items()):
            if s.request.request_id in ids:
                eng.state.finished[slot] = True
                del eng.slots[slot]

    def codes(self, requests: Sequence[TurnRequest], trace: TurnTrace | None = None,
              progress: Progress | None = None) -> dict[str, list[int]]:
        """Stages 1 and 2 only: each request's codec ids (no EOS)."""
        self._check(requests, need_voice=False)
        trace = trace if trace is not None else TurnTrace()
        for _ in self.codec_chunks(requests, trace, progress):
            pass
        return {r.request_id: trace.codes(r.request_id) for r in requests}

    # ---- stage 3: Code2Wav ------------------------------------------------------------------------
    def run(self, requests: Sequence[TurnRequest], trace: TurnTrace | None = None,
            progress: Progress | None = None, admit: Admit | None = None) -> Iterator[PcmChunk]:
        """All three stages; PcmChunks of different requests interleave, each request's in order.
        Inputs (ids, voices) are checked before the first chunk is produced. ``progress`` hears of each
        Talker chunk before Code2Wav decodes it. ``admit`` (optional, e.g. a server's queue): called before
        every step, it returns requests that join this run (checked as they join; an empty list when none);
        they take the Thinker's rows and the Talker's slots as these free, and the run ends when every
        request it holds is done."""
        if self.code2wav is None:
            raise InputError("this pipeline was built without Code2Wav; build it with with_code2wav=True")
        self._check(requests, need_voice=True)
        return self._run(list(requests), trace, progress, admit)

    def _run(self, requests: list[TurnRequest], trace: TurnTrace | None,
             progress: Progress | None = None, admit: Admit | None = None) -> Iterator[PcmChunk]:
        voices = {r.request_id: r.voice for r in requests}

        def joining() -> list[TurnRequest]:
            new = list(admit())
            if new:
                self._check(new, need_voice=True, taken=voices)
                voices.update((r.request_id, r.voice) for r in new)
            return new

        codec_out: SnapshotPublisher[CodecChunk] = SnapshotPublisher("talker")
        reader = SnapshotReader(codec_out)
        streams: dict = {}
        skip: dict[str, int] = {}
        seq: dict[str, int] = {}
        heard: dict[str, tuple[float, int]] = {}     # request -> (clock at its first PCM, samples yielded)

        def ahead() -> bool:
            """Every request the Talker holds is at least ``talker_lead_s`` of audio ahead of real time."""
            eng, lead = self.talker, self.talker_lead_s
            if eng.pending or not eng.slots:
                return False
            now = self.clock()
            for slot in eng.slots.values():
                t0, n = heard.get(slot.request.request_id, (None, 0))
                if t0 is None or n / SAMPLE_RATE - (now - t0) < lead:
                    return False
            return True

        rounds = self.codec_rounds(requests, trace, progress, joining if admit is not None else None,
                                   ahead if self.talker_lead_s is not None else None)
        try:
            for chunks in rounds:
                codec_out.publish(*chunks)
                todo = []
                for chunk in reader.poll():
                    rid = chunk.request_id
                    if rid not in voices:
                        continue
                    if rid not in streams:
                        streams[rid] = self.code2wav.open_stream(voices[rid])
                        # The first payload also decodes the vocoder lead-in and the silence context.
                        skip[rid] = streams[rid].lead_samples + CONTEXT_CODES * SAMPLES_PER_CODE
                        seq[rid] = 0
                    todo.append(chunk)
                for chunk, wav in zip(todo, self._vocode(streams, todo)):
                    rid = chunk.request_id
                    cut = min(skip[rid], len(wav))
                    skip[rid] -= cut
                    wav = wav[cut:]
                    if len(wav):
                        t0, n = heard.get(rid, (self.clock(), 0))
                        heard[rid] = (t0, n + len(wav))
                    if len(wav) or chunk.final:
                        yield PcmChunk(rid, seq[rid], wav, chunk.final)
                        seq[rid] += 1
            codec_out.close()
        finally:
            rounds.close()      # a consumer that stops early frees the Thinker's rows and the Talker's slots now
            for s in streams.values():
                s.close()

    def _vocode(self, streams: dict, chunks: list[CodecChunk]) -> list[np.ndarray]:
        """Each chunk's new PCM, in order: one ``push_many`` per run of chunks of distinct requests
        (``batch_code2wav``; streams with equal cache shapes share the flow solve and the HiFT call),
        else one ``push`` each."""
        if not self.batch_code2wav or len(chunks) < 2:
            return [streams[c.request_id].push(list(c.codes), c.final) for c in chunks]
        out: list[np.ndarray] = []
        start = 0
        while start < len(chunks):
            end, seen = start, set()
            while end < len(chunks) and chunks[end].request_id not in seen:     # a stream once per call
                seen.add(chunks[end].request_id)
                end += 1
            out += self.code2wav.push_many([(streams[c.request_id], list(c.codes), c.final)
                                            for c in chunks[start:end]])
            start = end
        return out

    def respond(self, text_or_messages: Union[str, Sequence[Message]], voice, request_id: str = "turn-0",
                seed: int = 0, max_new_tokens: int | None = None, max_codes: int | None = None,
                trace: TurnTrace | None = None) -> Iterator[PcmChunk]:
        """One turn: user text (or a message list ending with the user's) -> PcmChunks in order."""
        req = TurnRequest.make(request_id, text_or_messages, voice, seed, max_new_tokens, max_codes)
        return self.run([req], trace)

    def respond_waveform(self, text_or_messages: Union[str, Sequence[Message]], voice, request_id: str = "turn-0",
                         seed: int = 0, max_new_tokens: int | None = None, max_codes: int | None = None,
                         trace: TurnTrace | None = None) -> np.ndarray:
        """The whole answer as one float32 waveform at 24 kHz."""
        chunks = list(self.respond(text_or_messages, voice, request_id, seed, max_new_tokens, max_codes, trace))
        return collect(chunks)[request_id]


    def warm_up(self, voice, batches: Sequence[int] | None = None, text: str = "Tell me about your day.",
                tokens: int = 8, codes: int | None = None) -> dict[int, float]:
        """Answer short turns in ``voice`` at each of ``batches`` concurrent requests (default: one, and the
        Talker's capacity) before any user's request, so that what a turn's stages replay at those sizes
        (Code2Wav's graphs for the voice, the Thinker's prefill and decode graphs, the Talker's, compiled
        kernels, cuFFT plans) is made ahead instead of inside a user's time to first audio. Each answer has
        ``tokens`` text tokens and ``codes`` codes (default: the first window and three more, so that Code2Wav
        meets the first chunk's shapes and reaches its steady cache length). Nothing of the warm-up turns stays
        behind but those graphs. Returns the wall ms of each batch size's turns."""
        batches = (1, self.talker.capacity) if batches is None else tuple(batches)
        if not batches or min(batches) < 1:
            raise InputError(f"turn warm-up: batches {batches} must be concurrent request counts >= 1")
        if tokens < 1 or (codes is not None and codes < 1):
            raise InputError(f"turn warm-up: tokens ({tokens}) and codes ({codes}) must be >= 1")
        codes = codes or self.talker.first_window + 3 * self.talker.window
        took = {}
        for n in dict.fromkeys(batches):
            requests = [TurnRequest.make(f"warm-up-{n}-{i}", text, voice, seed=i, max_new_tokens=tokens,
                                         max_codes=codes) for i in range(n)]
            t0 = time.perf_counter()
            for _ in self.run(requests) if self.code2wav is not None else [self.codes(requests)]:
                pass
            if self.thinker.device.type == "cuda":
                torch.cuda.synchronize(self.thinker.device)
            took[n] = (time.perf_counter() - t0) * 1e3
        return took


def collect(chunks: Sequence[PcmChunk]) -> dict[str, np.ndarray]:
    """Concatenate each request's PcmChunks (checking they arrived in order)."""
    parts: dict[str, list[np.ndarray]] = {}
    for c in chunks:
        got = parts.setdefault(c.request_id, [])
        if c.seq != len(got):
            raise ValueError(f"request {c.request_id!r}: chunk {c.seq} arrived after {len(got)} chunks")
        got.append(c.samples)
    return {rid: np.concatenate(p).astype(np.float32, copy=False) for rid, p in parts.items()}
