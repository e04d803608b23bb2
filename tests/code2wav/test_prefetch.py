"""The L2 prefetch of the GEMM weights (``dit_ops.prefetch_l2``): which launches issue it, and how a bulk
prefetch splits its bytes over the programs.

The prefetch itself is inline PTX, which Triton's interpreter cannot run; the GPU runs show it changes no
output bit and the compile gate checks it reaches the PTX (``test_kernel_compile``). Here the interpreter (or a GPU)
runs the share arithmetic the bulk form uses, and the host-side choice runs as it would in the compile gate.
"""

import pytest
import torch

from minicpmo_rt.code2wav.kernels import AVAILABLE, dit_ops, interpreting

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton")

if AVAILABLE:
    import triton

    @triton.jit
    def _shares(OUT, n):
        pid = triton.language.program_id(0)
        first, size = dit_ops.prefetch_share(n, pid, triton.language.num_programs(0))
        triton.language.store(OUT + 2 * pid, first)
        triton.language.store(OUT + 2 * pid + 1, size)


@pytest.mark.parametrize("n, nprog", [(786432, 132), (1048576, 1600), (7, 3), (1000, 7), (33, 132), (0, 4),
                                      (921600, 132)])
def test_bulk_shares_tile_the_buffer_in_16_byte_units(n, nprog):
    # the share kernel runs on CPU tensors under the interpreter (CI), on the GPU without it
    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    out = torch.full((nprog, 2), -1, dtype=torch.int32, device="cpu" if interpreting() else "cuda")
    _shares[(nprog,)](out, n)
    first, size = out[:, 0].tolist(), out[:, 1].tolist()
    assert all(s % 16 == 0 and s >= 0 for s in size), size
    covered = [(f * 4, f * 4 + s) for f, s in zip(first, size) if s]     # programs past the end issue nothing
    assert all(end <= n * 4 for _, end in covered), f"a share reaches past the buffer's {n * 4} bytes: {covered}"
    for (a0, a1), (b0, _) in zip(covered, covered[1:]):
        assert a1 == b0, f"shares leave a gap or overlap: {covered}"
    assert (covered[0][0] if covered else 0) == 0
    assert sum(size) == n * 4 // 16 * 16     # all but a last partial 16-byte unit
    # the shares are even: no program asks for more than one 16-byte unit above an even split
    assert max(size) <= -(-n * 4 // nprog) + 16


def test_row_stage_prefetch_choice(monkeypatch):
    """``_prefetch_args``: the next GEMM's FP32 weight is prefetched (bulk form, as the compile gate compiles it
    on CPU tensors outside the interpreter); never under the interpreter, with the switch off, for FP16 weights or
    a strided view."""
    like = torch.zeros(4)
    w = torch.randn(64, 32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ptr, n, how = dit_ops._prefetch_args(w, like)
    assert ptr is w and n == w.numel() and how == 2
    assert dit_ops._prefetch_args(None, like) == (like, 0, 0)
    assert dit_ops._prefetch_args(w.half(), like)[2] == 0
    assert dit_ops._prefetch_args(w.t(), like)[2] == 0
    monkeypatch.setattr(dit_ops, "STAGED_PREFETCH", False)
    assert dit_ops._prefetch_args(w, like)[2] == 0
    monkeypatch.setattr(dit_ops, "STAGED_PREFETCH", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dit_ops._prefetch_args(w, like)[2] == 0
