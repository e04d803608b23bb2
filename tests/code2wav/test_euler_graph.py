"""Whole-Euler solver vs the reference CFM solve (cfm.CausalConditionalCFM.forward_chunk)."""

import contextlib
from dataclasses import replace
import math

import pytest
import torch

from minicpmo_rt.code2wav import kernels
from minicpmo_rt.code2wav.cfm import CausalConditionalCFM
from minicpmo_rt.code2wav.euler_graph import GraphConfig, SolveKey, WholeEulerSolver, trim_span
from minicpmo_rt.code2wav.flow_config import CFMConfig, DiTConfig
from minicpmo_rt.code2wav.precision import tf32_enabled

from conftest import ieee_cudnn, rel_err, requires_cuda
from test_fused_dit import randomize

TINY = DiTConfig(in_channels=320, out_channels=80, mlp_ratio=4.0, depth=2, num_heads=2, head_dim=32, hidden_size=64)
S = 3


def tiny_cfm(seed=0, cfg=TINY, mild=False):
    cfm = CausalConditionalCFM(CFMConfig(estimator=cfg), noise_frames=2000)
    randomize(cfm.estimator, seed, mild=mild)
    return cfm.eval()


def chunk(B, T, L, seed, C=64, H=2, D=32, depth=2, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    return dict(mu=r(B, 80, T), spks=r(B, 80), cond=r(B, 80, T),
                cnn_cache=r(S, depth, 2 * B, 2 * C, 2), att_cache=r(S, depth, 2 * B, H, L, 2 * D) if L else None)


def reference(cfm, kw):
    with torch.inference_mode():
        return cfm.forward_chunk(kw["mu"], kw["spks"], kw["cond"], n_timesteps=S,
                                 cnn_cache=kw["cnn_cache"], att_cache=kw["att_cache"])


def assert_close(got, ref, tol):
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert rel_err(g, r) <= tol, rel_err(g, r)


@pytest.mark.parametrize("B,T,L", [(2, 6, 8), (3, 5, 7), (1, 6, 0)])
@pytest.mark.parametrize("body,split_k", [("fused", None), ("fused", 2), ("original", None)])
def test_eager_solver_matches_reference(body, split_k, B, T, L):
    """(2,6,8) is an exact bucket; (3,5,7) pads batch 3->4, width 5->6 and offset 7->8 (masked).
    ``split_k=2``: every GEMM of the fused body as 2 K-slice partials (the tiny K is below the
    default rule's minimum, so it is forced here)."""
    cfm = tiny_cfm()
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    solver = WholeEulerSolver(cfm, body=body, attention="sdpa", n_timesteps=S, config=cfg, use_triton=False,
                              split_k=split_k)
    kw = chunk(B, T, L, seed=B * 10 + T)
    got = solver.solve(**kw, graph=False)
    assert_close(got, reference(cfm, kw), 1e-5)
    if body == "fused" and (B, T, L) == (3, 5, 7):
        assert list(solver._statics) == [SolveKey(4, 6, 8, True)]


@pytest.mark.parametrize("keep", [True, False])
def test_held_graphs_keep_their_arena_and_wider_solves_split_rows(monkeypatch, keep):
    """``GraphConfig.keep_arena``: once graphs are held, a final (narrower) chunk whose arena would outgrow the
    current one (4 masked rows need 4x a batch-1 arena) runs in row groups that fit it, so the held statics
    survive; the result is the reference's. A full-width chunk masked by its offset (a recurring shape)
    still grows it. Off: the arena grows and drops them. A CUDA graph cannot exist on a CPU, so "held" is
    mocked (``graphs``); the CUDA test of the flow's final chunks runs real ones."""
    cfm = tiny_cfm(seed=4)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8, keep_arena=keep)
    solver = WholeEulerSolver(cfm, body="fused", attention="sdpa", n_timesteps=S, config=cfg, use_triton=False)
    solver.solve(**chunk(1, 6, 8, seed=1), graph=False)
    arena = solver._arena.numel()
    mu = torch.zeros(1, 80, 6)
    assert solver.rows_in_arena(4, 5, 8, mu) == 4                  # nothing held: no reason to split
    monkeypatch.setattr(solver, "graphs", lambda: list(solver._statics))
    assert solver.rows_in_arena(4, 5, 8, mu) == (1 if keep else 4)
    assert solver.rows_in_arena(1, 5, 8, mu) == 1
    assert solver.rows_in_arena(4, 6, 7, mu) == 4                  # full width, masked by offset: grows
    kw = chunk(4, 5, 8, seed=2)
    got = solver.solve(**kw, graph=False)
    assert_close(got, reference(cfm, kw), 1e-5)
    if keep:
        assert solver._arena.numel() == arena and SolveKey(1, 6, 8, False) in solver._statics
        assert set(solver._statics) == {SolveKey(1, 6, 8, False), SolveKey(1, 6, 8, True)}
    else:
        assert solver._arena.numel() == 4 * arena and list(solver._statics) == [SolveKey(4, 6, 8, True)]


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_final_batch_sizes_the_arena_for_final_chunks():
    """``GraphConfig.final_batch``: precapture also takes the final (narrower, masked) chunks' keys up to that
    batch where their arena (query + offset frames per row) outgrows the direct steady solves' (query frames
    only), the largest first so the arena is sized once; 0 keeps the final keys that fit (batch 1 here: 2 x 80
    frames, as batch 4's 8 x 20). Once sized, held graphs keep batch-4 finals in one solve (``rows_in_arena``)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # the direct path needs Triton on the inputs' device
    cfm = tiny_cfm(seed=3).to(dev)
    trim = (20, 40)
    mu = torch.zeros(1, 80, 19, device=dev)
    for final_batch, finals in ((0, {1}), (2, {1, 2}), (4, {1, 2, 4})):
        cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(20,), offset_bucket=20, offset_anchor=60,
                          final_batch=final_batch)
        sv = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", n_timesteps=S, config=cfg,
                              use_triton=True, block_kernel=False)
        keys = sv.precapture_keys((1, 2, 4), 20, (60,), dev, trim, final=True)
        assert {k.batch for k in keys if not k.masked} == {1, 2, 4} and all(k.direct for k in keys if not k.masked)
        assert {k.batch for k in keys if k.masked} == finals
        sizes = [math.prod(sv._arena_shape(k)) for k in keys]
        assert sizes == sorted(sizes, reverse=True)
        sv._arena = torch.zeros(sizes[0], device=dev)   # what precapture's first (largest) key allocates
        sv.graphs = lambda: [keys[0]]                   # "held": a CUDA graph cannot exist on a CPU
        assert sv.rows_in_arena(4, 19, 60, mu, trim) == max(finals)
    with pytest.raises(ValueError, match="final_batch"):
        GraphConfig(final_batch=-1)


def test_precapture_skips_a_key_that_does_not_fit(monkeypatch, caplog):
    """A precapture key whose buffers raise CUDA's out-of-memory error (here the largest, a final chunk's) is
    skipped with one warning and the rest are still taken, largest first. Mocked: an out-of-memory error and
    a CUDA device cannot be produced on a CPU machine; the CUDA tests run real precaptures."""
    cfm = tiny_cfm(seed=5)
    sv = WholeEulerSolver(cfm, body="fused", attention="sdpa", n_timesteps=S, use_triton=False)
    keys = [SolveKey(4, 50, 400, True), SolveKey(16, 50, 400, False), SolveKey(1, 50, 400, False)]
    taken = []

    def static_for(key, device, want_graph):
        if key.masked:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (mocked)")
        taken.append(key)
    monkeypatch.setattr(sv, "precapture_keys", lambda *a, **k: keys)
    monkeypatch.setattr(sv, "_static_for", static_for)
    monkeypatch.setattr(sv, "graphs", lambda: list(taken))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with caplog.at_level("WARNING"):
        assert sv.precapture((1, 4, 16), 50, (400,), device="cuda:0", trim=(300, 100), final=True) == 2
    assert taken == keys[1:] and caplog.text.count("does not fit in device memory") == 1


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_block_kernel_solver_with_masks_matches_reference():
    """The persistent block kernel inside the Euler solver, on the padded (masked) bucket: batch 3
    -> 4, width 5 -> 6, offset 7 -> 8. CPU: Triton's interpreter, one phase per launch, FP32 dots;
    CUDA: the one-launch kernel with IEEE dots."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=7).to(dev)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", n_timesteps=S, config=cfg,
                              use_triton=True, block_kernel=True)      # TF32 off: IEEE dots on CUDA
    kw = chunk(3, 5, 7, seed=8, device=dev)
    got = solver.solve(**kw, graph=False)
    st = solver._statics[SolveKey(4, 6, 8, True)]
    assert st.ws.ctr is not None and st.mask is not None      # the block kernel ran, masked
    with ieee_cudnn():
        assert_close(got, reference(cfm, kw), 1e-5)


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("split_k", [None, 2])
def test_step_kernels_match_the_torch_glue(split_k):
    """The Euler-step junction and CNN-roll kernels between the staged Triton body's evaluations
    (padded, masked bucket) vs the same solver with the torch glue, and both vs the reference.
    IEEE dots on CUDA (TF32 off, IEEE attention: under TF32 attention a 1e-7 input difference
    flips operand roundings and the two paths differ by ~6e-6 on the H200), plain FP32 dots
    under the interpreter."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=5).to(dev)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    kw = chunk(3, 5, 7, seed=9, device=dev)
    outs = {}
    for step_kernels in (True, False):
        solver = WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S, config=cfg,
                                  use_triton=True, block_kernel=False, split_k=split_k, step_kernels=step_kernels)
        assert solver._uses_step_kernels(kw["mu"]) == step_kernels
        outs[step_kernels] = solver.solve(**kw, graph=False)
    assert_close(outs[True], outs[False], 1e-6)
    with ieee_cudnn():
        assert_close(outs[True], reference(cfm, kw), 1e-5)


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_fp16_operands_in_the_solver_match_the_reference():
    """``gemm_operands="fp16"`` through a whole solve (padded, masked bucket): the Euler-step junction
    reads and writes the FP16 LN output, the CNN roll moves FP16 conv histories to and from the FP32
    caches, with the step kernels and with the torch glue. Every operand carries TF32's rounding, so
    the TF32 tolerance 1e-3 applies (CUDA: under TF32, which the FP16 operands require)."""
    from minicpmo_rt.code2wav.precision import matmul_tf32
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=6).to(dev)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    kw = chunk(3, 5, 7, seed=10, device=dev)
    with ieee_cudnn():
        ref = reference(cfm, kw)
    for step_kernels in (True, False):
        solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S, config=cfg,
                                  use_triton=True, block_kernel=False, wide_gemm=True, gemm_operands="fp16",
                                  step_kernels=step_kernels)
        with matmul_tf32(True):
            got = solver.solve(**kw, graph=False)
        st = solver._statics[SolveKey(4, 6, 8, True)]
        assert st.hist.dtype == torch.float16 and st.ws.norm.dtype == torch.float16
        assert all(t.dtype == torch.float32 for t in got)
        errs = [rel_err(g, r) for g, r in zip(got, ref)]
        assert 1e-6 < max(errs) <= 1e-3, (step_kernels, errs)


def _trim_ref(att, prompt, keep):
    d0, d1 = trim_span(att.shape[4], prompt, keep)
    return torch.cat([att[..., :d0, :], att[..., d1:, :]], 4)


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("B,step_kernels", [(3, True), (5, False)])
def test_direct_solve_reads_caches_in_place_and_trims(B, step_kernels):
    """``solve(trim=...)`` on the staged Triton body: the direct path (no arena copy of the old cache;
    the attention writes the trimmed successor) against the arena path + the flow's trim, stacked and
    per-stream caches. B=3 pads to 4 (padding rows read stream 0, write nothing); 5 runs as groups of
    4 and 1, with the torch glue between steps. IEEE dots on CUDA; the keys reach the softmax in
    another tile grouping, hence 1e-6, not bit equality."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=12).to(dev)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    kw = chunk(B, 6, 8, seed=30 + B, device=dev)
    att = kw.pop("att_cache")
    streams = [torch.cat([att[:, :, i:i + 1], att[:, :, B + i:B + i + 1]], 2) for i in range(B)]
    trim = (5, 4)                                      # 14 frames -> the first 5 and the last 4
    make = lambda direct: WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S,  # noqa: E731
                                           config=cfg, use_triton=True, block_kernel=False,
                                           step_kernels=step_kernels, direct=direct)
    ref = make(False).solve(**kw, att_cache=att, graph=False)
    want = _trim_ref(ref[2], *trim)
    direct = make(None)
    for form in (att, streams):
        mel, cnn, new = direct.solve(**kw, att_cache=form, graph=False, copy_out=False, trim=trim)
        assert all(k.direct == (5, 10) for k in direct._statics)
        assert all(st.kv.shape[4] == 6 for st in direct._statics.values())     # current frames only
        assert rel_err(mel, ref[0]) < 1e-6 and rel_err(cnn, ref[1]) < 1e-6
        if form is streams:
            assert isinstance(new, list) and len(new) == B
            new = _stacked(new)
        assert new.shape == want.shape and rel_err(new, want) < 1e-6


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_staged_direct_solve_one_key_loop_and_key_tiles():
    """The staged direct attention under TF32 dots walks its two key sources in one loop by default
    (``FusedDiT.direct_one_loop``; pointer loads): the same bits as one pointer loop per source. Against the two
    loops through TMA descriptors (the default before, where the device builds them: the interpreter does too)
    the FP32 tolerance (the H100 solve was bit-identical; the interpreter's descriptor loads differ in the last
    bits). ``direct_block_n`` 16 splits the 40 old frames into more key tiles than 64 does, so the softmax sums
    group otherwise: FP32 tolerance under the interpreter (its TF32 dots are FP32), TF32's on CUDA. B=5 runs as
    4 + 1 rows."""
    from minicpmo_rt.code2wav.precision import matmul_tf32
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=13).to(dev)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=40)
    kw = chunk(5, 6, 40, seed=41, device=dev)
    att = kw.pop("att_cache")
    shapes = []

    def solve(**fused_attrs):
        s = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S, config=cfg,
                             use_triton=True, block_kernel=False, direct=None)
        for k, v in fused_attrs.items():
            setattr(s.fused, k, v)
        with matmul_tf32(True):
            out = s.solve(**kw, att_cache=att, graph=False, trim=(5, 30))
        assert all(k.direct for k in s._statics)
        shapes.append(s.fused._direct_shape(8, 2, 6, True).tma)
        return out

    one, two = solve(), solve(direct_one_loop=False, direct_tma=False)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    tol = 1e-3 if dev == "cuda" else 1e-6
    two_tma = solve(direct_one_loop=False)
    assert shapes == [False, False, True]
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(two_tma, one))
    tiles16 = solve(direct_block_n=16)
    errs = [rel_err(a, b) for a, b in zip(tiles16, one)]
    assert 0 < max(errs) and all(e < tol for e in errs), errs


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_block_kernel_direct_solve_matches_the_arena():
    """The persistent block kernel's direct attention phase (opt-in, ``direct=True``): batch 2 fills its
    bucket, batch 1 pads to 2 (a padding row), per-stream caches, against the same kernel through the
    arena with the flow's trim. IEEE dots on CUDA, FP32 under the interpreter (one phase per launch).
    At T=6 each (row, head) is one query block; the blocks' turns at writing are covered by
    test_tiled_attention's direct test."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=14).to(dev)
    cfg = GraphConfig(batch_buckets=(2,), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    make = lambda direct: WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S,  # noqa: E731
                                           config=cfg, use_triton=True, block_kernel=True, direct=direct)
    auto, direct, arena = make(None), make(True), make(False)
    for B in (2, 1):
        kw = chunk(B, 6, 8, seed=50 + B, device=dev)
        att = kw.pop("att_cache")
        streams = [torch.cat([att[:, :, i:i + 1], att[:, :, B + i:B + i + 1]], 2) for i in range(B)]
        ref = arena.solve(**kw, att_cache=streams, graph=False, trim=(5, 4))
        got = direct.solve(**kw, att_cache=streams, graph=False, trim=(5, 4))
        st = direct._statics[SolveKey(2, 6, 8, False, (5, 10))]
        assert st.ws.ctr is not None                        # the block kernel ran, on the direct path
        assert rel_err(got[0], ref[0]) < 1e-6 and rel_err(got[1], ref[1]) < 1e-6
        assert rel_err(_stacked(got[2]), _stacked(ref[2])) < 1e-6
    auto.solve(**kw, att_cache=streams, graph=False, trim=(5, 4))
    assert not any(k.direct for k in auto._statics)         # by default few rows keep the arena


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_block_kernel_direct_one_key_loop_matches_two(monkeypatch):
    """The block kernel's direct phase walking a split's current and old key tiles in one loop
    (``dit_block.DIRECT_ONE_LOOP``) gives the two loops' bits: the same tiles in the same order. Width 20 and 150
    old frames: under the interpreter (one program, one key split) the split holds one tile of current frames and
    three of old ones (the last partial); on CUDA the splits take a tile each. Two query blocks take turns writing
    the successor, whose dropped span [5, 35) crosses the sources. Batch 1 (a padding row) and 2, per-stream
    caches, TF32 dots on CUDA, FP32 under the interpreter."""
    from minicpmo_rt.code2wav.kernels import dit_block

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=17).to(dev)
    cfg = GraphConfig(batch_buckets=(2,), query_buckets=(20,), offset_bucket=10, offset_anchor=150)
    outs = {}
    for one in (False, True):
        monkeypatch.setattr(dit_block, "DIRECT_ONE_LOOP", one)
        solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=2, config=cfg,
                                  use_triton=True, block_kernel=True, direct=True)
        for B in (1, 2):
            kw = chunk(B, 20, 150, seed=80 + B, device=dev)
            kw["cnn_cache"], att = kw["cnn_cache"][:2], kw.pop("att_cache")[:2]
            streams = [torch.cat([att[:, :, i:i + 1], att[:, :, B + i:B + i + 1]], 2) for i in range(B)]
            got = solver.solve(**kw, att_cache=streams, graph=False, trim=(5, 135))
            assert all(k.direct for k in solver._statics)
            outs[one, B] = [got[0].clone(), got[1].clone(), _stacked(got[2]).clone()]
    for B in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(outs[True, B], outs[False, B]))


@requires_cuda
@pytest.mark.skipif(not kernels.AVAILABLE, reason="needs Triton")
def test_cuda_block_kernel_direct_prefetch_changes_no_result(monkeypatch):
    """The block kernel's direct phase asks L2 for each row's old frames (``dit_block.DIRECT_PREFETCH``, inline
    PTX, so CUDA only: the interpreter issues no prefetch). A prefetch is a hint: with it on and off the solve
    (batch 1 padded to 2 and batch 2, per-stream caches, graph replay) gives the same bits."""
    from minicpmo_rt.code2wav.kernels import dit_block

    cfm = tiny_cfm(seed=16).to("cuda")
    cfg = GraphConfig(batch_buckets=(2,), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(dit_block, "DIRECT_PREFETCH", on)
        solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S, config=cfg,
                                  use_triton=True, block_kernel=True, direct=True)
        for B in (1, 2):
            kw = chunk(B, 6, 8, seed=60 + B, device="cuda")
            att = kw.pop("att_cache")
            streams = [torch.cat([att[:, :, i:i + 1], att[:, :, B + i:B + i + 1]], 2) for i in range(B)]
            got = solver.solve(**kw, att_cache=streams, trim=(5, 4))
            assert all(k.direct for k in solver.graphs())
            outs[on, B] = [got[0].clone(), got[1].clone(), _stacked(got[2]).clone()]
    for B in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(outs[True, B], outs[False, B]))


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_block_kernel_arena_writes_the_trimmed_successor(monkeypatch):
    """Trimmed solves on the block kernel's arena (``ARENA_SUCCESSOR``): the attention phase writes each row's
    trimmed successor while it reads the arena, and no trim copy follows; the result equals the arena solve
    trimmed afterwards bit for bit (same arithmetic). Batch 2 (one stacked cache) fills its bucket, batch 1
    (per-stream caches) pads to 2 (a padding row, written nowhere). Width 20 and 60 old frames: two query
    blocks and two key tiles (one key split), so both query blocks take their turn at writing; the span
    dropped (frames [5, 40)) crosses the tiles' boundary."""
    from minicpmo_rt.code2wav import euler_graph

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=15).to(dev)
    cfg = GraphConfig(batch_buckets=(2,), query_buckets=(20,), offset_bucket=4, offset_anchor=60)
    make = lambda: WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=2,  # noqa: E731
                                    config=cfg, use_triton=True, block_kernel=True, direct=False)
    trim = (5, 40)      # 80 frames -> the first 5 and the last 40
    for B, per_stream in ((2, False), (1, True)):
        kw = chunk(B, 20, 60, seed=70 + B, device=dev)
        kw["cnn_cache"], kw["att_cache"] = kw["cnn_cache"][:2], kw["att_cache"][:2]
        att = kw.pop("att_cache")
        cache = [torch.cat([att[:, :, i:i + 1], att[:, :, B + i:B + i + 1]], 2) for i in range(B)] if per_stream else att
        monkeypatch.setattr(euler_graph, "ARENA_SUCCESSOR", False)
        ref = make().solve(**kw, att_cache=cache, graph=False, trim=trim)
        monkeypatch.setattr(euler_graph, "ARENA_SUCCESSOR", True)
        solver = make()
        got = solver.solve(**kw, att_cache=cache, graph=False, trim=trim)
        (key, st), = solver._statics.items()
        assert key.succ == (5, 40) and not key.direct and st.ws.ctr is not None    # the block kernel wrote it
        assert key in solver.precapture_keys((1, 2), 20, (60,), dev, trim)       # what precapture would take
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        new, want = (_stacked(got[2]), _stacked(ref[2])) if per_stream else (got[2], ref[2])
        assert new.shape == want.shape == (2, 2, 2 * B, 2, 45, 64)
        assert torch.equal(new, want)


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_direct_solve_takes_rows_of_their_own_cache_lengths():
    """Per-stream caches of 8, 2 and 6 frames in ONE direct solve on the staged Triton body (``SolveKey.rows``,
    keyed at 8; batch 3 pads to 4): each stream's mel, CNN cache and successor equal that stream solved alone
    at its own length (its own key, noise offset and trim: the flow's trim (5, 4) drops [5, 10), nothing, and
    [5, 8) of the three), within 1e-6 (IEEE dots; the keys reach the softmax in another grouping); also with
    the 2-frame stream's chunk a final one of 3 frames among them (``widths``). The solver refuses lengths it cannot read in place (SDPA attention), naming the way out, and
    ``joins_lengths`` says which solver can take them. Rows all shorter than the steady length (trim's sum)
    solve under the steady key where that is direct (``anchor_at_trim``), so the precaptured graph serves them."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=14).to(dev)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    lengths, trim, T = [8, 2, 6], (5, 4), 6
    B = len(lengths)
    kw = chunk(B, T, 0, seed=41, device=dev)
    kw.pop("att_cache")
    g = torch.Generator().manual_seed(42)
    streams = [torch.randn(S, 2, 2, 2, n, 64, generator=g).to(dev) for n in lengths]
    solver = WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S, config=cfg,
                              use_triton=True, block_kernel=False)
    assert solver.joins_lengths(T, streams, kw["mu"], trim)
    mel, cnn, new = solver.solve(**kw, att_cache=streams, graph=False, copy_out=True, trim=trim)
    assert [k.rows for k in solver._statics] == [True] and next(iter(solver._statics)).offset == 8
    assert [a.shape[4] for a in new] == [T + n - (d1 - d0) for n, (d0, d1) in
                                         ((n, trim_span(T + n, *trim)) for n in lengths)]
    for i, n in enumerate(lengths):
        one = {k: (v[i:i + 1] if k != "cnn_cache" else torch.cat([v[:, :, i:i + 1], v[:, :, B + i:B + i + 1]], 2))
               for k, v in kw.items() if v is not None}
        alone = WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S, config=cfg,
                                 use_triton=True, block_kernel=False)
        m1, c1, a1 = alone.solve(**one, att_cache=[streams[i]], graph=False, copy_out=True, trim=trim)
        assert rel_err(mel[i:i + 1], m1) < 1e-6, i
        assert rel_err(torch.cat([cnn[:, :, i:i + 1], cnn[:, :, B + i:B + i + 1]], 2), c1) < 1e-6, i
        assert new[i].shape == a1[0].shape and rel_err(new[i], a1[0]) < 1e-6, i
    # a stream's final chunk among them (row 1: 3 of the 6 frames, its padding never attended, no successor)
    mel_w, _, new_w = solver.solve(**kw, att_cache=streams, graph=False, copy_out=True, trim=trim, widths=[6, 3, 6])
    assert new_w[1] is None and all(torch.equal(new_w[i], new[i]) for i in (0, 2))
    assert torch.equal(mel_w[0::2], mel[0::2])
    alone = WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S, config=cfg,
                             use_triton=True, block_kernel=False)
    one = dict(mu=kw["mu"][1:2, :, :3], spks=kw["spks"][1:2], cond=kw["cond"][1:2, :, :3],
               cnn_cache=torch.cat([kw["cnn_cache"][:, :, 1:2], kw["cnn_cache"][:, :, B + 1:B + 2]], 2))
    m1, _, _ = alone.solve(**one, att_cache=[streams[1]], graph=False, copy_out=True, trim=trim)
    assert rel_err(mel_w[1:2, :, :3], m1) < 1e-6
    # rows all shorter than the steady length (a round of second and first chunks alone): where the steady key
    # is a direct one (the offset grid anchored at the trim, as in Code2Wav), they solve under it, so the rows
    # graph precaptured at the steady length serves them; each still equals its own solve
    at_trim = WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S, use_triton=True,
                               config=replace(cfg, anchor_at_trim=True), block_kernel=False)
    short = dict(mu=kw["mu"][1:], spks=kw["spks"][1:], cond=kw["cond"][1:],
                 cnn_cache=torch.cat([kw["cnn_cache"][:, :, 1:B], kw["cnn_cache"][:, :, B + 1:]], 2))
    mel_s, _, new_s = at_trim.solve(**short, att_cache=streams[1:], graph=False, copy_out=True, trim=trim)
    assert [(k.rows, k.offset, k.masked) for k in at_trim._statics] == [(True, sum(trim), False)]
    for r, i in enumerate((1, 2)):
        assert rel_err(mel_s[r:r + 1], mel[i:i + 1]) < 1e-6 and rel_err(new_s[r], new[i]) < 1e-6, i
    sdpa = WholeEulerSolver(cfm, body="fused", attention="sdpa", n_timesteps=S, config=cfg, use_triton=False)
    assert not sdpa.joins_lengths(T, streams, kw["mu"], trim)
    with pytest.raises(ValueError, match="only on the direct path.*joins_lengths"):
        sdpa.solve(**kw, att_cache=streams, graph=False, trim=trim)
    with pytest.raises(ValueError, match="but for the frames"):        # only the frame counts may differ
        solver.solve(**kw, att_cache=[streams[0], streams[1][:, :1], streams[2]], graph=False, trim=trim)


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("lengths", [[8, 8, 8], [8, 4, 6]])
def test_direct_solve_reads_shared_prompt_tails(lengths):
    """``share_tail``: per-stream caches that end with their voice prompt cache's last min(trim) = 4 frames
    (two voices, one stream without a prompt cache) solve with those frames read from the prompt caches
    (``solve(tails=)``, ``SolveKey.tail``). The streams' own copies of the frames are NaN, so a read of them
    would show; the mel, CNN cache and every successor (whose last frames are copied from the prompt cache)
    equal, bit for bit, the solve of the clean caches without tails. Batch 3 pads to 4 (the padding row reads
    stream 0's cache and tail); [8, 4, 6] are rows of their own lengths (``SolveKey.rows``). The tail is not
    taken where the block kernel would run, and a prompt cache that does not fit its stream is refused.
    ``reuse``: successors written into retired caches of the voice (NaN but for the prompt's last frames, which
    they hold already and a tail solve leaves as they are): the same bits, in those tensors; a reused tensor of
    the wrong shape, or one that is a cache the solve reads, is refused."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=15).to(dev)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    trim, T, B = (5, 4), 6, len(lengths)
    kw = chunk(B, T, 0, seed=43, device=dev)
    kw.pop("att_cache")
    g = torch.Generator().manual_seed(44)
    prompts = [torch.randn(S, 2, 2, 2, trim[0], 64, generator=g).to(dev) for _ in range(2)]
    clean = []
    for n, p in zip(lengths, [prompts[0], prompts[1], None]):
        c = torch.randn(S, 2, 2, 2, n, 64, generator=g).to(dev)
        if p is not None:
            c[..., n - 4:, :] = p[..., trim[0] - 4:, :]
        clean.append(c)
    poisoned = [c.clone() for c in clean]
    for c in poisoned[:2]:
        c[..., c.shape[4] - 4:, :] = float("nan")

    def make(share):
        sv = WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S, config=cfg,
                              use_triton=True, block_kernel=False)
        sv.share_tail = share
        return sv

    ref = make(False).solve(**kw, att_cache=clean, graph=False, copy_out=True, trim=trim)
    shared = make(True)
    out = shared.solve(**kw, att_cache=poisoned, graph=False, copy_out=True, trim=trim,
                       tails=[prompts[0], prompts[1], None])
    assert [(k.direct is not None, k.tail, k.rows) for k in shared._statics] == [(True, True, len(set(lengths)) > 1)]
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(out[2], ref[2]))
    retired = []
    for a, p in zip(ref[2], [prompts[0], prompts[1], None]):
        r = torch.full_like(a, float("nan"))
        if p is not None:
            r[..., a.shape[4] - 4:, :] = p[..., trim[0] - 4:, :]
        retired.append(r)
    again = shared.solve(**kw, att_cache=poisoned, graph=False, copy_out=True, trim=trim,
                         tails=[prompts[0], prompts[1], None], reuse=retired)
    assert all(a is r for a, r in zip(again[2], retired))
    assert torch.equal(again[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(again[2], ref[2]))
    with pytest.raises(ValueError, match="reused successor is a"):
        shared.solve(**kw, att_cache=clean, graph=False, trim=trim, reuse=[retired[0][..., 1:, :], None, None])
    flat = torch.empty(clean[2].numel() + retired[2].numel(), device=dev)      # a cache and a successor in one
    inside = flat[:clean[2].numel()].view(clean[2].shape).copy_(clean[2])
    with pytest.raises(ValueError, match="shares memory with a cache"):
        shared.solve(**kw, att_cache=clean[:2] + [inside], graph=False, trim=trim,
                     reuse=[None, None, flat[clean[2].numel():].view(retired[2].shape)])
    # tails are only a hint: without them the tail key reads every row's own frames
    assert torch.equal(shared.solve(**kw, att_cache=clean, graph=False, copy_out=True, trim=trim)[0], ref[0])
    block = WholeEulerSolver(cfm, body="fused", attention="triton-ieee", n_timesteps=S, config=cfg,
                             use_triton=True, block_kernel=True, direct=True)
    block.share_tail = True
    assert not block.solve_key(B, T, 8, kw["mu"], trim).tail
    with pytest.raises(ValueError, match="prompt tail"):
        shared.solve(**kw, att_cache=clean, graph=False, trim=trim, tails=[prompts[0][..., 1:, :], None, None])
    with pytest.raises(ValueError, match="3 prompt tails|one per stream"):
        shared.solve(**kw, att_cache=clean, graph=False, trim=trim, tails=[None])


def _stacked(per_stream):
    return torch.cat([a[:, :, 0:1] for a in per_stream] + [a[:, :, 1:2] for a in per_stream], 2)


@pytest.mark.parametrize("B", [3, 5])
def test_trim_through_the_arena_equals_the_flows_trim(B):
    """Where the direct path does not apply (SDPA attention here), ``solve(trim=...)`` returns the
    arena's new cache trimmed as the flow trims, in memory of its own, for both cache forms."""
    cfm = tiny_cfm(seed=13)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    solver = WholeEulerSolver(cfm, body="fused", attention="sdpa", n_timesteps=S, config=cfg, use_triton=False)
    kw = chunk(B, 6, 8, seed=40 + B)
    att = kw.pop("att_cache")
    streams = [torch.cat([att[:, :, i:i + 1], att[:, :, B + i:B + i + 1]], 2) for i in range(B)]
    mel, cnn, full = [t.clone() for t in solver.solve(**kw, att_cache=att)]
    for form in (att, streams):
        got_mel, got_cnn, new = solver.solve(**kw, att_cache=form, copy_out=False, trim=(5, 4))
        assert not any(k.direct for k in solver._statics)
        new = new if form is att else _stacked(new)
        assert torch.equal(got_mel, mel) and torch.equal(new, _trim_ref(full, 5, 4))
    assert trim_span(14, 5, 4) == (5, 10) and trim_span(9, 5, 4) == (9, 9)


def test_batches_beyond_the_largest_bucket_run_in_groups():
    cfm = tiny_cfm(seed=2)
    solver = WholeEulerSolver(cfm, body="fused", attention="sdpa", n_timesteps=S, use_triton=False,
                              config=GraphConfig(batch_buckets=(1, 2), query_buckets=(4,), offset_bucket=5))
    kw = chunk(5, 4, 5, seed=3)
    assert_close(solver.solve(**kw, graph=False), reference(cfm, kw), 1e-5)


def test_offset_grid_is_anchored_at_the_steady_length():
    solver = WholeEulerSolver(tiny_cfm(), body="fused", attention="sdpa", n_timesteps=S,
                              config=GraphConfig(offset_bucket=50, offset_anchor=400))
    assert [solver.snap_offset(L) for L in (400, 401, 450, 451, 399, 350, 349, 0)] == \
        [400, 450, 450, 500, 400, 350, 400 - 50, 0]
    assert solver.key_for(1, 50, 400) == SolveKey(1, 50, 400, False)
    assert solver.key_for(3, 40, 380) == SolveKey(4, 50, 400, True)
    assert solver.key_for(1, 51, 400) is None


def test_tf32_scope_is_restored_after_solve_and_on_error():
    cfm = tiny_cfm()
    solver = WholeEulerSolver(cfm, body="fused", attention="sdpa", tf32=True, n_timesteps=S, use_triton=False,
                              config=GraphConfig(query_buckets=(4,), offset_bucket=4))
    before = tf32_enabled()
    kw = chunk(1, 4, 4, seed=1)
    solver.solve(**kw, graph=False)
    assert tf32_enabled() == before
    bad = dict(kw, att_cache=torch.zeros(S + 1, 2, 2, 2, 4, 64))
    with pytest.raises(ValueError):
        solver.solve(**bad)
    assert tf32_enabled() == before


@contextlib.contextmanager
def full_size_ten_steps(device="cuda"):
    """(cfm, graph config) for the full-size CUDA tests: the full-size DiT (mild random weights), 10 Euler
    steps (the module's S while inside), TF32 matmuls and cuDNN TF32 off (an IEEE reference throughout;
    the original body's Conv1d is cuDNN), buckets up to batch 4 at query 50 and cache 400."""
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE
    global S
    torch.backends.cuda.matmul.allow_tf32 = False
    cfm = tiny_cfm(seed=4, cfg=FULL_SIZE.dit, mild=True).to(device)
    S_saved, S = S, 10
    try:
        with ieee_cudnn():
            yield cfm, GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(50,), offset_bucket=50, offset_anchor=400)
    finally:
        S = S_saved


