"""The row store's hot operations on a GPU as Triton kernels: the id map's probe and insert
(for ``id_map.TritonBackend``) and the header touch of a training lookup.

The torch twins walk all probes together in rounds, each ending in a host sync to learn which
ids are left: tens of syncs and launches per batch, which on a GPU cost more than the table's
reads (most of a 1M-row training step on an H200, docs/gpu.md). Here one kernel walks each
id's probe to its end in its own lane: a lookup is one launch and one sync (its miss count).
New ids are placed by a second kernel that claims free entries with compare-and-swap, so ids
racing for one entry each end up in their own; which entry an id lands in may differ from the
twin's, its slot may not (slots are assigned before, by the caller). The touch counts a row's
occurrences in a scratch counter per slot, and one lane per row then writes the header once.
Each block of the count sorts its slots first and adds a run of equal ones in one atomic: under
skewed ids (Zipf: a hot id is several percent of a batch) one atomic per occurrence would queue
a hundred thousand adds on one word, where this queues one per block. Every atomic here is
relaxed (Triton's default fences each one): a lane decides on its own atomic's result alone (a
stale plain read costs an insert at most a failed compare-and-swap), and the kernel's end
orders all of it before whatever follows.

This module needs Triton (a dependency of torch's CUDA builds); it is imported only where these
kernels are picked. Without a GPU, Triton's interpreter runs them on the CPU
(``TRITON_INTERPRET=1`` set before this module is imported): that is how the tests check them
against the twins on machines without one. It is for tests only: its sort takes a good part of
a second per block of 512 ids, so a touch of thousands of ids takes seconds there.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from torchrec_kvzch.table.hashing import BUCKET, EMPTY, FIBONACCI
from torchrec_kvzch.table.layout import COUNT_MAX, TS_MASK

BLOCK = 512
_LOG_BLOCK = BLOCK.bit_length() - 1
_NEVER = -3  # an id no entry holds: the compare-and-swap of a lane with nothing to claim
_NO_SLOT = 1 << 53  # the count's dead lanes: sorts past every slot, and still fits next to a lane


def check_device(device: torch.device) -> None:
    """Refuse a device the kernels cannot run on (CUDA; the CPU under the interpreter)."""
    if not (device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
        raise ValueError(f"the triton id map runs on CUDA devices (or on the CPU under TRITON_INTERPRET=1), "
                         f"not on {device}; use 'torch'")


def _geometry(table: torch.Tensor) -> dict:
    capacity = table.shape[0]
    return dict(fib=FIBONACCI, shift=64 - (capacity.bit_length() - 1), first=capacity - BUCKET,
                wrap=capacity - 1, EMPTY=EMPTY, BLOCK=BLOCK)


def probe(table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(entry of each id or -1, its slot or -1, the first id outside ``[lo, hi)`` or -1, the
    number of ids inside absent from the table): ``launch_probe``, then one host sync."""
    pos, slots, stats = launch_probe(table, ids, lo, hi)
    bad_from_end, misses = stats.tolist()
    return pos, slots, (ids.numel() - bad_from_end if bad_from_end else -1), misses


