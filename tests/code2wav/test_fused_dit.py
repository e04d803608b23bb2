"""Fused DiT body vs the original body on the same weights and inputs (CPU: SDPA fallback
and, under TRITON_INTERPRET=1, the Triton stages on a tiny shape)."""


import pytest
import torch

from minicpmo_rt.code2wav import kernels
from minicpmo_rt.code2wav.flow_config import DiTConfig
from minicpmo_rt.code2wav.fused_dit import FusedDiT, supports_fused_body

from conftest import ieee_cudnn, rel_err, requires_cuda

TINY = DiTConfig(in_channels=320, out_channels=80, mlp_ratio=4.0, depth=2, num_heads=2, head_dim=32, hidden_size=64)


def randomize(module: torch.nn.Module, seed: int, mild: bool = False) -> torch.nn.Module:
    """Non-trivial weights everywhere (upstream init zeroes adaLN and the final layer).

    ``mild`` (small biases, norm gains near 1, as the benchmark uses) for whole 10-step solves at
    full size: with the default large biases the solve amplifies fp32 rounding itself (measured on
    CPU: fp32 vs fp64 of the reference solve 1.6e-6 mel / 4.4e-6 CNN cache), too close to 1e-5.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + (0.1 if mild else 0.2) * torch.randn(p.shape, generator=g))
            elif mild and p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 16
                if p.dim() == 3:
                    fan_in = p.shape[1] * p.shape[2]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return module.eval()


def our_dit(cfg=TINY, seed=0):
    from minicpmo_rt.code2wav.dit import DiT
    return randomize(DiT(cfg), seed)


def inputs(R, T, Lc, depth, C, H, D, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    t = torch.full((R,), 0.3).to(device)
    return dict(x=r(R, 80, T), mu=r(R, 80, T), t=t, spks=r(R, 80), cond=r(R, 80, T),
                cnn_cache=r(depth, R, 2 * C, 2), att_cache=r(depth, R, H, Lc, 2 * D) if Lc else None)


def check(dit, fused, R, T, Lc, tol, seed=1, device="cpu", with_cnn=True):
    cfg_C = dit.in_proj.out_features
    a = dit.blocks[0].attn
    kw = inputs(R, T, Lc, len(dit.blocks), cfg_C, a.num_heads, a.head_dim, seed, device)
    if not with_cnn:
        kw["cnn_cache"] = None
    with torch.no_grad():
        ref = dit.forward_chunk(**kw)
        got = fused.forward_chunk(**kw)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    assert got[2].shape == ref[2].shape and got[1].shape == ref[1].shape
    assert max(errs) <= tol, errs
    return errs


def test_guard_accepts_our_and_upstream_layouts():
    assert supports_fused_body(our_dit())[0]
    dit = our_dit()
    dit.blocks[1].mlp.act = torch.nn.GELU()              # erf-GELU is not what the fused MLP computes
    ok, why = supports_fused_body(dit)
    assert not ok and "blocks.1.mlp.act" in why
    dit = our_dit()
    dit.blocks[1].conv.block[4] = torch.nn.SiLU()          # another activation in the conv block
    assert "conv.block.4" in supports_fused_body(dit)[1]
    dit = our_dit()
    dit.blocks[0].norm1 = torch.nn.LayerNorm(64)          # affine norm1: another layout
    assert not supports_fused_body(dit)[0]
    with pytest.raises(ValueError, match="not supported"):
        FusedDiT(dit)


@pytest.mark.parametrize("Lc,with_cnn", [(0, False), (7, True)])
def test_sdpa_fallback_matches_original(Lc, with_cnn):
    dit = our_dit()
    fused = FusedDiT(dit, attention="sdpa", use_triton=False)
    check(dit, fused, R=4, T=6, Lc=Lc, tol=1e-5, with_cnn=with_cnn)


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_triton_stages_match_original_tiny():
    dit = our_dit(seed=3)
    fused = FusedDiT(dit, attention="triton-ieee", use_triton=True)
    errs = check(dit, fused, R=2, T=5, Lc=6, tol=1e-5, seed=4)
    assert max(errs) > 0  # really a different computation path


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_few_row_gemm_and_split_attention_match_original_tiny():
    """The TF32-only fast stages (few-row Triton GEMMs, key-split attention). Under the CPU
    interpreter TF32 dots compute in FP32, so the IEEE tolerance applies; on CUDA it is TF32's."""
    from minicpmo_rt.code2wav.precision import matmul_tf32
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dit = our_dit(seed=5).to(dev)
    fused = FusedDiT(dit, attention="triton-tf32", use_triton=True, gemm="triton", attn_splits=2,
                     attn_block_m=16, block_kernel=False)     # the staged body (CUDA's default is the block kernel)
    calls = []
    import minicpmo_rt.code2wav.fused_dit as fd
    real = fd.small_gemm

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)
    fd.small_gemm = spy
    try:
        with matmul_tf32(True):
            check(dit, fused, R=2, T=5, Lc=20, tol=1e-5 if kernels.interpreting() else 2e-3, seed=6, device=dev)
        with matmul_tf32(False):     # TF32 off: back on torch GEMMs (the explicit triton-tf32 attention stays)
            n = len(calls)
            check(dit, fused, R=2, T=5, Lc=20, tol=1e-5 if kernels.interpreting() else 2e-3, seed=6, device=dev)
            assert len(calls) == n
    finally:
        fd.small_gemm = real
    assert len(calls) == 2 + 6 * len(dit.blocks)      # in/out projections + 6 per block
    with pytest.raises(ValueError, match="gemm"):
        FusedDiT(dit, gemm="cutlass")
    with pytest.raises(ValueError, match="attn_splits"):
        FusedDiT(dit, attn_splits=0)


