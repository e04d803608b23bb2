"""The duplex Talker (upstream generate_chunk driven by streaming_generate) on the tiny config."""

import pytest
import torch
import torch.nn.functional as F

from minicpmo_rt.checkpoint.config import MiniCPMOConfig
from minicpmo_rt.checkpoint.tiny import randomize_, tiny_config
from minicpmo_rt.errors import InputError
from minicpmo_rt.talker.chunked import ChunkSampling, TalkerTurn
from minicpmo_rt.talker.model import MiniCPMTTS

from conftest import rel_err, requires_cuda


@pytest.fixture(scope="module")
def tts():
    m = MiniCPMTTS(MiniCPMOConfig.from_dict(tiny_config()).tts)
    randomize_(m, seed=3, prefix="tts.")
    return m.eval()


def _unit(n, seed, llm_dim=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151000, (n,), generator=g).tolist(), torch.randn(n, llm_dim, generator=g)


def test_condition_is_normalised_rows_then_audio_bos(tts):
    turn = TalkerTurn(tts)
    ids, hid = _unit(3, 0)
    cond = turn.condition(ids, hid)
    bos = tts.emb_text(torch.tensor([tts.cfg.audio_bos_token_id]))
    ref = tts.emb_text(torch.tensor(ids)) + F.normalize(tts.projector_semantic(hid), dim=-1)
    assert cond.shape == (4, tts.cfg.hidden_size)
    assert rel_err(cond[:3], ref) <= 1e-6 and torch.equal(cond[3:], bos)
    assert torch.equal(turn.condition([], torch.zeros(0, 128)), bos)   # a unit without tokens
    with pytest.raises(InputError, match="2 text ids but 3 hidden rows"):
        turn.condition([1, 2], torch.zeros(3, 128))


@torch.no_grad()
def test_a_turn_keeps_one_cache_whose_rows_are_the_conditions_and_codes(tts):
    """After each mid-turn unit the cache holds exactly condition + returned codes (the last draw is
    never fed), at consecutive positions: it equals one forward of all those rows at once."""
    turn = TalkerTurn(tts, seed=5)
    rows = []
    for k in range(3):
        ids, hid = _unit(2 + k, k)
        start = turn.text_start_pos
        out = turn.generate_unit(ids, hid, turn_end=False)
        assert out.start_pos == start and out.turn_start == (k == 0) and not out.turn_end
        rows += [turn.condition(ids, hid), tts.embed_codes(torch.tensor(out.codes, dtype=torch.long))]
        if k > 0:
            assert len(out.codes) == 25 and not out.eos     # mid-turn: EOS masked for all 26 draws
        assert turn.text_start_pos == sum(r.shape[0] for r in rows)
    x = torch.cat(rows)[None]
    ref, ref_cache = tts.forward_reference(x, torch.arange(x.shape[1])[None])
    k_inc = turn.cache.layers[0].keys if hasattr(turn.cache, "layers") else turn.cache.key_cache[0]
    k_ref = ref_cache.layers[0].keys if hasattr(ref_cache, "layers") else ref_cache.key_cache[0]
    assert k_inc.shape == k_ref.shape and rel_err(k_inc, k_ref) <= 1e-5


def test_turn_end_resets_and_the_next_unit_starts_a_turn(tts):
    turn = TalkerTurn(tts, seed=1)
    turn.generate_unit(*_unit(3, 1), turn_end=False)
    out = turn.generate_unit(*_unit(2, 2), turn_end=True)
    assert out.turn_end and turn.cache is None and turn.text_start_pos == 0
    assert turn.generate_unit(*_unit(2, 3), turn_end=False).turn_start


def test_draw_masks_eos_only_when_asked_and_penalises_this_units_codes(tts):
    turn = TalkerTurn(tts, ChunkSampling(temperature=1e-3))   # near-greedy
    eos = tts.eos_code
    x = torch.zeros(tts.cfg.num_audio_tokens)
    x[eos], x[7] = 5.0, 4.99
    assert turn.draw(x, [], mask_eos=False) == eos
    assert turn.draw(x, [], mask_eos=True) == 7
    y = torch.zeros(tts.cfg.num_audio_tokens)
    y[7], y[8] = 1.0, 0.99
    assert turn.draw(y, [], mask_eos=True) == 7
    assert turn.draw(y, [7], mask_eos=True) == 8          # 1.0 / 1.05 < 0.99


