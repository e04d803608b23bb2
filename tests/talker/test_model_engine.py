from dataclasses import replace

import pytest
import torch

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, reference_config, tiny_config
from minicpmo_rt.snapshot_tools import check_manifest
from minicpmo_rt.talker.engine import SILENCE_CODE, TalkerEngine, TalkerRequest, kv_bytes_per_token
from minicpmo_rt.talker.model import MiniCPMTTS
from minicpmo_rt.talker.sampler import SamplingParams
from minicpmo_rt.errors import InputError
from minicpmo_rt.thinker import kernels as K
from tests.conftest import rel_err


@pytest.fixture(scope="module")
def tts():
    cfg = MiniCPMOConfig.from_dict(tiny_config())
    torch.manual_seed(0)
    m = MiniCPMTTS(cfg.tts)
    randomize_(m, seed=3, prefix="tts.")
    return m.eval()


def _request(rid, n=5, seed=1, max_codes=60, llm_dim=128):
    g = torch.Generator().manual_seed(sum(map(ord, rid)))     # not hash(): str hashes change per process
    return TalkerRequest(rid, torch.randint(0, 151000, (n,), generator=g), torch.randn(n, llm_dim, generator=g),
                         seed=seed, max_codes=max_codes)


def test_manifest_tts_prefix(shared_dir):
    res = check_manifest(shared_dir / "config.json", shared_dir / "state_dict_manifest.json")
    rep = res.reports["tts"]
    assert rep.ok, rep.details()
    assert rep.matched == 194


def test_condition_layout(tts):
    req = _request("a", n=4)
    cond = tts.condition(req.text_ids, req.hidden)
    assert cond.shape == (6, tts.cfg.hidden_size)
    proj = torch.nn.functional.normalize(tts.projector_semantic(req.hidden), dim=-1)
    assert rel_err(cond[:4], tts.emb_text(req.text_ids) + proj) < 1e-6
    assert torch.equal(cond[4], tts.emb_text.weight[tts.cfg.text_eos_token_id])
    assert torch.equal(cond[5], tts.emb_text.weight[tts.cfg.audio_bos_token_id])