def test_split_k_rule_for_the_full_size_gemms():
    """Up to 512 rows (batch 5 with CFG) every GEMM runs as 2 K-slice partials (>= 128 of K each);
    from batch 8 on (800 rows) nothing is split; gemm="cublas" never splits."""
    from minicpmo_rt.code2wav.fused_dit import split_k_for
    assert [split_k_for(100, n, k) for n, k in ((1536, 512), (512, 512), (512, 2048))] == [2, 2, 2]
    assert split_k_for(104, 1536, 512) == 2 and split_k_for(500, 512, 2048) == 2
    assert split_k_for(800, 512, 2048) == 1 and split_k_for(100, 512, 200) == 1
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE
    fused = FusedDiT(our_dit(FULL_SIZE.dit, seed=1))              # the default kind
    assert fused.gemm == "cublas-split"
    assert fused.gemm_splits(2, 50) == {"qkv": 2, "proj": 2, "conv": 2, "fc2": 2}
    assert set(fused.gemm_splits(32, 50).values()) == {1}
    assert set(FusedDiT(our_dit(FULL_SIZE.dit, seed=1), gemm="cublas").gemm_splits(2, 50).values()) == {1}
    assert FusedDiT(our_dit(seed=1), split_k=8).gemm_splits(2, 50)["fc2"] == 8
    with pytest.raises(ValueError, match="split_k"):
        FusedDiT(our_dit(seed=1), gemm="cublas-split", split_k=3)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch-stages", "triton-stages"])
def test_split_k_partials_match_original(use_triton):
    """gemm="cublas-split" with 2 partials per GEMM (forced: the tiny K is below the rule's
    minimum): the stages sum the partials and add the bias the split GEMM left out (fp32: 1e-5).
    The Triton stages run in Triton's interpreter on CPU."""
    if use_triton and not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    dit = our_dit(seed=9)
    fused = FusedDiT(dit, attention="triton-ieee" if use_triton else "sdpa", use_triton=use_triton,
                     gemm="cublas-split", split_k=2)
    assert set(fused.gemm_splits(2, 5).values()) == {2}
    errs = check(dit, fused, R=2, T=5, Lc=6, tol=1e-5, seed=10)
    assert max(errs) > 0


def test_attention_launch_shape_by_grid_fill():
    fused = FusedDiT(our_dit(seed=1))
    assert fused._attn_shape(2, 8, 50) == (16, 8, 2, False, 4)     # batch 1: 64 programs -> keys split 8 ways
    assert fused._attn_shape(8, 8, 50) == (16, 2, 2, False, 4)
    assert fused._attn_shape(32, 8, 50) == (32, 1, 2, False, 4)    # batch 16: the grid is full already
    # where TMA loads can run (Hopper, packed cache) a full grid takes them with 64-query blocks, 3 stages
    assert fused._attn_shape(32, 8, 50, tma_ok=True) == (64, 1, 3, True, 4)
    assert fused._attn_shape(8, 8, 50, tma_ok=True) == (16, 2, 2, False, 4)
    assert FusedDiT(our_dit(seed=1), attn_tma=False)._attn_shape(32, 8, 50, tma_ok=True) == (32, 1, 2, False, 4)
    assert FusedDiT(our_dit(seed=1), attn_tma=True)._attn_shape(8, 8, 50, tma_ok=True) == (16, 2, 3, True, 4)
    assert FusedDiT(our_dit(seed=1), attn_splits=3, attn_block_m=64)._attn_shape(2, 8, 50) == (64, 3, 2, False, 4)


def test_ieee_attention_takes_blocks_that_fit_in_registers():
    """IEEE dots keep their tiles in registers: a 64-query block spilled (IEEE solve at batch 16 on the
    H200: 515 ms against 121), so IEEE attention caps its query block at IEEE_BLOCK_M on IEEE_WARPS warps
    and loads through pointers, in both the staged and the direct attention; explicit settings are taken
    as given.
    (That the capped shapes compile without spills is checked by compile_gate.py.)"""
    from minicpmo_rt.code2wav.fused_dit import IEEE_BLOCK_M, IEEE_WARPS
    ieee = FusedDiT(our_dit(seed=1), attention="triton-ieee")
    assert ieee._attn_shape(32, 8, 50, tma_ok=True) == (IEEE_BLOCK_M, 1, 2, False, IEEE_WARPS)
    assert ieee._attn_shape(32, 8, 50) == (32, 1, 2, False, IEEE_WARPS)
    assert ieee._attn_shape(2, 8, 50) == (16, 8, 2, False, 4)       # small blocks keep 4 warps
    assert ieee._direct_shape(32, 8, 50, tma_ok=True) == (IEEE_BLOCK_M, 1, 3, False, IEEE_WARPS)
    tf32 = FusedDiT(our_dit(seed=1), attention="triton-tf32")
    assert tf32._direct_shape(32, 8, 50, tma_ok=True) == (64, 1, 3, False, 4)      # one key loop: pointer loads
    tf32.direct_one_loop = False
    assert tf32._direct_shape(32, 8, 50, tma_ok=True) == (64, 1, 3, True, 4)
    explicit = FusedDiT(our_dit(seed=1), attention="triton-ieee", attn_block_m=64, attn_tma=True)
    explicit.attn_warps, explicit.direct_tma = 4, True
    assert explicit._attn_shape(32, 8, 50, tma_ok=True) == (64, 1, 3, True, 4)
    assert explicit._direct_shape(32, 8, 50, tma_ok=True) == (64, 1, 3, True, 4)