def test_draws_are_reproducible_per_seed(tts):
    a = TalkerTurn(tts, seed=9).generate_unit(*_unit(3, 4), turn_end=False).codes
    b = TalkerTurn(tts, seed=9).generate_unit(*_unit(3, 4), turn_end=False).codes
    c = TalkerTurn(tts, seed=10).generate_unit(*_unit(3, 4), turn_end=False).codes
    assert a == b and a != c


@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"max_new_codes": 0}, {"window": 0}])
def test_bad_sampling_is_named(kw):
    with pytest.raises(InputError):
        ChunkSampling(**kw)


@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=requires_cuda)])
def test_static_cache_backend_equals_the_reference(tts, graphs):
    """The fast path for one conversation (a one-seat ``TalkerTurns``: the engine's model math on a static
    cache; on CUDA the fused draw forward from one graph) draws the same codes as the transformers reference over a turn of
    three units, a turn end and a new turn."""
    from minicpmo_rt.talker.chunked import TalkerTurns

    dev = "cuda" if graphs else "cpu"
    model = tts.to(dev)
    ref = TalkerTurn(model, seed=7)
    turns = TalkerTurns(model, 1, seeds=[7], max_len=512, graphs=graphs)
    fast = turns.seat(0)
    assert turns.graphs == ((1 if turns.fused else 2) if graphs else 0)     # fused on CUDA: one graph
    try:
        for k, end in enumerate([False, False, True, False]):
            ids, hid = _unit(2 + k, 10 + k)
            a, b = ref.generate_unit(ids, hid, end), fast.generate_unit(ids, hid.to(dev), end)
            assert a == b, f"unit {k}"
        assert fast.text_start_pos == ref.text_start_pos and fast.draws == ref.draws
    finally:
        tts.to("cpu")


# ---- several conversations on one cache (TalkerTurns) --------------------------------------------------

# (seat, unit seed, turn_end) per round; a seat missing from a round is idle in it
_ROUNDS = [[(0, 20, False), (1, 21, False), (2, 22, True)],
           [(0, 23, False), (2, 24, False)],
           [(1, 25, True), (2, 26, False), (0, 27, False)],
           [(0, 28, True), (1, 29, False)],
           [(2, 30, True), (1, 31, False), (0, 32, False)]]


def _eos_prone(tts, boost):
    """A copy of the tiny Talker whose EOS row of the code head is scaled up, so that units which may stop
    (a turn's first and last) stop after a few draws and the others in the round go on without them."""
    import copy

    m = copy.deepcopy(tts)
    with torch.no_grad():   # the weight-normed head's per-row magnitude (g)
        g = dict(m.head_code[0].named_parameters())
        (g.get("parametrizations.weight.original0") if "weight_g" not in g else g["weight_g"])[m.eos_code] *= boost
    return m


@pytest.mark.parametrize("boost", [1.0, 8.0])
def test_talker_turns_draw_what_each_conversation_draws_alone(tts, boost):
    """Three seats stepping together (some idle in a round, turns ending and starting at different rounds)
    give each conversation the codes, EOS flags and positions of its own ``TalkerTurn`` (the transformers
    reference) with the same seed; with a boosted EOS some units stop early while others keep drawing."""
    from minicpmo_rt.talker.chunked import SeatUnit, TalkerTurns

    model = _eos_prone(tts, boost) if boost != 1.0 else tts
    alone = [TalkerTurn(model, seed=40 + i) for i in range(3)]
    together = TalkerTurns(model, 3, seeds=[40, 41, 42], max_len=512, graphs=False)
    lengths = set()
    for rnd in _ROUNDS:
        units = [SeatUnit(seat, *map(tuple, [_unit(2 + seed % 3, seed)[0]]), _unit(2 + seed % 3, seed)[1], end)
                 for seat, seed, end in rnd]
        got = together.generate_units(units)
        for (seat, seed, end), out in zip(rnd, got):
            ids, hid = _unit(2 + seed % 3, seed)
            assert out == alone[seat].generate_unit(ids, hid, end), f"seat {seat}, unit seed {seed}"
            assert together.text_start_pos[seat] == alone[seat].text_start_pos
            assert together.draws[seat] == alone[seat].draws
        lengths |= {len(o.codes) for o in got}
    if boost != 1.0:
        assert min(lengths) < 25 and 25 in lengths, lengths   # ragged rounds were exercised


