"""Compile every Triton kernel the Code2Wav fast path launches, for real GPU targets, on a CPU.

Run as a script (``python tests/code2wav/compile_gate.py``; the test ``test_kernel_compile.py``
does, in a subprocess, because the test session imports the kernels under ``TRITON_INTERPRET=1``).
The Whole-Euler solves (staged body, persistent block kernel, slot pool, TF32 and IEEE, masked and
unmasked, few rows and a full grid) run on CPU tensors at the full DiT width (depth 2) with
``JITFunction.run`` replaced: each launch's (kernel, argument types and 16-divisibility, constexprs, warps,
stages) is compiled through Triton's code generator and the NVIDIA backend (TTIR -> TTGIR -> LLVM -> PTX ->
cubin) for SM90, and the attention for SM80 too, instead of being run. Each compile prints ptxas's spill
report; the attention kernels and tile GEMMs (``NO_SPILL``) must not spill more than SPILL_LIMIT bytes per
thread for SM90, every kernel must fit the target's shared memory per program (``SMEM_LIMIT``: above it a
kernel compiles but fails to load), and the L2 prefetches (block kernel, row stages) must reach their PTX. Outputs are never computed, so the numbers the solves produce are garbage;
only compilation is checked.

Why: the CPU tests run kernels through Triton's interpreter, which executes Python and accepts code
the compiler rejects (a helper returning from inside a ``constexpr`` branch passed every interpreter
test and failed to compile on the H200). Exit status: 0 all compiled, 1 a kernel failed to compile (an
attention kernel or tile GEMM spilled too much, a kernel needs more shared memory than its target has, or the
block kernel lost its prefetches),
3 this Triton's internals differ from what the harness expects (the test then skips).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import time
import traceback

import torch

DT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
      torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}


class HarnessError(Exception):
    """The harness cannot describe a launch to this Triton (not a kernel bug)."""


def arg_type(v) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + DT[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    if type(v).__name__ == "TensorDescriptor":
        return f"tensordesc<{DT[v.base.dtype]}[{','.join(str(b) for b in v.block_shape)}]>"
    raise HarnessError(f"no Triton type for a launch argument of type {type(v).__name__}")


# Kernels whose every launch must not spill registers on SM90 beyond SPILL_LIMIT bytes of spill stores per
# thread: the attention keeps its tiles in registers, and an IEEE 64-query block spilled 5-6 KB per thread,
# which made the IEEE solve 4x slower on the H200; the tile GEMMs with IEEE dots spilled 4-26 KB on the TF32
# tables' tiles (session 17, wide_gemm.IEEE_TILE). The TF32 shapes spill at most 144 bytes
# (benchmarks/results/compile_spills_session16.md, compile_spills_session17.md); SM80 is reported, not checked.
NO_SPILL = {"_attn_fwd", "_attn_direct", "_attn_combine", "_wide_gemm", "_wide_qkv"}
SPILL_LIMIT = 512
# Shared memory one program may take, by target (the opt-in maximum per block: H100/H200 227 KB, A100 163 KB).
# A kernel above it still compiles; it fails only when loaded, with OutOfResources, on the GPU (a 256-key
# attention tile in the block kernel asked for 283136 bytes on the H200, session 18), so the gate checks it.
SMEM_LIMIT = {90: 232448, 80: 166912}


def aligned(v) -> bool:
    """Would a launch specialise this argument as divisible by 16 (Triton's "D": a tensor whose address, an
    integer whose value, is a multiple of 16)? The gate compiles what the launch would."""
    if isinstance(v, torch.Tensor):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


def spill_bytes(ptxas_log: str) -> int | None:
    """Bytes of spill stores in a ptxas -v report (the largest over its functions), None without a report
    (a Triton that does not print it)."""
    found = [int(m) for m in re.findall(r"(\d+) bytes spill stores", ptxas_log)]
    return max(found) if found else None


def shared_bytes(kernel) -> int | None:
    """Bytes of shared memory a compiled kernel asks for per program (None where this Triton does not say)."""
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    return int(shared) if isinstance(shared, int) else None


def main() -> int:
    # every launch compiled here, with ptxas's resource report printed (and captured per compile)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    compiled: dict[tuple, float] = {}
    spilled: list[str] = []
    too_big: list[str] = []
    no_prefetch: list[str] = []

    def capture(self, *args, grid, warmup, **kwargs):
        try:
            opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            vals = dict(zip(self.arg_names, args))
            vals.update(kwargs)
            sig, consts, attrs = {}, {}, {}
            for i, p in enumerate(self.params):
                if p.name in vals:
                    v = vals[p.name]
                elif p.has_default:
                    v = p.default
                else:
                    raise HarnessError(f"{self.fn.__name__}: no value for {p.name}")
                if p.is_constexpr or v is None:
                    sig[p.name], consts[(i,)] = "constexpr", v
                else:
                    sig[p.name] = arg_type(v)
                    # as the launch would specialise it (spills depend on it): not the kernel's do_not_specialize ones
                    if aligned(v) and not (p.do_not_specialize or getattr(p, "do_not_specialize_on_alignment", 0)):
                        attrs[(i,)] = [["tt.divisibility", 16]]
            src = ASTSource(self, signature=sig, constexprs=consts, attrs=attrs)
        except (AttributeError, KeyError, TypeError) as exc:
            raise HarnessError(f"{self.fn.__name__}: {exc!r}") from exc
        caps = ((90, 80) if self.fn.__name__ in ("_attn_fwd", "_attn_direct", "_attn_combine", "_wide_gemm", "_wide_qkv")
                else (90,))
        if any(t.startswith("tensordesc") for t in sig.values()) or (self.fn.__name__ == "_attn_direct"
                                                                      and vals.get("TMA")):
            caps = (90,)        # TMA descriptors (host-made, or built in the kernel): Hopper only
        key = (self.fn.__name__, tuple(sorted(sig.items())), repr(sorted(consts.items())), tuple(sorted(opts.items())))
        if key in compiled:
            return None
        t0 = time.time()
        spill, smem, ptx = {}, {}, {}
        for cap in caps:
            log = io.StringIO()
            try:
                with contextlib.redirect_stdout(log):     # ptxas's -v report (TRITON_DUMP_PTXAS_LOG, set in main)
                    kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=opts)
            except Exception as exc:
                named = {self.arg_names[i[0]]: v for i, v in consts.items()}
                raise RuntimeError(f"{self.fn.__name__} does not compile for sm{cap} with {named} {opts}") from exc
            spill[cap] = spill_bytes(log.getvalue())
            smem[cap] = shared_bytes(kernel)
            ptx[cap] = kernel.asm.get("ptx", "")
        compiled[key] = time.time() - t0
        named = {self.arg_names[i[0]]: v for i, v in consts.items() if isinstance(v, (bool, int, str))}
        print(f"compiled {self.fn.__name__:18s} sm{'/sm'.join(map(str, caps))} {compiled[key]:5.1f}s spills "
              f"{'/'.join('?' if spill[c] is None else str(spill[c]) for c in caps)} smem "
              f"{'/'.join('?' if smem[c] is None else str(smem[c]) for c in caps)} {opts} {named}", flush=True)
        for cap in caps:
            if smem[cap] is not None and smem[cap] > SMEM_LIMIT[cap]:
                too_big.append(f"{self.fn.__name__} needs {smem[cap]} bytes of shared memory per program on sm{cap} "
                               f"(the limit is {SMEM_LIMIT[cap]}) with {named} {opts}: it would fail to load there; "
                               "pick smaller tiles or fewer stages")
        if self.fn.__name__ in NO_SPILL and (spill.get(90) or 0) > SPILL_LIMIT:
            spilled.append(f"{self.fn.__name__} spills registers ({spill} bytes of spill stores by target) with "
                           f"{named} {opts}: pick a launch shape that fits (fused_dit._attn_shape / _direct_shape, "
                           f"wide_gemm.IEEE_TILE)")
        if (named.get("PREFETCH") and named.get("PHASE", -1) == -1 and "prefetch" not in ptx[90]
                and self.fn.__name__ in ("_dit_block", "_residual_mod_ln", "_taps_ln_mish")):
            no_prefetch.append(f"{self.fn.__name__} with PREFETCH={named['PREFETCH']} has no prefetch instruction in "
                               f"its sm90 PTX ({named} {opts}): the inline-asm hint was dropped (dit_ops.prefetch_l2)")
        return None

    JITFunction.run = capture
    try:
        drive()
    except HarnessError as exc:
        print(f"HARNESS: {exc}", flush=True)
        return 3
    except Exception:  # noqa: BLE001 - report the compile failure
        traceback.print_exc()
        return 1
    if too_big:
        print("SHARED MEMORY:\n" + "\n".join(too_big), flush=True)
    if spilled:
        print("SPILLS:\n" + "\n".join(spilled), flush=True)
    if no_prefetch:
        print("PREFETCH:\n" + "\n".join(no_prefetch), flush=True)
    if too_big or spilled or no_prefetch:
        return 1
    print(f"ok: {len(compiled)} kernel specialisations, {sum(compiled.values()):.0f}s", flush=True)
    return 0


def cuda_paths_on_cpu():
    """Make CPU tensors take the CUDA code paths (Triton stages "usable", the block kernel allowed, one launch
    per evaluation rather than one per phase, TF32 operands rounded as compiled TF32 does); returns a
    full-width CFM of depth 2, its estimator's config and ``caches(B, L)``, zero (CNN, attention) caches for
    2 Euler steps."""
    from minicpmo_rt.code2wav import fused_dit
    from minicpmo_rt.code2wav.cfm import CausalConditionalCFM
    from minicpmo_rt.code2wav.flow_config import FULL_SIZE, CFMConfig
    from minicpmo_rt.code2wav.kernels import dit_block, tiled_attention as ta

    fused_dit.usable_on = lambda t: True
    fused_dit.interpreting = lambda: True
    fused_dit._has_tma = lambda device: True
    ta.device_tma = lambda device: True          # direct_attention's own check; fused_dit's is set per case
    one_launch = dit_block.dit_blocks
    dit_block.dit_blocks = lambda **kw: one_launch(**dict(kw, phase_by_phase=False))
    dit_block.rounds = lambda precision, device: precision == "tf32"

    est = dataclasses.replace(FULL_SIZE.decoder.estimator, depth=2)
    cfm = CausalConditionalCFM(CFMConfig(estimator=est), noise_frames=1200).eval()
    S, C, H, D, depth = 2, est.hidden_size, est.num_heads, est.head_dim, est.depth

    def caches(B, L):
        return (torch.zeros(S, depth, 2 * B, 2 * C, 2), torch.zeros(S, depth, 2 * B, H, L, 2 * D))

    return cfm, est, caches


def drive() -> None:
    """The launches of the Whole-Euler solves that CUDA runs, on CPU tensors (kernels only compiled)."""
    from minicpmo_rt.code2wav import euler_graph, fused_dit
    from minicpmo_rt.code2wav.euler_graph import GraphConfig, WholeEulerSolver
    from minicpmo_rt.code2wav.kernels import tiled_attention as ta
    from minicpmo_rt.code2wav.precision import matmul_tf32
    from minicpmo_rt.code2wav.slot_pool import SlotPool, SlotSolver

    cfm, est, caches = cuda_paths_on_cpu()
    S, H, D = 2, est.num_heads, est.head_dim

    with torch.inference_mode():
        # (B, T, L, tf32, Triton tile GEMMs (CUDA's default from batch 8 with TF32; the QKV one with its
        # head LNs up to batch 10), their TMA loads)
        for B, T, L, tf32, wide, tma in ((1, 50, 400, True, None, True), (1, 45, 380, True, None, True),
                                         (1, 50, 400, False, None, True), (4, 50, 400, True, False, True),
                                         (16, 50, 400, True, False, True), (16, 50, 400, True, True, True),
                                         (16, 45, 380, True, True, False), (16, 50, 400, False, True, True),
                                         (8, 50, 400, True, True, True), (8, 45, 380, True, True, False)):
            cfg = GraphConfig(enabled=False, batch_buckets=(1, 4, 8, 16), query_buckets=(50,), offset_anchor=400)
            fused_dit._has_tma = lambda device, v=tma: v
            for block_kernel in ((True, False) if B == 1 else (None,)):     # True: CUDA's B=1 default
                attention = "triton-tf32" if tf32 else "triton-ieee"
                solver = WholeEulerSolver(cfm, body="fused", attention=attention, tf32=tf32, n_timesteps=S,
                                          config=cfg, use_triton=True, block_kernel=block_kernel, wide_gemm=wide)
                fused_dit.dot_precision = lambda t, p="tf32" if tf32 else "ieee": p
                with matmul_tf32(tf32):
                    solver.solve(torch.zeros(B, 80, T), torch.zeros(B, 80), torch.zeros(B, 80, T), *caches(B, L),
                                 graph=False)
        fused_dit._has_tma = lambda device: True
        # direct solves (trimmed; each stream's cache read in place): split keys at batch 4, a full grid at
        # 16, IEEE dots, FP16 operands (P @ V in FP16); tiles through in-kernel TMA descriptors or pointer loads
        for B, tf32, wide, operands, tma in ((4, True, False, "fp32", True), (16, True, True, "fp32", True),
                                             (16, True, True, "fp32", False), (16, False, True, "fp32", True),
                                             (16, True, True, "fp16", True)):
            fused_dit.device_tma = lambda device, v=tma: v
            cfg = GraphConfig(enabled=False, batch_buckets=(4, 16), query_buckets=(50,), offset_anchor=400)
            solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32" if tf32 else "triton-ieee", tf32=tf32,
                                      n_timesteps=S, config=cfg, use_triton=True, wide_gemm=wide,
                                      gemm_operands=operands)
            fused_dit.dot_precision = lambda t, p="tf32" if tf32 else "ieee": p
            with matmul_tf32(tf32):
                solver.solve(torch.zeros(B, 80, 50), torch.zeros(B, 80), torch.zeros(B, 80, 50), *caches(B, 400),
                             graph=False, trim=(300, 100))
            assert all(k.direct for k in solver._statics), "the compile gate's direct solve took the arena"
        fused_dit.device_tma = lambda device: False
        # the persistent block kernel's trimmed solves, FP32 and FP16 operands: its arena writing the successors
        # (euler_graph.ARENA_SUCCESSOR) and its direct attention phase (batch 2 by default, here forced)
        euler_graph.ARENA_SUCCESSOR = True
        for operands, direct in (("fp32", None), ("fp16", None), ("fp32", True), ("fp16", True)):
            cfg = GraphConfig(enabled=False, batch_buckets=(1,), query_buckets=(50,), offset_anchor=400)
            solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                      config=cfg, use_triton=True, block_kernel=True, gemm_operands=operands,
                                      direct=direct)
            fused_dit.dot_precision = lambda t: "tf32"
            with matmul_tf32(True):
                solver.solve(torch.zeros(1, 80, 50), torch.zeros(1, 80), torch.zeros(1, 80, 50), *caches(1, 400),
                             graph=False, trim=(300, 100))
            assert all((k.direct if direct else k.succ) and st.ws.ctr is not None for k, st in solver._statics.items())
        euler_graph.ARENA_SUCCESSOR = False
        # rows of their own cache lengths (cfm_join_starts: a stream's first and second chunks among steady ones;
        # the ROW_LENGTHS variants): the block kernel's direct phase at batch 2 (its CUDA default), the staged
        # body's direct attention at 4 and 16 with in-kernel TMA descriptors (Hopper's path: no spills; with
        # pointer loads, the SM80 path, the variant spills 84 bytes per thread on SM90, within SPILL_LIMIT, where
        # the default one spills none), FP16 operands too
        for B, operands, tma in ((2, "fp32", True), (4, "fp32", True), (4, "fp32", False), (16, "fp32", True),
                                 (16, "fp16", True)):
            fused_dit.device_tma = lambda device, v=tma: v
            cfg = GraphConfig(enabled=False, batch_buckets=(2, 4, 16), query_buckets=(50,), offset_anchor=400)
            solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                      config=cfg, use_triton=True, wide_gemm=B >= 8, gemm_operands=operands,
                                      block_kernel=True if B == 2 else None)
            fused_dit.dot_precision = lambda t: "tf32"
            streams = [torch.zeros(S, est.depth, 2, H, n, 2 * D) for n in ([400, 300, 350] * B)[:B]]
            with matmul_tf32(True):
                solver.solve(torch.zeros(B, 80, 50), torch.zeros(B, 80), torch.zeros(B, 80, 50), caches(B, 400)[0],
                             streams, graph=False, trim=(300, 100))
            assert all(k.direct and k.rows for k in solver._statics), "the compile gate's joined solve took no rows key"
        fused_dit.device_tma = lambda device: False
        # shared prompt tails (WholeEulerSolver.share_tail): the staged direct attention reading each row's last
        # old frames from its voice's prompt cache (pointer loads, one key loop): split keys at batch 4, a full
        # grid at 16, FP16 operands, and rows of their own cache lengths (ROW_LENGTHS with TAIL)
        for B, operands, lengths in ((4, "fp32", [400]), (16, "fp32", [400]), (16, "fp16", [400]),
                                     (4, "fp32", [400, 300, 350])):
            cfg = GraphConfig(enabled=False, batch_buckets=(4, 16), query_buckets=(50,), offset_anchor=400)
            solver = WholeEulerSolver(cfm, body="fused", attention="triton-tf32", tf32=True, n_timesteps=S,
                                      config=cfg, use_triton=True, wide_gemm=B >= 8, gemm_operands=operands)
            solver.share_tail = True
            fused_dit.dot_precision = lambda t: "tf32"
            streams = [torch.zeros(S, est.depth, 2, H, n, 2 * D) for n in (lengths * B)[:B]]
            prompt = torch.zeros(S, est.depth, 2, H, 300, 2 * D)
            with matmul_tf32(True):
                solver.solve(torch.zeros(B, 80, 50), torch.zeros(B, 80), torch.zeros(B, 80, 50), caches(B, 400)[0],
                             streams, graph=False, trim=(300, 100), tails=[prompt] * B)
            assert all(k.direct and k.tail for k in solver._statics), "the compile gate's tail solve read no tails"
        # slot pool: pooled caches (rows/pos), a stride-0 key mask, the block kernel at B=1, TMA at B=16
        fused_dit.dot_precision = lambda t: "tf32"
        for B in (1, 4, 8, 16):
            solver = SlotSolver(cfm, pool=None, attention="triton-tf32", tf32=True, n_timesteps=S,
                                config=GraphConfig(enabled=False, batch_buckets=(1, 4, 8, 16), query_buckets=(50,)),
                                use_triton=True, block_kernel=True if B == 1 else None, wide_gemm=B >= 8)
            solver.pool = SlotPool(solver, slots=B, frames=464, device="cpu")
            handles = [solver.pool.admit(*[c[:, :, [i, B + i]] for c in caches(B, 400)], 300) for i in range(B)]
            with matmul_tf32(True):
                solver.solve_slots(handles, torch.zeros(B, 80, 50), torch.zeros(B, 80), torch.zeros(B, 80, 50),
                                   graph=False)
        # the attention's other launch variants: TMA descriptors (Hopper, a full grid), key-vector masks
        q = torch.zeros(32, H, 50, D)
        kv = torch.zeros(32, H, 450, 2 * D)
        keys = torch.ones(32, 450, dtype=torch.bool)[:, None].expand(32, 50, 450)
        for mask, key_mask, tma in ((None, False, True), (keys, False, True), (keys, True, True), (keys, True, False)):
            ta.tiled_attention(q, kv[..., :D], kv[..., D:], mask, block_m=64, num_stages=3, tma=tma,
                               key_mask=key_mask)
        # split keys combined by the second kernel (no counters: ``fused_dit.ATTN_LAST_COMBINE`` off, or a caller
        # of its own)
        ta.tiled_attention(q[:4], kv[:4, ..., :D], kv[:4, ..., D:], None, block_m=16, splits=4)


if __name__ == "__main__":
    sys.exit(main())
