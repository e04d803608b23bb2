"""Slot pooling + row-offset merging vs separate per-stream reference solves (with the dense trim)."""


import pytest
import torch

from minicpmo_rt.code2wav.euler_graph import GraphConfig
from minicpmo_rt.code2wav.flow import trim_estimator_att
from minicpmo_rt.code2wav.slot_pool import SlotPool, SlotSolver

from conftest import ieee_cudnn, rel_err, requires_cuda
from test_euler_graph import S, tiny_cfm


def test_pooled_merged_solves_match_separate_solves():
    cfm = tiny_cfm(seed=6)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), query_buckets=(4,))
    prompt, keep, T = 6, 4, 4
    base = SlotSolver(cfm, pool=None, attention="sdpa", n_timesteps=S, config=cfg, use_triton=False)
    pool = SlotPool(base, slots=3, frames=prompt + keep + 4 + T, keep=keep, device="cpu")
    base.pool = pool
    g = torch.Generator().manual_seed(1)
    # three streams whose caches differ in length (6, 9 and 10 frames): one merged replay per chunk
    lengths = [6, 9, 10]
    dense = [(torch.randn(S, 2, 2, 128, 2, generator=g), torch.randn(S, 2, 2, 2, L, 64, generator=g))
             for L in lengths]
    handles = [pool.admit(c, a, prompt) for c, a in dense]
    for chunk in range(3):
        B = 3
        mu, spk, cond = torch.randn(B, 80, T, generator=g), torch.randn(B, 80, generator=g), torch.randn(B, 80, T, generator=g)
        mel = base.solve_slots(handles, mu, spk, cond)
        for i, h in enumerate(handles):
            with torch.inference_mode():
                ref, rc, ra = cfm.forward_chunk(mu[i:i + 1], spk[i:i + 1], cond[i:i + 1], n_timesteps=S,
                                                cnn_cache=dense[i][0], att_cache=dense[i][1])
            ra = trim_estimator_att(ra, prompt, keep)
            dense[i] = (rc, ra)
            got_cnn, got_att = h.dense()
            assert rel_err(mel[i:i + 1], ref) <= 1e-5
            assert got_att.shape == ra.shape and rel_err(got_att, ra) <= 1e-5
            assert rel_err(got_cnn, rc) <= 1e-5
    assert [h.length for h in handles] == [prompt + keep] * 3
    handles[1].release()
    assert pool.admit(None, None, prompt).slot == 1



def test_padded_rows_narrow_chunk_and_frame_list_restore():
    """Batch 2 in a bucket of 4 (scratch rows), width 3 in a bucket of 4; restoring the frame lists
    (and the CNN caches) replays the same chunk exactly, as the benchmark's merged row does."""
    cfm = tiny_cfm(seed=9)
    prompt, keep, T = 4, 3, 3
    solver = SlotSolver(cfm, pool=None, attention="sdpa", n_timesteps=S, use_triton=False,
                        config=GraphConfig(batch_buckets=(4,), query_buckets=(4,)))
    solver.pool = pool = SlotPool(solver, slots=2, frames=prompt + keep + 4, keep=keep, device="cpu")
    g = torch.Generator().manual_seed(4)
    dense = [(torch.randn(S, 2, 2, 128, 2, generator=g), torch.randn(S, 2, 2, 2, L, 64, generator=g)) for L in (5, 7)]
    handles = [pool.admit(c, a, prompt) for c, a in dense]
    saved, cnn = [list(h.frames) for h in handles], pool.cnn.clone()
    mu, spk, cond = torch.randn(2, 80, T, generator=g), torch.randn(2, 80, generator=g), torch.randn(2, 80, T, generator=g)
    mel = solver.solve_slots(handles, mu, spk, cond, temperature=0.8)
    after = [h.dense() for h in handles]
    for i, h in enumerate(handles):
        with torch.inference_mode():
            ref, rc, ra = cfm.forward_chunk(mu[i:i + 1], spk[i:i + 1], cond[i:i + 1], n_timesteps=S, temperature=0.8,
                                            cnn_cache=dense[i][0], att_cache=dense[i][1])
        assert rel_err(mel[i:i + 1], ref) <= 1e-5
        assert rel_err(after[i][1], trim_estimator_att(ra, prompt, keep)) <= 1e-5
        assert rel_err(after[i][0], rc) <= 1e-5
    for h, f in zip(handles, saved):
        h.frames = list(f)
    pool.cnn.copy_(cnn)
    again = solver.solve_slots(handles, mu, spk, cond, temperature=0.8)
    assert torch.equal(again, mel)
    for h, (c, a) in zip(handles, after):
        c2, a2 = h.dense()
        assert torch.equal(c2, c) and torch.equal(a2, a)

