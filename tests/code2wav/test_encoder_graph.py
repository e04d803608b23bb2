"""The flow's encoder half from CUDA graphs (``code2wav.encoder_graph``) against the eager encoder."""

import logging

import torch

from conftest import rel_err, requires_cuda
from fake_graphs import FakeGraphs
from minicpmo_rt.checkpoint.tiny import randomize_
from minicpmo_rt.code2wav.encoder import POS_TABLES_KEPT, EncoderCache, rel_position_table
from minicpmo_rt.code2wav.encoder_graph import EncoderGraphs
from minicpmo_rt.code2wav.flow import Flow
from minicpmo_rt.code2wav.flow_config import TINY


def tiny_flow(device="cpu"):
    flow = Flow(TINY, noise_seed=3)
    randomize_(flow, 5)
    return flow.to(device).eval()


def prompt_cache(flow, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = next(flow.parameters()).device
    tokens = torch.randint(0, TINY.vocab_size, (b, 15), generator=g).to(dev)
    mel = torch.randn(b, 24, 80, generator=g).to(dev)
    spk = torch.randn(b, TINY.spk_embed_dim, generator=g).to(dev)
    return flow.setup_cache(tokens, mel, spk, n_timesteps=2), spk


def test_position_tables_are_made_once_and_bounded():
    """A size's table is built once per (device, dtype, inference mode) and equals a fresh one; the
    memo keeps at most POS_TABLES_KEPT tables, dropping the oldest."""
    enc = tiny_flow().encoder
    like = torch.zeros(1)
    a = enc._pos(7, like)
    assert enc._pos(7, like) is a and torch.equal(a, rel_position_table(7, TINY.encoder.output_size))
    with torch.inference_mode():
        b = enc._pos(7, like)
    assert b is not a and torch.equal(a, b)
    for size in range(20, 20 + POS_TABLES_KEPT):
        enc._pos(size, like)
    assert len(enc._pos_tables) == POS_TABLES_KEPT and (7, like.device, like.dtype, False) not in enc._pos_tables


def test_position_projection_is_made_once_and_follows_the_weights():
    """Outside autograd a layer's ``linear_pos`` of a position table is made once per size and handed out
    again (bit-identical to computing it); an in-place change of the weights (a load) makes a new one; with
    autograd on nothing is kept (the gradient must reach the weights); at most POS_TABLES_KEPT are kept."""
    enc = tiny_flow().encoder
    attn = enc.encoders[0].self_attn
    like = torch.zeros(1)
    table = enc._pos(7, like)
    with torch.no_grad():
        a = attn._projected(table)
        assert attn._projected(table) is a and torch.equal(a, attn.linear_pos(table))
        attn.linear_pos.weight.mul_(2.0)
        b = attn._projected(table)
        assert b is not a and torch.equal(b, attn.linear_pos(table))
        for size in range(20, 20 + POS_TABLES_KEPT):
            attn._projected(enc._pos(size, like))
        assert len(attn._proj) == POS_TABLES_KEPT
    kept = dict(attn._proj)
    c = attn._projected(table)
    assert c.requires_grad and attn._proj == kept


def test_keepalive_collects_what_caches_hand_out_during_a_capture():
    """``keepalive()`` collects every tensor ``keep_for_graph`` hands out inside it, nested collectors each
    their own, and outside one nothing is collected; the encoder's tables and projections go through it."""
    from minicpmo_rt.code2wav.keepalive import keep_for_graph, keepalive

    x, y = torch.zeros(2), torch.ones(2)
    assert keep_for_graph(x) is x
    with keepalive() as outer:
        keep_for_graph(x)
        with keepalive() as inner:
            keep_for_graph(y)
        assert inner == [y]
    assert len(outer) == 1 and outer[0] is x
    enc = tiny_flow().encoder
    with torch.no_grad(), keepalive() as held:
        table = enc._pos(9, torch.zeros(1))
        p = enc.encoders[0].self_attn._projected(table)
    assert [id(t) for t in held] == [id(table), id(p)]


def test_off_cuda_the_graphs_run_the_eager_encoder():
    flow = tiny_flow()
    cache, spk = prompt_cache(flow)
    tok = torch.randint(0, TINY.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = flow.encode_chunk(tok, spk, cache.encoder)
        flow.encoder_graphs = EncoderGraphs(flow)
        got = flow.encode_chunk(tok, spk, cache.encoder)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2].att, want[2].att) and torch.equal(got[2].cnn, want[2].cnn)
    assert not flow.encoder_graphs.graphs()