@requires_cuda
@pytest.mark.parametrize("body,tf32", [("fused", False), ("fused", True), ("original", False), ("original", True),
                                       ("fused-block", False), ("fused-block", True)])
def test_cuda_graph_matches_eager(body, tf32):
    """``fused-block``: the persistent block kernel (batch 2 = 200 rows; the padded batch 4 is past
    its row limit and runs the staged body)."""
    block = body == "fused-block"
    body = "fused" if block else body
    with full_size_ten_steps() as (cfm, cfg):
        solver = WholeEulerSolver(cfm, body=body, attention="triton-tf32" if tf32 else "triton-ieee", tf32=tf32,
                                  n_timesteps=10, config=cfg, block_kernel=block)
        for B, T, L in ((2, 50, 400), (3, 45, 380)):
            if body == "original" and T != 50:
                continue
            kw = chunk(B, T, L, seed=5, C=512, H=8, D=64, depth=16, device="cuda")
            eager = solver.solve(**kw, graph=False)
            graphed = solver.solve(**kw, graph=True)
            assert tf32_enabled() is False              # the process flag is restored after capture/replay
            assert solver.graphs(), "no graph was captured"
            errs = [rel_err(g, e) for g, e in zip(graphed, eager)]
            print(f"graph vs eager {body}{' block kernel' if block else ''} tf32={tf32} B={B} T={T} L={L}: "
                  f"{max(errs):.2e}")
            assert max(errs) <= 1e-6
            if not tf32:
                assert_close(graphed, reference(cfm, kw), 1e-5)