def test_direct_attention_launch_shape_and_guard():
    """The direct path's launch shape (one query block per (row, head) up to 64 queries; keys split to
    ~256 programs), and ``blocks`` refusing per-stream caches where the direct
    attention cannot serve them (a mask, pooled rows, SDPA attention) instead of reading the wrong keys."""
    from minicpmo_rt.code2wav.kernels.tiled_attention import TABLE_WIDTH, StreamKV
    fused = FusedDiT(our_dit(seed=1))
    assert fused._direct_shape(8, 8, 50)[:3] == (64, 4, 3)          # batch 4: 64 rows x heads -> 4 key splits
    assert fused._direct_shape(16, 8, 50)[:3] == (64, 2, 3)         # batch 8: 128 rows x heads -> 2 key splits
    assert fused._direct_shape(32, 8, 50)[:3] == (64, 1, 3)         # batch 16: 256 programs unsplit
    assert fused._direct_shape(8, 8, 6)[:3] == (16, 4, 3)
    assert FusedDiT(our_dit(seed=1), attn_splits=3, attn_block_m=32)._direct_shape(8, 8, 50)[:3] == (32, 3, 3)
    R, T = 2, 5
    L = fused.L
    ws = fused.workspace(R, T, "cpu")
    ws.h.zero_()
    hist = fused.new_hist(R, T, "cpu")
    kv = torch.zeros(L.depth, R, L.heads, T, 2 * L.head_dim)
    table = torch.zeros(R, TABLE_WIDTH, dtype=torch.int64)
    streams = StreamKV(kv, table, table, 3, T + 3, (T + 3, T + 3))
    mod = fused.modulation(torch.full((R,), 0.3))
    mask = torch.ones(R, T, T + 3, dtype=torch.bool)
    for kw in (dict(mask=mask), dict(rows=torch.arange(R, dtype=torch.int32))):
        with pytest.raises(ValueError, match="per-stream caches"):
            fused.blocks(mod, hist, kv, kw.get("mask"), ws, kw.get("rows"), None, streams=streams)
    with pytest.raises(ValueError, match="per-stream caches"):
        FusedDiT(our_dit(seed=1), attention="sdpa").blocks(mod, hist, kv, None, ws, streams=streams)


def test_matches_upstream_original_dit_full_width():
    """Independent oracle: upstream's DiT at full width (512, 8x64), depth 2, batch 1 with CFG."""
    from upstream import import_upstream
    up = import_upstream("stepaudio2.cosyvoice2.flow.decoder_dit")
    dit = randomize(up.DiT(in_channels=320, out_channels=80, depth=2, num_heads=8, head_dim=64,
                           hidden_size=512), seed=5)
    assert supports_fused_body(dit)[0]
    fused = FusedDiT(dit, attention="sdpa", use_triton=False)
    g = torch.Generator().manual_seed(6)
    R, T, Lc = 2, 8, 12
    kw = dict(x=torch.randn(R, 80, T, generator=g), mu=torch.randn(R, 80, T, generator=g),
              t=torch.full((R,), 0.42), spks=torch.randn(R, 80, generator=g),
              cond=torch.randn(R, 80, T, generator=g), cnn_cache=torch.randn(2, R, 1024, 2, generator=g),
              att_cache=torch.randn(2, R, 8, Lc, 128, generator=g))
    with torch.no_grad():
        v, cnn, att = dit.forward_chunk(**kw)
        ref = [v, cnn[:2], att[:2]]      # upstream returns its depth-16 buffers
        got = fused.forward_chunk(**kw)
    for g_, r_ in zip(got, ref):
        assert g_.shape == r_.shape
        assert rel_err(g_, r_) <= 1e-5


@requires_cuda
@pytest.mark.parametrize("R,gemm", [(8, "cublas"), (2, "cublas"), (32, "cublas"), (2, "cublas-split"),
                                    (8, "cublas-split"), (32, "wide"), (16, "wide"), (32, "wide16"),
                                    (8, "wide16"), (32, "wide16-tiles"), (8, "wide16-tiles"),
                                    (32, "wide16-cublas-all")])
@pytest.mark.parametrize("tf32,tol", [(False, 1e-5), (True, 1e-3)])
def test_cuda_fused_vs_original_full_size(tf32, tol, R, gemm):
    """gemm "wide": the Triton tile GEMMs forced on (by default they run with TF32 from 768 rows, so
    R=32 "cublas" with TF32 takes them too); with TF32 off they compute IEEE dots. "wide16": FP16
    operands (``gemm_operands="fp16"``, tile GEMMs from any staged row count under TF32, but for the roles that
    run as cuBLAS FP16 GEMMs, ``CUBLAS16_ROLES``); "wide16-tiles": the same with every GEMM a tile GEMM
    (``FusedDiT.cublas16`` empty); "wide16-cublas-all": every GEMM role on cuBLAS (``CUBLAS16_ALL``)."""
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE
    from minicpmo_rt.code2wav.fused_dit import CUBLAS16_ALL
    from minicpmo_rt.code2wav.precision import matmul_tf32
    dit = our_dit(FULL_SIZE.dit, seed=7).cuda()
    kind = dict(gemm="cublas-split", wide_gemm=True) if gemm == "wide" else dict(gemm=gemm)
    if gemm.startswith("wide16"):   # FP16 operands under TF32; with TF32 off the workspace keeps FP32 ones (IEEE dots)
        kind = dict(gemm="cublas-split", gemm_operands="fp16")
    fused = FusedDiT(dit, attention="triton-tf32" if tf32 else "triton-ieee", **kind)
    if gemm == "wide16-tiles":
        fused.cublas16 = frozenset()
    if gemm == "wide16-cublas-all":
        fused.cublas16 = CUBLAS16_ALL
    kw = inputs(R, 50, 400, 16, 512, 8, 64, seed=8, device="cuda")
    with matmul_tf32(False), ieee_cudnn():   # the reference is always IEEE (its Conv1d runs in cuDNN)
        ref = dit.forward_chunk(**kw)
    with matmul_tf32(tf32):
        got = fused.forward_chunk(**kw)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    print(f"fused vs original (tf32={tf32}, R={R}, gemm={gemm}): velocity {errs[0]:.2e}, cnn cache {errs[1]:.2e}, att cache {errs[2]:.2e}")
    assert max(errs) <= tol


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("R,T,Lc,nprog,one_launch,last", [(2, 5, 6, None, False, True),
                                                          (4, 17, 40, None, False, True),
                                                          (4, 17, 150, 64, False, False),
                                                          (4, 17, 150, 64, False, True),
                                                          (2, 5, 70, 1, True, True), (2, 17, 150, 1, True, True)])
