"""Batched map from int64 global ids to dense row slots ``0..n-1``.

Open addressing with linear probing over a power-of-two table kept at load <= 0.7. The state is
two tensors: ``table`` ``[capacity, 2]`` int64 (id or a sentinel, slot) pairs - a hit reads one
cache line - and ``slot_keys``, each slot's id. Interchangeable backends run the operations
touching it (``probe``, ``lookup``, ``find_or_insert``), and the header touch of the rows a
training lookup returns (``touch``):

* ``NativeBackend``: the C++ op in ``csrc/id_map_ops.cpp``: a parallel prefetching lookup, and a
  find_or_insert that reads each id's entry once, in parallel, one table region per thread
  (after a lookup of every id when the last batch had few new ids, so that a batch of known ids
  costs a lookup). The default on CPU.
* ``TorchBackend``: the same semantics in vectorised torch ops; the fallback.
* ``TritonBackend``: the torch twin with its rounds done by GPU kernels. The default on CUDA.

All use the same hash and sentinels (``hashing.py``), so a table built by one can be read by
another, and the tests check they agree on every operation sequence (which free entry a new id
lands in may differ; its slot may not). Erase, compaction and rehash are written once, on top.

A lookup checks the ids against the caller's bounds before it changes anything
(``IdOutOfRange``). ``find_or_insert`` runs in one pass when the table has room for the whole
batch as new ids; else it looks the batch up, makes room for the absent ids and inserts them.

Slots stay dense: new ids take the next slots in order of first appearance, and erasing moves
the last rows into the holes (the caller moves its row data the same way). Row storage can
therefore be plain contiguous arrays that fbgemm's TBE indexes directly.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from torchrec_kvzch.table.hashing import BUCKET, EMPTY, MAX_LOAD, MIN_CAPACITY, REHASH_CHUNK, TOMB, capacity_for, home
from torchrec_kvzch.table.layout import touch_meta
from torchrec_kvzch.table.native import NATIVE_WHY, empty_large, native_status, release_rows

logger = logging.getLogger(__name__)

MAX_SLOTS = 2**31 - 1  # rows per table shard
# find_or_insert looks every id up before inserting when the last batch had fewer new ids than this fraction
# (then the insert pass runs over the absent ids only). A/B of the op, 163,840 ids, caches flushed, lookup first
# vs the insert pass over every id: 1.2 vs 1.6 ms with no new id at 1M keys, 1.8 vs 2.1 ms at 10M; even at 20%
# new; lost from 35% (2.8 vs 2.7 ms at 10M; 5.5 vs 3.0 ms with only new ids), where most probes are walked twice.
LOOKUP_FIRST_BELOW = 0.25
ANY_ID = (0, 2**63 - 1)  # the bounds of a lookup that only refuses negative ids


class IdOutOfRange(ValueError):
    """An id outside a lookup's bounds; the caller words the error (it knows the table)."""

    def __init__(self, id_: int, bounds: tuple[int, int]) -> None:
        super().__init__(f"id {id_} is outside [{bounds[0]}, {bounds[1]})")
        self.id, self.bounds = id_, bounds