class _CPUGraphs(EncoderGraphs):
    """EncoderGraphs' bookkeeping on CPU tensors, through ``FakeGraphs``."""

    def __init__(self, flow, max_graphs):
        super().__init__(flow, max_graphs)
        self.shapes.__class__ = FakeGraphs    # the real set's configuration (buckets, axes, budget), faked capture
        self.padded.__class__ = FakeGraphs
        self.ended.__class__ = FakeGraphs

    @property
    def captures(self):
        return self.shapes.captures


def test_graph_bookkeeping_second_call_and_least_recently_replayed(caplog):
    """A shape is captured on its second call; replays return the caller's own tensors equal to the
    eager encoder; past ``max_graphs`` the least recently replayed graph makes room (logged once).
    The capture itself is mocked (no CUDA graph on a CPU); the CUDA test below runs real graphs."""
    flow = tiny_flow()
    graphs = _CPUGraphs(flow, max_graphs=2)
    cache, spk = prompt_cache(flow)
    g = torch.Generator().manual_seed(4)
    toks = {n: torch.randint(0, TINY.vocab_size, (1, n), generator=g) for n in (8, 7, 6)}
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        def call(n):
            got = graphs.run(toks[n], cache.encoder, False)
            want = flow._encode(toks[n], cache.encoder, False)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1].att, want[1].att)
            return got
        call(8)
        assert not graphs.graphs()                       # first call: eager
        a = call(8)
        assert [k.tokens for k in graphs.graphs()] == [8] and graphs.captures == 1
        call(7), call(7)
        call(8)                                          # 8 is now the most recently replayed
        call(6), call(6)                                 # evicts 7, not 8
        assert sorted(k.tokens for k in graphs.graphs()) == [6, 8]
        call(7), call(7)                                 # 7 again: first call after eviction is eager
        assert sorted(k.tokens for k in graphs.graphs()) == [6, 7] and graphs.captures == 4
        b = call(8)
        assert a[1].att.data_ptr() != b[1].att.data_ptr()
    assert caplog.text.count("encoder graph budget") == 1


def test_rows_pad_to_batch_buckets_and_keep_their_own_cache_rows():
    """3 and 4 streams' chunks replay ONE graph (bucket 4): the layer-major attention cache pads and cuts
    along its rows axis (1), and each row's mu and next cache equal the eager encoder on the unpadded
    batch. The capture is mocked (no CUDA graph on a CPU); the CUDA test below runs real graphs."""
    flow = tiny_flow()
    graphs = _CPUGraphs(flow, max_graphs=4)
    cache4, _ = prompt_cache(flow, 4, seed=3)
    enc4 = cache4.encoder
    enc3 = EncoderCache(enc4.cnn[:3].clone(), enc4.att[:, :3].clone())
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for enc in (enc3, enc4, enc3, enc4, enc3):
            b = enc.cnn.shape[0]
            tok = torch.randint(0, TINY.vocab_size, (b, 8), generator=g)
            got, want = graphs.run(tok, enc, False), flow._encode(tok, enc, False)
            assert got[1].att.shape == want[1].att.shape and got[1].att.is_contiguous()
            for x, y in ((got[0], want[0]), (got[1].cnn, want[1].cnn), (got[1].att, want[1].att)):
                assert rel_err(x, y) <= 1e-6, b       # fp32: only a different row count's rounding
    assert [k.batch for k in graphs.graphs()] == [4] and graphs.captures == 1 and graphs.shapes.replays == 4