PROMPT, KEEP, T_TINY = 3, 2, 4


def two_pooled_streams(solver, seed: int, device="cpu"):
    """Two tiny streams with caches of 3 and 5 frames admitted to a 2-slot pool of ``solver`` (set as
    its pool), and one chunk's inputs: (handles, dense caches, mu, spk, cond)."""
    solver.pool = pool = SlotPool(solver, slots=2, frames=12, keep=KEEP, device=device)
    g = torch.Generator().manual_seed(seed)
    dense = [(torch.randn(S, 2, 2, 128, 2, generator=g).to(device),
              torch.randn(S, 2, 2, 2, L, 64, generator=g).to(device)) for L in (3, 5)]
    handles = [pool.admit(c, a, PROMPT) for c, a in dense]
    mu, spk, cond = (torch.randn(2, 80, T_TINY, generator=g).to(device), torch.randn(2, 80, generator=g).to(device),
                     torch.randn(2, 80, T_TINY, generator=g).to(device))
    return handles, dense, mu, spk, cond


def stream_reference(cfm, dense, mu, spk, cond, i):
    """Stream i alone through the original solve (IEEE cuDNN, TF32 off): (mel, its trimmed att cache)."""
    from minicpmo_rt.code2wav.precision import matmul_tf32
    with torch.inference_mode(), ieee_cudnn(), matmul_tf32(False):
        ref, _, ra = cfm.forward_chunk(mu[i:i + 1], spk[i:i + 1], cond[i:i + 1], n_timesteps=S,
                                       cnn_cache=dense[i][0], att_cache=dense[i][1])
    return ref, trim_estimator_att(ra, PROMPT, KEEP)


@pytest.mark.parametrize("split_k,wide", [(1, False), (2, False), (1, True)], ids=["unsplit", "split-k-2", "wide"])
def test_triton_pooled_writes_and_reads_match_reference(split_k, wide):
    """The QKV kernel's (row, frame) scatter and the attention's kv_rows under Triton (or the
    interpreter); also with the GEMMs as 2 K-slice partials summed by the Triton stages, and as
    Triton tile GEMMs (``wide_gemm``)."""
    from minicpmo_rt.code2wav import kernels
    if not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    if wide and not kernels.interpreting():
        pytest.skip("tile GEMMs over CPU tensors need the interpreter "
                    "(CUDA: test_cuda_slot_graph_matches_separate_solves)")
    cfm = tiny_cfm(seed=7)
    solver = SlotSolver(cfm, pool=None, attention="triton-ieee", n_timesteps=S, use_triton=True,
                        config=GraphConfig(batch_buckets=(2,), query_buckets=(4,)), split_k=split_k,
                        wide_gemm=wide)
    assert set(solver.fused.gemm_splits(4, T_TINY).values()) == {split_k}
    handles, dense, mu, spk, cond = two_pooled_streams(solver, seed=2)
    mel = solver.solve_slots(handles, mu, spk, cond)
    assert next(iter(solver._statics.values())).ws.wide == wide
    for i, h in enumerate(handles):
        ref, ra = stream_reference(cfm, dense, mu, spk, cond, i)
        assert rel_err(mel[i:i + 1], ref) <= 1e-5
        assert rel_err(h.dense()[1], ra) <= 1e-5


def test_block_kernel_over_pooled_caches_matches_reference():
    """The persistent block kernel over pooled caches (row merging: two streams of different cache
    lengths in one solve): its [k|v] scatter to (rows, pos) and its attention through pool rows.
    CPU: the interpreter, one phase per launch; CUDA: one launch, IEEE dots (TF32 off)."""
    from minicpmo_rt.code2wav import kernels
    if not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=9).to(dev)
    solver = SlotSolver(cfm, pool=None, attention="triton-ieee", n_timesteps=S, use_triton=True, block_kernel=True,
                        config=GraphConfig(batch_buckets=(2,), query_buckets=(4,)))
    handles, dense, mu, spk, cond = two_pooled_streams(solver, seed=4, device=dev)
    mel = solver.solve_slots(handles, mu, spk, cond, graph=False)
    st = next(iter(solver._statics.values()))
    assert st.ws.ctr is not None and solver.fused.runs_persistent(st.ws)     # the block kernel ran
    for i, h in enumerate(handles):
        ref, ra = stream_reference(cfm, dense, mu, spk, cond, i)
        assert rel_err(mel[i:i + 1], ref) <= 1e-5
        assert rel_err(h.dense()[1], ra) <= 1e-5