def test_block_kernel_matches_original_tiny(R, T, Lc, nprog, one_launch, last, monkeypatch):
    """The persistent block kernel (kernels/dit_block.py): on CPU it runs in Triton's interpreter one
    phase per launch (the barrier is the launch boundary), its TF32 dots computed in FP32, so the
    IEEE tolerance applies; T=17 leaves partial query blocks, and 64 programs over 167 keys split
    them 3 ways (ragged last split) so the partials are combined: by the last split of each query
    block (``last``, ``dit_block.LAST_COMBINE``) or in a combine phase of their own.
    ``one_launch``: the GPU form itself (every block and phase in one launch behind the grid barriers),
    which the interpreter can run with a single program (its barriers then pass on its own arrivals);
    at T=17 its keys are split 3 ways too (forced: one program would not split them)."""
    from minicpmo_rt.code2wav.kernels import dit_block
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(dit_block, "LAST_COMBINE", last)
    if nprog is not None:
        monkeypatch.setattr(dit_block, "programs", lambda device: nprog)
    split3 = nprog == 64 or T == 17 and nprog == 1
    if nprog == 1 and split3:
        monkeypatch.setattr(dit_block, "_wanted_splits", lambda *a: 3)
    dit = our_dit(seed=11).to(dev)
    fused = FusedDiT(dit, attention="triton-tf32", use_triton=True, block_kernel=True)
    assert fused.uses_block_kernel(R, T, dev)
    sp = fused.gemm_splits(R, T, dev)
    want = {"qkv": 2, "proj": 2, "conv": 2, "fc2": 4}               # tiny K limits the splits
    if dit_block.wave_programs(torch.device(dev)) is None:
        assert sp == want
    else:       # CUDA: FILL_WAVE may halve them further to fit the launch's programs (1 here)
        assert all(1 <= sp[k] <= want[k] for k in want)
    calls = []
    real = dit_block.dit_blocks

    def spy(**kw):
        calls.append((kw["attn_splits"], kw["first"], kw["n_blocks"]))
        # a profiling buffer must hold every stamp: 13 per block (12 without a combine phase)
        stamps = (13 - (kw["attn_splits"] == 1 or last)) * kw["n_blocks"] + 1
        with pytest.raises(ValueError, match=f"write {stamps}$"):
            real(**kw, times=torch.zeros(stamps - 1, dtype=torch.int64))
        with pytest.raises(ValueError, match=f"write {stamps * 2 * kw['nprog']}$"):
            real(**kw, times=torch.zeros(stamps, dtype=torch.int64), per_program=True)
        k = real(**kw, phase_by_phase=False) if one_launch else real(**kw)
        assert int(kw["tile_ctr"].abs().sum()) == 0            # the split counters are left zero
        return k
    monkeypatch.setattr(dit_block, "dit_blocks", spy)
    errs = check(dit, fused, R=R, T=T, Lc=Lc, tol=1e-5 if kernels.interpreting() else 2e-3, seed=12, device=dev)
    assert calls == [(3 if split3 else 1, 0, len(dit.blocks))] and max(errs) > 0   # every block at once
    assert not fused.uses_block_kernel(32, 50, dev)             # many rows: the staged body
    auto = FusedDiT(dit, attention="triton-tf32", use_triton=True)   # default: CUDA (+ TF32) only
    assert auto.uses_block_kernel(R, T, "cuda") and not auto.uses_block_kernel(R, T, "cpu")
    assert not FusedDiT(dit, attention="triton-ieee", use_triton=True).uses_block_kernel(R, T, "cuda")


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("R,T,Lc,qkv_ln", [(4, 6, 7, True), (2, 17, 40, True), (4, 6, 7, False)])
def test_wide_gemm_body_matches_original_tiny(R, T, Lc, qkv_ln, monkeypatch):
    """The staged body with Triton tile GEMMs (``wide_gemm=True``): the q/k head LNs in the QKV GEMM's
    epilogue (or, past ``wide_qkv_ln_max_rows``, the QKV GEMM and the LN stage), conv taps summed
    inside the GEMM, fc1's GELU in its epilogue, fc2 on torch. Under the interpreter TF32 dots compute
    in FP32 (and nothing is rounded: ``dit_block.rounds``), so the IEEE tolerance applies."""
    import minicpmo_rt.code2wav.fused_dit as fd
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dit = our_dit(seed=21).to(dev)
    fused = FusedDiT(dit, attention="triton-tf32", use_triton=True, block_kernel=False, wide_gemm=True)
    if not qkv_ln:
        fused.wide_qkv_ln_max_rows = R * T - 1
    assert fused.uses_wide(R, T, dev)
    ws = fused.workspace(R, T, dev)
    assert ws.wide and ws.taps.shape == (1, R, T + 2, 64)       # C wide: the taps are summed in the GEMM
    calls = []
    real, real_qkv = fd._wide_gemm, fd._wide_qkv

    def spy(x, w, b, out, **kw):
        calls.append((kw.get("taps", 1), kw.get("gelu", False)))
        return real(x, w, b, out, **kw)

    def spy_qkv(*a, **kw):
        calls.append("qkv")
        return real_qkv(*a, **kw)
    monkeypatch.setattr(fd, "_wide_gemm", spy)
    monkeypatch.setattr(fd, "_wide_qkv", spy_qkv)
    errs = check(dit, fused, R=R, T=T, Lc=Lc, tol=1e-5 if kernels.interpreting() else 2e-3, seed=22, device=dev)
    assert max(errs) > 0
    qkv = "qkv" if qkv_ln else (1, False)
    per_block = [qkv, (1, False), (3, False), (3, False), (1, True)]    # qkv (+ head LNs), proj, conv1, conv2, fc1
    assert calls == per_block * len(dit.blocks)
    # the rule: explicit off, the block kernel's rows, and auto (CUDA SM80+, TF32, >= WIDE_MIN_ROWS rows)
    assert not FusedDiT(dit, use_triton=True, wide_gemm=False).uses_wide(R, T, dev)
    assert not FusedDiT(dit, attention="triton-tf32", use_triton=True, block_kernel=True,
                        wide_gemm=True).uses_wide(R, T, dev)
    assert not FusedDiT(dit, use_triton=True).uses_wide(32, 50, "cpu")          # auto: CUDA only


