"""Which torch ops spend the GPU time of each feature-extractor stage (eager, so kernels are
attributed to ops; the real run replays the same bodies from CUDA graphs).

The stages are the bodies the fast session captures: the audio step over the fixed K/V buffer
(``buffered_stream_body``), the 4 forked tails' audio step (``forked_stream_body``), the vision
tower + resampler for a batch of 1080p frames (``embed_body``), and the static-cache LLM prefill
(``StaticDecoder.fused_step``) at one row and at the fork batch. Each runs twice to warm up,
then once under ``torch.profiler``; the table lists ops by self GPU time with input shapes.

    python benchmarks/stage_ops_profile.py OUT            # GPU, full-size random weights
    python benchmarks/stage_ops_profile.py OUT --tiny     # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import features_bench as fb  # noqa: E402

from minicpmo_rt.thinker.audio_graph import buffer_rows, buffered_stream_body, fork_batch_inputs, \
    forked_stream_body  # noqa: E402
from minicpmo_rt.thinker.decode import StaticDecoder  # noqa: E402
from minicpmo_rt.thinker.image_processor import pack_patches, process_frame_torch  # noqa: E402
from minicpmo_rt.thinker.vision_graph import embed_body  # noqa: E402


def profile(name: str, fn, out: Path, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(2):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tprofile(activities=acts, record_shapes=True) as p:
        fn()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = p.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows, max_name_column_width=40,
                                                            max_shapes_column_width=90)
    text = f"## {name}\n\n```\n{table}\n```\n"
    (out / f"ops_{name}.txt").write_text(text)
    print(text, flush=True)
    return text


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    factory, _, _ = fb.build_factory(args.tiny, args.out, device, dtype, fast=False)
    th = factory().thinker
    apm = th.apm
    a = apm.layers[0].self_attn
    P = buffer_rows(apm.max_source_positions)
    past, n_mel, pre = 300, 100 + 16, 16   # a 1-s chunk with redundancy frames after 6 s of audio
    mel = torch.randn(1, apm.conv1.in_channels, n_mel, device=device)
    buf = torch.randn(len(apm.layers), 2, 1, a.num_heads, P, a.head_dim, device=device, dtype=th.dtype)
    n = (n_mel - 1) // 2 + 1 - (pre + 1) // 2
    rows = torch.arange(past, past + n, device=device)
    mask = (torch.arange(P, device=device) < past + n)[None, None, None]
    profile("audio_step", lambda: buffered_stream_body(th, mel, buf, rows, mask, pre, 0), args.out)

    mels = [torch.randn(apm.conv1.in_channels, pre + 20 * k, device=device) for k in (1, 2, 3, 4)]
    x, valid, ns = fork_batch_inputs(mels, [pre] * 4, [0] * 4)
    fbuf = buf.expand(-1, -1, 4, -1, -1, -1).contiguous()
    frows = torch.arange(past, past + max(ns), device=device)
    fmask = (torch.arange(P, device=device)[None] < torch.tensor([past + k for k in ns], device=device)[:, None])
    profile("audio_forks", lambda: forked_stream_body(th, x, valid, fbuf, frows, fmask[:, None, None], pre), args.out)

    h, w = (48, 64) if args.tiny else (1080, 1920)
    frames = [process_frame_torch(np.random.randint(0, 255, (h, w, 3), dtype=np.uint8), device) for _ in range(5)]
    batch = pack_patches(frames)
    valid_p = batch.patch_attention_mask.reshape(batch.pixel_values.shape[0], -1)
    pos = th.vpm.embeddings.position_ids(valid_p, batch.tgt_sizes).to(device)
    pix = batch.pixel_values.to(device=device, dtype=th.vpm.embeddings.patch_embedding.weight.dtype)
    vmask = None if bool(valid_p.all()) else valid_p[:, None, None, :].to(device)
    profile("vision_5_frames", lambda: embed_body(th, pix, pos, vmask, batch.tgt_sizes), args.out)

    dec = StaticDecoder(th.llm, max_len=4096, batch=4, kernels="auto")
    for B in (1, 4):
        xe = torch.randn(B, 85, th.llm.config.hidden_size, device=device, dtype=th.dtype)
        p0 = torch.arange(3000, 3085, device=device)[None].expand(B, -1).contiguous()
        d = dec if B == 4 else StaticDecoder(th.llm, max_len=4096, batch=1, kernels="auto", share_weights=dec)
        profile(f"llm_prefill_B{B}", lambda: d.step(xe, p0, 3085), args.out)


if __name__ == "__main__":
    main()