@pytest.mark.parametrize("block_kernel,wide", [(True, None), (False, True)], ids=["block-kernel", "wide"])
def test_fp16_operands_over_pooled_caches_match_reference(block_kernel, wide):
    """``gemm_operands="fp16"`` over pooled caches (two streams of different cache lengths in one solve),
    through the block kernel and through the tile GEMMs: the FP16 operand buffers, FP32 pool and CNN
    caches. TF32's rounding of every operand, so TF32's tolerance 1e-3 (CUDA: under TF32)."""
    from minicpmo_rt.code2wav import kernels
    from minicpmo_rt.code2wav.precision import matmul_tf32
    if not (kernels.AVAILABLE and (torch.cuda.is_available() or kernels.interpreting())):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfm = tiny_cfm(seed=10).to(dev)
    solver = SlotSolver(cfm, pool=None, attention="triton-tf32", tf32=True, n_timesteps=S, use_triton=True,
                        block_kernel=block_kernel, wide_gemm=wide, gemm_operands="fp16",
                        config=GraphConfig(batch_buckets=(2,), query_buckets=(4,)))
    handles, dense, mu, spk, cond = two_pooled_streams(solver, seed=5, device=dev)
    with matmul_tf32(True):
        mel = solver.solve_slots(handles, mu, spk, cond, graph=False)
    st = next(iter(solver._statics.values()))
    assert st.ws.norm.dtype == torch.float16 and st.hist.dtype == torch.float16
    assert (st.ws.ctr is not None) == block_kernel
    for i, h in enumerate(handles):
        ref, ra = stream_reference(cfm, dense, mu, spk, cond, i)
        assert 1e-6 < rel_err(mel[i:i + 1], ref) <= 1e-3
        c, a_ = h.dense()
        assert c.dtype == torch.float32 and a_.dtype == torch.float32
        assert rel_err(a_, ra) <= 1e-3


@requires_cuda
@pytest.mark.parametrize("bucket,lengths,block_kernel,wide", [(4, (360, 400, 380), None, None),
                                                              (2, (360, 400), True, None),
                                                              (8, (360, 400, 380), None, True)],
                         ids=["staged-batch-4", "block-kernel-batch-2", "staged-wide-batch-8"])
def test_cuda_slot_graph_matches_separate_solves(bucket, lengths, block_kernel, wide):
    """Full size, IEEE (TF32 off): batch bucket 4 runs the staged body, bucket 2 (200 rows) the
    persistent block kernel over the pool (forced: its auto rule wants TF32), bucket 8 the staged
    body with Triton tile GEMMs (forced, IEEE dots)."""
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE
    torch.backends.cuda.matmul.allow_tf32 = False
    cfm = tiny_cfm(seed=8, cfg=FULL_SIZE.dit, mild=True).cuda()
    prompt, keep, T, n = 300, 100, 50, 10
    solver = SlotSolver(cfm, pool=None, attention="triton-ieee", n_timesteps=n, block_kernel=block_kernel,
                        config=GraphConfig(batch_buckets=(bucket,), query_buckets=(50,)), wide_gemm=wide)
    solver.pool = pool = SlotPool(solver, slots=4, frames=512, keep=keep, device="cuda")
    g = torch.Generator().manual_seed(3)
    dense = [(torch.randn(n, 16, 2, 1024, 2, generator=g).cuda(), torch.randn(n, 16, 2, 8, L, 128, generator=g).cuda())
             for L in lengths]
    handles = [pool.admit(c, a, prompt) for c, a in dense]
    k = len(lengths)
    mu, spk, cond = (torch.randn(k, 80, T, generator=g).cuda(), torch.randn(k, 80, generator=g).cuda(),
                     torch.zeros(k, 80, T, device="cuda"))
    mel = solver.solve_slots(handles, mu, spk, cond, graph=True)
    assert solver.graphs()
    st = next(iter(solver._statics.values()))
    assert solver.fused.runs_persistent(st.ws) == bool(block_kernel) and st.ws.wide == bool(wide)
    for i, h in enumerate(handles):
        with torch.inference_mode(), ieee_cudnn():
            ref, rc, ra = cfm.forward_chunk(mu[i:i + 1], spk[i:i + 1], cond[i:i + 1], n_timesteps=n,
                                            cnn_cache=dense[i][0], att_cache=dense[i][1])
        errs = [rel_err(mel[i:i + 1], ref), rel_err(h.dense()[1], trim_estimator_att(ra, prompt, keep)),
                rel_err(h.dense()[0], rc)]
        print(f"slot pool ({'block kernel' if block_kernel else 'staged'}) stream {i}: {errs}")
        assert max(errs) <= 1e-5