def test_cublas16_roles_only_on_cuda_and_overridable():
    """The staged FP16-operand body's out-proj, convs, fc1 and fc2 run as cuBLAS FP16 GEMMs on CUDA only:
    ``torch.mm(out_dtype=)`` exists only there, so CPU (the interpreter's tests) keeps the tile GEMMs."""
    from minicpmo_rt.code2wav.fused_dit import CUBLAS16_ROLES
    fused = FusedDiT(our_dit(), use_triton=False, gemm_operands="fp16")
    assert fused.cublas16_roles("cpu") == frozenset()
    assert fused.cublas16_roles("cuda") == CUBLAS16_ROLES == {"proj", "conv", "fc1", "fc2"}
    fused.cublas16 = frozenset({"fc2"})
    assert fused.cublas16_roles("cuda") == {"fc2"} and fused.cublas16_roles("cpu") == {"fc2"}


@requires_cuda
@pytest.mark.parametrize("R,roles", [(8, None), (32, None), (32, "proj fc2"), (32, "qkv proj fc2"),
                                     (32, "proj conv fc2"), (8, "proj conv fc2"), (32, "proj fc1 fc2"),
                                     (32, "qkv proj conv fc1 fc2")])
def test_cuda_cublas16_matches_tile_gemms(R, roles):
    """GEMM roles as cuBLAS FP16 GEMMs with FP32 outputs (None: the default with FP16 operands on CUDA,
    ``CUBLAS16_ROLES``) against the tile GEMMs. The GEMMs themselves came out bit-identical at every role's shape
    on the H100 (the same FP16 products, K summed in the same order), and with only the out-proj and fc2 moved
    so did the whole body: FP32 tolerance. The other roles move work out of the GEMMs' epilogues: the QKV's head
    LNs into a row stage, the convs' tap sums into the row stages after them (three rounded FP32 partial sums
    instead of one accumulator), fc1's bias into cuBLASLt's GELU epilogue in FP16. Those FP32 roundings differ,
    and where one tips an FP16 operand's rounding the difference becomes an FP16 (TF32) ulp: on the H100 one
    block's velocity differed by 4e-5 (qkv), 6e-5 (conv), 1e-4 (fc1), sixteen blocks' by 3.3e-4 to 3.4e-4 (the
    random full-size DiT carries such differences through its blocks). So the TF32 tolerance there."""
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE
    from minicpmo_rt.code2wav.fused_dit import CUBLAS16_ROLES
    from minicpmo_rt.code2wav.precision import matmul_tf32
    dit = our_dit(FULL_SIZE.dit, seed=7).cuda()
    kw = inputs(R, 50, 400, 16, 512, 8, 64, seed=8, device="cuda")
    outs = []
    for chosen in (None if roles is None else frozenset(roles.split()), frozenset()):
        fused = FusedDiT(dit, attention="triton-tf32", gemm="cublas-split", gemm_operands="fp16")
        fused.cublas16 = chosen
        with matmul_tf32(True):
            outs.append(fused.forward_chunk(**kw))
    errs = [rel_err(a, b) for a, b in zip(*outs)]
    print(f"cuBLAS FP16 roles {roles or 'default'} vs tile GEMMs, R={R}: {errs}")
    moved = CUBLAS16_ROLES if roles is None else set(roles.split())
    assert max(errs) <= (1e-3 if moved - {"proj", "fc2"} else 1e-5)