@requires_cuda
def test_cuda_graphed_encoder_equals_eager(caplog):
    """Graph replays give the eager encoder's mu and next cache over a stream of chunks (batch 1 bit for
    bit; batch 3, padded to the bucket of 4, within fp32 rounding; a final chunk); outputs are the
    caller's own (a later replay leaves them as they were); a changed TF32 flag captures a new graph;
    past the budget the least recently replayed graph makes room (logged once) and the replacements
    still give the eager result."""
    flow = tiny_flow("cuda")
    g = torch.Generator().manual_seed(2)
    graphs = EncoderGraphs(flow, max_graphs=10)
    with torch.inference_mode():
        for b in (1, 3):
            cache, spk = prompt_cache(flow, b, seed=b)
            enc = cache.encoder
            kept = None
            for k in range(4):
                last = k == 3
                tok = torch.randint(0, TINY.vocab_size, (b, 8), generator=g).cuda()
                flow.encoder_graphs = None
                want = flow.encode_chunk(tok, spk, enc, last)
                flow.encoder_graphs = graphs
                for _ in range(2):      # eager, then captured and replayed (3 rows in the bucket of 4)
                    got = flow.encode_chunk(tok, spk, enc, last)
                    for x, y in ((got[0], want[0]), (got[1], want[1]), (got[2].cnn, want[2].cnn),
                                 (got[2].att, want[2].att)):
                        # a padded replay's GEMMs have more rows: fp32 rounding may differ, nothing more
                        assert torch.equal(x, y) if b == 1 else rel_err(x, y) <= 1e-6, (b, k)
                if kept is not None:
                    assert torch.equal(kept[0], kept[1])        # an earlier result survived this replay
                kept = (got[2].att, got[2].att.clone())
                enc = flow.trim_encoder_cache(got[2], cache.prompt_frames)
        assert len(graphs.graphs()) == 8         # one per chunk: the cache grows every chunk here
        saved = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = not saved
            flow.encoder_graphs = graphs
            with caplog.at_level(logging.WARNING):
                cache, spk = prompt_cache(flow, 1, seed=9)
                tok = torch.randint(0, TINY.vocab_size, (1, 8), generator=g).cuda()
                for n in (8, 8):                                   # batch 1's first shape, TF32 flipped: new
                    flow.encode_chunk(tok[:, :n], spk, cache.encoder)
                assert len(graphs.graphs()) == 9
                for n in (7, 7, 6, 6, 5, 5):                       # the 10th, then replacements
                    flow.encode_chunk(tok[:, :n], spk, cache.encoder)
                flow.encoder_graphs = None
                want = flow.encode_chunk(tok[:, :5], spk, cache.encoder)
                flow.encoder_graphs = graphs
                got = flow.encode_chunk(tok[:, :5], spk, cache.encoder)
                assert torch.equal(got[0], want[0]) and torch.equal(got[2].att, want[2].att)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    assert len(graphs.graphs()) == 10
    assert caplog.text.count("encoder graph budget") == 1


@requires_cuda
def test_cuda_graph_keeps_the_tables_it_reads_alive():
    """A captured encoder graph reads position tables and their projections from the encoder's bounded
    caches. Dropped from the caches, their memory freed and refilled with NaN, the replay still gives the
    eager result bit for bit: the graph's entry holds them (``keepalive``)."""
    flow = tiny_flow("cuda")
    graphs = EncoderGraphs(flow, max_graphs=4)
    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        cache, spk = prompt_cache(flow, 1, seed=3)
        tok = torch.randint(0, TINY.vocab_size, (1, 8), generator=g).cuda()
        want = flow.encode_chunk(tok, spk, cache.encoder)
        flow.encoder_graphs = graphs
        for _ in range(2):      # eager, then captured
            flow.encode_chunk(tok, spk, cache.encoder)
        entry = next(iter(graphs.shapes.graphs.values()))
        # two position tables (token and upsampled rates) and each layer's projection of its table
        assert len(entry[3]) == 2 + len(flow.encoder.encoders) + len(flow.encoder.up_encoders)
        sizes = {t.numel() for t in entry[3]}
        flow.encoder._pos_tables.clear()
        for layer in list(flow.encoder.encoders) + list(flow.encoder.up_encoders):
            layer.self_attn._proj.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        junk = [torch.full((n,), float("nan"), device="cuda") for n in sizes for _ in range(8)]
        got = flow.encode_chunk(tok, spk, cache.encoder)
        del junk
    assert graphs.shapes.replays >= 1
    assert torch.equal(got[0], want[0]) and torch.equal(got[2].att, want[2].att)


