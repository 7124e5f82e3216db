"""A store's rows at one moment, addressed by position in bucket (ascending id) order.

Checkpoints read tables through snapshots: position ``i`` is the ``i``-th smallest id live when
the snapshot was taken. A plain snapshot reads the live rows (by slot while no row has moved,
by id after), so a row trained after the snapshot reads as trained and a deleted one as absent.

``changed_since(mark)`` is the snapshot of the rows changed since an earlier snapshot's
``mark`` (an incremental checkpoint's rows), ``deleted_since(mark)`` the ids deleted since and
``decays_since(mark)`` the count decays (``changes.py``).

``freeze()`` pins the rows to the moment of the call, for checkpoints written in the background
while training goes on (``dcp.async_save``). From then on the store copies a snapshot row aside
the first time anything is about to change it (copy on write), and the snapshot reads the copy.
A frozen snapshot therefore costs the rows changed while it is frozen, not a copy of the table,
and another thread may read it while the owning thread trains. Every change to a store's rows
goes through the store, which calls ``_Frozen.preserve`` first (fbgemm's fused update writes the
rows of the forward's slots, which the store preserves when the forward looks them up, and
those of an update announced before the freeze, ``RowStore.expect_update``).

A store over a disk tier (``disk_cache.py``) is snapshotted whole: the rows on disk sit among
the others in id order, read at their tier positions. Rows on disk never change in place (a row
comes into DRAM to change), so a frozen snapshot only needs the tier to keep its positions
(``DiskTier.hold``) until it is released, and their header words as they were (the tier keeps
those in memory, where a decay rewrites them); a plain one reads by id once rows moved between
tiers.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch

from torchrec_kvzch.table.arrays import RowArrays
from torchrec_kvzch.table.changes import ChangeMark
from torchrec_kvzch.table.id_map import ANY_ID, as_ids
from torchrec_kvzch.table.layout import RowPart, meta_timestamp_view
from torchrec_kvzch.table.row_store import RowStore


class RowSnapshot:
    def __init__(self, store: RowStore, ids: torch.Tensor | None = None) -> None:
        """``ids``: the rows to address, ascending; default, every live row (which can be
        frozen). A snapshot of given ids always reads by id."""
        self.store = store
        self.positions: torch.Tensor | None = None  # over a disk tier: each row's tier position, or -1
        if ids is None and store.cache is not None:
            self.ids, self.slots, self.positions = store.cache.snapshot(store.keys())
        elif ids is None:
            # (The ids are unique, so stability costs nothing; torch's stable sort of int64 measured
            # 15-20% faster than its default one.)
            self.ids, self.slots = torch.sort(store.keys(), stable=True)
        else:
            self.ids, self.slots = as_ids(ids, store.device), None
        self.epoch, self.generation = store.epoch, _generation(store)
        self.mark = store.mark()
        self._frozen: _Frozen | None = None
        self._unpin: weakref.finalize | None = None

    def __len__(self) -> int:
        return self.ids.numel()

    def bucket_counts(self) -> torch.Tensor:
        """Rows per local bucket, ``[bucket_range.num_buckets]`` int64. The ids ascend, so each
        bucket's rows are one run, found by binary search: a pass over every id cost a quarter
        of the state dict of a 4M-row table."""
        r = self.store.bucket_range
        edges = [min(r.id_start + k * r.size, ANY_ID[1]) for k in range(r.num_buckets + 1)]
        return torch.diff(torch.searchsorted(self.ids, torch.tensor(edges, device=self.ids.device)))

    def changed_since(self, base: ChangeMark) -> "RowSnapshot":
        """The rows of this snapshot changed since ``base`` (stamped at or after its clock),
        as a snapshot of their own: same moment and mark, freezable. Refused when the store
        cannot tell (``ChangeLog.covers``): the caller saves every row instead."""
        self._check_current("told what changed")
        if not self.store.changes.covers(base, self.mark):
            raise ValueError(f"table '{self.store.params.name}': rows changed since the base "
                             "without a trace (a load or write from outside training, "
                             "or a delete before deletes were logged)")
        n = len(self.store)
        changed = meta_timestamp_view(self.store.meta[:n]) >= base.since
        if self.positions is None:
            keep = torch.nonzero(changed[self.slots]).view(-1)
        else:  # rows on disk: by the header words the tier keeps
            disk = self.positions >= 0
            hit = changed[self.slots.clamp(min=0)] & ~disk
            hit[disk] = meta_timestamp_view(self.store.cache.stamps(self.ids[disk])) >= base.since
            keep = torch.nonzero(hit).view(-1)
        sub = copy.copy(self)  # same store, moment and mark; never frozen
        sub.ids, sub.slots, sub._frozen, sub._unpin = self.ids[keep], self.slots[keep], None, None
        sub.positions = None if self.positions is None else self.positions[keep]
        return sub

    def decays_since(self, base: ChangeMark) -> list[float]:
        """The count decays between ``base`` and this snapshot, in order."""
        return self.store.changes.decays_between(base, self.mark)

    def deleted_since(self, base: ChangeMark) -> torch.Tensor:
        """Ids deleted between ``base`` and this snapshot and not live in it, ascending."""
        ids = self.store.changes.deleted_between(base, self.mark).to(self.ids.device)
        if ids.numel() and self.ids.numel():
            pos = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
            ids = ids[self.ids[pos] != ids]
        return ids

    def _current(self) -> bool:
        """Whether every row is still where the snapshot found it."""
        return self.slots is not None and (self.epoch, self.generation) == (self.store.epoch, _generation(self.store))

    def _check_current(self, what: str) -> None:
        if not self._current():
            raise ValueError(f"table '{self.store.params.name}': rows were deleted or reloaded "
                             f"since this state dict was taken, so it cannot be {what}; take the "
                             "state dict again right before saving")

    def check_fresh(self, what: str = "save") -> None:
        """A state dict saves (or copies) its tables as of the moment it was taken (rows, clock,
        counters); after a training step, load or write, a plain snapshot would read today's
        rows under that moment's ids and history, a checkpoint of two moments: refused."""
        if self.mark != self.store.mark() or self.epoch != self.store.epoch:
            raise ValueError(f"KV-ZCH table '{self.store.params.name}': the state dict to {what} was taken "
                             "before the table last changed (a training step, load or write since), so "
                             f"it would {what} rows of two moments; take a fresh state_dict() (the model's, "
                             f"then the optimizer's) right before each {what}")

    @property
    def frozen(self) -> bool:
        return self._frozen is not None

    def read(self, start: int, length: int, part: RowPart, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at positions ``[start, start + length)`` as ``part``; into ``out`` (contiguous,
        of the result's shape and dtype) when given."""
        part, end = RowPart(part), start + length
        if part is RowPart.ID:
            ids = self.ids[start:end].unsqueeze(1)
            return ids if out is None else out.copy_(ids)
        frozen = self._frozen
        if frozen is not None:
            return frozen.read(start, end, part, out)
        if self._current() and self.positions is not None:
            return self.store.cache.read_mixed(self.slots[start:end], self.positions[start:end], self.ids[start:end],
                                               part, out)
        if self._current():
            return self.store.read(self.slots[start:end], part, out=out)
        rows = self.store.read_ids(self.ids[start:end], part)  # rows moved: found by id
        return rows if out is None else out.copy_(rows)

    def freeze(self) -> None:
        """Pin the rows to now until ``release()`` (or until the snapshot is garbage)."""
        name = self.store.params.name
        if self._frozen is not None:
            raise ValueError(f"table '{name}': this state dict is already being saved "
                             "asynchronously; take a new state dict for each save")
        self._check_current("saved asynchronously")
        self.check_fresh()
        self._frozen = _Frozen(self.store, self.ids, self.slots, self.positions)
        self.store.pin(self._frozen)
        if self.positions is not None:
            self.store.cache.tier.hold()
        # A snapshot dropped without release() must not keep the store copying rows.
        self._unpin = weakref.finalize(self, _let_go, self.store, self._frozen)

    def release(self) -> None:
        """Stop copying and free the copies; reads go to the live rows again. Idempotent."""
        if self._frozen is not None:
            self._unpin()
            self._frozen = None

    @property
    def copied_bytes(self) -> int:
        """Memory held by rows copied aside since the freeze."""
        return self._frozen.nbytes if self._frozen is not None else 0


def _generation(store) -> int:
    return store.cache.tier.generation if store.cache is not None else 0


def _let_go(store, frozen: "_Frozen") -> None:
    store.unpin(frozen)
    if frozen.positions is not None:
        store.cache.tier.release()


class _Frozen:
    """Copy-on-write state of a frozen snapshot.

    ``saved_at[p]`` is -1 while position ``p`` is untouched (its row still sits, unchanged, at
    the snapshot's slot ``p``), else the index of its copy. Positions are found from the keys of
    the slots about to change (ids are sorted), so nothing per slot is kept."""

    def __init__(self, store: RowStore, ids: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor | None = None) -> None:
        self.store, self.ids, self.slots, self.positions = store, ids, slots, positions
        self.saved_at = torch.full((ids.numel(),), -1, dtype=torch.int32, device=ids.device)
        self.count = 0
        self.copies = store.arrays.empty_like(0)
        self.arrays: RowArrays | None = None  # arrays the store let go of (clear), read in place
        self.meta: torch.Tensor | None = None  # header words by slot, kept before a rewrite of all
        self.disk_meta: torch.Tensor | None = None  # header words of the rows on disk, by position
        if positions is not None:
            disk = positions >= 0
            self.disk_meta = torch.zeros_like(ids).masked_scatter_(disk, store.cache.stamps(ids[disk]))

    @property
    def nbytes(self) -> int:
        meta = sum(m.numel() * 8 for m in (self.meta, self.disk_meta) if m is not None)
        return self.copies.nbytes + self.saved_at.numel() * 4 + meta

    def preserve_headers(self) -> None:
        """Keep the header word of every slot (once): the store is about to rewrite them all.
        Rows not copied aside still sit at their snapshot slots below ``len(store)``."""
        if self.meta is None and self.arrays is None:
            self.meta = self.store.meta[: len(self.store)].clone()

    def preserve(self, slots: torch.Tensor) -> None:
        """Copy aside the snapshot rows at ``slots`` not copied yet. Called by the store on the
        thread that changes it, just before the change."""
        if self.arrays is not None or slots.numel() == 0 or self.ids.numel() == 0:
            return
        slots = torch.unique(slots.reshape(-1).long())
        slots = slots[(slots >= 0) & (slots < len(self.store))]
        keys = self.store.keys()[slots]
        pos = torch.searchsorted(self.ids, keys).clamp_(max=self.ids.numel() - 1)
        new = (self.ids[pos] == keys) & (self.saved_at[pos] < 0)
        if self.positions is not None:  # rows on disk at the freeze are read there, never copied
            new &= self.positions[pos] < 0
        if not bool(new.any()):
            return
        slots, pos = slots[new], pos[new]
        with self.store.lock:
            end = self.count + slots.numel()
            if end > self.copies.rows:
                self.copies = self.copies.grown(max(end, 2 * self.copies.rows, 1024))
            source = self.store.arrays
            if self.meta is not None:  # headers rewritten since the freeze: the kept ones
                source = dataclasses.replace(source, meta=self.meta)
            self.copies.assign(slice(self.count, end), source, slots)
            self.saved_at[pos] = torch.arange(self.count, end, dtype=torch.int32, device=pos.device)
            self.count = end

    def let_go(self) -> None:
        """The store is dropping its arrays (clear): keep reading the untouched rows from them."""
        self.arrays = self.store.arrays

    def read(self, start: int, end: int, part: RowPart, out: torch.Tensor | None = None) -> torch.Tensor:
        store = self.store
        with store.lock:  # a consistent (slots, arrays) pair: no resize or move in between
            arrays = self.arrays or store.arrays
            if self.meta is not None:
                arrays = dataclasses.replace(arrays, meta=self.meta)
            copied = self.saved_at[start:end] >= 0
            slots = self.slots[start:end].masked_fill(copied, 0)  # copied slots may be gone
        # Gather outside the lock, so training is not held up by a chunk read. Rows not yet
        # copied are unchanged; any row changed meanwhile was copied first and is fixed below.
        if self.positions is not None:  # rows on disk at the freeze: at their held positions
            rows = store.cache.read_mixed(slots.clamp(min=0), self.positions[start:end].masked_fill(copied, -1),
                                          self.ids[start:end], part, out, arrays, self.disk_meta[start:end])
        else:
            rows = store.read(slots, part, keys=self.ids[start:end], arrays=arrays, out=out)
        with store.lock:
            saved = self.saved_at[start:end]
            hit = saved >= 0
            if bool(hit.any()):
                at = saved[hit].long()
                rows[hit] = store.read(at, part, keys=self.ids[start:end][hit], arrays=self.copies)
        return rows