@requires_cuda
def test_cuda_precaptured_graphs_serve_the_flows_trimmed_solves(monkeypatch):
    """Full size, ten steps, TF32 (the flow's default): ``precapture`` with the flow's trim captures the steady
    chunk's keys (batch 1: the block kernel through the arena; batch 2: its direct phase; batch 4: the staged
    direct body) on zero address tables, largest arena first. The flow's trimmed solves then replay them
    without a new capture, each equal to the same solve run eagerly (<= 1e-6). The arena's successor writes
    (``ARENA_SUCCESSOR``, opt-in) give batch 1 the same result bit for bit."""
    from minicpmo_rt.code2wav import euler_graph

    with full_size_ten_steps() as (cfm, cfg):
        make = lambda: WholeEulerSolver(cfm, body="fused", n_timesteps=10, config=cfg, tf32=True)  # noqa: E731
        solver, trim = make(), (300, 100)
        assert solver.precapture((1, 2, 4), 50, (400,), "cuda", trim) == 3
        held = solver.graphs()
        assert {k.batch: (k.succ, k.direct) for k in held} == {1: (None, None), 2: (None, (300, 350)),
                                                                  4: (None, (300, 350))}
        for B in (1, 2, 4):
            kw = chunk(B, 50, 400, seed=8 + B, C=512, H=8, D=64, depth=16, device="cuda")
            graphed = [t.clone() for t in solver.solve(**kw, graph=True, trim=trim)]
            assert solver.graphs() == held and tf32_enabled() is False
            eager = solver.solve(**kw, graph=False, trim=trim)
            errs = [rel_err(g, e) for g, e in zip(graphed, eager)]
            print(f"precaptured B={B}: graph vs eager {errs}")
            assert max(errs) <= 1e-6
            if B == 1:
                monkeypatch.setattr(euler_graph, "ARENA_SUCCESSOR", True)
                succ = make()
                written = succ.solve(**kw, graph=True, trim=trim)
                assert [k.succ for k in succ.graphs()] == [(300, 350)]
                monkeypatch.setattr(euler_graph, "ARENA_SUCCESSOR", False)
                assert all(torch.equal(g, w) for g, w in zip(graphed, written))


