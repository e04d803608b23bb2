"""HostStaging: pinned-ring uploads (values, dtypes, slot reuse) and the session's device read-outs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpmo_rt.thinker.mel import FIXED_FLOOR_DB, log_mel, mel_filters
from minicpmo_rt.thinker.staging import HostStaging

from conftest import requires_cuda


def test_cpu_staging_returns_an_independent_copy_of_any_array():
    st = HostStaging("cpu", slots=2)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.setflags(write=False)  # the mel's buffers are read-only numpy arrays
    out = st.upload(a)
    assert out.dtype == torch.float32 and out.shape == (3, 4) and torch.equal(out, torch.from_numpy(a.copy()))
    t = torch.ones(5, dtype=torch.int64)
    u = st.upload(t)
    u += 1
    assert torch.equal(t, torch.ones(5, dtype=torch.int64))  # a copy, never the caller's tensor


def test_cpu_upload_into_out_copies_in_place():
    """On the CPU an upload with ``out`` (the direct solve's address tables, the slot pool's indices: device
    tensors a CUDA graph reads at fixed addresses) is a plain copy into ``out``."""
    dev = torch.zeros(2, 3, 4, dtype=torch.int64)
    st = HostStaging("cpu", slots=2)
    st.upload(torch.arange(24).view(2, 3, 4), out=dev)
    assert torch.equal(dev, torch.arange(24).view(2, 3, 4))
    st.upload(np.arange(24).reshape(2, 3, 4), out=dev)
    assert torch.equal(dev, torch.arange(24).view(2, 3, 4))
    with pytest.raises(ValueError, match="out is"):
        st.upload(torch.arange(24), out=dev)



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_upload_ints_gives_int64_of_the_lists_shape_with_or_without_staging(device):
    """``upload_ints``: nested host lists (the Talker's slots and positions, rows' starts) as a device int64 tensor
    of their shape, through the staging ring where one is given (one upload) and by a plain copy without."""
    from minicpmo_rt.thinker.staging import upload_ints

    st = HostStaging(device, slots=2)
    for staging in (st, None):
        got = upload_ints(staging, [[3, 1, 2**33], [0, -5, 7]], device)
        assert got.dtype == torch.int64 and got.device.type == device
        assert got.cpu().tolist() == [[3, 1, 2**33], [0, -5, 7]]
    assert st.uploads == (1 if device == "cuda" else 0)

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_upload_packed_places_each_part_at_its_offset_in_one_slot(device):
    """``upload_packed`` lays read-only arrays of several dtypes at their byte offsets in one device buffer,
    and on CUDA takes one slot of the ring for all of them (log_mel_many's buffers and row table)."""
    st = HostStaging(device, slots=4)
    a = np.arange(5, dtype=np.float32)
    a.setflags(write=False)
    b = np.array([[7, -3], [2**40, 1]], dtype=np.int64)
    buf = st.upload_packed([a, b], [0, 24], 24 + b.nbytes)
    assert buf.dtype == torch.uint8 and buf.shape == (56,) and buf.device.type == device
    assert torch.equal(buf[:20].view(torch.float32).cpu(), torch.from_numpy(a.copy()))
    assert torch.equal(buf[24:].view(torch.int64).view(2, 2).cpu(), torch.from_numpy(b))
    assert st.uploads == (1 if device == "cuda" else 0)
    with pytest.raises(ValueError, match="part 1 .* outside"):
        st.upload_packed([a, b], [0, 30], 56)
    with pytest.raises(ValueError, match="2 parts and 1 offsets"):
        st.upload_packed([a, b], [0], 56)

@requires_cuda
def test_cuda_upload_into_out_never_overwrites_a_pending_copy():
    """Uploads into one fixed device tensor run ahead of the device (pinned slots in turn, no host wait):
    with the device held busy, 40 uploads each read by the kernel queued after it must all see their own
    values (a refilled slot whose copy had not yet run would show a later round's)."""
    dev = torch.zeros(2, 8, 4, dtype=torch.int64, device="cuda")
    st = HostStaging("cuda", slots=2)
    sums = torch.zeros(40, dtype=torch.int64, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for i in range(40):
        big = big @ big.clamp(-1, 1) / 4096          # keeps the device behind the host
        st.upload(torch.full((2, 8, 4), i, dtype=torch.int64), out=dev)
        sums[i] = dev.sum()
    torch.cuda.synchronize()
    assert torch.equal(sums.cpu(), torch.arange(40) * 64)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="slots=0"):
        HostStaging("cpu", slots=0)
    with pytest.raises(TypeError, match="complex64"):
        HostStaging("cuda", slots=1).upload(np.zeros(3, np.complex64))


def test_fixed_floor_clamp_equals_the_maximum_with_a_floor_tensor():
    """log_mel's fixed floor is a clamp now (no scalar upload); the old form was a maximum with
    a -10 tensor. Same values bit for bit, including rows sitting exactly on the floor."""
    x = (np.random.default_rng(3).standard_normal(16000) * np.r_[np.zeros(4000), np.ones(12000)]).astype(np.float32)
    got = log_mel(x, False)
    wave = torch.tensor(x)
    stft = torch.stft(wave, 400, 160, window=torch.hann_window(400), return_complex=True)
    spec = torch.clamp(mel_filters(80) @ (stft[..., :-1].abs() ** 2), min=1e-10).log10()
    ref = (torch.maximum(spec, torch.tensor(FIXED_FLOOR_DB)) + 4.0) / 4.0
    assert torch.equal(got, ref) and bool((got == (FIXED_FLOOR_DB + 4.0) / 4.0).any())


@requires_cuda
def test_cuda_uploads_keep_their_values_while_slots_are_reused():
    """One slot, many uploads: each waits for the previous copy out of the pinned buffer
    before rewriting it, so no earlier upload is corrupted."""
    st = HostStaging("cuda", slots=1)
    big = torch.empty(1 << 24, device="cuda")
    arrays = [np.full((1080, 1920, 3), i, np.uint8) for i in range(4)]
    outs = []
    for a in arrays:
        big.mul_(1.0001)  # queue GPU work ahead of each copy, so the copies are still pending
        outs.append(st.upload(a))
    torch.cuda.synchronize()
    assert all(int(o.min()) == i == int(o.max()) for i, o in enumerate(outs))
    assert st.uploads == 4 and outs[0].dtype == torch.uint8 and outs[0].shape == (1080, 1920, 3)
    f = np.linspace(-1, 1, 48000, dtype=np.float32)
    assert torch.equal(st.upload(f).cpu(), torch.from_numpy(f))


@requires_cuda
def test_cuda_log_mel_through_staging_equals_the_plain_upload():
    x = np.random.default_rng(4).standard_normal(80000).astype(np.float32)
    st = HostStaging("cuda", slots=2)
    assert torch.equal(log_mel(x, True, device="cuda", staging=st), log_mel(x, True, device="cuda"))


@requires_cuda
def test_cuda_a_large_upload_takes_the_idle_slot_that_holds_it_instead_of_growing_one():
    """Two small uploads and one large per round on a 4-slot ring: taken strictly in turn, the large one lands on
    a small slot in most rounds and grows it, page-locking new memory each time (the batched mel, nearly every
    duplex second until session 52). The ring now takes the smallest idle slot that fits: after two rounds
    nothing grows, and a round behind ~1 s of queued work returns at once with every value intact."""
    from conftest import behind_queued_work

    st = HostStaging("cuda", slots=4)
    rng = np.random.default_rng(0)

    def round_of_uploads():
        arrays = [rng.standard_normal(1000).astype(np.float32), rng.standard_normal(2000).astype(np.float32),
                  rng.standard_normal(600_000).astype(np.float32)]      # 2.4 MB: a 4-MiB slot
        return arrays, [st.upload(a) for a in arrays]

    for _ in range(2):      # every copy pending: each upload of a round holds its own slot
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        round_of_uploads()
    torch.cuda.synchronize()
    grown = st.grows
    for _ in range(3):
        (arrays, outs), host_s = behind_queued_work(round_of_uploads)
        assert host_s < 0.2, f"a round of uploads waited {host_s:.3f} s for the queued work"
        assert all(torch.equal(o.cpu(), torch.from_numpy(a)) for a, o in zip(arrays, outs))
    assert st.grows == grown and st.waits == 0


@requires_cuda
def test_cuda_upload_packed_grows_to_its_reserve_once():
    st = HostStaging("cuda", slots=2)
    parts = [np.arange(n, dtype=np.float32) for n in (10, 1000, 300_000)]
    for a in parts:
        out = st.upload_packed([a], [0], a.nbytes, reserve=8 << 20)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.float32).cpu(), torch.from_numpy(a))
    assert st.grows == 1 and st.uploads == 3