def test_talker_seat_steps_one_conversation_and_checks_its_input(tts):
    from minicpmo_rt.talker.chunked import SeatUnit, TalkerTurns

    turns = TalkerTurns(tts, 2, seeds=[5, 6], max_len=128, graphs=False)
    seat = turns.seat(1)
    ref = TalkerTurn(tts, seed=6)
    for end in (False, True, False):
        ids, hid = _unit(3, 50 + end)
        assert seat.generate_unit(ids, hid, end) == ref.generate_unit(ids, hid, end)
        assert seat.text_start_pos == ref.text_start_pos
    assert turns.text_start_pos[0] == 0 and turns.draws[0] == 0     # the other seat never drew
    seat.reset()
    assert seat.text_start_pos == 0
    with pytest.raises(InputError, match="seat 2 does not exist"):
        turns.seat(2)
    with pytest.raises(InputError, match="must be distinct"):
        turns.generate_units([SeatUnit(0, (), torch.zeros(0, 128), False)] * 2)
    with pytest.raises(InputError, match="one seed per seat"):
        TalkerTurns(tts, 2, seeds=[1])
    with pytest.raises(InputError, match="larger max_len"):
        turns.generate_units([SeatUnit(0, *_unit(110, 1), False)])
    with pytest.raises(InputError, match="precapture rows"):
        turns.precapture((8, 0))
    with pytest.raises(InputError, match="precapture rows"):
        turns.precapture((8,), kv_len=turns.max_len + 1)
    assert turns.precapture() == 0      # no graphs off CUDA: nothing to capture


@requires_cuda
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_talker_turns_graph_equals_the_eager_batch(kernels):
    """On CUDA the batched draw replays a graph (one per bucket with the torch step, one for every position
    with the fused one), the draw another, and the conditions' prefill one per (rows, bucket), captured at first
    use and eager past its budget; it draws what the eager batch draws (same device, same math), seats idle or
    ragged included. In FP32 the fused step draws what the torch step draws."""
    from minicpmo_rt.talker.chunked import SeatUnit, TalkerTurns

    m = MiniCPMTTS(MiniCPMOConfig.from_dict(tiny_config()).tts)
    randomize_(m, seed=3, prefix="tts.")
    model = _eos_prone(m.eval(), 8.0).to("cuda")
    eager = TalkerTurns(model, 3, seeds=[1, 2, 3], max_len=512, graphs=False, kernels=kernels)
    graph = TalkerTurns(model, 3, seeds=[1, 2, 3], max_len=512, graphs=True, kernels=kernels)
    plain = TalkerTurns(model, 3, seeds=[1, 2, 3], max_len=512, graphs=False, kernels="torch")
    assert graph.graphs == (len(graph.buckets) if kernels == "torch" else 1) and eager.graphs == 0
    assert graph.fused == (kernels == "triton")
    tight = TalkerTurns(model, 3, seeds=[1, 2, 3], max_len=512, graphs=True, kernels=kernels, max_prefill_graphs=1)
    # precaptured: the prefill graphs of conditions up to 16 rows exist before any unit, and the units' prefills
    # replay them (their warm-ups wrote at the idle position only: the codes are the eager batch's)
    ready = TalkerTurns(model, 3, seeds=[1, 2, 3], max_len=512, graphs=True, kernels=kernels)
    assert ready.precapture((5, 16)) == 2 and set(ready._prefill_graphs) == {(8, 256), (16, 256)}
    held = dict(ready._prefill_graphs)
    assert eager.precapture() == 0
    for k, rnd in enumerate(_ROUNDS):
        n = 3 if k % 2 else 9      # conditions of 4 and 10 rows: prefill row buckets 8 and 16
        units = [SeatUnit(seat, tuple(_unit(n, seed)[0]), _unit(n, seed)[1].cuda(), end) for seat, seed, end in rnd]
        got = graph.generate_units(units)
        assert eager.generate_units(units) == got
        assert plain.generate_units(units) == got
        assert tight.generate_units(units) == got
        assert ready.generate_units(units) == got
    assert eager._prefill_graphs is None and set(graph._prefill_graphs) == {(8, 256), (16, 256)}
    assert len(tight._prefill_graphs) == 1
    assert all(ready._prefill_graphs[key] is held[key] for key in held) and len(ready._prefill_graphs) == 2