@requires_cuda
@pytest.mark.parametrize("tf32", [False, True])
def test_cuda_direct_solve_matches_the_arena(tf32):
    """Full-size DiT at batch 4 (staged body), steady chunk (query 50, cache 400), per-stream caches:
    the direct path from its graph against its eager run (<= 1e-6) and against the arena path with the
    flow's trim (IEEE: <= 1e-6, only the key grouping differs; TF32: <= 1e-3, operand roundings
    follow that difference), and with TF32 off against the IEEE reference (<= 1e-5)."""
    with full_size_ten_steps() as (cfm, cfg):
        make = lambda direct: WholeEulerSolver(cfm, body="fused", n_timesteps=10, config=cfg, direct=direct,  # noqa: E731
                                               attention="triton-tf32" if tf32 else "triton-ieee", tf32=tf32)
        B, trim = 4, (300, 100)
        kw = chunk(B, 50, 400, seed=6, C=512, H=8, D=64, depth=16, device="cuda")
        att = kw.pop("att_cache")
        streams = [torch.cat([att[:, :, i:i + 1], att[:, :, B + i:B + i + 1]], 2) for i in range(B)]
        direct, arena = make(None), make(False)
        eager = direct.solve(**kw, att_cache=streams, graph=False, trim=trim)
        graphed = direct.solve(**kw, att_cache=streams, graph=True, trim=trim)
        assert direct.graphs() and all(k.direct == (300, 350) for k in direct.graphs())
        assert tf32_enabled() is False
        ref = arena.solve(**kw, att_cache=streams, graph=True, trim=trim)
        flat = lambda r: (r[0], r[1], _stacked(r[2]))       # noqa: E731
        errs_graph = [rel_err(g, e) for g, e in zip(flat(graphed), flat(eager))]
        errs_arena = [rel_err(g, e) for g, e in zip(flat(graphed), flat(ref))]
        print(f"direct tf32={tf32}: graph vs eager {max(errs_graph):.2e}, vs arena {errs_arena}")
        assert max(errs_graph) <= 1e-6
        assert max(errs_arena) <= (1e-3 if tf32 else 1e-6)
        if not tf32:
            full = reference(cfm, dict(kw, att_cache=att))
            assert_close(flat(graphed), (full[0], full[1], _trim_ref(full[2], *trim)), 1e-5)