def test_pick_slot_takes_the_smallest_idle_slot_that_fits_then_an_idle_one_then_waits():
    """The ring's choice (``HostStaging._slot`` runs it on CUDA): an upload never grows a slot while an idle one
    holds it, and never waits for a copy while any slot is idle (growing one costs host time only)."""
    from minicpmo_rt.thinker.staging import pick_slot

    mib = 1 << 20
    sizes = [mib, 32 * mib, mib, 0]
    asked = []

    def idle(i):        # records which slots' events the choice queried
        asked.append(i)
        return True

    # the smallest that fits, first from the turn: one event queried when it is idle
    assert pick_slot(sizes, idle, 0, 600_000) == 0 and asked == [0]
    assert pick_slot(sizes, idle, 1, 600_000) == 2          # ... counting from the turn
    assert pick_slot(sizes, idle, 0, 20 * mib) == 1         # only the large one holds it
    large_busy = [True, False, True, True].__getitem__
    assert pick_slot(sizes, large_busy, 0, 20 * mib) == 0   # it is busy: grow an idle one
    assert pick_slot(sizes, large_busy, 2, 20 * mib) == 2
    assert pick_slot(sizes, lambda i: False, 3, 100) == 3       # every slot busy: the one at the turn, waited for
    assert pick_slot([0, 0], lambda i: True, 1, 100) == 1     # an empty ring starts at the turn
    assert pick_slot([mib, mib], lambda i: True, 5, 100) == 1   # the turn wraps