def launch_probe(table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    """``probe`` with its counters left on the device, read by no one yet (no sync): (entries,
    slots, [len(ids) less the first bad index (0: none), misses])."""
    n = ids.numel()
    pos, slots = torch.empty_like(ids), torch.empty_like(ids)
    stats = ids.new_zeros(2)  # (one launch, no copy)
    if n:
        _probe_kernel[(_blocks(n),)](table, ids, pos, slots, stats, n, lo, hi, **_geometry(table))
    return pos, slots, stats


def place(table: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor) -> None:
    """Insert ``ids`` (distinct, none in the table) with their ``slots``."""
    if ids.numel():
        _place_kernel[(_blocks(ids.numel()),)](table, ids.contiguous(), slots.contiguous(), ids.numel(),
                                                  NEVER=_NEVER, **_geometry(table))


def touch(meta: torch.Tensor, slots: torch.Tensor, clock: int, counts: torch.Tensor) -> None:
    """``layout.touch_meta``: the rows at ``slots`` get timestamp ``clock`` and their count
    grows by their occurrences (saturating). ``counts``: int32 zeros, one per slot at least
    (left zero again)."""
    n = slots.numel()
    if n:
        leads = count(slots, counts)
        _header_kernel[(_blocks(n),)](meta, slots, counts, leads, n, clock & TS_MASK, COUNT_MAX=COUNT_MAX,
                                      USED=-(1 << 63), BLOCK=BLOCK)


def count(slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Add each slot's occurrences in ``slots`` (int64, contiguous) to ``counts[slot]``; returns,
    per position, 0 at exactly one occurrence of each slot whose counter was 0 before (the lane
    that writes its header), else a positive number."""
    n = slots.numel()
    leads = torch.empty(n, dtype=torch.int32, device=slots.device)
    if n:
        _count_kernel[(_blocks(n),)](slots, counts, leads, n, NO_SLOT=_NO_SLOT, LOG=_LOG_BLOCK, BLOCK=BLOCK)
    return leads


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


@triton.jit
def _home(x, fib, shift, first):
    h = (x * fib).to(tl.uint64, bitcast=True) >> shift.to(tl.uint64)  # a logical shift
    return h.to(tl.int64, bitcast=True) & first

@triton.jit
def _probe_kernel(table, ids, pos_out, slot_out, stats, n, lo, hi, fib, shift, first, wrap,
                 EMPTY: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = off < n
    x = tl.load(ids + off, mask=live, other=0)
    bad = live & ((x < lo) | (x >= hi))
    active = live & ~bad
    pos = _home(x, fib, shift, first)
    found = tl.full([BLOCK], -1, tl.int64)
    while tl.max(active.to(tl.int32), axis=0) > 0:  # each lane until its hit or an empty entry
        key = tl.load(table + 2 * pos, mask=active, other=EMPTY)
        hit = active & (key == x)
        found = tl.where(hit, pos, found)
        active = active & ~hit & (key != EMPTY)
        pos = (pos + 1) & wrap
    slot = tl.load(table + 2 * found + 1, mask=found >= 0, other=-1)
    tl.store(pos_out + off, found, mask=live)
    tl.store(slot_out + off, slot, mask=live)
    tl.atomic_max(stats, tl.max(tl.where(bad, n - off, 0), axis=0), sem="relaxed")
    tl.atomic_add(stats + 1, tl.sum((live & ~bad & (found < 0)).to(tl.int64), axis=0), sem="relaxed")

@triton.jit
def _place_kernel(table, ids, slots, n, fib, shift, first, wrap,
                 EMPTY: tl.constexpr, NEVER: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    active = off < n
    x = tl.load(ids + off, mask=active, other=0)
    slot = tl.load(slots + off, mask=active, other=0)
    pos = _home(x, fib, shift, first)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        key = tl.load(table + 2 * pos, mask=active, other=0)
        free = active & (key < 0)  # EMPTY or TOMB
        old = tl.atomic_cas(table + 2 * pos, tl.where(free, key, NEVER), x, sem="relaxed")
        won = free & (old == key)  # else another id claimed it first: go on
        tl.store(table + 2 * pos + 1, slot, mask=won)
        active = active & ~won
        pos = tl.where(active, (pos + 1) & wrap, pos)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _count_kernel(slots, counts, leads, n, NO_SLOT: tl.constexpr, LOG: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    base = tl.program_id(0).to(tl.int64) * BLOCK
    slot = tl.load(slots + base + lane, mask=base + lane < n, other=NO_SLOT)
    key = tl.sort((slot << LOG) | lane.to(tl.int64))  # the block's slots in order, each with its lane
    slot, lane_of = key >> LOG, key & (BLOCK - 1)
    head = (lane == 0) | (slot != tl.gather(slot, tl.maximum(lane - 1, 0), 0))
    tail = (lane == BLOCK - 1) | (slot != tl.gather(slot, tl.minimum(lane + 1, BLOCK - 1), 0))
    run = lane - tl.associative_scan(tl.where(head, lane, 0), 0, _max) + 1  # at a tail: its run's length
    live = slot != NO_SLOT
    seen = tl.atomic_add(counts + slot, run, mask=tail & live, sem="relaxed")  # 0 for the first run of the row
    tl.store(leads + base + lane_of, tl.where(tail, seen, 1), mask=live)  # (the first run's tail leads)


@triton.jit
def _header_kernel(meta, slots, counts, leads, n, clock, COUNT_MAX: tl.constexpr, USED: tl.constexpr,
                   BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lead = (off < n) & (tl.load(leads + off, mask=off < n, other=1) == 0)  # one lane per row
    slot = tl.load(slots + off, mask=lead, other=0)
    hits = tl.load(counts + slot, mask=lead, other=0).to(tl.int64)
    old = tl.load(meta + slot, mask=lead, other=0)
    total = tl.minimum(((old >> 32) & COUNT_MAX) + hits, COUNT_MAX)
    used = old & USED
    tl.store(meta + slot, used | (total << 32) | clock, mask=lead)
    tl.store(counts + slot, tl.zeros_like(hits).to(tl.int32), mask=lead)