@pytest.mark.parametrize("body", ["fused", "original"])
@pytest.mark.parametrize("B,T", [(2, 6), (3, 6), (3, 5), (5, 6)])
def test_per_stream_caches_match_the_stacked_form(body, B, T):
    """att_cache as B per-stream (S, depth, 2, ...) caches: the same mel and caches as the stacked
    (S, depth, 2B, ...) form, the new attention cache split back per stream (rows i and B + i of the
    stacked one), bit for bit: a full bucket (2), a padded one (3 in 4), a narrow query (T=5 < 6,
    fused only) and a batch past the largest bucket (5: groups of 4 and 1); views with
    ``copy_out=False`` and own memory with ``copy_out=True``."""
    if body == "original" and T != 6:
        pytest.skip("the original body takes exact widths only")
    cfm = tiny_cfm(seed=3)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(6,), offset_bucket=4, offset_anchor=8)
    solver = WholeEulerSolver(cfm, body=body, attention="sdpa", n_timesteps=S, config=cfg, use_triton=False)
    kw = chunk(B, T, 8, seed=20 + B + T)
    att = kw.pop("att_cache")
    streams = [torch.cat([att[:, :, i:i + 1], att[:, :, B + i:B + i + 1]], 2) for i in range(B)]
    mel, cnn, stacked = [t.clone() for t in solver.solve(**kw, att_cache=att)]
    for copy_out in (False, True):
        got_mel, got_cnn, per = solver.solve(**kw, att_cache=streams, copy_out=copy_out)
        assert torch.equal(got_mel, mel) and torch.equal(got_cnn, cnn)
        assert isinstance(per, list) and len(per) == B
        for i, a in enumerate(per):
            assert torch.equal(a, torch.cat([stacked[:, :, i:i + 1], stacked[:, :, B + i:B + i + 1]], 2))
            if copy_out:
                assert all(a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                           for b in per if b is not a)
    with pytest.raises(ValueError, match="per-stream attention cache 1"):
        solver.solve(**kw, att_cache=[streams[0], streams[0][..., :7, :]] + streams[2:])
    with pytest.raises(ValueError, match="per-stream attention caches for a batch"):
        solver.solve(**kw, att_cache=streams[:-1])


def test_solver_from_knobs_on_cpu(caplog):
    from minicpmo_rt.code2wav.euler_graph import solver_from_knobs
    cfm = tiny_cfm()
    with caplog.at_level("INFO"):
        solver, choice = solver_from_knobs(cfm, {}, "cpu", n_timesteps=S, env={})
    assert (choice.body, choice.tf32, solver.body) == ("original", False, "original")
    assert "CFM body original" in caplog.text
    solver, choice = solver_from_knobs(cfm, {"cfm_fused_body": True}, "cpu", n_timesteps=S, env={},
                                       config=GraphConfig(query_buckets=(4,), offset_bucket=4))
    assert (choice.body, choice.attention, solver.body) == ("fused", "sdpa", "fused")
    kw = chunk(1, 4, 4, seed=9)
    assert_close(solver.solve(**kw), reference(cfm, kw), 1e-5)


def test_precapture_is_a_no_op_off_cuda():
    solver = WholeEulerSolver(tiny_cfm(), body="fused", attention="sdpa", n_timesteps=S, use_triton=False)
    assert solver.precapture((1, 2), 50, (400,), device="cpu") == 0
    assert solver._graphs_off_reason is None and not solver.graphs()