@pytest.mark.skipif(not (kernels.AVAILABLE and kernels.interpreting()), reason="needs Triton's interpreter")
def test_cublas16_roles_checked_and_conv_role_keeps_taps_products():
    """An unknown role is refused by name; the "conv" role makes the staged workspace hold cuBLAS's taps
    products (K*C wide, summed by the row stages) instead of a tile GEMM's summed conv (C wide), and a
    workspace made before the roles changed is refused rather than read with the wrong tap count."""
    import types
    fused = FusedDiT(our_dit(seed=3), attention="triton-tf32", use_triton=True, block_kernel=False, wide_gemm=True,
                     gemm_operands="fp16")
    L = fused.L
    old = fused.workspace(4, 6, "cpu")
    assert old.wide and old.taps.shape[-1] == L.hidden and old.norm.dtype == torch.float16
    fused.cublas16 = frozenset({"conv"})
    ws = fused.workspace(4, 6, "cpu")
    assert ws.taps.shape[-1] == L.taps * L.hidden
    with pytest.raises(ValueError, match="make the workspace after setting FusedDiT.cublas16"):
        fused.blocks(types.SimpleNamespace(blocks=None), None, None, None, old)
    fused.cublas16 = frozenset({"fc3"})
    with pytest.raises(ValueError, match=r"unknown GEMM roles \['fc3'\]"):
        fused.cublas16_roles("cuda")


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_fp16_operand_body_matches_original_tiny(monkeypatch):
    """``gemm_operands="fp16"``: the tile GEMMs read FP16 operands (LN outputs, conv histories, the
    attention output, fc1's output; FP16 weights) and fc2 becomes a tile GEMM too. The FP16 rounding
    of every operand is TF32's (10 mantissa bits, unit roundoff 4.9e-4), so the TF32 tolerance 1e-3
    applies, against the original body and against the same body with FP32 operands; the residual
    stream, q, the attention cache and the CNN cache handed out stay FP32. (On CUDA under TF32, which
    FP16 operands need.)"""
    import minicpmo_rt.code2wav.fused_dit as fd
    from minicpmo_rt.code2wav.precision import matmul_tf32
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    R, T, Lc = 4, 6, 7
    dit = our_dit(seed=31).to(dev)
    fused = FusedDiT(dit, attention="triton-tf32", use_triton=True, block_kernel=False, wide_gemm=True,
                     gemm_operands="fp16")
    fp32 = FusedDiT(dit, attention="triton-tf32", use_triton=True, block_kernel=False, wide_gemm=True)
    dtypes = []
    real = fd._wide_gemm

    def spy(x, w, b, out, **kw):
        dtypes.append((x.dtype, w.dtype, kw.get("taps", 1), kw.get("gelu", False)))
        return real(x, w, b, out, **kw)
    monkeypatch.setattr(fd, "_wide_gemm", spy)
    kw = inputs(R, T, Lc, 2, 64, 2, 32, seed=32, device=dev)
    with matmul_tf32(True):
        assert fused.operand_dtype(R, T, dev) == torch.float16 and fp32.operand_dtype(R, T, dev) == torch.float32
        ws = fused.workspace(R, T, dev)
        assert (ws.norm.dtype, ws.o.dtype, ws.mlp.dtype) == (torch.float16,) * 3
        assert (ws.h.dtype, ws.q.dtype) == (torch.float32,) * 2
        assert fused.new_hist(R, T, dev).dtype == torch.float16
        got = fused.forward_chunk(**kw)
        f16 = torch.float16
        assert dtypes == [(f16, f16, 1, False), (f16, f16, 3, False), (f16, f16, 3, False), (f16, f16, 1, True),
                          (f16, f16, 1, False)] * len(dit.blocks)    # proj, conv1, conv2, fc1, fc2 (qkv: wide_qkv)
        mid = fp32.forward_chunk(**kw)
        hist = fused.new_hist(R, T, dev)
    if dev == "cuda":   # FP16 operands made under TF32 refuse to run once TF32 is off (IEEE dots asked)
        kv = torch.zeros(2, R, 2, T + Lc, 64, device=dev)
        with matmul_tf32(False), pytest.raises(RuntimeError, match="TF32 matmuls are off"):
            fused.blocks(fused.modulation(kw["t"]), hist, kv, None, ws)
    assert all(t.dtype == torch.float32 for t in got)
    with torch.inference_mode(), matmul_tf32(False), ieee_cudnn():
        ref = dit.forward_chunk(**kw)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    print(f"fp16 operands vs original: {errs}")
    assert 1e-6 < max(errs) <= 1e-3, errs                         # rounded, and only as much as TF32
    assert max(rel_err(g, r) for g, r in zip(got, mid)) <= 1e-3
    with pytest.raises(ValueError, match="gemm_operands"):
        FusedDiT(dit, gemm_operands="bf16")
    # FP16 operands only where Triton GEMMs run (tile GEMMs or the block kernel), not with cuBLAS
    with matmul_tf32(True):
        plain = FusedDiT(dit, use_triton=True, wide_gemm=False, block_kernel=False, gemm_operands="fp16")
        assert plain.operand_dtype(R, T, dev) == torch.float32


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_fp16_operand_block_kernel_matches_original_tiny(monkeypatch):
    """The persistent block kernel with FP16 operands (LN outputs, conv histories, attention output,
    fc1's GELU output and the stacked GEMM weights), a key split so the combine phase writes the FP16
    attention output too. TF32's tolerance, as for the staged body."""
    from minicpmo_rt.code2wav.precision import matmul_tf32
    from minicpmo_rt.code2wav.kernels import dit_block
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    R, T, Lc = 2, 5, 150
    monkeypatch.setattr(dit_block, "programs", lambda device: 64)     # 64 programs: the keys split 3 ways
    assert dit_block.attention_splits(R, 2, T, T + Lc, 64)[0] > 1
    dit = our_dit(seed=33).to(dev)
    fused = FusedDiT(dit, attention="triton-tf32", use_triton=True, block_kernel=True, gemm_operands="fp16")
    kw = inputs(R, T, Lc, 2, 64, 2, 32, seed=34, device=dev)
    with matmul_tf32(True):
        assert fused.uses_block_kernel(R, T, dev) and fused.operand_dtype(R, T, dev) == torch.float16
        ws = fused.workspace(R, T, dev)
        assert ws.ctr is not None and ws.mlp.dtype == torch.float16 and ws.attn_acc.dtype == torch.float32
        got = fused.forward_chunk(**kw)
    with torch.inference_mode(), ieee_cudnn():
        ref = dit.forward_chunk(**kw)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    assert 1e-6 < max(errs) <= 1e-3, errs


