"""Host->device uploads that never wait for the device (``HostStaging``).

An upload from pageable host memory (a decoded frame, the mel's waveform buffer, a row of
indices) returns only once the stream has reached it, i.e. after every kernel queued before
it, whatever its size: on the H200 a 128-byte table behind 1 s of queued work took 1 s
(session 51; ``.to(device, non_blocking=True)`` changes nothing for pageable memory). The host
then cannot queue the next second's work while the GPU runs this one. Copying into a pinned
buffer first makes the upload truly asynchronous (``upload``, ``upload_packed`` for several
arrays in one copy, ``upload_ints`` for index lists).

Pinned buffers are kept in a ring and reused, never allocated per call: allocating pinned
memory per upload (``Tensor.pin_memory()``) grew the host allocator and cost more than it
saved (features benchmark, session 2). A slot is rewritten only after its previous copy
finished (one event per slot), so a host far ahead of the GPU waits there at the latest.

Growing a slot page-locks new host memory (milliseconds for tens of MiB; on the H200 it did not
wait for queued device work) and leaves the old buffer in torch's pinned cache. So an upload
takes the smallest idle slot that already holds it, grows an idle one only when none does, and
waits only when every slot is busy (``pick_slot``); a caller that knows its largest upload can
``reserve`` it on the first upload, or ``hold`` it when it opens, before its first second.
Taking slots strictly in turn, the batched mel's growing upload (up to 32 MiB a duplex second)
landed on a frame's 1 MiB slot and grew it nearly every second (one pinned allocation per second,
session 51's ``--diag``; none after the first since session 52).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class _Slot:
    buffer: torch.Tensor | None = None   # pinned uint8
    done: torch.cuda.Event | None = None  # recorded after the slot's last upload


class HostStaging:
    """Uploads to ``device`` through ``slots`` reusable pinned buffers (CUDA); a plain copy elsewhere."""

    def __init__(self, device: torch.device | str, slots: int = 16):
        if slots < 1:
            raise ValueError(f"HostStaging: slots={slots} must be >= 1")
        self.device = torch.device(device)
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self._lock = threading.Lock()
        self.uploads = 0
        self.waits = 0   # uploads that found their slot's previous copy still running
        self.grows = 0   # pinned allocations (slots grown)
        self._held: list[int] = []   # the sizes ``hold`` was asked for, largest first (at most one per slot)

    def upload(self, array: np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A new device tensor holding ``array`` (same dtype and shape); returns at once. ``out``: a device
        tensor of that shape and dtype to copy into instead (one a CUDA graph reads at a fixed address)."""
        if isinstance(array, np.ndarray):
            dtype, shape = _TORCH_DTYPES.get(array.dtype), array.shape
            if dtype is None:
                raise TypeError(f"HostStaging.upload: numpy dtype {array.dtype} is not supported")
        else:
            dtype, shape = array.dtype, array.shape
        if out is not None and (out.shape != shape or out.dtype != dtype or out.device.type != self.device.type):
            raise ValueError(f"HostStaging.upload: out is {tuple(out.shape)} {out.dtype} on {out.device}, the "
                             f"upload {tuple(shape)} {dtype} to {self.device}")
        if isinstance(array, torch.Tensor) and (self.device.type != "cuda" or array.device.type != "cpu"):
            return array.to(self.device, copy=True) if out is None else out.copy_(array)
        if self.device.type != "cuda":
            host = torch.from_numpy(np.array(array, copy=True))
            return host.to(self.device) if out is None else out.copy_(host)
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self.device)
        nbytes = out.numel() * out.element_size()
        if nbytes == 0:
            return out
        with self._lock:
            slot = self._slot(nbytes)
            host = slot.buffer[:nbytes].view(dtype).view(shape)
            if isinstance(array, np.ndarray):
                np.copyto(host.numpy(), array, casting="no")  # read-only arrays are fine as a source
            else:
                host.copy_(array)
            self._send(slot, host, out)
        return out

    def upload_packed(self, parts: list[np.ndarray], offsets: list[int], nbytes: int,
                      reserve: int = 0) -> torch.Tensor:
        """One device uint8 tensor of ``nbytes`` holding each numpy array ``parts[i]`` from byte ``offsets[i]``
        (bytes no part covers are unspecified): arrays one computation reads together go up through one slot
        as one copy, instead of taking as many slots of the ring (a slot reused before its last copy ran waits
        for that copy, and with it for the work queued before it). ``reserve``: the caller's largest upload; the
        slot taken must hold that many bytes (so that it is grown once, not each time the uploads outgrow it)."""
        if len(parts) != len(offsets):
            raise ValueError(f"HostStaging.upload_packed: {len(parts)} parts and {len(offsets)} offsets")
        for i, (a, at) in enumerate(zip(parts, offsets)):
            if at < 0 or at + a.nbytes > nbytes:
                raise ValueError(f"HostStaging.upload_packed: part {i} ({a.nbytes} bytes at {at}) lies outside the "
                                 f"{nbytes} bytes")
        if self.device.type != "cuda" or nbytes == 0:
            host = np.zeros(nbytes, dtype=np.uint8)
            for a, at in zip(parts, offsets):
                host[at:at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            return torch.from_numpy(host).to(self.device)
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with self._lock:
            slot = self._slot(max(nbytes, reserve))
            host = slot.buffer[:nbytes].numpy()
            for a, at in zip(parts, offsets):
                np.copyto(host[at:at + a.nbytes], np.ascontiguousarray(a).reshape(-1).view(np.uint8), casting="no")
            self._send(slot, slot.buffer[:nbytes], out)
        return out

    def hold(self, nbytes: int) -> int:
        """Page-lock ahead of the uploads: one more slot (at most every slot) holds ``nbytes``, grown now where it
        is idle. A stream whose uploads grow up to a known size (the mel's waveform buffer, up to its 30-s slide
        trigger: ~1.9 MB) holds it when it opens, so its uploads never grow a slot mid-conversation: 16 duplex
        seats outgrew the ring's 1-MiB slots at their 17th second, 16 page-lockings in 3 seconds that made the
        slowest second of a 20-s run (``duplex_waits_session53_h200.md``). A busy slot is left to the uploads to
        grow (growing it would mean waiting for its copy). Returns the slots grown; elsewhere than CUDA, 0."""
        if self.device.type != "cuda" or nbytes <= 0:
            return 0
        with self._lock:
            self._held.append(int(nbytes))
            self._held.sort(reverse=True)
            del self._held[len(self._slots):]     # every slot holds a claim: more claims hold nothing more
            grown = 0
            for i, size in slots_to_hold(self._sizes(), self._held):
                slot = self._slots[i]
                if slot.done is None or slot.done.query():
                    self._grow(slot, size)
                    grown += 1
            return grown

    def _sizes(self) -> list[int]:
        return [0 if s.buffer is None else s.buffer.numel() for s in self._slots]

    def _grow(self, slot: _Slot, nbytes: int) -> None:
        """Page-lock a new buffer for an idle ``slot`` (the old one goes back to torch's pinned cache)."""
        slot.buffer = torch.empty(_round_up(nbytes), dtype=torch.uint8, pin_memory=True)
        self.grows += 1

    def _slot(self, nbytes: int) -> _Slot:
        """The slot ``pick_slot`` names for ``nbytes`` (under the lock), its previous copy finished (waited for
        only when every slot is busy) and its buffer grown where it is smaller."""
        n = len(self._slots)
        sizes = self._sizes()
        known: dict[int, bool] = {}

        def idle(i: int) -> bool:     # an event query per slot looked at, at most once per upload
            if i not in known:
                done = self._slots[i].done
                known[i] = done is None or done.query()
            return known[i]

        at = pick_slot(sizes, idle, self._next, nbytes)
        slot = self._slots[at]
        self._next = (at + 1) % n
        if not idle(at):
            self.waits += 1
            slot.done.synchronize()
        if sizes[at] < nbytes:
            self._grow(slot, nbytes)
        return slot

    def _send(self, slot: _Slot, host: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(host, non_blocking=True)
        if slot.done is None:
            slot.done = torch.cuda.Event()
        slot.done.record()
        self.uploads += 1


def staging_on(device: torch.device | str, slots: int = 16) -> "HostStaging | None":
    """A ring of ``slots`` for ``device`` where staging pays (CUDA), else None: ``upload_ints`` and the
    callers that take an optional ring then make a plain copy."""
    return HostStaging(device, slots) if torch.device(device).type == "cuda" else None


def pick_slot(sizes: list[int], idle, start: int, nbytes: int) -> int:
    """The slot of a ring that takes an upload of ``nbytes``: ``sizes[i]`` the bytes slot i holds (0: none yet),
    ``idle(i)`` whether its previous copy finished (asked smallest fitting slot first, so that usually one event
    is queried), ``start`` the ring's turn. The smallest idle slot that holds the upload (the first from the turn
    among equals); else the first idle slot from the turn, to be grown (page-locking costs host time, not a wait
    for the device); else, every slot busy, the one at the turn, whose copy the upload then waits for."""
    n = len(sizes)
    order = [(start + k) % n for k in range(n)]
    fits = sorted((i for i in order if sizes[i] >= nbytes), key=lambda i: sizes[i])     # stable: turn order kept
    best = next((i for i in fits if idle(i)), None)
    return best if best is not None else next((i for i in order if idle(i)), start % n)


def slots_to_hold(sizes: list[int], claims: list[int]) -> list[tuple[int, int]]:
    """The slots to grow so that every claim has a slot of its own that holds it: ``sizes[i]`` the bytes slot i
    holds, ``claims`` at most one per slot. The largest claim goes to the largest slot, the next to the next, so
    a slot is grown only where the one matched to it is smaller; returns (slot, bytes) for each to grow."""
    if len(claims) > len(sizes):
        raise ValueError(f"slots_to_hold: {len(claims)} claims on {len(sizes)} slots")
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])     # stable: equal slots in ring order
    return [(i, c) for i, c in zip(order, sorted(claims, reverse=True)) if sizes[i] < c]


def upload_ints(staging: "HostStaging | None", values, device: torch.device | str) -> torch.Tensor:
    """Host integers (a nested list or an array) as a device int64 tensor of their shape: through ``staging``
    (pinned) where given, else a plain copy. On CUDA a copy from pageable memory syncs the stream before it starts,
    even for a few bytes (H200: a 128-byte row table waited out 1 s of queued work, session 51), so index and
    position uploads on paths that should run ahead of the GPU go through a staging ring."""
    host = np.asarray(values, dtype=np.int64)
    if staging is not None:
        return staging.upload(host)
    return torch.from_numpy(host).to(device)


_TORCH_DTYPES = {np.dtype(k): v for k, v in ((np.uint8, torch.uint8), (np.float32, torch.float32),
                                             (np.float64, torch.float64), (np.int64, torch.int64),
                                             (np.int32, torch.int32), (np.bool_, torch.bool))}


def _round_up(nbytes: int, least: int = 1 << 20) -> int:
    """Slots grow to powers of two (at least 1 MiB): the mel's buffer grows a little at every
    chunk, and frames and buffers share the ring, so slots settle after a few reallocations."""
    return max(least, 1 << (nbytes - 1).bit_length())

