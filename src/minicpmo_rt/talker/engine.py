"""Talker slots: a fixed capacity, a static KV cache sized by a byte budget, batched decode.

Model math lives in ``model.py``; this module only schedules it. The decode step runs
every slot of the capacity each step (free and finished rows are masked), so its shapes
never change and it can be captured in a CUDA graph. The host never reads device
state per step: it syncs once per emitted window, which is where it learns of EOS.

Each step attends over the shortest key bucket (a power of two from ``MIN_BUCKET``, or the
cache length) that holds every live slot's next position, which the host knows without a sync
(prompt rows + steps run). The profiles' caches hold 4096 positions per slot, while a spoken answer
rarely passes a few hundred: attending over all of them read the whole KV budget (up to 4 GiB) every
step. Keys past a slot's position are masked either way, so a bucket changes no value, only the work.
One graph per bucket, captured up front, sharing one memory pool.

On CUDA the decode step runs instead through the Thinker's fused Triton kernels (``kernels="triton"``,
the default there): the step's ~700 small launches set its time under graph replay, not its weights, and
the fused attention reads each slot's position on the device, so one graph serves every position.
The requests admitted on one step are prefilled together, one forward per run of consecutive slots; with the
decode graphs captured, that forward is a graph too (``_prefill_graphed``): every slot's row, the conditions
right-padded to a length bucket, written into a private K/V buffer (a live slot's cache is never touched), then
copied into the admitted slots. Eagerly it took 19-40 ms of a turn's first audio on the H200 (~600 launches). The
buffer holds 256 positions per slot beside the KV budget: 252 MB at the H200 profile's 16 slots. The rest of an
admission is one projector pass for all its requests, over rows the Thinker left on the device, padded to one of
``PROJECTOR_ROWS``, and one write of the sampler's state: 5 ms at 16 requests on the H200, against 10 ms with
host rows, the projector at each new row count and six state writes per request.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..errors import InputError
from ..sdpa_backend import attention
from ..thinker.staging import staging_on, upload_ints
from .model import MiniCPMTTS
from .sampler import SamplingParams, SlotState, sample_step

SILENCE_CODE = 4218
CONTEXT_CODES = 3
MIN_BUCKET = 128    # the shortest key span a decode step attends over
# Condition lengths the admissions' prefill replays from CUDA graphs (longer ones run eagerly). A condition is an
# answer's text tokens + 2, so a spoken answer's fits the top bucket unless it runs past ~250 tokens.
PREFILL_BUCKETS = (16, 32, 64, 128, 256)
# Row counts the admissions' projector pass is padded up to (an admission's text rows, all requests together).
# A GEMM at a row count cuBLAS has not met may pick a kernel not yet loaded: 2.6-4.0 ms at the first call on the
# H200, 0.06-0.17 ms at the second (admit_stall_probe_session50_h200.json). The text rows change with every
# admission, so the engine runs these few counts, and warms them when it captures its graphs.
PROJECTOR_ROWS = (64, 128, 256, 512, 1024, 2048, 4096)


def kv_buckets(max_len: int) -> tuple[int, ...]:
    """Key spans a decode step may use: powers of two from ``MIN_BUCKET`` below ``max_len``, then ``max_len``."""
    out, b = [], MIN_BUCKET
    while b < max_len:
        out.append(b)
        b *= 2
    return (*out, max_len)


@dataclass(frozen=True)
class TalkerRequest:
    request_id: str
    text_ids: torch.Tensor  # [n] long: Thinker tokens after <|tts_bos|>, terminator excluded
    hidden: torch.Tensor  # [n, llm_dim] Thinker final-norm hidden rows of those tokens
    seed: int = 42
    max_codes: int | None = None
    text_finished: bool = True


@dataclass(frozen=True)
class CodecChunk:
    """Talker -> Code2Wav: 3 left-context codes + a window of new codes (25 Hz)."""

    request_id: str
    seq: int
    codes: tuple[int, ...]  # context + window
    n_context: int
    final: bool


def kv_bytes_per_token(tts: MiniCPMTTS, dtype: torch.dtype) -> int:
    c = tts.cfg
    head_dim = c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass
class _Slot:
    request: TalkerRequest
    cond_len: int
    emitted: int = 0  # codes already sent downstream
    seq: int = 0
    context: list[int] = field(default_factory=lambda: [SILENCE_CODE] * CONTEXT_CODES)
    steps_run: int = 0  # host-side count of decode steps since admission (upper bound of codes)


KERNEL_SETS = ("auto", "torch", "triton")
log = logging.getLogger(__name__)


def resolve_kernels(kernels: str, device: torch.device | str) -> str:
    """The kernel set a decode step on ``device`` uses for ``kernels`` ("auto": Triton on CUDA, where the
    kernels can run in this process; torch elsewhere). Raises a named error for an unknown or unusable set."""
    from ..thinker import kernels as K

    if kernels not in KERNEL_SETS:
        raise InputError(f"talker kernels={kernels!r}; choose one of {', '.join(KERNEL_SETS)}")
    device = torch.device(device)
    probe = torch.empty(0, device=device)
    if kernels == "auto":
        return "triton" if device.type == "cuda" and K.usable_on(probe) else "torch"
    if kernels == "triton" and not K.usable_on(probe):
        raise InputError(f"talker kernels='triton' cannot run on {device} here (need CUDA, or "
                         "TRITON_INTERPRET=1 set before import on CPU); use kernels='torch'")
    return kernels


def describe_kernels(kernels: str) -> str:
    """One line on what a resolved kernel set runs (logs and ``inspect``)."""
    if kernels == "triton":
        return ("decode step on fused Triton kernels (packed QKV and gate/up, RoPE + cache write, split-KV "
                "attention at device-side positions; one CUDA graph for every position)")
    return "decode step on transformers' Llama modules over the shortest key bucket (a CUDA graph per bucket)"


class TalkerEngine:
    """``kernels``: how a decode step computes its layers. ``"torch"``: transformers' Llama modules over a
    key bucket under a mask (the reference, and every prefill). ``"triton"``: the Thinker's fused kernels
    (``thinker.kernels``: residual + RMSNorm, RoPE + cache write, split-KV attention off the cache at each
    row's device-side position, SiLU * up) around packed QKV and gate/up GEMMs, about ten launches a layer
    instead of ~35; positions are read on the device, so one graph serves every step. ``"auto"``: Triton
    on CUDA."""

    def __init__(self, tts: MiniCPMTTS, capacity: int, kv_budget_bytes: int,
                 params: SamplingParams = SamplingParams(), window: int = 25, first_window: int | None = None,
                 kernels: str = "auto"):
        if capacity < 1:
            raise InputError(f"talker capacity must be >= 1, got {capacity}")
        kernels = resolve_kernels(kernels, next(tts.parameters()).device)
        self.tts = tts.eval()
        p = next(tts.parameters())
        self.device, self.dtype = p.device, p.dtype
        c = tts.cfg
        self.capacity, self.params, self.window = capacity, params, window
        self.first_window = first_window or window
        self.n_layers = c.num_hidden_layers
        self.n_kv = c.num_key_value_heads
        self.n_heads = c.num_attention_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        per_token = kv_bytes_per_token(tts, self.dtype)
        self.max_len = min(c.max_position_embeddings, kv_budget_bytes // (per_token * capacity))
        if self.max_len < 64:
            raise InputError(f"talker KV budget {kv_budget_bytes} bytes gives {self.max_len} tokens per slot at "
                             f"capacity {capacity} ({per_token} bytes/token); raise the budget or lower the capacity")
        shape = (self.n_layers, capacity, self.n_kv, self.max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # index and position uploads go through pinned staging (TalkerTurns shares it): a copy from pageable
        # memory syncs the stream first, so an admission would wait for the prefill it had just queued
        self.uploads = staging_on(self.device, slots=8)
        self.state = SlotState(capacity, params.window, self.device, self.uploads)
        self.pos = torch.zeros(capacity, dtype=torch.long, device=self.device)  # next write position
        self.first_logits = torch.zeros(capacity, c.num_audio_tokens, device=self.device)
        self.codes = torch.zeros(capacity, self.max_len, dtype=torch.long, device=self.device)
        self.pending: deque[TalkerRequest] = deque()
        self.slots: dict[int, _Slot] = {}
        self.buckets = kv_buckets(self.max_len)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # T bucket -> (graph, its input rows [capacity, T, H], its hidden [capacity, T, H]); see _prefill_graphed
        self._prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._prefill_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.batched_prefill = True     # False: one prefill per admitted request (benchmarks' before forms)
        self.kernels = kernels
        if kernels == "triton":
            self._pack()
        log.info("Talker on %s: %s", self.device, describe_kernels(kernels))

    # ---- admission -------------------------------------------------------------------------
    def need_tokens(self, req: TalkerRequest) -> int:
        return req.text_ids.shape[0] + 2 + self._limit(req)

    def _limit(self, req: TalkerRequest) -> int:
        return req.max_codes or self.params.max_codes

    def submit(self, req: TalkerRequest) -> None:
        if self.need_tokens(req) > self.max_len:
            raise InputError(
                f"talker request {req.request_id!r}: needs {self.need_tokens(req)} KV tokens "
                f"({req.text_ids.shape[0]} text rows + 2 + max_codes {self._limit(req)}) but a slot holds "
                f"{self.max_len}; it can never fit: lower max_codes or raise the KV budget")
        self.pending.append(req)

    def _admit(self) -> None:
        free = [i for i in range(self.capacity) if i not in self.slots]
        batch = []
        while self.pending and free:
            batch.append((free.pop(0), self.pending.popleft()))
        if not batch:
            return
        # One batched projector pass for every new request's conditioning.
        with torch.no_grad():
            # every request's text ids and the two tail tokens (text EOS, audio BOS) in one pinned upload: the
            # contract's ids are host tensors, and a copy from pageable memory would wait for the device
            ids = torch.cat([r.text_ids.reshape(-1) for _, r in batch]).tolist()
            N = len(ids)
            tails = [self.tts.cfg.text_eos_token_id, self.tts.cfg.audio_bos_token_id]
            emb = self.tts.emb_text(upload_ints(self.uploads, ids + tails, self.device))
            # the Thinker hands its rows over on its own device (TalkerInput): joined there, nothing crosses
            # the bus; host rows (other callers) go up one request at a time
            hid = torch.cat([r.hidden.to(self.device) for _, r in batch]).to(self.dtype)
            rows = emb[:N] + self._project(hid, self._projector_rows(hid.shape[0]))
            conds, start = [], 0
            for slot, req in batch:
                n = req.text_ids.shape[0]
                tail = emb[N:] if req.text_finished else emb[N + 1:]     # [EOS,] BOS
                conds.append(torch.cat([rows[start:start + n], tail]))
                start += n
            last = self._prefill_many([slot for slot, _ in batch], conds)
            vals = upload_ints(self.uploads, [[slot for slot, _ in batch], [c.shape[0] for c in conds]], self.device)
            slots = vals[0]
            self.first_logits[slots] = self.tts.logits(last)
            self.pos[slots] = vals[1]
            self.state.admit_many([slot for slot, _ in batch], [req.seed for _, req in batch],
                                  [self._limit(req) for _, req in batch], self.params.min_codes)
            for (slot, req), cond in zip(batch, conds):
                self.slots[slot] = _Slot(req, cond.shape[0])

    def _projector_rows(self, m: int) -> int:
        """The row count an admission's projector pass over ``m`` rows runs at: on CUDA the next of
        ``PROJECTOR_ROWS`` (``m`` past the last); elsewhere ``m``."""
        return next((b for b in PROJECTOR_ROWS if b >= m), m) if self.device.type == "cuda" else m

    def _project(self, hid: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """``projector_semantic`` (L2-normalised where the config says so) of hidden rows [m, llm_dim], run
        over ``rows`` >= m rows (zero rows appended; each row's result is its own)."""
        m = hid.shape[0]
        pad = m if rows is None else max(rows, m)
        proj = self.tts.projector_semantic(F.pad(hid, (0, 0, 0, pad - m)) if pad > m else hid)[:m]
        return F.normalize(proj, p=2, dim=-1) if self.tts.cfg.normalize_projected_hidden else proj

    @torch.no_grad()
    def warm_projector(self) -> None:
        """Run an admission's projector pass once at each of ``PROJECTOR_ROWS`` (padded, as admissions are),
        so that no admission pays for loading a kernel (``capture_prefill_graphs`` calls it)."""
        for b in PROJECTOR_ROWS:
            self._project(torch.zeros(b - 1, self.tts.cfg.llm_dim, dtype=self.dtype, device=self.device), b)

    # ---- model math on the static cache ----------------------------------------------------
    def _layers(self, x: torch.Tensor, positions: torch.Tensor, rows: slice, kv_len: int,
                write_at: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [B,T,H] at positions [B,T] for cache rows ``rows``; writes K/V in place at ``write_at`` [B,T].
        ``caches``: other K/V tensors [layers, ...] to use instead of the engine's (``rows`` indexes them)."""
        k_cache, v_cache = caches if caches is not None else (self.k_cache, self.v_cache)
        model = self.tts.model
        B, T, _ = x.shape
        cos, sin = model.rotary_emb(x, positions)
        key_pos = torch.arange(kv_len, device=x.device)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B,T,kv_len]
        for li, layer in enumerate(model.layers):
            h = layer.input_layernorm(x)
            att = layer.self_attn
            q = att.q_proj(h).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = att.k_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            v = att.v_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            kc, vc = k_cache[li, rows], v_cache[li, rows]  # views: writes land in the cache
            idx = write_at[:, None, :, None].expand(B, self.n_kv, T, self.head_dim)
            kc.scatter_(2, idx, k.to(kc.dtype))
            vc.scatter_(2, idx, v.to(vc.dtype))
            keys, vals = kc[:, :, :kv_len], vc[:, :, :kv_len]
            if self.n_kv != self.n_heads:
                rep = self.n_heads // self.n_kv
                keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
            o = attention(q, keys, vals, attn_mask=mask[:, None])    # lengths follow each condition: no cuDNN plans
            x = x + att.o_proj(o.transpose(1, 2).reshape(B, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x)

    def _pack(self) -> None:
        """The fused step's weights: QKV and gate/up packed into one GEMM each (copies), and the rotary
        tables of every position from the model's own rotary module (the values its prefill uses)."""
        from ..thinker.decode import pack_layers

        model = self.tts.model
        self.wqkv, self.w13 = pack_layers(model.layers)
        with torch.no_grad():
            pos = torch.arange(self.max_len, device=self.device)[None]
            cos, sin = model.rotary_emb(self.k_cache.new_zeros(1, 1, self.head_dim), pos)
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()      # [max_len, D], model dtype
        if getattr(model.layers[0].mlp, "act_fn", None) is not None and \
                type(model.layers[0].mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            raise InputError(f"talker kernels='triton' fuse SiLU; this model's MLP uses "
                             f"{type(model.layers[0].mlp.act_fn).__name__}: use kernels='torch'")

    def _fused_layers(self, x: torch.Tensor, pos: torch.Tensor, read: torch.Tensor | None = None) -> torch.Tensor:
        """``_layers`` for one token per slot (x [B,1,H] at positions pos [B,1], written there) through the
        fused kernels (``thinker.decode.fused_layers``); ``read``: as there."""
        from ..thinker.decode import fused_layers

        model = self.tts.model
        return fused_layers(model.layers, model.norm.weight, self.wqkv, self.w13, self.k_cache, self.v_cache,
                            self.cos, self.sin, x, pos, self.n_heads, self.n_kv,
                            model.layers[0].input_layernorm.variance_epsilon, read)

    @torch.no_grad()
    def _prefill(self, slot: int, cond: torch.Tensor) -> torch.Tensor:
        n = cond.shape[0]
        pos = torch.arange(n, device=self.device)[None]
        return self._layers(cond[None], pos, slice(slot, slot + 1), n, pos)[0]

    @torch.no_grad()
    def _prefill_many(self, slots: list[int], conds: list[torch.Tensor]) -> torch.Tensor:
        """Each conditioning [n_i, H] into its slot from position 0 -> the hidden at each one's last row
        [k, H]. The conds of consecutive slots run as one forward, right-padded to the longest
        (``thinker.decode.padded_runs``): one request at a time took ~10 ms each on the H200. Where a prefill
        graph's bucket holds the longest, the graph runs them all instead (``_prefill_graphed``)."""
        from ..thinker.decode import padded_runs

        longest = max(int(c.shape[0]) for c in conds)
        bucket = next((b for b in sorted(self._prefill_graphs) if b >= longest), None)
        if bucket is not None and self.batched_prefill:
            return self._prefill_graphed(slots, conds, bucket)
        last: list[torch.Tensor | None] = [None] * len(slots)
        for run, first, x in padded_runs(slots, conds, join=self.batched_prefill):
            T = x.shape[1]
            pos = torch.arange(T, device=self.device)[None].expand(len(run), T)
            hidden = self._layers(x, pos, slice(first, first + len(run)), T, pos)
            for j, i in enumerate(run):
                last[i] = hidden[j, int(conds[i].shape[0]) - 1]
        return torch.stack(last)

    def prefill_buckets(self) -> tuple[int, ...]:
        """The condition lengths (``PREFILL_BUCKETS`` within the cache) whose prefill a graph may serve."""
        return tuple(b for b in PREFILL_BUCKETS if b <= self.max_len)

    def _prefill_padded(self, x: torch.Tensor) -> torch.Tensor:
        """Every slot's row x [capacity, T, H] from position 0 into the private K/V buffer (what
        ``_prefill_graphed``'s graphs run) -> final-norm hidden [capacity, T, H]. Rows of slots without a
        condition compute garbage there, which nothing reads."""
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)[None].expand(self.capacity, T)
        return self._layers(x, pos, slice(0, self.capacity), T, pos, caches=self._prefill_kv)

    def _ensure_prefill_kv(self) -> None:
        if self._prefill_kv is None:
            shape = (self.n_layers, self.capacity, self.n_kv, max(self.prefill_buckets()), self.head_dim)
            self._prefill_kv = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                                torch.zeros(shape, dtype=self.dtype, device=self.device))

    @torch.no_grad()
    def _prefill_graphed(self, slots: list[int], conds: list[torch.Tensor], bucket: int) -> torch.Tensor:
        """``_prefill_many`` through the graph of ``bucket`` (or eagerly on the same padded rows where no graph
        is held: the CPU tests' path): condition j in row j, right-padded to ``bucket``; then each admitted
        slot's K/V rows [0, bucket) copied from row j of the private buffer (the padding's rows are rewritten by
        the slot's decode steps before any read, as in ``padded_runs``)."""
        graph, x, hidden = self._prefill_graphs.get(bucket, (None, None, None))
        if graph is None:
            self._ensure_prefill_kv()
            x = conds[0].new_zeros(self.capacity, bucket, conds[0].shape[-1])
        else:
            x.zero_()
        for j, c in enumerate(conds):
            x[j, :c.shape[0]] = c
        if graph is None:
            hidden = self._prefill_padded(x)
        else:
            graph.replay()      # hidden: the graph's output buffer
        n = len(conds)
        vals = upload_ints(self.uploads, [list(slots), [int(c.shape[0]) - 1 for c in conds]], self.device)
        for cache, buf in zip((self.k_cache, self.v_cache), self._prefill_kv):
            cache[:, vals[0], :, :bucket] = buf[:, :n, :, :bucket]
        return hidden[torch.arange(n, device=self.device), vals[1]]

    def capture_prefill_graphs(self, buckets: tuple[int, ...] | None = None) -> None:
        """Capture the admissions' prefill at each of ``buckets`` (default: ``prefill_buckets()``) on CUDA. It
        writes only the private K/V buffer, so it may run while slots are live."""
        if self.device.type != "cuda":
            raise InputError("CUDA-graph prefill needs the talker on a CUDA device")
        self._ensure_prefill_kv()
        self.warm_projector()
        buckets = self.prefill_buckets() if buckets is None else buckets
        pool = next(iter(self._prefill_graphs.values()))[0].pool() if self._prefill_graphs else None
        for T in sorted(set(buckets) - set(self._prefill_graphs), reverse=True):     # the longest's pool serves all
            x = torch.zeros(self.capacity, T, self.tts.cfg.hidden_size, dtype=self.dtype, device=self.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.no_grad(), torch.cuda.stream(side):
                self._prefill_padded(x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
                hidden = self._prefill_padded(x)
            pool = graph.pool() if pool is None else pool
            self._prefill_graphs[T] = (graph, x, hidden)

    @torch.no_grad()
    def decode_step(self, kv_len: int | None = None) -> torch.Tensor:
        """One code for every slot: sample from the pending logits, then feed the code.

        The first step of a slot samples from its prefill logits (the audio-BOS row).
        Returns the sampled codes [capacity] (device tensor; eos for idle rows).
        """
        kv_len = kv_len or self.max_len
        logits = self.first_logits
        live = ~self.state.finished  # rows that draw a real code this step
        codes = sample_step(logits, self.state, self.params, self.tts.eos_code)
        step_idx = (self.state.step - 1).clamp_min(0)
        # Finished rows keep their last code (their step did not advance; writing would clobber it).
        old = self.codes.gather(1, step_idx[:, None])
        self.codes.scatter_(1, step_idx[:, None], torch.where(live[:, None], codes[:, None], old))
        # Feed the new code to get the next logits (finished rows compute garbage that is never read).
        x = self.tts.embed_codes(codes.clamp_max(self.tts.cfg.num_audio_tokens - 1))[:, None]
        pos = self.pos.clamp_max(self.max_len - 1)
        if self.kernels == "triton":
            hidden = self._fused_layers(x, pos[:, None])
        else:
            hidden = self._layers(x, pos[:, None], slice(0, self.capacity), kv_len, pos[:, None])
        self.first_logits.copy_(self.tts.logits(hidden[:, -1]))
        self.pos.add_((~self.state.finished).long())
        return codes

    def capture_cuda_graph(self, kv_len: int | None = None, prefill: bool = True) -> None:
        """Capture ``decode_step`` (CUDA only): one graph per key bucket (``buckets``), or only the one for
        ``kv_len``; with the fused kernels one graph over the whole cache, which serves every position.
        Call while no slot is live: the warm-up steps then change nothing but idle rows.
        Later ``step`` calls replay the shortest captured span that holds every live slot (eager when
        none does). ``prefill``: also the admissions' prefill graphs (``capture_prefill_graphs``)."""
        if self.device.type != "cuda":
            raise InputError("CUDA-graph decode needs the talker on a CUDA device")
        if self.slots:
            raise InputError("capture the talker decode graph before admitting requests")
        spans = self.buckets if kv_len is None else (min(int(kv_len), self.max_len),)
        if self.kernels == "triton":      # the fused step reads positions on the device: one graph for all
            spans = (self.max_len,)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for n in spans:
                for _ in range(2):
                    self.decode_step(n)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        for n in sorted(spans, reverse=True):       # the longest first: its pool serves the rest
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.decode_step(n)
            pool = graph.pool() if pool is None else pool
            self._graphs[n] = graph
        if prefill:
            self.capture_prefill_graphs()

    def _span(self) -> int:
        """The shortest key bucket holding the next position of every live slot (host counts: prompt
        rows + steps run, an upper bound of the device's positions)."""
        need = max((s.cond_len + s.steps_run + 1 for s in self.slots.values()), default=1)
        return next((b for b in self.buckets if b >= need), self.max_len)

    def _run_step(self) -> None:
        span = self._span()
        graph = next((self._graphs[n] for n in sorted(self._graphs) if n >= span), None)
        if graph is not None:
            graph.replay()
        else:
            self.decode_step(span)

    # ---- host side -------------------------------------------------------------------------
    def _boundary(self, s: _Slot) -> int:
        return self.first_window if s.emitted == 0 else s.emitted + self.window

    def step(self) -> list[CodecChunk]:
        """Admit what fits, run one decode step, emit the windows that are due."""
        self._admit()
        if not self.slots:
            return []
        self._run_step()
        for s in self.slots.values():
            s.steps_run += 1
        due = [i for i, s in self.slots.items() if s.steps_run >= self._boundary(s)]
        if not due:
            return []
        return self._emit(due)

    def _emit(self, due: list[int], flush: bool = False) -> list[CodecChunk]:
        # One host sync per emission: counters, flags and the code rows of the due slots.
        steps = self.state.step.cpu()
        finished = self.state.finished.cpu()
        codes_host = self.codes.cpu()
        out = []
        eos = self.tts.eos_code
        for i in list(self.slots) if flush else due:
            s = self.slots[i]
            n = int(steps[i])
            got = codes_host[i, s.emitted:n].tolist()
            done = bool(finished[i])
            if done and got and got[-1] == eos:
                got = got[:-1]
            if not done:
                got = got[: self._boundary(s) - s.emitted]
            out.append(CodecChunk(s.request.request_id, s.seq, tuple(s.context + got), CONTEXT_CODES, done))
            s.seq += 1
            s.emitted += len(got)
            if got:
                s.context = (s.context + got)[-CONTEXT_CODES:]
            if done:
                del self.slots[i]
        return out

    def run(self, requests: list[TalkerRequest]) -> dict[str, list[CodecChunk]]:
        """Run requests to completion; returns each request's chunks in order."""
        for r in requests:
            self.submit(r)
        result: dict[str, list[CodecChunk]] = {r.request_id: [] for r in requests}
        while self.pending or self.slots:
            for ch in self.step():
                result[ch.request_id].append(ch)
            # Slots that finished between windows are found at their next boundary.
        return result