def _several_lengths(device: str, make_graphs, tol: float = 1e-6) -> "EncoderGraphs":
    """Three streams' encoder caches of three lengths (the prompt's only; one chunk more; twelve more, past the
    trim) encoded in one ``Flow.encode_streams`` call, eagerly and through ``make_graphs(flow)`` (three calls:
    eager, capture, replay), against each stream alone: mu and the next cache within ``tol``; eagerly also the two
    shorter ones alone, padded to the steady length (``pad_to``). Returns the graphs."""
    from minicpmo_rt.code2wav.flow import HISTORY_FRAMES, pad_encoder_caches

    flow = tiny_flow(device)
    cache, spk = prompt_cache(flow)
    g = torch.Generator().manual_seed(7)
    tok = lambda: torch.randint(0, TINY.vocab_size, (1, 8), generator=g)     # noqa: E731
    p = cache.prompt_frames
    encs = []
    with torch.inference_mode():
        for n in (0, 1, 12):
            enc = cache.encoder
            for _ in range(n):
                enc = flow.encode_streams(tok(), spk, [enc], False, [p])[2][0]
            encs.append(enc)
        assert len({e.att.shape[3] for e in encs}) == 3 and encs[2].att.shape[3] == p + HISTORY_FRAMES
        toks = torch.cat([tok() for _ in encs])
        spks = spk.expand(3, -1)
        alone = [flow.encode_streams(toks[i:i + 1], spks[i:i + 1], [e], False, [p]) for i, e in enumerate(encs)]
        for graphs in (None, make_graphs(flow)):
            flow.encoder_graphs = graphs
            for _ in range(3 if graphs else 1):      # a graph's first call runs eagerly, its second captures
                h, sp, news = flow.encode_streams(toks, spks, encs, False, [p] * 3)
            for i, (ha, _, na) in enumerate(alone):
                assert rel_err(h[i:i + 1], ha) < tol, i
                assert news[i].att.shape == na[0].att.shape and rel_err(news[i].att, na[0].att) < tol, i
                assert torch.equal(news[i].cnn, na[0].cnn) or rel_err(news[i].cnn, na[0].cnn) < tol, i
            if graphs is None:  # starting streams alone, padded to the steady length (the shape warm_up captures)
                steady = (p + HISTORY_FRAMES) // 2
                assert pad_encoder_caches(encs[:2], len(flow.encoder.encoders), steady)[1] == [
                    steady - e.token_frames for e in encs[:2]]
                h, _, news = flow.encode_streams(toks[:2], spks[:2], encs[:2], False, [p] * 2, pad_to=steady)
                for i, (ha, _, na) in enumerate(alone[:2]):
                    assert rel_err(h[i:i + 1], ha) < tol and rel_err(news[i].att, na[0].att) < tol, i
        flow.encoder_graphs = None
    return graphs


def test_streams_of_several_cache_lengths_encode_in_one_call():
    """``Flow.encode_streams`` over three streams whose encoder caches differ in length: one call, the shorter
    caches padded at the front and their padding masked (``pad_encoder_caches``, ``forward_chunk(pad=)``),
    equals each stream encoded alone (``_several_lengths``), FP32 on the CPU. The same through the graph set's
    bookkeeping (``EncoderGraphs.padded``, a batch bucket of 4 padding the third row up; captures faked on the
    CPU), which keeps the unpadded calls' graphs apart."""
    graphs = _several_lengths("cpu", lambda flow: _CPUGraphs(flow, 8))
    assert graphs.padded.captures == 1 and graphs.padded.replays >= 1 and not graphs.shapes.graphs


@requires_cuda
def test_cuda_padded_encoder_graphs_equal_each_stream_alone():
    """``_several_lengths`` on CUDA with real graphs (``EncoderGraphs.padded`` captured on the second call and
    replayed on the third), IEEE matmuls (the encoder's default outside the CFM); 1e-5: cuBLAS picks its kernels
    by the rows, so a batch of 4 and a row alone sum in other orders."""
    graphs = _several_lengths("cuda", EncoderGraphs, 1e-5)
    assert graphs.padded.captures == 1 and graphs.padded.replays >= 1 and not graphs.shapes.graphs