def test_stacked_weights_are_copies_and_rounded_copies_leave_the_module_alone():
    from minicpmo_rt.code2wav.kernels import dit_block
    dit = our_dit(seed=13)
    before = {k: v.clone() for k, v in dit.state_dict().items()}
    fused = FusedDiT(dit, attention="triton-tf32", use_triton=False, block_kernel=False)
    plain, rounded = fused.stacked_weights(False), fused.stacked_weights(True)
    assert fused.stacked_weights(True) is rounded                      # built once
    assert all(torch.equal(v, dit.state_dict()[k]) for k, v in before.items())
    assert torch.equal(plain.w_fc1[1], dit.blocks[1].mlp.fc1.weight)
    assert torch.equal(plain.w_qkv[0], fused.w_qkv[0]) and plain.w_taps2.shape[0] == len(dit.blocks)
    assert torch.equal(rounded.w_fc1, dit_block.round_tf32_(plain.w_fc1.clone()))
    half = fused.stacked_weights(False, torch.float16)
    assert fused.stacked_weights(False, torch.float16) is half and half.w_fc2.dtype == torch.float16
    assert torch.equal(half.w_qkv, plain.w_qkv.half()) and half.qn_w is plain.qn_w     # norms shared, FP32
    assert not torch.equal(rounded.w_fc1, plain.w_fc1) and torch.equal(rounded.b_fc1, plain.b_fc1)


def test_block_kernel_shape_rules():
    from minicpmo_rt.code2wav.kernels import dit_block
    assert dit_block.gemm_splits(512, "qkv") == 4 and dit_block.gemm_splits(2048, "fc2") == 8
    assert dit_block.gemm_splits(64, "qkv") == 2 and dit_block.gemm_splits(96, "fc2") == 1
    assert dit_block.supported(512, 8, 64, 2048) == (True, "")
    assert "hidden" in dit_block.supported(48, 2, 32, 192)[1]
    assert dit_block.attention_splits(2, 8, 50, 450, 132) == (2, 256)   # 64 units -> 2 key splits
    # the direct phase's splits start on key tiles of their source: split 0 walks 50 current + 192 old keys
    assert dit_block.direct_attention_splits(2, 8, 50, 400, 132) == (2, 256, 64)
    assert dit_block.attention_splits(8, 8, 50, 450, 132)[0] == 1
    assert dit_block.tile("fc1", 512) == (64, 32, 1, 32) and dit_block.tile("fc2", 96)[2:] == (1, 32)
    # on CUDA the splits are halved until a phase's units fit the programs in one wave (FILL_WAVE): at
    # batch 1 (100 rows) the tiles already give <= 128 units on 132 SMs, at batch 2 (200 rows) 192-256
    shapes = {R: dit_block.gemm_shapes(R, 50, 512, 8, 64, 2048, 3) for R in (2, 4)}
    splits = {R: {r: dit_block.gemm_splits(K, r, M, N, 132) for r, (M, N, K) in sh.items()} for R, sh in shapes.items()}
    assert splits[2] == {"qkv": 4, "proj": 4, "conv": 4, "fc1": 1, "fc2": 8}
    assert splits[4] == {"qkv": 2, "proj": 2, "conv": 2, "fc1": 1, "fc2": 4}
    assert dit_block.tile("fc2", 2048, 2, 200, 512, 132) == (64, 64, 4, 128)       # FP16 K steps still double
    # fc1 (no splits to halve) takes 128-row tiles at batch 2 (FILL_WAVE_ROWS), keeps 64 at batch 1
    assert dit_block.tile("fc1", 512, 1, 200, 2048, 132) == (128, 32, 1, 32)
    assert dit_block.tile("fc1", 512, 1, 100, 2048, 132) == (64, 32, 1, 32)
    assert dit_block.tile("fc1", 512, 1, 200, 2048, None) == (64, 32, 1, 32)
    assert dit_block.gemm_splits(2048, "fc2", 200, 512, None) == 8                  # no programs given: as tiled
    assert dit_block.wave_programs("cpu") is None
    cfg = DiTConfig(in_channels=320, out_channels=80, mlp_ratio=3.0, depth=1, num_heads=2, head_dim=32,
                    hidden_size=48)
    with pytest.raises(ValueError, match="block_kernel"):
        FusedDiT(our_dit(cfg), block_kernel=True)