def test_static_cache_step_matches_transformers_forward(tts):
    """Prefill + 20 teacher-forced decode steps on the engine's own static-cache math vs
    transformers' LlamaModel over the whole sequence (fp32)."""
    eng = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22)
    req = _request("a", n=6)
    cond = tts.condition(req.text_ids, req.hidden)
    codes = torch.randint(0, 6561, (20,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h = eng._prefill(1, cond)
        logits = [tts.logits(h[-1])]
        pos = cond.shape[0]
        for c in codes:
            x = tts.embed_codes(c.view(1))[None].expand(2, 1, -1).contiguous()
            p = torch.tensor([[pos], [pos]])
            hh = eng._layers(x, p, slice(0, 2), eng.max_len, p)
            logits.append(tts.logits(hh[1, -1]))
            pos += 1
        full = torch.cat([cond, tts.embed_codes(codes)])[None]
        ref_h, _ = tts.forward_reference(full, torch.arange(full.shape[1])[None])
        ref = tts.logits(ref_h[0, cond.shape[0] - 1:])
    err = rel_err(torch.stack(logits), ref)
    assert err < 1e-5, err


def test_engine_chunks_contract_and_reproducibility(tts):
    params = SamplingParams(min_codes=5, max_codes=40)
    eng = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
    reqs = [_request("a", seed=7, max_codes=40), _request("b", seed=8, max_codes=33), _request("c", seed=9, max_codes=12)]
    out = eng.run(reqs)
    for rid, chunks in out.items():
        assert chunks and chunks[-1].final and not any(c.final for c in chunks[:-1])
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert chunks[0].codes[:3] == (SILENCE_CODE,) * 3
        new = [c.codes[3:] for c in chunks]
        assert len(new[0]) <= 10 and all(len(w) <= 25 for w in new)
        flat = [x for w in new for x in w]
        assert all(0 <= x < 6561 for x in flat)
        for prev, cur in zip(chunks, chunks[1:]):
            allcodes = list(prev.codes[3:])
            if allcodes:
                assert cur.codes[:3] == tuple((list(prev.codes[:3]) + allcodes)[-3:])
    assert sum(len(c.codes) - 3 for c in out["c"]) <= 12
    # Same request alone in a fresh engine: same codes (counter-based RNG, batch-independent).
    alone = TalkerEngine(tts, capacity=1, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
    got = alone.run([_request("b", seed=8, max_codes=33)])["b"]
    assert [c.codes for c in got] == [c.codes for c in out["b"]]


def test_request_that_can_never_fit_is_refused(tts):
    eng = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 20)
    with pytest.raises(InputError, match="never fit"):
        eng.submit(_request("x", max_codes=100000))
    with pytest.raises(InputError, match="budget"):
        TalkerEngine(tts, capacity=16, kv_budget_bytes=1000)


def test_max_codes_limit_yields_exactly_max_codes(tts):
    """A slot stopped by its code limit keeps its last code (regression: EOS overwrote it)."""
    params = SamplingParams(min_codes=10**6, max_codes=17)  # EOS never allowed: only the limit stops
    eng = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
    out = eng.run([_request("a", seed=3, max_codes=17), _request("b", seed=4, max_codes=9)])
    for rid, n in (("a", 17), ("b", 9)):
        codes = [c for ch in out[rid] for c in ch.codes[3:]]
        assert len(codes) == n and all(0 <= c < 6561 for c in codes)


def test_graph_decode_needs_cuda_and_an_idle_engine(tts):
    eng = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22)
    with pytest.raises(InputError, match="CUDA"):
        eng.capture_cuda_graph()
    with pytest.raises(InputError, match="CUDA"):
        eng.capture_prefill_graphs()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_graph_decode_emits_the_eager_engines_chunks(tts, kernels):
    """The turn pipeline replays the Talker's decode step from CUDA graphs (``TurnPipeline.from_snapshot``
    on CUDA), one per key bucket with the torch step, one for every position with the fused one: the same
    requests give the same chunks as the eager engine (the sampler's counter-based RNG lives in device
    tensors the graphs update)."""
    dev_tts = MiniCPMTTS(tts.cfg)
    dev_tts.load_state_dict(tts.state_dict())
    dev_tts = dev_tts.cuda().eval()
    params = SamplingParams(min_codes=10**6, max_codes=150)     # "a" passes 128 keys: two buckets replay
    reqs = lambda: [_request("a", seed=7, max_codes=150), _request("b", seed=8, max_codes=33),  # noqa: E731
                    _request("c", seed=9, max_codes=12)]
    eager = TalkerEngine(dev_tts, capacity=2, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10,
                         kernels=kernels)
    graphed = TalkerEngine(dev_tts, capacity=2, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10,
                           kernels=kernels)
    graphed.capture_cuda_graph()
    assert sorted(graphed._graphs) == (list(graphed.buckets) if kernels == "torch" else [graphed.max_len])
    assert tuple(sorted(graphed._prefill_graphs)) == graphed.prefill_buckets()
    want, got = eager.run(reqs()), graphed.run(reqs())
    assert sum(len(c.codes) - 3 for c in got["a"]) == 150
    assert {k: [c.codes for c in v] for k, v in got.items()} == {k: [c.codes for c in v] for k, v in want.items()}
    with pytest.raises(InputError, match="before admitting"):
        graphed.submit(_request("d"))
        graphed.step()
        graphed.capture_cuda_graph()


def test_projector_padded_to_its_row_bucket_gives_each_rows_own_result(tts):
    """An admission's projector pass runs over a row bucket on CUDA (``_projector_rows``; zero rows appended):
    the appended rows change no row's result (fp32, 1e-6); off CUDA no padding is asked for."""
    eng = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22)
    hid = torch.randn(37, tts.cfg.llm_dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain, padded = eng._project(hid), eng._project(hid, 64)
    assert padded.shape == plain.shape and rel_err(padded, plain) <= 1e-6
    assert eng._projector_rows(37) == 37
    eng.warm_projector()                                       # runs on any device; CUDA is where it matters


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_admission_takes_rows_on_the_device_or_the_host_alike(tts):
    """On CUDA the Thinker hands its hidden rows over on the device (``TalkerInput``); the engine joins them
    there, pads the projector's rows to a bucket, and gives the same codes as for the same rows on the host."""
    from minicpmo_rt.talker.engine import PROJECTOR_ROWS

    dev_tts = MiniCPMTTS(tts.cfg)
    dev_tts.load_state_dict(tts.state_dict())
    dev_tts = dev_tts.cuda().eval()
    eng = TalkerEngine(dev_tts, capacity=3, kv_budget_bytes=1 << 22)
    assert eng._projector_rows(37) == 64 and eng._projector_rows(PROJECTOR_ROWS[-1] + 1) == PROJECTOR_ROWS[-1] + 1
    reqs = [_request(r, n=n, seed=s) for r, n, s in (("a", 9, 1), ("b", 30, 2), ("c", 4, 3))]
    on_dev = [replace(r, hidden=r.hidden.cuda()) for r in reqs]
    host = TalkerEngine(dev_tts, capacity=3, kv_budget_bytes=1 << 22).run(reqs)
    dev = eng.run(on_dev)
    assert {k: [c.codes for c in v] for k, v in dev.items()} == {k: [c.codes for c in v] for k, v in host.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_admission_and_a_step_never_wait_for_queued_work(tts):
    """With ~1 s of device work queued ahead, the step that admits three requests (host text ids and hidden rows on
    the device, as the turn contract hands them over) and runs their first decode step returns without waiting
    for it: the ids, the tail tokens, the slots and positions and the sampler's state go up pinned. Until session
    51 each went up from pageable memory, and a copy from pageable memory syncs the stream first. The codes equal
    those of an engine run on the same requests without a queue."""
    from tests.conftest import behind_queued_work

    dev_tts = MiniCPMTTS(tts.cfg)
    dev_tts.load_state_dict(tts.state_dict())
    dev_tts = dev_tts.cuda().eval()
    reqs = [replace(r, hidden=r.hidden.cuda()) for r in
            (_request(r, n=n, seed=s) for r, n, s in (("a", 9, 1), ("b", 30, 2), ("c", 4, 3)))]
    want = TalkerEngine(dev_tts, capacity=3, kv_budget_bytes=1 << 22).run(reqs)    # also warms the kernels
    eng = TalkerEngine(dev_tts, capacity=3, kv_budget_bytes=1 << 22)
    for r in reqs:
        eng.submit(r)
    first, host_s = behind_queued_work(eng.step)
    assert host_s < 0.2, f"the admitting step waited {host_s:.3f} s for the queued work"
    assert first == [] and len(eng.slots) == 3      # admitted, no window due after one step
    got: dict[str, list] = {r.request_id: [] for r in reqs}
    while eng.pending or eng.slots:
        for ch in eng.step():
            got[ch.request_id].append(ch)
    assert {k: [c.codes for c in v] for k, v in got.items()} == {k: [c.codes for c in v] for k, v in want.items()}

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_graph_replays_the_eager_padded_prefill(tts):
    """A prefill graph's replay against the same padded prefill run eagerly (fp32; the same kernels, so
    within 1e-6), also while a slot is live: that slot's cache is not touched."""
    dev_tts = MiniCPMTTS(tts.cfg)
    dev_tts.load_state_dict(tts.state_dict())
    dev_tts = dev_tts.cuda().eval()
    H = tts.cfg.hidden_size
    conds = [torch.randn(n, H, device="cuda") for n in (30, 7)]
    eager = TalkerEngine(dev_tts, capacity=3, kv_budget_bytes=1 << 22)
    graphed = TalkerEngine(dev_tts, capacity=3, kv_budget_bytes=1 << 22)
    graphed.capture_prefill_graphs((16, 32))
    assert sorted(graphed._prefill_graphs) == [16, 32]
    live = torch.randn_like(graphed.k_cache[:, 1])
    graphed.k_cache[:, 1] = live
    want = eager._prefill_graphed([0, 2], conds, 32)
    got = graphed._prefill_many([0, 2], conds)          # picks bucket 32's graph
    assert rel_err(got, want) <= 1e-6
    for slot in (0, 2):
        assert rel_err(graphed.k_cache[:, slot, :, :32], eager.k_cache[:, slot, :, :32]) <= 1e-6
        assert rel_err(graphed.v_cache[:, slot, :, :32], eager.v_cache[:, slot, :, :32]) <= 1e-6
    assert torch.equal(graphed.k_cache[:, 1], live)


def test_kv_buckets_cover_the_cache():
    from minicpmo_rt.talker.engine import kv_buckets

    assert kv_buckets(4096) == (128, 256, 512, 1024, 2048, 4096)
    assert kv_buckets(300) == (128, 256, 300)
    assert kv_buckets(100) == (100,)


def test_decode_steps_attend_over_the_shortest_bucket_and_change_no_code(tts):
    """Each step attends over the shortest key bucket holding every live slot's next position; the keys
    it leaves out are masked anyway, so the codes equal attending over the whole cache every step."""
    params = SamplingParams(min_codes=10**6, max_codes=150)
    reqs = lambda: [_request("a", n=6, seed=5, max_codes=150), _request("b", n=3, seed=6, max_codes=40)]  # noqa: E731
    eng = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
    spans = []
    step = eng.decode_step
    eng.decode_step = lambda kv_len=None: (spans.append(kv_len), step(kv_len))[1]
    got = eng.run(reqs())
    whole = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
    whole.buckets = (whole.max_len,)
    want = whole.run(reqs())
    assert {k: [c.codes for c in v] for k, v in got.items()} == {k: [c.codes for c in v] for k, v in want.items()}
    # "a" has 6 text rows + 2 and 150 codes: 128 keys until its position passes 127, then 256
    assert spans[0] == 128 and spans[-1] == 256 and spans == sorted(spans)
    assert spans.count(128) == 128 - 8 and eng.max_len == 2048     # 4 MiB over 2 slots of 1 KiB per position


def test_requests_admitted_together_prefill_in_one_forward_as_each_alone(tts):
    """Requests admitted on the same step are prefilled together (consecutive slots in one right-padded
    forward): each slot's K/V over its conditioning and its last hidden equal a prefill alone (fp32
    rounding), slots 0 and 2-3 make two runs, and three requests of different lengths admitted together
    emit the codes each emits alone."""
    eng = TalkerEngine(tts, capacity=4, kv_budget_bytes=1 << 22, window=25, first_window=10)
    torch.manual_seed(4)
    H = tts.cfg.hidden_size
    conds = [torch.randn(n, H) for n in (6, 3, 9)]
    calls = []
    layers = eng._layers
    eng._layers = lambda x, *a: (calls.append(tuple(x.shape[:2])), layers(x, *a))[1]
    last = eng._prefill_many([2, 0, 3], conds)
    assert sorted(calls) == [(1, 3), (2, 9)]
    alone = TalkerEngine(tts, capacity=1, kv_budget_bytes=1 << 22, window=25, first_window=10)
    for j, slot in enumerate([2, 0, 3]):
        n = conds[j].shape[0]
        h = alone._prefill(0, conds[j])
        assert rel_err(last[j], h[-1]) <= 1e-5
        assert rel_err(eng.k_cache[:, slot, :, :n], alone.k_cache[:, 0, :, :n]) <= 1e-5
        assert rel_err(eng.v_cache[:, slot, :, :n], alone.v_cache[:, 0, :, :n]) <= 1e-5

    params = SamplingParams(min_codes=5, max_codes=40)
    reqs = lambda: [_request("a", n=4, seed=1), _request("b", n=9, seed=2), _request("c", n=6, seed=3)]  # noqa: E731
    together = TalkerEngine(tts, capacity=3, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
    got = together.run(reqs())
    for req in reqs():
        one = TalkerEngine(tts, capacity=1, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
        assert [c.codes for c in one.run([req])[req.request_id]] == [c.codes for c in got[req.request_id]]


def test_padded_prefill_touches_only_the_admitted_slots_and_matches_the_runs(tts):
    """The graphs' prefill (``_prefill_graphed``, eager here: no graph is held on the CPU): every slot's row,
    the conditions padded to a length bucket, into the private K/V buffer, then copied into the admitted
    slots. Their K/V over the conditions and their last hidden equal the eager runs' (fp32 rounding); a live
    slot's cache and a free one's stay bit for bit as they were."""
    H = tts.cfg.hidden_size
    torch.manual_seed(5)
    conds = [torch.randn(n, H) for n in (6, 3)]
    eng = TalkerEngine(tts, capacity=4, kv_budget_bytes=1 << 22)
    eng.k_cache.normal_()
    eng.v_cache.normal_()
    before = eng.k_cache.clone(), eng.v_cache.clone()
    last = eng._prefill_graphed([2, 0], conds, 16)
    ref = TalkerEngine(tts, capacity=4, kv_budget_bytes=1 << 22)
    want = ref._prefill_many([2, 0], conds)
    assert rel_err(last, want) <= 1e-5
    for j, slot in enumerate([2, 0]):
        n = conds[j].shape[0]
        for got, exp in ((eng.k_cache, ref.k_cache), (eng.v_cache, ref.v_cache)):
            assert rel_err(got[:, slot, :, :n], exp[:, slot, :, :n]) <= 1e-5
        for got, old in zip((eng.k_cache, eng.v_cache), before):
            assert torch.equal(got[:, slot, :, 16:], old[:, slot, :, 16:])
    for slot in (1, 3):
        assert torch.equal(eng.k_cache[:, slot], before[0][:, slot])
        assert torch.equal(eng.v_cache[:, slot], before[1][:, slot])
    assert eng.prefill_buckets() == tuple(b for b in (16, 32, 64, 128, 256) if b <= eng.max_len)


def test_padded_prefill_emits_the_eager_engines_codes(tts):
    """Requests of different lengths admitted together and one after another (a slot freed and taken while
    another is live) through the padded prefill give the codes of the eager runs."""
    params = SamplingParams(min_codes=5, max_codes=40)
    reqs = lambda: [_request("a", n=4, seed=1), _request("b", n=19, seed=2, max_codes=12),  # noqa: E731
                    _request("c", n=6, seed=3)]
    padded = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
    buckets = []

    def through_buckets(slots, conds):
        bucket = next(b for b in padded.prefill_buckets() if b >= max(c.shape[0] for c in conds))
        buckets.append(bucket)
        return padded._prefill_graphed(slots, conds, bucket)

    padded._prefill_many = through_buckets
    got = padded.run(reqs())
    assert buckets == [32, 16]        # "a" and "b" (21 rows) together, then "c" in "b"'s freed slot
    eager = TalkerEngine(tts, capacity=2, kv_budget_bytes=1 << 22, params=params, window=25, first_window=10)
    want = eager.run(reqs())
    assert {k: [c.codes for c in v] for k, v in got.items()} == {k: [c.codes for c in v] for k, v in want.items()}


@pytest.mark.skipif(not K.usable_on(torch.empty(0)), reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_fused_decode_step_equals_the_reference_step(tts):
    """The Triton decode step (packed GEMMs, fused norms, RoPE + cache write, split-KV attention at each
    slot's device-side position; run here through Triton's interpreter) against transformers' Llama modules
    over a key bucket: three slots at different positions, one finishing early; every step's logits and
    the written K/V within fp32 rounding, and the same codes."""
    params = SamplingParams(min_codes=2)       # (the interpreter takes ~0.5 s a step)
    budget = 3 * 256 * kv_bytes_per_token(tts, torch.float32)
    fused = TalkerEngine(tts, 3, budget, params, window=2, first_window=2, kernels="triton")
    plain = TalkerEngine(tts, 3, budget, params, window=2, first_window=2, kernels="torch")
    assert fused.kernels == "triton" and plain.kernels == "torch" and fused.max_len == 256
    reqs = lambda: [_request("a", n=7, seed=1, max_codes=8), _request("b", n=3, seed=2, max_codes=3),  # noqa: E731
                    _request("c", n=11, seed=3, max_codes=8)]
    for eng in (fused, plain):
        for r in reqs():
            eng.submit(r)
    got = {r.request_id: [] for r in reqs()}
    want = {r.request_id: [] for r in reqs()}
    steps = 0
    while fused.slots or fused.pending or plain.slots or plain.pending:
        for ch in fused.step():
            got[ch.request_id].append(ch.codes)
        for ch in plain.step():
            want[ch.request_id].append(ch.codes)
        steps += 1
        assert rel_err(fused.first_logits, plain.first_logits) <= 1e-5, steps
    assert got == want and steps >= 8 and len(got["b"]) < len(got["a"])
    n = int(plain.pos.max())
    assert rel_err(fused.k_cache[:, :, :, :n], plain.k_cache[:, :, :, :n]) <= 1e-5
    with pytest.raises(InputError, match="kernels='fast'"):
        TalkerEngine(tts, 1, budget, kernels="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_fused_decode_step_equals_the_reference_step(tts, dtype, tol):
    """On CUDA (``"auto"`` picks the fused step there), the compiled kernels against the torch step: every
    step's logits within the precision's rounding (fp32 1e-5; bf16 2e-2, a few bf16 roundings that RoPE and
    the norms take in another order), the same codes in fp32, and the first step's in bf16."""
    dev_tts = MiniCPMTTS(tts.cfg)
    dev_tts.load_state_dict(tts.state_dict())
    dev_tts = dev_tts.to("cuda", dtype).eval()
    params = SamplingParams(min_codes=10**6, max_codes=40)
    budget = 3 * 512 * kv_bytes_per_token(dev_tts, dtype)
    fused = TalkerEngine(dev_tts, 3, budget, params, window=10, first_window=5)
    plain = TalkerEngine(dev_tts, 3, budget, params, window=10, first_window=5, kernels="torch")
    assert fused.kernels == "triton"
    reqs = lambda: [_request("a", n=7, seed=1, max_codes=40), _request("b", n=3, seed=2, max_codes=9),  # noqa: E731
                    _request("c", n=11, seed=3, max_codes=40)]
    for eng in (fused, plain):
        for r in reqs():
            eng.submit(r)
        eng._admit()
    worst = 0.0
    for step in range(40):
        if dtype == torch.bfloat16 and step == 1:
            break                   # sampled codes may part after the first bf16 step; the logits were compared
        fused.step()
        plain.step()
        worst = max(worst, rel_err(fused.first_logits, plain.first_logits))
    assert worst <= tol, worst
    if dtype == torch.float32:
        assert torch.equal(fused.codes, plain.codes)