@pytest.mark.skipif(not __import__("minicpmo_rt.thinker.kernels", fromlist=["usable_on"]).usable_on(torch.empty(0)),
                    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_talker_turns_fused_step_draws_what_the_torch_step_draws(tts):
    """The fused draw forward (the Talker engine's Triton kernels, here through the interpreter; an idle seat
    reads one row) against the torch one over the bucket: the same codes, EOS flags and positions per seat,
    with seats idle in some rounds and a turn ending. Short units: the interpreter takes ~0.5 s a draw."""
    from minicpmo_rt.talker.chunked import SeatUnit, TalkerTurns

    short = ChunkSampling(max_new_codes=4)
    fused = TalkerTurns(tts, 3, short, seeds=[40, 41, 42], max_len=256, graphs=False, kernels="triton")
    plain = TalkerTurns(tts, 3, short, seeds=[40, 41, 42], max_len=256, graphs=False, kernels="torch")
    assert fused.fused and not plain.fused
    for rnd in _ROUNDS[:3]:
        units = [SeatUnit(seat, tuple(_unit(2, seed)[0]), _unit(2, seed)[1], end) for seat, seed, end in rnd]
        assert fused.generate_units(units) == plain.generate_units(units)
        assert fused.text_start_pos == plain.text_start_pos and fused.draws == plain.draws


def test_talker_turns_attend_only_the_live_bucket(tts):
    """A turn that grows past the first attention bucket (256) switches to the next one, and what it draws
    does not depend on the bucket: each seat draws what its own ``TalkerTurn`` (the transformers reference,
    attending exactly its positions) draws, before and after the switch."""
    from minicpmo_rt.talker.chunked import SeatUnit, TalkerTurns

    turns = TalkerTurns(tts, 2, seeds=[3, 4], max_len=512, graphs=False)
    alone = [TalkerTurn(tts, seed=3), TalkerTurn(tts, seed=4)]
    assert turns.buckets == [256, 512] and TalkerTurns(tts, 1, max_len=300, graphs=False).buckets == [256, 300]
    assert turns.kv_bucket(1) == 256 and turns.kv_bucket(257) == 512
    seen = []
    for k in range(9):     # mid-turn units of 4 + 1 + 25 rows: past 256 positions in the 9th
        units = [SeatUnit(s, *_unit(4, 70 + k), False) for s in (0, 1)]
        seen.append(turns.kv_bucket(turns.text_start_pos[0] + 30))
        assert turns.generate_units(units) == [a.generate_unit(*_unit(4, 70 + k), False) for a in alone], k
    assert seen[0] == 256 and seen[-1] == 512


def test_device_draw_is_draw_codes_row_by_row(tts):
    """``TalkerTurns._draw`` (the unit's draw on the device, replayed from a graph on CUDA) against
    ``draw_codes`` (the reference ``TalkerTurn``'s draw) on crafted rows: five competing codes, so that the
    repetition penalty over this unit's last ``window`` codes decides many draws (histories longer than the
    window, repeats at its edge), EOS masked or not, each seat at its own RNG counter; then the books: an EOS
    ends the unit, another code is kept and fed at base + t unless it is the unit's last draw, and a seat that
    is not live keeps nothing and is fed at the idle position."""
    from minicpmo_rt.talker.chunked import TalkerTurns, draw_codes

    s = ChunkSampling()
    turns = TalkerTurns(tts, 4, s, seeds=[11, 12, 13, 14], max_len=128, graphs=False)
    M, V, eos = s.max_new_codes, tts.cfg.num_audio_tokens, tts.eos_code
    g = torch.Generator().manual_seed(0)
    hot = torch.tensor([3, 5, 8, 13, eos])
    penalised = edge = 0
    for trial in range(240):
        t = int(torch.randint(0 if trial % 2 else s.window, M, (), generator=g))     # half past the window
        if trial < 4:
            t = [0, s.window, s.window + 1, M - 1][trial]
        hist = hot[:4][torch.randint(0, 4, (4, t), generator=g)]
        logits = 0.01 * torch.randn(4, V, generator=g)
        logits[:, hot] += 10.0 + 0.3 * torch.randn(4, len(hot), generator=g)
        min_new = torch.tensor([0, M, 0, M])[torch.randperm(4, generator=g)]
        counter, base = torch.randint(0, 500, (4,), generator=g), torch.randint(10, 60, (4,), generator=g)
        live = torch.tensor([True, True, True, trial % 3 != 0])
        turns._logits.copy_(logits)
        turns._t.fill_(t)
        turns._drawn.fill_(-1)
        turns._drawn[:, :t] = hist
        turns._live.copy_(live)
        turns._hit.zero_()
        turns._min_new.copy_(min_new)
        turns._counter.copy_(counter)
        turns._ndraw.zero_()
        turns._base.copy_(base)
        turns._draw()
        want = draw_codes(logits, [h.tolist() for h in hist], (t < min_new).tolist(), turns.seeds,
                          counter.tolist(), s, eos)
        plain = draw_codes(logits, [[]] * 4, (t < min_new).tolist(), turns.seeds, counter.tolist(), s, eos)
        shorter = ChunkSampling(window=s.window - 1)
        inner = draw_codes(logits, [h.tolist() for h in hist], (t < min_new).tolist(), turns.seeds, counter.tolist(),
                           shorter, eos)
        penalised += sum(a != b for a, b in zip(want, plain))
        edge += sum(a != b for a, b in zip(want, inner))
        for r in range(4):
            code, hit = want[r], bool(live[r]) and want[r] == eos
            kept = bool(live[r]) and not hit and t < M - 1
            assert bool(turns._hit[r]) == hit and bool(turns._live[r]) == kept, (trial, r)
            assert int(turns._ndraw[r]) == int(live[r])
            assert int(turns._drawn[r, t]) == (code if kept else -1), (trial, r, t)
            assert turns._drawn[r, :t].tolist() == hist[r].tolist()
            assert int(turns._pos[r, 0]) == (int(base[r]) + t if kept else turns.idle_pos)
            assert int(turns._codes[r]) == (code if kept else 0)
        assert int(turns._t) == t + 1
    assert penalised >= 10 and edge >= 3, (penalised, edge)    # the penalty, and its window's edge, decided draws


def test_a_round_whose_units_all_stopped_skips_its_remaining_steps(tts):
    """Units that may stop (a turn's first) and here all draw EOS within a few draws: the round looks at the
    device's live flags every four draws and stops stepping at the first look after the last EOS, with the
    reference's codes; a mid-turn round (EOS masked) makes every step."""
    from minicpmo_rt.talker.chunked import SeatUnit, TalkerTurns

    model = _eos_prone(tts, 40.0)
    turns = TalkerTurns(model, 2, seeds=[1, 2], max_len=256, graphs=False)
    alone = [TalkerTurn(model, seed=1), TalkerTurn(model, seed=2)]
    steps, step = [], turns._step
    turns._step = lambda kv: (steps.append(kv), step(kv))[1]
    units = [SeatUnit(s, *map(tuple, [_unit(3, 90 + s)[0]]), _unit(3, 90 + s)[1], False) for s in (0, 1)]
    got = turns.generate_units(units)
    assert got == [a.generate_unit(*_unit(3, 90 + s), False) for s, a in enumerate(alone)]
    last = max(len(u.codes) for u in got)        # the draw at which the last unit drew EOS
    assert all(u.eos for u in got) and last < 20
    assert len(steps) == next(t for t in range(last, 25) if t % 4 == 3)     # looked at after draw t: t steps
    steps.clear()
    got = turns.generate_units(units)     # mid-turn now: EOS masked for every draw
    assert got == [a.generate_unit(*_unit(3, 90 + s), False) for s, a in enumerate(alone)]
    assert all(len(u.codes) == 25 for u in got) and len(steps) == 25