class Backend(Protocol):
    """``looked``: the caller's lookup of ``ids`` (slots, absent count), completed in place."""
    name: str

    def probe(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor: ...
    def lookup(self, table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, int, int]: ...
    def find_or_insert(self, table: torch.Tensor, slot_keys: torch.Tensor, ids: torch.Tensor, lo: int, hi: int, size: int,
                       lookup_first: bool, looked: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, int, int]: ...
    def touch(self, meta: torch.Tensor, slots: torch.Tensor, clock: int) -> None: ...


class TorchBackend:
    """Vectorised torch implementation: probing advances every unresolved id by ``window``
    entries per round; ``find_or_insert`` is a lookup, then a placement of the absent ids.

    Each round ends in a device sync (the ids left), and the rounds are as many as the longest
    probe's windows: 35-40 one-entry rounds for 2^20 ids at load 0.5. On a GPU, where rounds
    cost syncs and launches and the extra reads are free, a window of two buckets ends nearly
    every probe in the first round; on CPU, the reads cost (2x at 1M keys), so it steps by one."""

    name = "torch"

    def __init__(self, window: int = 1) -> None:
        self.window = window

    def touch(self, meta, slots, clock) -> None:
        touch_meta(meta, slots, clock, native=False)

    def probe(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        keys = table[:, 0]
        mask = keys.numel() - 1
        out = torch.full_like(ids, -1)
        todo = torch.arange(ids.numel(), device=ids.device)
        want = ids
        pos = home(ids, keys.numel())
        steps = torch.arange(self.window, device=ids.device)
        while todo.numel():
            window = (pos.unsqueeze(1) + steps) & mask
            k = keys[window]
            hit = k == want.unsqueeze(1)
            stop = hit | (k == EMPTY)  # the probe ends at the first hit or empty entry
            first = stop.to(torch.uint8).argmax(1, keepdim=True)
            ended = stop.any(1)
            found = ended & hit.gather(1, first).squeeze(1)
            out[todo[found]] = window.gather(1, first).squeeze(1)[found]
            cont = ~ended
            todo, want, pos = todo[cont], want[cont], (pos[cont] + self.window) & mask
        return out

    def lookup(self, table, ids, lo, hi):
        bad = torch.nonzero((ids < lo) | (ids >= hi))
        if bad.numel():
            return ids, int(bad[0]), 0
        pos = self.probe(table, ids)
        slots = torch.where(pos >= 0, table[pos.clamp(min=0), 1], -1)
        return slots, -1, int((slots < 0).sum())

    def find_or_insert(self, table, slot_keys, ids, lo, hi, size, lookup_first, looked=None):
        slots, bad, misses = self.lookup(table, ids, lo, hi) if looked is None else (looked[0], -1, looked[1])
        if bad >= 0 or not misses:
            return slots, bad, size
        miss = slots < 0
        missing = ids[miss]
        uniq, inverse = torch.unique(missing, return_inverse=True)
        # Slots in order of first appearance, as the native op assigns them.
        first = torch.full_like(uniq, missing.numel())
        first.scatter_reduce_(0, inverse, torch.arange(missing.numel(), device=ids.device), "amin")
        order = torch.argsort(first)
        new_slots = torch.empty_like(uniq)
        new_slots[order] = torch.arange(size, size + uniq.numel(), device=ids.device)
        slots[miss] = new_slots[inverse]
        slot_keys[size : size + uniq.numel()] = uniq[order]
        self._place(table, uniq, new_slots)
        return slots, -1, size + uniq.numel()

    @staticmethod
    def _place(table, ids, slots) -> None:
        """Insert ids known to be absent: each round, the lowest-indexed contender per free
        position wins it and the rest move one position on."""
        mask = table.shape[0] - 1
        pos = home(ids, table.shape[0])
        while ids.numel():
            free = table[pos, 0] < 0  # EMPTY or TOMB
            cand = torch.nonzero(free).squeeze(1)
            cpos = pos[cand]
            sorted_pos, perm = torch.sort(cpos, stable=True)
            first = torch.ones_like(sorted_pos, dtype=torch.bool)
            first[1:] = sorted_pos[1:] != sorted_pos[:-1]
            win = cand[perm[first]]
            table[pos[win]] = torch.stack([ids[win], slots[win]], dim=1)
            keep = torch.ones_like(ids, dtype=torch.bool)
            keep[win] = False
            ids, slots, pos = ids[keep], slots[keep], (pos[keep] + 1) & mask


class TritonBackend(TorchBackend):
    """The torch twin with its probe and placement rounds done by GPU kernels instead
    (``gpu_kernels.py``): a lookup is one launch and one host sync, whatever the probes."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        from torchrec_kvzch.table import gpu_kernels  # imports Triton: only when chosen

        gpu_kernels.check_device(device)
        self.kernels = gpu_kernels
        self._counts = torch.zeros(0, dtype=torch.int32, device=device)

    def probe(self, table, ids):
        return self.kernels.probe(table, ids, *ANY_ID)[0]

    def lookup(self, table, ids, lo, hi):
        _, slots, bad, misses = self.kernels.probe(table, ids, lo, hi)
        return (ids, bad, 0) if bad >= 0 else (slots, -1, misses)

    def _place(self, table, ids, slots) -> None:
        self.kernels.place(table, ids, slots)

    def touch(self, meta: torch.Tensor, slots: torch.Tensor, clock: int) -> None:
        """``layout.touch_meta`` by the kernels (per-slot scratch counters grow with ``meta``)."""
        if self._counts.numel() < meta.shape[0]:
            self._counts = torch.zeros(meta.shape[0], dtype=torch.int32, device=meta.device)
        self.kernels.touch(meta, slots, clock, self._counts)


class NativeBackend:
    """The C++ op from ``csrc/id_map_ops.cpp``."""

    name = "native"

    def probe(self, table, ids):
        return torch.ops.kvzch.probe(table, ids)

    def lookup(self, table, ids, lo, hi):
        return torch.ops.kvzch.lookup(table, ids, lo, hi)

    def find_or_insert(self, table, slot_keys, ids, lo, hi, size, lookup_first, looked=None):
        if looked is None:
            return torch.ops.kvzch.find_or_insert(table, slot_keys, ids, lo, hi, size, lookup_first)
        return looked[0], -1, torch.ops.kvzch.insert_absent_(table, slot_keys, ids, *looked, size)

    def touch(self, meta, slots, clock) -> None:
        touch_meta(meta, slots, clock, native=True)


def backend_for(backend: str, device: torch.device) -> Backend:
    """``auto`` picks the native op on CPU when it is built, the GPU kernels on CUDA when Triton
    is installed, else the torch twin."""
    if backend not in ("auto", "native", "torch", "triton"):
        raise ValueError(f"id map backend must be 'auto', 'native', 'torch' or 'triton', got {backend!r}")
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        if importlib.util.find_spec("triton") is not None:
            return TritonBackend(device)
        if backend == "triton":
            raise ValueError("the triton id map needs Triton (pip install triton); use 'torch'")
        logger.warning("Triton is not installed: the torch id map serves %s, slower", device)
    if backend == "torch" or device.type != "cpu":
        if backend == "native":
            raise ValueError(f"the native id map runs on CPU only, not on {device}; use 'torch'")
        return TorchBackend(window=1 if device.type == "cpu" else 2 * BUCKET)
    if native_status(strict=backend == "native"):
        return NativeBackend()
    logger.warning("torchrec_kvzch native op unavailable (%s); using the torch id map", NATIVE_WHY)
    return TorchBackend()


def as_ids(ids: torch.Tensor, device: torch.device, check: bool = True) -> torch.Tensor:
    """Validate a batch of global ids: a flat contiguous int64 tensor of non-negative values
    (``check=False``: the values are checked later, by a lookup's bounds)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be an int64 (or int32) tensor, got {getattr(ids, 'dtype', type(ids))}")
    ids = ids.reshape(-1).to(device=device, dtype=torch.long).contiguous()
    if check and ids.numel() and int(ids.min()) < 0:
        raise _negative(int(ids.min()))
    return ids


def _negative(id_: int) -> ValueError:
    return ValueError(f"ids must be non-negative global ids, got {id_}; "
                      "map or hash negative ids into [0, num_embeddings) first")


@dataclass(frozen=True)
class Compaction:
    """Row moves that keep slots dense after an erase: ``rows[dst] = rows[src]``."""
    src: torch.Tensor
    dst: torch.Tensor
    new_size: int


class IdMap:
    """int64 global ids -> dense int64 slots ``0..len-1``. Ids must be non-negative."""

    def __init__(self, backend: str = "auto", device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.backend = backend_for(backend, self.device)
        self.size = 0
        self._occupied = 0  # upper bound on non-EMPTY entries (live keys + tombstones)
        self._new_fraction = 1.0  # of the last find_or_insert's ids, new ones (distinct)
        self.slot_keys = torch.empty(0, dtype=torch.long, device=self.device)
        self._alloc_table(MIN_CAPACITY)

    # -- queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.size

    @property
    def capacity(self) -> int:
        return self.table.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the map: the hash table plus the slot -> id array."""
        return sum(t.numel() * t.element_size() for t in (self.table, self.slot_keys))

    def keys(self) -> torch.Tensor:
        """The live ids, indexed by slot (a view: copy before mutating the map)."""
        return self.slot_keys[: self.size]

    def find(self, ids: torch.Tensor, bounds: tuple[int, int] = ANY_ID) -> torch.Tensor:
        """Slot of each id, -1 where absent; an id outside ``bounds`` raises ``IdOutOfRange``."""
        return self._lookup(ids, bounds)[0]

    def copy(self) -> "IdMap":
        """An independent map of the same ids in the same slots."""
        out = copy.copy(self)
        out.table = self.table.clone()
        out.slot_keys = self.slot_keys[: self.size].clone()
        return out

    # -- updates ------------------------------------------------------------------------------
    def find_or_insert(self, ids: torch.Tensor, bounds: tuple[int, int] = ANY_ID) -> torch.Tensor:
        """Slot of each id, inserting absent ids; new slots are ``[old len, new len)`` in order of
        first appearance, so a caller initialises exactly ``keys()[old_len:]``. An id outside
        ``bounds`` raises ``IdOutOfRange`` before anything changes."""
        ids = as_ids(ids, self.device, check=False)
        looked = None
        if self._occupied + ids.numel() > MAX_LOAD * self.capacity or self.size + ids.numel() > MAX_SLOTS:
            # Were every id new, the table would pass its load limit: count the absent ones first,
            # and let the insert reuse that lookup (a big table's steady state: one probe per id).
            slots, ids, misses = self._lookup(ids, bounds)
            if not misses:  # (nothing to insert)
                self._new_fraction = 0.0
                return slots
            self._reserve(misses)
            looked = (slots, misses)
        self._grow_slot_keys(self.size + ids.numel())
        slots, bad, new_size = self.backend.find_or_insert(
            self.table, self.slot_keys, ids, *bounds, self.size,
            self._new_fraction < LOOKUP_FIRST_BELOW, looked)
        self._raise_if_bad(ids, bad, bounds)
        self._new_fraction = (new_size - self.size) / max(1, ids.numel())
        self._occupied += new_size - self.size
        self.size = new_size
        return slots

    def erase(self, ids: torch.Tensor) -> Compaction:
        """Remove ids (absent ones are ignored) and compact; returns the row moves to mirror."""
        ids = torch.unique(as_ids(ids, self.device))
        pos = self.backend.probe(self.table, ids)
        pos = pos[pos >= 0]
        gone = torch.sort(self.table[pos, 1]).values
        self.table[pos, 0] = TOMB
        new_size = self.size - gone.numel()
        # Holes below the new end take the surviving rows from above it, both in slot order.
        # Work is O(erased): the tail [new_size, size) has exactly len(gone) slots.
        dst = gone[gone < new_size]
        tail_alive = torch.ones(gone.numel(), dtype=torch.bool, device=self.device)
        tail_alive[gone[gone >= new_size] - new_size] = False
        src = new_size + torch.nonzero(tail_alive).squeeze(1)
        if src.numel():
            moved = self.slot_keys[src]
            self.table[self.backend.probe(self.table, moved), 1] = dst
            self.slot_keys[dst] = moved
        release_rows(self.slot_keys, new_size, self.size, self.backend.name == "native")
        self.size = new_size
        if new_size < self.capacity * MAX_LOAD / 4 and self.capacity > MIN_CAPACITY:
            self.slot_keys = self.slot_keys[: max(new_size * 3 // 2, 1)].clone()
            self._rehash(capacity_for(new_size))
        return Compaction(src=src, dst=dst, new_size=new_size)

    def clear(self) -> None:
        self.size = 0
        self._occupied = 0
        self._alloc_table(MIN_CAPACITY)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` keys without a rehash or slot-array growth."""
        if rows > self.size:
            self._reserve(rows - self.size)

    # -- internals ----------------------------------------------------------------------------
    def _lookup(self, ids: torch.Tensor, bounds: tuple[int, int]):
        """(slots, ids as int64, absent count); raises ``IdOutOfRange`` for an id outside bounds."""
        ids = as_ids(ids, self.device, check=False)
        slots, bad, misses = self.backend.lookup(self.table, ids, *bounds)
        self._raise_if_bad(ids, bad, bounds)
        return slots, ids, misses

    @staticmethod
    def _raise_if_bad(ids: torch.Tensor, bad: int, bounds: tuple[int, int]) -> None:
        if bad >= 0:
            id_ = int(ids[bad])  # (ANY_ID: unbounded, or a shard of 2^63 - 1 ids, whose last is out)
            raise _negative(id_) if bounds == ANY_ID and id_ < 0 else IdOutOfRange(id_, bounds)

    def _grow_slot_keys(self, need: int) -> None:
        """Room for ``need`` slots in slot_keys (address space: untouched pages cost nothing)."""
        if self.slot_keys.numel() < need:
            grown = empty_large(max(need, self.slot_keys.numel() * 3 // 2), torch.long, self.device,
                                self.backend.name == "native")
            grown[: self.size] = self.slot_keys[: self.size]
            self.slot_keys = grown

    def _reserve(self, extra: int) -> None:
        need = self.size + extra
        if need > MAX_SLOTS:
            raise RuntimeError(
                f"id map shard would hold {need} rows, above the {MAX_SLOTS} slot limit; "
                "use more buckets/ranks"
            )
        self._grow_slot_keys(need)
        if self._occupied + extra > MAX_LOAD * self.capacity:
            # Rehash for the live keys (tombstones are dropped), never below the current size.
            self._rehash(max(self.capacity, capacity_for(need)))

    def _rehash(self, capacity: int) -> None:
        """A table of ``capacity`` with the live ids (no tombstones), rebuilt from ``slot_keys``
        (the old one freed first) a chunk at a time in slot order: one table at a time."""
        self.table = None
        self._alloc_table(capacity)
        for at in range(0, self.size, REHASH_CHUNK):
            chunk = self.slot_keys[at:min(at + REHASH_CHUNK, self.size)].clone()  # (the insert writes slot_keys)
            self.backend.find_or_insert(self.table, self.slot_keys, chunk, *ANY_ID, at, False)
        self._occupied = self.size

    def _alloc_table(self, capacity: int) -> None:
        native = self.backend.name == "native"
        self.table = empty_large((capacity, 2), torch.long, self.device, native).fill_(EMPTY)
