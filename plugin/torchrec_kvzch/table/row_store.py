"""The DRAM row store of one table shard: rows created on demand for each global id.

The parts of a row live in separate arrays indexed by the id map's dense slots (``arrays.py``;
the key is the map's ``slot -> id`` array), growing and shrinking with the live rows, never with
the virtual table size. Reads and writes address a ``RowPart`` (``layout.py``); whole-row writes
take each row's id from its header and skip rows whose used bit is 0.

Training goes through ``lookup_for_update``: it advances the store's clock, admits new ids
(``admission.py``), runs eviction (``eviction.py``), and finds or creates the batch's rows. The fused
update of fbgemm's TBE is announced with ``expect_update`` and ``update_started``: in between, no row
may move, and a frozen snapshot copies the rows it will change (``pending.py``). Checkpoints read
rows through snapshots (``snapshot.py``; frozen ones are ``pin``-ned: every change first lets them
copy rows aside; array swaps happen under ``lock``); incremental ones ask ``changes`` what changed
since a ``mark``. ``params.storage``: DRAM caches rows on disk (``disk_cache.py``);
``params.device_cache``: a CUDA store's rows are in host memory under a GPU cache (``row_cache.py``).
"""

from __future__ import annotations

import threading

import torch

from torchrec_kvzch.params import BucketRange, KVZCHTableParams
from torchrec_kvzch.table.admission import Admission
from torchrec_kvzch.table.arrays import GROWTH as _GROWTH, RowArrays, estimated_bytes
from torchrec_kvzch.table.changes import ChangeLog, ChangeMark
from torchrec_kvzch.table.disk_cache import DiskCache
from torchrec_kvzch.table.eviction import Evictor
from torchrec_kvzch.table.rank_budget import SharedBudget
from torchrec_kvzch.table.history import EVICTED, INSERTED, BucketHistory
from torchrec_kvzch.table.id_map import IdMap, IdOutOfRange, as_ids
from torchrec_kvzch.table.initializer import fill_uniform_by_id
from torchrec_kvzch.table.layout import RowLayout, RowPart, make_meta, meta_used, with_timestamp
from torchrec_kvzch.table.pending import PendingUpdate, PendingUpdates
from torchrec_kvzch.table.row_cache import RowCache

_MIN_ROWS = 1024
# Rows of address space mapped per array: growth up to it is in place; only written rows cost memory.
_RESERVED_ROWS = 1 << 24


