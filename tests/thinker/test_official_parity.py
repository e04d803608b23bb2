"""Parity of the Thinker's parts with the official MiniCPM-o 4.5 code (fixtures).

The fixtures in tests/fixtures/official/ were produced by the official modeling code at
the tiny config with every weight equal to ``random_tensor(key, shape, seed=0)`` (recipe:
docs/parity_fixtures.md). Here each part is rebuilt with ``randomize_(module, 0, prefix)``,
fed the same inputs, and compared at relative error <= 1e-4 (fp32; the measured errors are
~1e-7 or exactly 0, the margin covers BLAS/attention-kernel differences between machines).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.checkpoint.tokenizer import vendored_tokenizer_dir, load_tokenizer
from minicpmo_rt.thinker import audio as audio_mod
from minicpmo_rt.thinker import image_processor as ip
from minicpmo_rt.thinker import llm as llm_mod
from minicpmo_rt.thinker import mel as mel_mod
from minicpmo_rt.thinker.resampler import build_resampler
from minicpmo_rt.thinker.vision import build_vision
from tests.conftest import rel_err

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "official"
TOL = 1e-4
SEED = 0


def _load(name: str):
    data = dict(np.load(FIXTURES / f"{name}.npz"))
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    return data, meta


def _audio_f32(i16: np.ndarray) -> np.ndarray:
    return i16.astype(np.float32) / 32768.0


@pytest.fixture(scope="module")
def config() -> MiniCPMOConfig:
    return MiniCPMOConfig.from_dict(tiny_config())


def _randomized(module: torch.nn.Module, prefix: str) -> torch.nn.Module:
    return randomize_(module.float(), SEED, prefix).eval()


@pytest.fixture(scope="module")
def vpm(config):
    return _randomized(build_vision(config), "vpm.")


@pytest.fixture(scope="module")
def resampler(config):
    return _randomized(build_resampler(config), "resampler.")


@pytest.fixture(scope="module")
def apm(config):
    return _randomized(audio_mod.build_audio_encoder(config), "apm.")


@pytest.fixture(scope="module")
def projection(config):
    return _randomized(audio_mod.build_audio_projection(config), "audio_projection_layer.")


@pytest.fixture(scope="module")
def llm(config):
    return _randomized(llm_mod.build_llm(config), "llm.")


# ----------------------------------------------------------------------------- vision

def test_image_processor_matches_official():
    data, meta = _load("vision")
    for ci, case in enumerate(meta["cases"]):
        out = ip.process_image(data[case["image"]], max_slice_nums=case["max_slice_nums"])
        assert out.image_size == tuple(case["image_size_wh"])
        assert (list(out.grid) if out.grid is not None else None) == case["grid"], f"case {ci}: slicing grid"
        assert out.tgt_sizes.tolist() == case["tgt_sizes"], f"case {ci}: tgt_sizes"
        assert out.num_sub_images == case["n_sub"]
        for si, strip in enumerate(out.patches):
            ref = torch.from_numpy(data[f"case{ci}_pixels_u8_{si}"]).double() / 127.5 - 1.0
            assert tuple(strip.shape) == tuple(ref.shape), f"case {ci} sub-image {si}: strip shape"
            # The fixture codes pixels as uint8 (exact to 1e-6); a wrong resize/normalise is >= 1/127.5 off.
            assert float((strip.double() - ref).abs().max()) < 1e-5, f"case {ci} sub-image {si}: pixels"


def _official_pixels(data, ci: int, n_sub: int) -> list[torch.Tensor]:
    return [torch.from_numpy(data[f"case{ci}_pixels_u8_{si}"]).float() / 127.5 - 1.0 for si in range(n_sub)]


def _embed(vpm, resampler, strips: list[torch.Tensor], tgt_sizes: torch.Tensor) -> torch.Tensor:
    image = ip.ProcessedImage(strips, tgt_sizes, None, (0, 0))
    batch = ip.pack_patches(image)
    feats = vpm(batch.pixel_values, batch.patch_attention_mask, batch.tgt_sizes)
    return resampler(feats, batch.tgt_sizes)


@torch.no_grad()
@pytest.mark.parametrize("ci", [0, 1, 2], ids=["img_a", "img_b", "img_a_sliced"])
def test_vision_resampler_embeddings_match_official(vpm, resampler, ci):
    data, meta = _load("vision")
    case = meta["cases"][ci]
    strips = _official_pixels(data, ci, case["n_sub"])
    emb = _embed(vpm, resampler, strips, torch.from_numpy(data[f"case{ci}_tgt_sizes"]).long())
    ref = torch.from_numpy(data[f"case{ci}_embeds"])
    assert emb.shape == ref.shape
    err = rel_err(emb, ref)
    assert err <= TOL, f"case {ci}: vision+resampler rel err {err:.3e}"


@torch.no_grad()
def test_vision_batch_of_two_sizes_matches_official(vpm, resampler):
    """Both images padded into one vision batch (as a frame list is), each against the official."""
    data, meta = _load("vision")
    strips = _official_pixels(data, 0, 1) + _official_pixels(data, 1, 1)
    tgt = torch.cat([torch.from_numpy(data["case0_tgt_sizes"]), torch.from_numpy(data["case1_tgt_sizes"])]).long()
    emb = _embed(vpm, resampler, strips, tgt)
    ref = torch.from_numpy(data["batched_ab_embeds"])
    assert rel_err(emb[0], ref[0]) <= TOL and rel_err(emb[1], ref[1]) <= TOL


# ----------------------------------------------------------------------------- audio

def _mel_stream_input(data, meta) -> tuple[np.ndarray, list[int]]:
    x = np.concatenate([np.zeros(560, np.float32), _audio_f32(data["audio_i16"])])
    sizes = [16480, 16000, 16000]
    assert sum(sizes) == meta["chunks"][-1]["info"]["buffer_len_samples"]
    return x, sizes


def test_streaming_mel_matches_official():
    data, meta = _load("audio")
    x, sizes = _mel_stream_input(data, meta)
    mel = mel_mod.StreamingMel()   # duplex configuration: 1035 ms first chunk, 20 ms CNN redundancy
    off = 0
    for k, n in enumerate(sizes):
        assert mel.chunk_size() == n, f"chunk {k}: chunk size"
        out = mel.process(x[off:off + n])
        off += n
        ref = torch.from_numpy(data[f"chunk{k}_mel"])
        info = meta["chunks"][k]["info"]
        assert out.features.shape == ref.shape, f"chunk {k}: {tuple(out.features.shape)} vs {tuple(ref.shape)}"
        assert (out.core_start, out.core_end) == (info["core_start"], info["core_end"])
        assert (out.prefix_extra, out.suffix_extra) == (meta["chunks"][k]["kwargs"]["prefix_extra_frames"],
                                                        meta["chunks"][k]["kwargs"]["suffix_extra_frames"])
        err = rel_err(out.features, ref)
        assert err <= TOL, f"chunk {k}: mel rel err {err:.3e}"


def test_streaming_mel_long_stream_and_tails_match_official():
    """36 s through the streaming mel: the fixed->dynamic log floor at 5 s, the 30-s sliding
    window (10 s dropped), and partial tails in last-chunk mode."""
    data, meta = _load("mel_long")
    audio, _ = _load("audio")
    x = np.tile(_audio_f32(audio["audio_i16"]), 12)
    mel = mel_mod.StreamingMel()
    off = 0
    for k, info in enumerate(meta["chunks"]):
        assert mel.chunk_size() == info["samples"], f"chunk {k}: chunk size"
        out = mel.process(x[off:off + info["samples"]])
        off += info["samples"]
        assert out.n_frames == info["emitted_frames"], f"chunk {k}: emitted frames"
        assert (out.core_start, out.core_end) == (info["core_start"], info["core_end"]), f"chunk {k}: core range"
        if k in meta["kept_chunks"]:
            err = rel_err(out.features, torch.from_numpy(data[f"chunk{k}_mel"]))
            assert err <= TOL, f"chunk {k}: mel rel err {err:.3e}"
    tail = meta["tail_long"]
    assert off == tail["offset"]
    out = mel.process(x[off:off + tail["samples"]], last_chunk=True)
    assert rel_err(out.features, torch.from_numpy(data["tail_long_mel"])) <= TOL

    tail = meta["tail_early"]
    mel = mel_mod.StreamingMel()
    off = 0
    for _ in range(tail["after_chunks"]):
        n = mel.chunk_size()
        mel.process(x[off:off + n])
        off += n
    assert off == tail["offset"]
    out = mel.process(x[off:off + tail["samples"]], last_chunk=True)
    assert out.n_frames == tail["emitted_frames"]
    assert rel_err(out.features, torch.from_numpy(data["tail_early_mel"])) <= TOL


@torch.no_grad()
def test_streaming_audio_embeddings_match_official(apm, projection):
    """Three consecutive chunks through one encoder cache (positions continue)."""
    data, meta = _load("audio")
    cache = None
    for k, call in enumerate(meta["chunks"]):
        mel = torch.from_numpy(data[f"chunk{k}_mel"])[None]
        kw = call["kwargs"]
        hidden, cache = apm.stream(mel, cache, kw["prefix_extra_frames"], kw["suffix_extra_frames"])
        emb = audio_mod.avg_pool(projection(hidden), 5)[0]
        ref = torch.from_numpy(data[f"chunk{k}_embeds"])
        assert emb.shape == ref.shape == (10, ref.shape[1])
        err = rel_err(emb, ref)
        assert err <= TOL, f"chunk {k}: audio embedding rel err {err:.3e}"
    assert cache.length == 50 * 3


@torch.no_grad()
def test_reference_audio_block_causal_embeddings_match_official(apm, projection):
    """The system-prompt voice reference: whole clip, 1-s (50-frame) block-causal encoder mask."""
    data, meta = _load("audio")
    mel = torch.from_numpy(data["ref_mel"])[None]
    n = audio_mod.conv_output_length(mel.shape[-1])
    hidden = apm(mel, audio_mod.block_causal_mask(n, 50))
    emb = audio_mod.avg_pool(projection(hidden), 5)[0]
    ref = torch.from_numpy(data["ref_embeds"])
    assert emb.shape == ref.shape
    assert rel_err(emb, ref) <= TOL


def test_reference_mel_is_the_zero_padded_30s_window():
    """Upstream's non-streaming mel pads to 30 s with zeros before the STFT (last frame differs
    from a reflect-padded STFT of the bare clip)."""
    data, _ = _load("audio")
    clip = _audio_f32(data["ref_audio_i16"])
    ref = torch.from_numpy(data["ref_mel"])
    window = np.zeros(30 * 16000, np.float32)
    window[: clip.shape[0]] = clip
    mel = mel_mod.log_mel(window, True)[:, : ref.shape[-1]]
    assert rel_err(mel, ref) <= TOL


# ----------------------------------------------------------------------------- LLM

def _check_stream(llm, name: str):
    data, meta = _load(name)
    embeds = torch.from_numpy(data["inputs_embeds"])
    ids = data["token_ids"]
    table = llm.model.embed_tokens.weight
    tok_rows = np.nonzero(ids >= 0)[0]
    # The token rows are plain embedding rows: our tokenizer ids and table give the same rows.
    assert torch.equal(embeds[tok_rows], table[torch.from_numpy(ids[tok_rows])].detach())
    assert ids[: len(meta["prefix_ids"])].tolist() == meta["prefix_ids"]
    bounds = np.cumsum(data["block_lengths"])
    n_prep = meta["n_prepare_blocks"]
    stops = [int(bounds[n_prep - 1])] + [int(bounds[e - 1]) for _, e in meta["unit_block_ranges"]]
    refs = [data["prepare_hidden"]] + list(data["unit_hidden"])
    cache, start = None, 0
    with torch.no_grad():
        for i, (stop, ref) in enumerate(zip(stops, refs)):
            pos = torch.arange(start, stop)[None]
            hidden, cache = llm_mod.final_norm_hidden(llm, embeds[start:stop][None], cache, pos)
            err = rel_err(hidden[0, -1], torch.from_numpy(ref))
            assert err <= TOL, f"{name}: final-norm hidden after segment {i} (rows {start}..{stop}) rel err {err:.3e}"
            if i > 0:
                logits = llm.lm_head(hidden[0, -1])
                top_ids = torch.from_numpy(data["unit_logits_top_ids"][i - 1])
                assert rel_err(logits[top_ids], torch.from_numpy(data["unit_logits_top_vals"][i - 1])) <= TOL
                assert int(logits.argmax()) == int(top_ids[0])
            start = stop
    assert start == meta["seq_len"]


def test_llm_streaming_prefill_final_hidden_matches_official(llm):
    _check_stream(llm, "llm_stream")


def test_llm_streaming_prefill_without_reference_matches_official(llm):
    _check_stream(llm, "llm_stream_noref")


def test_prompt_ids_match_official_tokenizer():
    data, meta = _load("greedy")
    tok = load_tokenizer(vendored_tokenizer_dir())
    assert tok.encode(meta["prompt_text"]) == data["prompt_ids"].tolist()
    _, stream = _load("llm_stream")
    assert tok.encode(stream["system_prefix"]) == stream["prefix_ids"]
    assert tok.encode(stream["system_suffix"]) == stream["suffix_ids"]


def _layout_ids(piece) -> list[int]:
    ids = list(piece.ids)
    for slot in piece.slots:
        ids[slot.start:slot.start + slot.length] = [-1] * slot.length
    return ids


@pytest.mark.parametrize("name,ref_embeds,close_units", [("llm_stream", 15, False), ("llm_stream_noref", 0, True)])
def test_duplex_prompt_layout_matches_official(name, ref_embeds, close_units):
    """PromptBuilder's duplex system prompt and units give the official row layout (token ids,
    and embedding rows exactly where upstream put embeddings)."""
    prompt_mod = pytest.importorskip("minicpmo_rt.thinker.prompt")
    data, meta = _load(name)
    pb = prompt_mod.PromptBuilder(load_tokenizer(vendored_tokenizer_dir()))
    piece = pb.duplex_system("Streaming Omni Conversation.", ref_audio_embeds=ref_embeds)
    unit_end = prompt_mod.PromptPiece((pb.sp.unit_end,))
    for k in range(3):
        piece = piece + pb.duplex_unit([1], audio_embeds=10)
        if close_units and k < 2:
            piece = piece + unit_end
    assert _layout_ids(piece) == data["token_ids"].tolist()


def test_chat_template_matches_official():
    prompt_mod = pytest.importorskip("minicpmo_rt.thinker.prompt")
    _, meta = _load("greedy")
    text = prompt_mod.apply_chat_template(meta["messages"], add_generation_prompt=True, enable_thinking=False,
                                          use_tts_template=True)
    assert text == meta["prompt_text"]


@torch.no_grad()
def test_greedy_tokens_and_hidden_match_official(llm):
    data, meta = _load("greedy")
    ids = torch.from_numpy(data["prompt_ids"])[None]
    embeds = llm.model.embed_tokens(ids)
    hidden, cache = llm_mod.final_norm_hidden(llm, embeds, None, torch.arange(ids.shape[1])[None])
    out, rows = [], [hidden[0, -1]]
    for step in range(meta["max_new_tokens"]):
        logits = llm.lm_head(rows[-1])
        top = torch.from_numpy(data["step_top16_ids"][step])
        assert rel_err(logits[top], torch.from_numpy(data["step_top16_vals"][step])) <= TOL
        tok = int(logits.argmax())
        out.append(tok)
        if step + 1 < meta["max_new_tokens"]:
            pos = torch.tensor([[ids.shape[1] + step]])
            h, cache = llm_mod.final_norm_hidden(llm, llm.model.embed_tokens(torch.tensor([[tok]])), cache, pos)
            rows.append(h[0, -1])
    assert out == data["generated_ids"].tolist()
    err = rel_err(torch.stack(rows), torch.from_numpy(data["step_hidden"]))
    assert err <= TOL, f"per-step final-norm hidden rel err {err:.3e}"


@torch.no_grad()
def test_generate_greedy_matches_official(llm):
    gen_mod = pytest.importorskip("minicpmo_rt.thinker.generate")
    data, meta = _load("greedy")
    ids = torch.from_numpy(data["prompt_ids"])[None]
    out = llm(input_ids=ids, use_cache=True)
    sampling = gen_mod.SamplingConfig(greedy=True, repetition_penalty=1.0, max_new_tokens=meta["max_new_tokens"])
    turn = gen_mod.generate(llm, out.past_key_values, out.logits[0, -1], sampling)
    assert turn.token_ids == data["generated_ids"].tolist()
    # hidden row i belongs to token i (the state after feeding it) = official step row i+1
    ref = torch.from_numpy(data["step_hidden"][1:])
    assert rel_err(turn.hidden[: ref.shape[0]], ref) <= TOL


@torch.no_grad()
def test_static_decoder_fast_path_matches_official(llm):
    """The static-KV packed-weight decoder (the CUDA-graph path) on the streaming prefill
    (segment by segment, as commits arrive) and on greedy decoding."""
    decode_mod = pytest.importorskip("minicpmo_rt.thinker.decode")
    data, meta = _load("llm_stream")
    embeds = torch.from_numpy(data["inputs_embeds"])
    bounds = np.cumsum(data["block_lengths"])
    stops = [int(bounds[meta["n_prepare_blocks"] - 1])] + [int(bounds[e - 1]) for _, e in meta["unit_block_ranges"]]
    refs = [data["prepare_hidden"]] + list(data["unit_hidden"])
    dec = decode_mod.StaticDecoder(llm, max_len=meta["seq_len"] + 16)
    start = 0
    for i, (stop, ref) in enumerate(zip(stops, refs)):
        hidden = dec.prefill(embeds[start:stop][None], start)
        err = rel_err(hidden[0, -1], torch.from_numpy(ref))
        assert err <= TOL, f"segment {i}: static decoder hidden rel err {err:.3e}"
        start = stop

    g, gmeta = _load("greedy")
    prompt = torch.from_numpy(g["prompt_ids"])
    n = prompt.numel()
    dec = decode_mod.StaticDecoder(llm, max_len=n + 16)
    rows = [dec.prefill(llm.model.embed_tokens(prompt)[None], 0)[0, -1]]
    out = []
    logits = llm.lm_head(rows[0]).float()[None]
    for step in range(gmeta["max_new_tokens"]):
        tok = int(logits[0].argmax())
        out.append(tok)
        if step + 1 < gmeta["max_new_tokens"]:
            logits, h = dec.decode(torch.tensor([tok]), torch.tensor([n + step]), kv_len=n + step + 1)
            rows.append(h[0])
    assert out == g["generated_ids"].tolist()
    assert rel_err(torch.stack(rows), torch.from_numpy(g["step_hidden"])) <= TOL


# ----------------------------------------------------------------------------- Thinker / session

@pytest.fixture(scope="module")
def thinker(config):
    model_mod = pytest.importorskip("minicpmo_rt.thinker.model")
    model = model_mod.Thinker(config)
    randomize_(model.float(), SEED, "")     # Thinker keys == checkpoint keys minus tts.
    model.rebuild_buffers()
    return model.eval()


def test_thinker_embeds_match_official(thinker):
    stream, meta = _load("llm_stream")
    audio, ameta = _load("audio")
    start = sum(stream["block_lengths"][: meta["n_prepare_blocks"]])
    cache = None
    for k in range(3):
        # unit rows: <unit>, <image>, 64 image rows, </image>, 10 audio rows
        rows = torch.from_numpy(stream["inputs_embeds"][start:start + 77])
        img = thinker.embed_image(stream[f"frame_{k}"], max_slice_nums=1)
        assert img.shape == (1, 64, rows.shape[1])
        assert rel_err(img[0], rows[2:66]) <= TOL, f"unit {k}: frame embedding"
        kw = ameta["chunks"][k]["kwargs"]
        chunk = thinker.embed_audio_chunk(torch.from_numpy(audio[f"chunk{k}_mel"]), cache,
                                          kw["prefix_extra_frames"], kw["suffix_extra_frames"])
        cache = chunk.cache
        assert rel_err(chunk.embeds, rows[67:77]) <= TOL, f"unit {k}: audio embedding"
        start += 77


def test_session_read_state_matches_official(thinker):
    session_mod = pytest.importorskip("minicpmo_rt.thinker.session")
    stream, meta = _load("llm_stream_noref")
    frames, _ = _load("llm_stream")
    audio, _ = _load("audio")
    tok = load_tokenizer(vendored_tokenizer_dir())
    session = session_mod.StreamingSession(thinker, tok, system_prompt=meta["system_text"],
                                           window=session_mod.WindowPolicy.off())
    prep = rel_err(session.read_state(), torch.from_numpy(stream["prepare_hidden"]))
    assert prep <= TOL, (f"system prompt state differs from upstream's duplex prepare (rel err {prep:.3e}); "
                         f"expected ids {meta['prefix_ids'] + meta['suffix_ids']}")
    pcm = _audio_f32(audio["audio_i16"])
    bounds = np.cumsum(stream["block_lengths"])
    for k in range(3):
        session.commit(pcm[k * 16000:(k + 1) * 16000], frames[f"frame_{k}"])
        expected_len = int(bounds[meta["unit_block_ranges"][k][1] - 1])
        assert session.fingerprint().llm_cache_len == expected_len, f"unit {k}: cache length (layout)"
        err = rel_err(session.read_state(), torch.from_numpy(stream["unit_hidden"][k]))
        assert err <= TOL, f"unit {k}: read_state rel err {err:.3e}"


def _voice_session(thinker, audio):
    """The duplex prepare of the fixtures: default system text, the voice reference, no window."""
    session_mod = pytest.importorskip("minicpmo_rt.thinker.session")
    return session_mod.StreamingSession(thinker, load_tokenizer(vendored_tokenizer_dir()),
                                        system_prompt="Streaming Omni Conversation.",
                                        window=session_mod.WindowPolicy.off(),
                                        ref_audio=_audio_f32(audio["ref_audio_i16"]))


def test_session_with_voice_reference_matches_official(thinker):
    """The duplex prepare with a voice reference (15 block-causal embeddings in the system
    prompt), then the first unit: layout, read-out state and the LM head's top logits. (The
    fixture's later units were fed without ``finalize_unit``, so they lack the ``</unit>`` this
    session feeds; ``llm_stream_noref`` covers closed units.)"""
    stream, meta = _load("llm_stream")
    audio, _ = _load("audio")
    session = _voice_session(thinker, audio)
    assert _layout_ids(session.system_piece) == stream["token_ids"][: len(session.system_piece)].tolist()
    prep = rel_err(session.read_state(), torch.from_numpy(stream["prepare_hidden"]))
    assert prep <= TOL, f"prepare with a voice reference: rel err {prep:.3e}"
    pcm = _audio_f32(audio["audio_i16"])
    bounds = np.cumsum(stream["block_lengths"])
    for k in range(1):
        session.commit(pcm[k * 16000:(k + 1) * 16000], stream[f"frame_{k}"])
        assert session.cache_len == int(bounds[meta["unit_block_ranges"][k][1] - 1]), f"unit {k}: layout"
        assert rel_err(session.read_state(), torch.from_numpy(stream["unit_hidden"][k])) <= TOL, f"unit {k}"
        logits = session.logits()
        top = torch.from_numpy(stream["unit_logits_top_ids"][k])
        assert rel_err(logits[top], torch.from_numpy(stream["unit_logits_top_vals"][k])) <= TOL, f"unit {k} logits"


def test_reference_audio_embeddings_through_the_thinker_match_official(thinker):
    audio, _ = _load("audio")
    emb = thinker.embed_audio(_audio_f32(audio["ref_audio_i16"]))
    ref = torch.from_numpy(audio["ref_embeds"])
    assert emb.shape == ref.shape
    assert rel_err(emb, ref) <= TOL


@pytest.mark.parametrize("scenario,force_listen_units", [("s1", 0), ("s2", 1)])
def test_duplex_generate_matches_official(thinker, scenario, force_listen_units):
    """Upstream's duplex loop (prepare with a voice reference, then per unit streaming_prefill,
    streaming_generate(greedy), finalize_unit) against ``StreamingSession`` + ``generate_unit``:
    the same ids per unit (step 0's, the 28-character rejection, the deferred terminator), the
    decoder's history, the Talker's ids and hidden rows, the text and the cache lengths."""
    duplex_mod = pytest.importorskip("minicpmo_rt.thinker.duplex")
    data, meta = _load("duplex_generate")
    stream, _ = _load("llm_stream")
    audio, _ = _load("audio")
    tok = load_tokenizer(vendored_tokenizer_dir())
    session = _voice_session(thinker, audio)
    res = meta["results"][scenario]
    assert session.cache_len == res["prepare_llm_cache_len"]
    decoder = duplex_mod.DuplexDecoder(tok, duplex_mod.DuplexDecodeConfig(mode="greedy",
                                                                          force_listen_units=force_listen_units))
    turn = duplex_mod.TurnState()
    pcm = _audio_f32(audio["audio_i16"])
    for k, ref in enumerate(res["units"]):
        session.commit(pcm[k * 16000:(k + 1) * 16000], stream[f"frame_{k}"])
        assert session.cache_len == ref["llm_cache_len_after_prefill"], f"unit {k}: prefill (and the last finalize)"
        top = torch.from_numpy(data[f"{scenario}_unit{k}_prefill_logits_top_ids"])
        got = session.logits()[top]
        assert rel_err(got, torch.from_numpy(data[f"{scenario}_unit{k}_prefill_logits_top_vals"])) <= TOL
        gen = duplex_mod.generate_unit(session, decoder, tok, turn)
        fin = ref["pending_finalize"]
        assert list(gen.decoded) == ref["generated_total_ids"], f"unit {k}: decoded ids"
        assert list(gen.fed) == [b[0] for b in ref["generate_fed_ids"]], f"unit {k}: fed ids"
        assert gen.terminator == fin["terminator_id"] and gen.listen == fin["is_listen"] == ref["result_is_listen"]
        assert list(gen.talker_ids) == fin["total_ids_in_unit"] and gen.text == ref["result_text"]
        assert gen.turn_end == ref["result_end_of_turn"]
        assert decoder.history == ref["decoder_generated_tokens"], f"unit {k}: repetition history"
        assert session.cache_len == ref["llm_cache_len_after_generate"]
        if gen.talker_ids:
            assert data[f"{scenario}_unit{k}_hidden_ids"].tolist() == list(gen.talker_ids)
            err = rel_err(gen.talker_hidden, torch.from_numpy(data[f"{scenario}_unit{k}_hidden"]))
            assert err <= TOL, f"unit {k}: Talker hidden rows rel err {err:.3e}"
    # the last unit's [terminator, </unit>] is fed by the next commit here, by finalize_unit upstream
    assert session.cache_len + 2 == res["final_llm_cache_len"]


@pytest.mark.slow
def test_session_long_audio_only_stream_matches_official(thinker):
    """32 audio-only units: crosses the 5-s mel floor switch, the 30-s mel slide and the
    audio-encoder cache reset at 1500 positions (unit 29), all as upstream."""
    session_mod = pytest.importorskip("minicpmo_rt.thinker.session")
    data, meta = _load("session_long")
    audio, _ = _load("audio")
    x = np.tile(_audio_f32(audio["audio_i16"]), 12)
    tok = load_tokenizer(vendored_tokenizer_dir())
    session = session_mod.StreamingSession(thinker, tok, system_prompt=meta["system_text"],
                                           window=session_mod.WindowPolicy.off())
    assert rel_err(session.read_state(), torch.from_numpy(data["prepare_hidden"])) <= TOL
    errs = []
    for k in range(data["unit_hidden"].shape[0]):
        session.commit(x[k * 16000:(k + 1) * 16000], None)
        fp = session.fingerprint()
        assert fp.llm_cache_len == int(data["llm_cache_len"][k]), f"unit {k}: LLM cache length"
        assert fp.audio_cache_len == meta["audio_calls"][k]["cache_after"], f"unit {k}: audio-encoder cache length"
        errs.append(rel_err(session.read_state(), torch.from_numpy(data["unit_hidden"][k])))
    assert max(errs) <= TOL, f"read_state rel err per unit {['%.1e' % e for e in errs]}"


# ----------------------------------------------------------------------------- turn mode

def test_turn_mode_audio_path_matches_official(apm, projection):
    """Turn-mode streaming user audio (no DuplexCapability: CNN redundancy 0, no extra-context
    cut): chunk 0 is padded to 1035 ms (16560 samples) and each segment goes whole into the mel."""
    data, meta = _load("turn")
    audio, _ = _load("audio")
    pcm = _audio_f32(audio["audio_i16"])
    segments = [np.concatenate([np.zeros(560, np.float32), pcm[:16000]]), pcm[16000:32000], pcm[32000:48000]]
    mel = mel_mod.StreamingMel(cnn_redundancy_ms=0)
    cache = None
    for k, seg in enumerate(segments):
        out = mel.process(seg)
        ref = torch.from_numpy(data[f"chunk{k}_mel"])
        assert out.features.shape == ref.shape and rel_err(out.features, ref) <= TOL, f"segment {k}: mel"
        with torch.no_grad():
            hidden, cache = apm.stream(ref[None], cache, 0, 0)
            emb = audio_mod.avg_pool(projection(hidden), 5)[0]
        assert cache.length == meta["audio_calls"][k]["cache_after"]
        assert rel_err(emb, torch.from_numpy(data[f"chunk{k}_embeds"])) <= TOL, f"segment {k}: audio embeddings"


def test_turn_mode_prompt_layout_matches_official():
    prompt_mod = pytest.importorskip("minicpmo_rt.thinker.prompt")
    data, meta = _load("turn")
    pb = prompt_mod.PromptBuilder(load_tokenizer(vendored_tokenizer_dir()))
    piece = (pb.system_turn(meta["system_text"]) + pb.user_segment([16560], first_of_turn=True)
             + pb.user_segment([16000], first_of_turn=False) + pb.user_segment([16000], first_of_turn=False)
             + pb.assistant_bos())
    n = int(data["forward_rows"][: meta["n_prefill_forwards"] + 1].sum())
    assert _layout_ids(piece) == data["token_ids"][:n].tolist()


@torch.no_grad()
def test_turn_mode_prefill_and_greedy_generate_match_official(llm):
    """The official turn: four prefills, the assistant bos, then ChunkPrefillChunkGenerate's greedy
    decoding (repetition penalty 1.02 over the generated ids, chunks of 11 then 10) for 30 tokens."""
    data, meta = _load("turn")
    rows = data["forward_rows"]
    embeds = torch.from_numpy(data["inputs_embeds"])
    n_pre = meta["n_prefill_forwards"] + 1          # + the bos forward
    cache, start = None, 0
    for i in range(n_pre):
        stop = start + int(rows[i])
        hidden, cache = llm_mod.final_norm_hidden(llm, embeds[start:stop][None], cache, torch.arange(start, stop)[None])
        err = rel_err(hidden[0, -1], torch.from_numpy(data["forward_last_hidden"][i]))
        assert err <= TOL, f"prefill forward {i}: final-norm hidden rel err {err:.3e}"
        start = stop
    gen_mod = pytest.importorskip("minicpmo_rt.thinker.generate")
    logits = llm.lm_head(hidden[0, -1])
    sampling = gen_mod.SamplingConfig(greedy=True, temperature=0.7, repetition_penalty=1.02,
                                      max_new_tokens=len(meta["generated_ids"]))
    turn = gen_mod.generate(llm, cache, logits, sampling)
    assert turn.token_ids == meta["generated_ids"]
    ref = torch.from_numpy(data["forward_last_hidden"][n_pre:])
    err = rel_err(turn.hidden, ref)
    assert err <= TOL, f"per-token hidden rel err {err:.3e}"


@torch.no_grad()
@pytest.mark.parametrize("scenario", ["s1", "s2"])
def test_turn_mode_with_a_picture_and_recordings_matches_official(thinker, scenario):
    """Turn mode with whole recordings (official ``streaming_prefill(..., stream_input=False)``, omni mode):
    s1 = [picture, 1.5 s of audio, words], s2 = [0.5 s of audio, words] (front-padded to 1035 ms). The prompt
    ids (parts side by side, one audio block), the input rows with the encodings in their slots (SigLIP +
    resampler, Whisper with full attention), the final-norm hidden after the prompt and the greedy tokens and
    hidden rows of ``streaming_generate`` equal the official ones."""
    from PIL import Image

    from minicpmo_rt.runtime.contracts import TurnRequest
    from minicpmo_rt.runtime.turn import prompt_embeds
    from minicpmo_rt.thinker.generate import SamplingConfig, generate
    from minicpmo_rt.thinker.prompt import PromptBuilder

    data, meta = _load("turn_media")
    vision, _ = _load("vision")
    audio, _ = _load("audio")
    pcm = _audio_f32(audio["audio_i16"])
    content = {"s1": [Image.fromarray(vision["img_b"]), pcm[:24000], "What is this?"],
               "s2": [pcm[:8000], "Hi"]}[scenario]
    req = TurnRequest.make("t", [{"role": "system", "content": meta["system_text"]},
                                 {"role": "user", "content": content}])
    builder = PromptBuilder(load_tokenizer(vendored_tokenizer_dir()))
    piece, embeds = prompt_embeds(thinker, builder, req.messages)
    official_ids = data[f"{scenario}_prompt_ids"].tolist()
    assert list(piece.ids) == official_ids + list(builder.assistant_bos().ids)
    rows = data[f"{scenario}_forward_rows"]
    n = int(rows[:3].sum())                              # system, user, assistant bos
    ref = torch.from_numpy(data[f"{scenario}_inputs_embeds"])
    assert embeds.shape[0] == n and rel_err(embeds, ref[:n]) <= TOL
    cache = thinker.new_cache()
    step = thinker.forward_embeds(embeds, cache, logits=True)
    last = torch.from_numpy(data[f"{scenario}_forward_last_hidden"])
    assert rel_err(step.hidden[-1], last[2]) <= TOL
    want = meta["scenarios"][scenario]["generated_ids"]
    sampling = SamplingConfig(greedy=True, temperature=0.7, repetition_penalty=1.02, max_new_tokens=len(want))
    turn = generate(thinker.llm, cache, step.logits, sampling)
    assert turn.token_ids == want
    assert rel_err(turn.hidden, last[3:3 + len(want)]) <= TOL