def test_slots_to_hold_matches_the_largest_claims_to_the_largest_slots():
    """``HostStaging.hold``'s choice: each claim gets a slot of its own, largest to largest, and only a slot
    smaller than its claim is grown (a held ring that already holds every claim grows nothing)."""
    from minicpmo_rt.thinker.staging import slots_to_hold

    mib = 1 << 20
    assert slots_to_hold([0, 0, 0], [2 * mib]) == [(0, 2 * mib)]
    assert slots_to_hold([mib, 4 * mib, 0], [2 * mib, 2 * mib]) == [(0, 2 * mib)]     # the 4-MiB slot holds one
    assert slots_to_hold([mib, 4 * mib, 0], [8 * mib, 2 * mib]) == [(1, 8 * mib), (0, 2 * mib)]
    assert slots_to_hold([2 * mib, 2 * mib], [2 * mib, 2 * mib]) == []
    assert slots_to_hold([mib, mib, mib], [2 * mib, 2 * mib, 2 * mib]) == [(0, 2 * mib), (1, 2 * mib), (2, 2 * mib)]
    with pytest.raises(ValueError, match="3 claims on 2 slots"):
        slots_to_hold([0, 0], [1, 1, 1])


def test_the_streaming_mels_largest_upload_is_its_slide_trigger():
    """A sliding mel buffer slides before its mel is computed, so no upload reaches the trigger (30 s of
    float32: 1.92 MB); an unbounded one claims nothing."""
    from minicpmo_rt.thinker.mel import StreamingMel

    m = StreamingMel()
    assert m.largest_upload == 4 * 30 * 16000
    rng = np.random.default_rng(0)
    for _ in range(34):     # past one slide: the buffer always stays under the trigger
        m._appended(rng.standard_normal(16000).astype(np.float32))
        st, _ = m._appended(rng.standard_normal(16000).astype(np.float32))
        m.state = st
        assert 4 * st.buffer.shape[0] < m.largest_upload
    assert StreamingMel(sliding_window=False).largest_upload == 0
    assert HostStaging("cpu").hold(m.largest_upload) == 0     # nothing to page-lock off CUDA


@requires_cuda
def test_cuda_held_slots_take_growing_uploads_without_growing():
    """Two streams whose uploads grow to ~1.9 MB (the mel's buffers) on a 4-slot ring whose frames keep the
    other slots at 1 MiB: without ``hold`` the uploads outgrow the 1-MiB slots midway and grow them (16 seats
    at their 17th second, session 53); with both held when the streams open, nothing grows afterwards. Claims
    beyond the ring's slots hold nothing more, and a busy slot is not grown (that would wait for its copy)."""
    st = HostStaging("cuda", slots=4)
    big = 4 * 30 * 16000
    assert st.hold(big) == 1 and st.hold(big) == 1 and st.grows == 2
    assert st.hold(big) + st.hold(big) == 2 and st.hold(big) == 0     # 4 slots, 4 claims: all held
    assert st.grows == 4
    rng = np.random.default_rng(1)
    for seconds in range(1, 30):
        for _ in range(2):
            a = rng.standard_normal(16000 * seconds).astype(np.float32)
            out = st.upload(a)
            assert torch.equal(out.cpu(), torch.from_numpy(a)) if seconds % 10 == 0 else True
        st.upload(rng.integers(0, 255, (448, 448, 3), dtype=np.uint8))
    torch.cuda.synchronize()
    assert st.grows == 4 and st.waits == 0

    busy = HostStaging("cuda", slots=1)
    busy.upload(np.zeros(10, np.float32))
    torch.cuda._sleep(100_000_000)
    busy.upload(np.ones(10, np.float32))     # its copy waits behind the sleep: the slot is busy
    assert busy.hold(big) == 0 and busy.grows == 1
    torch.cuda.synchronize()


@requires_cuda
def test_cuda_a_session_holds_its_mels_largest_upload_when_it_opens(tiny_ckpt, tok):
    """A session on CUDA holds its mel's largest upload in the (shared) ring as it opens: sessions sharing a
    ring each get a slot that takes their buffer at 30 s, page-locked before their first second."""
    from minicpmo_rt.thinker.model import Thinker
    from minicpmo_rt.thinker.session import StreamingSession

    thinker = Thinker.from_snapshot(tiny_ckpt, device="cuda")
    ring = HostStaging("cuda", slots=4)
    sessions = [StreamingSession(thinker, tok, staging=ring) for _ in range(2)]
    assert ring.grows == 2
    held = [s.buffer.numel() for s in ring._slots if s.buffer is not None]
    assert len(held) == 2 and all(n >= sessions[0].mel.largest_upload for n in held)
    assert StreamingSession(thinker, tok).mel.staging is None and ring.grows == 2     # no ring: nothing held