def _final_chunks(device: str, make_graphs, tol: float = 1e-6) -> "EncoderGraphs":
    """Final chunks of three lengths (3, 8 and 5 tokens) of three streams whose encoder caches also differ in length
    (the prompt's only; one chunk more; past the trim), in ONE ``Flow.encode_ends`` call: tokens padded at the
    back and masked, caches padded at the front. Each row's mu equals its stream's final chunk encoded alone
    (``encode_streams(last_chunk=True)``) within ``tol``; a padding frame leaking into a real one shows at
    1e-2..1. Eagerly (no ``tokens_to`` off the graph path), then through ``make_graphs(flow)`` with
    ``tokens_to`` 10 and three rounds of other lengths, which share one shape: eager, capture, replay. Returns
    the graphs."""
    from minicpmo_rt.code2wav.flow import HISTORY_FRAMES

    flow = tiny_flow(device)
    cache, spk = prompt_cache(flow)
    g = torch.Generator().manual_seed(9)
    p = cache.prompt_frames
    steady = (p + HISTORY_FRAMES) // 2
    encs = []
    with torch.inference_mode():
        for n in (0, 1, 12):
            enc = cache.encoder
            for _ in range(n):
                enc = flow.encode_streams(torch.randint(0, TINY.vocab_size, (1, 8), generator=g), spk, [enc],
                                          False, [p])[2][0]
            encs.append(enc)
        spks = spk.expand(3, -1)
        for graphs, rounds in ((None, [(3, 8, 5)]), (make_graphs(flow), [(3, 8, 5), (2, 6, 4), (7, 1, 3)])):
            for lengths in rounds:
                toks = [torch.randint(0, TINY.vocab_size, (1, n), generator=g) for n in lengths]
                flow.encoder_graphs = None      # each stream alone, eagerly
                alone = [flow.encode_streams(t, spk, [e], True, None)[0] for t, e in zip(toks, encs)]
                flow.encoder_graphs = graphs
                hs, sp = flow.encode_ends(toks, spks, encs, tokens_to=10, pad_to=steady)
                assert sp.shape[0] == 3
                for i, (h, a) in enumerate(zip(hs, alone)):
                    assert h.shape == a.shape == (1, 80, 2 * lengths[i]), (h.shape, a.shape)
                    assert rel_err(h, a) < tol, (lengths, i, rel_err(h, a))
    flow.encoder_graphs = None
    return graphs


def test_final_chunks_of_several_lengths_encode_in_one_call():
    """``_final_chunks`` on the CPU: eagerly, and through the graph set's bookkeeping (``EncoderGraphs.ended``,
    captures faked on the CPU): final chunks of any lengths up to ``tokens_to`` share one graph, apart from the
    other sets'."""
    graphs = _final_chunks("cpu", lambda flow: _CPUGraphs(flow, 8))
    assert graphs.ended.captures == 1 and graphs.ended.replays == 2 and graphs.ended.eager_calls == 1
    assert not graphs.shapes.graphs and not graphs.padded.graphs


@requires_cuda
def test_cuda_final_chunks_of_several_lengths_replay_one_graph():
    """``_final_chunks`` on CUDA with real graphs (``EncoderGraphs.ended``: captured on the second round of
    lengths, which replays it, and replayed on the third), IEEE matmuls; 1e-5: cuBLAS picks its kernels by the rows and lengths."""
    graphs = _final_chunks("cuda", EncoderGraphs, 1e-5)
    assert graphs.ended.captures == 1 and graphs.ended.replays == 2


def test_back_padding_is_for_final_chunks_and_rows_must_match():
    """``forward_chunk(valid=)`` on a non-final chunk (whose look-ahead tokens are real) and ``encode_ends`` with
    caches or speaker rows that do not match the token rows are refused, naming what to pass."""
    import pytest

    from minicpmo_rt.errors import InputError

    flow = tiny_flow()
    cache, spk = prompt_cache(flow)
    tok = torch.randint(0, TINY.vocab_size, (1, 8))
    with torch.inference_mode():
        with pytest.raises(ValueError, match="final chunks only"):
            flow.encoder.forward_chunk(flow.input_embedding(tok), False, cache.encoder, valid=torch.tensor([5]))
        with pytest.raises(InputError, match="one cache and one speaker row per token row"):
            flow.encode_ends([tok, tok], spk, [cache.encoder])