@requires_cuda
@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("tf32,tol", [(False, 1e-5), (True, 1e-3)])
def test_cuda_block_kernel_vs_original_full_size(tf32, tol, R):
    """The persistent kernel at full size, batch 1 with CFG (100 rows; key splits combined by their last
    split) and batch 2 (200 rows; each GEMM phase's K splits halved to fit one wave, ``FILL_WAVE``), cache
    400: vs the original body in IEEE, and the one-launch (barrier) form vs one launch per block and per
    phase (same arithmetic)."""
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE
    from minicpmo_rt.code2wav.kernels import dit_block
    from minicpmo_rt.code2wav.precision import matmul_tf32
    dit = our_dit(FULL_SIZE.dit, seed=7).cuda()
    fused = FusedDiT(dit, attention="triton-tf32" if tf32 else "triton-ieee", block_kernel=True)
    assert fused.uses_block_kernel(R, 50, "cuda")
    if R == 4 and dit_block.programs(torch.device("cuda")) <= 132:
        assert fused.gemm_splits(R, 50, "cuda") == {"qkv": 2, "proj": 2, "conv": 2, "fc2": 4}
    kw = inputs(R, 50, 400, 16, 512, 8, 64, seed=8, device="cuda")
    with matmul_tf32(False), ieee_cudnn():
        ref = dit.forward_chunk(**kw)
    with matmul_tf32(tf32):
        got = fused.forward_chunk(**kw)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    print(f"block kernel vs original (tf32={tf32}, R={R}): velocity {errs[0]:.2e}, cnn cache {errs[1]:.2e}, "
          f"att cache {errs[2]:.2e}")
    assert max(errs) <= tol
    real = dit_block.dit_blocks
    try:
        dit_block.dit_blocks = lambda **k: real(**k, phase_by_phase=True)
        with matmul_tf32(tf32):
            staged = fused.forward_chunk(**kw)
        dit_block.dit_blocks = real
        dit_block.BLOCKS_PER_LAUNCH = 1
        with matmul_tf32(tf32):
            per_block = fused.forward_chunk(**kw)
    finally:
        dit_block.dit_blocks = real
        dit_block.BLOCKS_PER_LAUNCH = None
    assert max(rel_err(g, s) for g, s in zip(got, per_block)) == 0.0     # 16 launches vs one: same arithmetic
    errs = [rel_err(g, s) for g, s in zip(got, staged)]
    print(f"block kernel one launch vs per phase: {max(errs):.2e}")
    assert max(errs) == 0.0     # the same tiles in the same order: a barrier letting a stale read through shows


if kernels.AVAILABLE:
    import triton
    import triton.language as tl

    from minicpmo_rt.code2wav.kernels.dit_ops import round_tf32

    @triton.jit
    def _round_kernel(X, Y, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(Y + o, round_tf32(tl.load(X + o, mask=o < n), True), mask=o < n)


@pytest.mark.skipif(not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_round_tf32_is_round_to_nearest_ties_away():
    """The block kernel's operand rounding (Triton, in-kernel) and the weights' (torch) agree and
    round to nearest with ties away from zero at TF32's 10-bit mantissa."""
    from minicpmo_rt.code2wav.kernels import dit_block

    ulp = 2.0 ** -10
    x = torch.tensor([1 + ulp / 2, 1 + ulp / 2 - 2.0 ** -23, -(1 + ulp / 2), 3 * ulp, 1.0, 0.0, -2.5 + 0.3 * ulp])
    want = torch.tensor([1 + ulp, 1.0, -(1 + ulp), 3 * ulp, 1.0, 0.0, -2.5])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = torch.empty_like(x, device=dev)
    _round_kernel[(1,)](x.to(dev), got, x.numel(), BLOCK=8)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(dit_block.round_tf32_(x.clone()), want)
    r = torch.randn(10000)
    q = dit_block.round_tf32_(r.clone())
    assert ((q - r).abs() <= r.abs() * 2.0 ** -11 + 1e-30).all() and (q.view(torch.int32) & 0x1FFF).eq(0).all()


def test_block_kernel_k_steps_double_for_fp16_weights_and_keep_the_splits():
    """With FP16 weights the block kernel's K steps take twice the elements (FP32's bytes per step)
    wherever each K slice stays a whole number of steps; the split counts, which size the workspace's
    partial buffers, never change."""
    from minicpmo_rt.code2wav.kernels.dit_block import tile
    for role, K in (("qkv", 512), ("proj", 512), ("conv", 512), ("fc1", 512), ("fc2", 2048), ("qkv", 64), ("fc2", 256)):
        bm, bn, s, bk = tile(role, K)
        bm2, bn2, s2, bk2 = tile(role, K, 2)
        assert (bm2, bn2, s2) == (bm, bn, s) and (K // s) % bk2 == 0
        assert bk2 == (2 * bk if (K // s) % (2 * bk) == 0 else bk)
    assert tile("fc2", 2048, 2) == (64, 64, 8, 128) and tile("qkv", 512, 2) == (128, 64, 4, 64)


def test_forward_chunk_keeps_a_non_fp32_input_dtype():
    """An FP64 chunk through the torch formulation: the conv histories follow the input's dtype like
    the workspace (FP16 operands are only ever chosen for FP32 inputs), so it matches the original."""
    dit = our_dit(seed=35).double()
    fused = FusedDiT(dit, use_triton=False, gemm_operands="fp16")
    kw = {k: v.double() if torch.is_tensor(v) else v for k, v in inputs(2, 5, 6, 2, 64, 2, 32, seed=36).items()}
    got = fused.forward_chunk(**kw)
    with torch.inference_mode():
        ref = dit.forward_chunk(**kw)
    assert all(g.dtype == torch.float64 for g in got)
    assert max(rel_err(g, r) for g, r in zip(got, ref)) <= 1e-12