class RowStore:
    def __init__(self, params: KVZCHTableParams, bucket_range: BucketRange | None = None,
                 device: torch.device | str = "cpu", backend: str = "auto", initial_rows: int = 0,
                 budget: SharedBudget | None = None) -> None:
        """``bucket_range``: the buckets this shard owns; ids outside it are rejected.
        ``initial_rows``: capacity to reserve up front (e.g. the planner's expected rows).
        ``budget``: the rank's memory budget this store shares with the rank's other shards."""
        self.params = params
        self.layout = RowLayout.for_table(params)
        self.bucket_range = bucket_range or BucketRange(0, params.total_num_buckets, params.bucket_size)
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:<current>", as tensors say
        self.id_map = IdMap(backend, self.device)
        self.native = self.id_map.backend.name == "native"  # same choice for arrays and init
        self.clock = 0  # training steps seen; stamped into the headers find_or_insert touches
        self.epoch = 0  # bumped whenever rows change slots (delete, clear): snapshots check it
        self.lock = threading.RLock()
        self._pending = PendingUpdates()  # announced fused updates not started yet (pending.py)
        self._frozen: tuple = ()  # copy-on-write states of frozen snapshots (see snapshot.py)
        self.history = BucketHistory(self.bucket_range)  # rows inserted and evicted, by bucket
        self.changes = ChangeLog()  # what incremental checkpoints need to tell (changes.py)
        self.admission = Admission(params.admission, params.init_seed, self.device) if params.admission.enabled else None
        self._reserved = self._reserved_map = 0  # rows reserved (arrays, id map): deletes, loads keep them
        self.row_cache = RowCache(self, params.device_cache) if params.device_cache.enabled else None
        self.weights, self.optimizer, self.meta = self._new_arrays(_MIN_ROWS).tensors
        self.cache = DiskCache(self, params.storage) if params.storage.enabled else None  # rows on disk
        self.evictor = Evictor(self, budget)
        initial_rows = initial_rows if self.evictor.max_rows is None else self.evictor.max_rows  # a budget
        if initial_rows:  # room for it now: never a growth copy
            self.reserve(initial_rows)

    # -- sizes --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.id_map)

    @property
    def capacity(self) -> int:
        return self.weights.shape[0]

    @property
    def arrays(self) -> RowArrays:
        return RowArrays(self.weights, self.optimizer, self.meta)

    @property
    def nbytes(self) -> int:
        return self.arrays.nbytes + self.id_map.nbytes

    def keys(self) -> torch.Tensor:
        """The live ids, indexed by slot (a view: copy it before changing the store)."""
        return self.id_map.keys()

    @property
    def counters(self) -> dict[str, int]:
        """Live rows, rows ever inserted and evicted, bytes; admission's and a disk tier's counters."""
        out = {"rows": len(self), "inserted": self.history.inserted, "evicted": self.history.evicted, "bytes": self.nbytes}
        if self.admission is not None:
            out.update(admitted=self.admission.admitted, rejected=self.admission.rejected)
        return out if self.cache is None else {**out, **self.cache.counters}

    estimated_bytes = staticmethod(estimated_bytes)  # (arrays.py: what the planner counts)

    # -- training -----------------------------------------------------------------------------
    def lookup_for_update(self, ids: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """A training batch's slots: a clock step, admission (-1: not admitted yet), eviction, then
        ``find_or_insert`` (``scores``: per id, for a feature-score table). Under a pending update,
        growth and tables that may move rows in lookups are refused before anything changes."""
        self._pending.check_lookup(self, ids.numel())
        self.evictor.check_scores(scores)
        if self.cache is not None:
            self.cache.check_fits(ids)
        self.clock, ok = self.clock + 1, None
        try:  # a refusal (ids outside the shard, ...) comes before any row changes: undo the step
            if self.admission is not None:
                ids = as_ids(ids, self.device, check=False)  # range: checked by find
                known = (self.find(ids) >= 0) | (self.cache is not None and self.cache.known(ids))
                ok = self.admission.admit(ids, known, self.clock)  # (None: every id may use a row)
            admitted, scores = (ids, scores) if ok is None else (ids[ok], None if scores is None else scores[ok])
            self.evictor.before_insert(admitted)  # over both tiers; its evict is refused under a pending update
            if self.cache is not None:  # the batch's rows on disk come in; the coldest others go out
                self.cache.before_lookup(admitted)
            if ok is None:
                return self.find_or_insert(admitted, scores=scores)
            return torch.full_like(ids, -1).masked_scatter_(ok, self.find_or_insert(admitted, scores=scores))
        except Exception:
            self.clock -= 1
            raise

    def expect_update(self, slots: torch.Tensor) -> PendingUpdate:
        """A fused update will write the rows at ``slots`` (``pending.py``)."""
        return self._pending.add(slots, self.clock)

    def update_started(self, update: PendingUpdate | None = None) -> None:
        """``update`` (None: every one) is under way (its gradient arrived), or never will be."""
        self._pending.started(update)

    @property
    def pending_update(self) -> torch.Tensor | None:
        """The slots of every announced fused update not started yet, or None."""
        return self._pending.slots()

    # -- id -> slot ---------------------------------------------------------------------------
    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ids, -1 where absent. Touches nothing; ids outside the shard are refused."""
        return self._mapped(self.id_map.find, ids)

    def find_or_insert(self, ids: torch.Tensor, touch: bool = True, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Slots of ids; absent ids get new rows (id-seeded weights, zero optimizer state, header written). With
        ``touch`` (a lookup) ``Evictor.touch`` stamps the rows' headers and new rows count as inserted."""
        old = len(self)
        slots = self._mapped(self.id_map.find_or_insert, ids)
        if len(self) > old:
            self._init_rows(old, len(self))
            if touch:
                self.history.count(INSERTED, self.keys()[old:])
        if touch and slots.numel():
            self._before_change(slots)
            self.evictor.touch(slots, scores)
        return slots

    def delete(self, ids: torch.Tensor, moved: bool = False) -> int:
        """Remove the rows of ids (absent: ignored); returns how many. ``moved``: they went to the disk tier."""
        before = len(self)
        if self._frozen:  # the deleted rows, and the tail rows compaction moves into their slots
            found = torch.unique(self.find(ids))
            found = found[found >= 0]
            tail = torch.arange(before - found.numel(), before, device=self.device)
            self._before_change(torch.cat([found, tail]))
        moves = self.id_map.erase(ids)
        if not moved:
            self.changes.deleted(as_ids(ids, self.device, check=False))
        self.epoch += 1
        if self.row_cache is not None:
            self.row_cache.before_compaction(moves, before)
        self.arrays.assign(moves.dst, self.arrays, moves.src)
        floor = max(_MIN_ROWS, self._reserved)
        if moves.new_size * 4 < self.capacity and self.capacity > floor:
            self._resize(max(floor, int(moves.new_size * _GROWTH)), keep=moves.new_size)
        else:  # the dead tail's memory goes back without a copy
            self.arrays.release(moves.new_size, before, self.native)
        return before - len(self) + (self.cache.tier.remove(ids) if self.cache is not None and not moved else 0)

    def evict(self, ids: torch.Tensor) -> None:
        """Delete the rows of ``ids`` (in either tier), counting them as evicted (eviction's way out)."""
        if self._pending:
            raise self._pending.refuse_moves(self.params.name)
        self.delete(ids)
        self.history.count(EVICTED, ids)

    # -- reads --------------------------------------------------------------------------------
    def read(self, slots: torch.Tensor, part: RowPart = RowPart.WEIGHT, *, keys: torch.Tensor | None = None,
             arrays: RowArrays | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at live slots, as ``part``; from ``arrays`` (with the rows' ``keys``), into ``out`` (a save's buffer)."""
        slots = slots.reshape(-1).long()
        keys = self.id_map.slot_keys[slots] if keys is None else keys
        if self.row_cache is not None and arrays is None and RowPart(part) in (RowPart.WEIGHT, RowPart.ROW):
            self.row_cache.flush_rows(slots)
        return (arrays or self.arrays).read(slots, RowPart(part), keys, self.layout, self.native, out)

    def read_ids(self, ids: torch.Tensor, part: RowPart = RowPart.WEIGHT) -> torch.Tensor:
        """Rows of ids; an absent id reads as zeros (as a whole row: key = id, used bit 0)."""
        ids = as_ids(ids, self.device)
        slots = self.find(ids)
        hit = slots >= 0
        if bool(hit.all()):  # the common case (checkpoint chunks): one gather, no mask
            return self.read(slots, part)
        out = torch.zeros(ids.numel(), self.layout.width(part), dtype=self.layout.part_dtype(part), device=self.device)
        out[hit] = self.read(slots[hit], part)
        if self.cache is not None:  # rows on disk, read where they are
            on_disk = torch.nonzero(~hit).view(-1)
            found, rows = self.cache.read(ids[on_disk], part)
            out[on_disk[found]], hit[on_disk[found]] = rows, True
        if RowPart(part) is RowPart.ROW:  # an absent row's header: its id, used bit 0
            missing = ids[~hit]
            header = torch.stack([missing, torch.zeros_like(missing)], dim=1)
            out[~hit, : self.layout.header_width] = header.view(self.layout.dtype)
        return out

    def peek(self, ids: torch.Tensor, absent: torch.Tensor | None = None) -> torch.Tensor:
        """Weights of ids changing nothing (what evaluation looks up): a live row's weights,
        else ``absent`` (a ``[D]`` row) or, without it, the id-seeded weights it would start with."""
        ids = as_ids(ids, self.device, check=False)  # range: checked by the lookup
        slots = self.find(ids)
        out = self.weights[slots.clamp(min=0)] if self.row_cache is None else self.row_cache.gather(slots.clamp(min=0))
        missing = torch.nonzero(slots < 0).view(-1)
        if missing.numel() and self.cache is not None:  # rows on disk, read where they are
            found, weights = self.cache.read(ids[missing], RowPart.WEIGHT)
            out[missing[found]], missing = weights.to(out.dtype), missing[~found]
        if missing.numel():
            out[missing] = (absent.to(out.dtype) if absent is not None else
                            self._initial_weights(out.new_empty(missing.numel(), out.shape[1]), ids[missing]))
        return out

    def mark(self) -> ChangeMark:
        """Now, for telling later what changed since (``changes.py``)."""
        oldest = self._pending.oldest_clock()  # rows stamped by a pending forward change later
        return self.changes.mark(self.clock, False) if oldest is None else self.changes.mark(oldest, True)

    def pin(self, frozen) -> None:
        """Have a frozen snapshot (``snapshot._Frozen``) copy rows aside before they change (``preserve``: pending
        updates' rows at once, after the GPU cache's write-back; ``preserve_headers``), keep arrays a clear drops."""
        with self.lock:
            if self.row_cache is not None:
                self.row_cache.flush()
            if self._pending:
                frozen.preserve(self._pending.slots())
            self._frozen = (*self._frozen, frozen)

    def unpin(self, frozen) -> None:
        with self.lock:
            self._frozen = tuple(f for f in self._frozen if f is not frozen)

    # -- writes -------------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, values: torch.Tensor, part: RowPart = RowPart.WEIGHT,
              moved: bool = False, stamp: int | None = None) -> None:
        """Overwrite ``part`` of live rows at ``slots`` (whole rows: weight, optimizer and the header's
        meta word; the key cannot change here). ``moved``: rows back from the disk tier, not a change.
        ``stamp``: a clock for the rows' timestamps, so that deltas carry the write (TorchRec's writes)."""
        part = RowPart(part)
        if part is RowPart.ID:
            raise ValueError(f"table '{self.params.name}': ids are keys, not values; "
                             "write rows by id (write_ids / write_rows) instead")
        slots = slots.reshape(-1).long()
        values = self.layout.checked(values, slots.numel(), part, self.params.name, self.device)
        self._before_change(slots)
        if not moved and stamp is None:
            self.changes.changed_untracked()  # no stamp: deltas cannot tell these rows
        self.arrays.write(slots, values, part, self.layout, self.native)
        if self.row_cache is not None and part in (RowPart.WEIGHT, RowPart.ROW):
            self.row_cache.forget(slots)
        if stamp is not None:
            self.meta[slots] = with_timestamp(self.meta[slots], stamp)

    def write_ids(self, ids: torch.Tensor, values: torch.Tensor, part: RowPart = RowPart.WEIGHT,
                  stamp: int | None = None) -> None:
        """Write ``part`` of the rows of ids (``stamp``: as in ``write``), creating absent rows first. For
        whole rows the ids must equal the header keys (``write_rows`` takes ids from the headers)."""
        ids = as_ids(ids, self.device, check=False)  # range: checked by the lookup
        if self.cache is not None and not self.cache.writing:  # rows on disk come in first, in pieces
            return self.cache.write(ids, values, lambda i, v: self.write_ids(i, v, part, stamp))
        values = self.layout.checked(values, ids.numel(), RowPart(part), self.params.name, self.device)
        if RowPart(part) is RowPart.ROW:
            keys = self.layout.unpack(values)[0]
            if not torch.equal(keys, ids):
                raise ValueError(f"table '{self.params.name}': whole-row header keys differ from "
                                 "the ids given; use write_rows to write rows by their header key")
            self.find(ids)  # refuses ids outside the shard, also of rows write_rows skips (unused)
            self.write_rows(values)
            return
        self.write(self.find_or_insert(ids, touch=False), values, part, stamp=stamp)

    def write_rows(self, rows: torch.Tensor, layout: RowLayout | None = None,
                   optimizer: bool = True, moved: bool = False) -> int:
        """Write whole rows by the id in each header, creating rows as needed; rows whose used bit is 0 are
        skipped. Returns the rows written. ``layout``: the rows' layout when not the store's (saved with another
        optimizer). With another layout, or without ``optimizer``, only weights and headers are written."""
        if self.cache is not None and not (moved or self.cache.writing):  # as in write_ids
            return self.cache.write((layout or self.layout).header(rows)[0], rows,
                                    lambda _, r: self.write_rows(r, layout, optimizer))
        if layout is None or layout == self.layout:
            n = rows.shape[0] if rows.dim() else -1
            rows = self.layout.checked(rows, n, RowPart.ROW, self.params.name, self.device)
            layout = self.layout
        elif (layout.embedding_dim, layout.dtype) != (self.layout.embedding_dim, self.layout.dtype):
            raise ValueError(f"table '{self.params.name}': rows of {layout.embedding_dim} x {layout.dtype} "
                             f"cannot become rows of {self.layout.embedding_dim} x {self.layout.dtype}")
        keys, meta = layout.header(rows)
        used = meta_used(meta)
        if not bool(used.all()):
            rows, keys, meta = rows[used], keys[used], meta[used]
        if keys.numel() == 0:
            return 0
        if layout is self.layout and optimizer:
            self.write(self._slots_to_overwrite(keys), rows, RowPart.ROW, moved)
        else:
            slots = self.find_or_insert(keys, touch=False)
            self.write(slots, layout.unpack(rows)[2], RowPart.WEIGHT)
            self.write(slots, meta.unsqueeze(1), RowPart.META)
        return keys.numel()

    def _slots_to_overwrite(self, keys: torch.Tensor) -> torch.Tensor:
        """``find_or_insert(touch=False)`` without initialising new rows (written whole next), if they fit."""
        fits = len(self) + keys.numel() <= self.capacity
        return self._mapped(self.id_map.find_or_insert, keys) if fits else self.find_or_insert(keys, touch=False)

    def restore_history(self, clock: int, counters: torch.Tensor, bucket_size: int) -> None:
        """Set the clock, and the history from saved ``[buckets, 2]`` counters."""
        self.history.restore(counters, bucket_size)
        self.clock = int(clock)
        self.evictor.loaded()  # every load ends here: the next lookup evicts down to the budgets

    def reserve(self, rows: int, id_map: bool = True) -> None:
        """Room for ``rows`` rows without further copies (deletes never shrink below it); the arrays'
        pages cost memory once written, the id map's table (``id_map``) is written up front."""
        rows = rows if self.cache is None else self.cache.reserve(rows, id_map)
        self._reserved = max(self._reserved, rows)
        if rows > self.capacity:
            self._resize(rows, keep=len(self))
        if id_map:
            self._reserved_map = max(self._reserved_map, rows)
            self.id_map.reserve(rows)

    def clear(self) -> None:
        with self.lock:
            for frozen in self._frozen:
                frozen.let_go()  # the dropped arrays stay readable for it, no copy needed
            self._frozen = ()
            self.id_map.clear()
            if self.cache is not None:  # the rows on disk too
                self.cache.clear()
            if self.row_cache is not None:
                self.row_cache.reset()
            self.id_map.reserve(self._reserved_map)
            self.changes.changed_untracked()
            self.epoch += 1  # (below: a load keeps the reservation, no growth copies)
            self.weights, self.optimizer, self.meta = self._new_arrays(max(_MIN_ROWS, self._reserved)).tensors

    # -- internals ----------------------------------------------------------------------------
    def before_header_rewrite(self, decay: float | None = None) -> None:
        """Call before rewriting every header: by lfu's ``decay`` (deltas replay it) or not."""
        self.changes.decayed(decay) if decay is not None else self.changes.changed_untracked()
        for frozen in self._frozen:
            frozen.preserve_headers()

    def _before_change(self, slots: torch.Tensor) -> None:
        for frozen in self._frozen:
            frozen.preserve(slots)

    def _init_rows(self, start: int, end: int) -> None:
        if end > self.capacity:
            self._resize(max(end, int(self.capacity * _GROWTH)), keep=start)
        self._initial_weights(self.weights[start:end], self.keys()[start:end])
        self.optimizer[start:end] = 0
        self.meta[start:end] = make_meta(self.clock, 0, used=True)

    def _initial_weights(self, out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        low, high = self.params.init_range
        fill_uniform_by_id(out, ids, low, high, self.params.init_seed, native=self.native)
        return out

    def _new_arrays(self, rows: int) -> RowArrays:
        # Uninitialised (_init_rows writes rows before use); CUDA managed memory (a device cache's) without 4x.
        ids, slack = self.bucket_range.id_end - self.bucket_range.id_start, 1 if self.row_cache else 4
        space = max(rows, min(ids, max(_RESERVED_ROWS, slack * rows)))
        return RowArrays.allocate(self.layout, rows, self.device, self.native, space, self.row_cache is not None)

    def _resize(self, rows: int, keep: int) -> None:
        with self.lock:  # (a reader in another thread takes the arrays under it)
            arrays = self.arrays.resized(rows, keep, self.native, self._new_arrays)
            self.weights, self.optimizer, self.meta = arrays.tensors

    def _mapped(self, lookup, ids: torch.Tensor) -> torch.Tensor:
        """``lookup(ids, bounds)`` of the id map, bounded to this shard's ids."""
        r = self.bucket_range
        try:
            return lookup(ids, (r.id_start, r.id_end))
        except IdOutOfRange as e:
            raise ValueError(f"table '{self.params.name}': id {e.id} is outside this shard's ids [{r.id_start}, "
                             f"{r.id_end}) (buckets [{r.start}, {r.end}) of size {r.size}); route ids to the "
                             "rank owning their bucket (id // bucket_size)") from None
