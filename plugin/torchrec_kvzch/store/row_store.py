"""The DRAM row store of one table shard: rows created on demand for each global id.

Physically the parts of a row live in separate arrays indexed by the id map's dense slots:
``weights [capacity, D]`` (contiguous, so fbgemm's TBE can index it directly), ``optimizer
[capacity, F]`` fp32 and ``meta [capacity]`` int64 (timestamp, count, used). The header key is the
id map's ``slot -> id`` array, stored once. Capacity grows and shrinks geometrically with the
live rows, never with the virtual table size.

Reads and writes address a ``RowPart``: the weight, the optimizer state, or the whole row in the
upstream layout (``layout.py``). Whole-row writes take each row's id from its header and skip
rows whose used bit is 0.

Checkpoints read rows through snapshots (``snapshot.py``). While a snapshot is frozen, every
method here that changes rows first lets it copy them aside; a frozen snapshot may be read from
another thread, so array swaps (growth, shrinking, clear) happen under ``lock``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from torchrec_kvzch.params import BucketRange, KVZCHTableParams
from torchrec_kvzch.store.eviction import SCRATCH_BYTES_PER_ROW, Evictor
from torchrec_kvzch.store.id_map import (
    IdMap,
    IdOutOfRange,
    as_ids,
    empty_large,
    map_bytes,
    regrown,
    release_rows,
    table_bytes,
)
from torchrec_kvzch.store.initializer import fill_uniform_by_id
from torchrec_kvzch.store.layout import RowLayout, RowPart, make_meta, meta_used, touch_meta
from torchrec_kvzch.store.snapshot import RowSnapshot

_GROWTH = 1.5
_MIN_ROWS = 1024
# Rows of address space mapped per array, so that growth up to it is in place (no copy, no peak
# of two arrays); only written rows cost memory.
_RESERVED_ROWS = 1 << 24
_COPY_CHUNK_BYTES = 4 << 20


def _gather(source: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``source[slots]``, into ``out`` when given."""
    return source[slots] if out is None else torch.index_select(source, 0, slots, out=out)


def _shift(window: slice, piece: slice) -> slice:
    """The part ``piece`` of the contiguous slot window ``window``."""
    return slice(window.start + piece.start, window.start + piece.stop)


@dataclass(frozen=True)
class RowArrays:
    """The per-slot arrays of a store (or of rows copied out of one)."""

    weights: torch.Tensor
    optimizer: torch.Tensor
    meta: torch.Tensor

    @property
    def rows(self) -> int:
        return self.weights.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weights, self.optimizer, self.meta))

    def empty_like(self, rows: int) -> "RowArrays":
        arrays = (self.weights, self.optimizer, self.meta)
        return RowArrays(*(t.new_empty((rows, *t.shape[1:])) for t in arrays))

    def grown(self, rows: int) -> "RowArrays":
        out = self.empty_like(rows)
        out.assign(slice(0, self.rows), self, slice(None))
        return out

    def assign(self, at, source: "RowArrays", slots) -> None:
        """``self[at] = source[slots]`` for every array. Gathers by index tensors go in chunks of
        about 4 MiB: one gather of every row a large eviction moves would be a temporary copy
        as big as those rows, outside any memory budget."""
        for dst, src in zip((self.weights, self.optimizer, self.meta),
                            (source.weights, source.optimizer, source.meta)):
            if not isinstance(slots, torch.Tensor):
                dst[at] = src[slots]  # slices: a view, no copy
                continue
            step = max(1, _COPY_CHUNK_BYTES // max(1, src[:1].nbytes))
            for start in range(0, slots.numel(), step):
                piece = slice(start, min(start + step, slots.numel()))
                dst[at[piece] if isinstance(at, torch.Tensor) else _shift(at, piece)] = src[slots[piece]]


class RowStore:
    def __init__(
        self,
        params: KVZCHTableParams,
        bucket_range: BucketRange | None = None,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        initial_rows: int = 0,
    ) -> None:
        """``bucket_range``: the buckets this shard owns; ids outside it are rejected.
        ``initial_rows``: capacity to reserve up front (e.g. the planner's expected rows)."""
        self.params = params
        self.layout = RowLayout.for_table(params)
        self.bucket_range = bucket_range or BucketRange(0, params.total_num_buckets,
                                                        params.bucket_size)
        self.device = torch.device(device)
        self.map = IdMap(backend, self.device)
        self._native = self.map.kernels.name == "native"  # same choice for init and touch
        self.clock = 0  # training steps seen; stamped into the headers find_or_insert touches
        self.epoch = 0  # bumped whenever rows change slots (delete, clear): snapshots check it
        self.lock = threading.RLock()
        self.in_flight: torch.Tensor | None = None  # slots the pending fused update will write
        self._frozen: tuple = ()  # copy-on-write states of frozen snapshots (see snapshot.py)
        # Rows ever created by lookups and evicted, per local bucket: checkpoints carry them by
        # bucket, so they follow the rows to any world size.
        self.inserted_per_bucket = torch.zeros(self.bucket_range.num_buckets, dtype=torch.long)
        self.evicted_per_bucket = torch.zeros_like(self.inserted_per_bucket)
        self._reserved = 0  # capacity reserved up front: deletes never shrink below it
        self._alloc(_MIN_ROWS)
        self.evictor = Evictor(self)
        if self.evictor.max_rows is not None:  # a budget: room for it now, never a growth copy
            initial_rows = self.evictor.max_rows
        if initial_rows:
            self.reserve(initial_rows)

    # -- sizes --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.map)

    @property
    def capacity(self) -> int:
        return self.weights.shape[0]

    @property
    def arrays(self) -> RowArrays:
        return RowArrays(self.weights, self.optimizer, self.meta)

    @property
    def nbytes(self) -> int:
        return self.arrays.nbytes + self.map.nbytes

    @property
    def inserted(self) -> int:
        return int(self.inserted_per_bucket.sum())

    @property
    def evicted(self) -> int:
        return int(self.evicted_per_bucket.sum())

    @property
    def counters(self) -> dict[str, int]:
        """What the progress bar and benchmarks show: live rows, rows ever inserted and
        evicted, bytes held."""
        return {"rows": len(self), "inserted": self.inserted, "evicted": self.evicted,
                "bytes": self.nbytes}

    def local_buckets(self, ids: torch.Tensor) -> torch.Tensor:
        """The local bucket (0 = the shard's first) of each of ``ids``, all of this shard."""
        r = self.bucket_range
        return torch.div(ids, r.size, rounding_mode="floor") - r.start

    def count(self, per_bucket: torch.Tensor, ids: torch.Tensor) -> None:
        """Add one to ``per_bucket`` (a counter above) for each of ``ids``."""
        if ids.numel():
            local = self.local_buckets(ids.cpu())
            per_bucket.index_add_(0, local, torch.ones_like(local))

    @staticmethod
    def estimated_bytes(layout: RowLayout, rows: int, reserved: bool = False) -> int:
        """Upper bound on what a store holding ``rows`` rows occupies: row arrays and the slot
        array at their largest growth slack, plus the hash table (what the planner counts).
        ``reserved``: arrays reserved up front (a budget), so no growth slack; instead the peak
        working memory counts - a second hash table while tombstones are rehashed away, and
        eviction's per-row scratch (``eviction.py``)."""
        # weights, optimizer, meta word
        row_bytes = layout.embedding_dim * layout.itemsize + layout.optimizer_floats * 4 + 8
        if reserved:
            return rows * (row_bytes + SCRATCH_BYTES_PER_ROW) + table_bytes(rows) + map_bytes(rows)
        return int(rows * row_bytes * _GROWTH) + map_bytes(rows, _GROWTH)

    # -- id -> slot ---------------------------------------------------------------------------
    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ids, -1 where absent. Touches nothing; ids outside the shard are refused."""
        return self._mapped(self.map.find, ids)

    def find_or_insert(self, ids: torch.Tensor, touch: bool = True) -> torch.Tensor:
        """Slots of ids; absent ids get new rows (id-seeded weights, zero optimizer state,
        header written). With ``touch`` (a lookup) the rows' timestamps become ``clock``, their
        counts grow by the number of occurrences, and new rows count as inserted; without it
        (writes, loads) rows change nothing else."""
        old = len(self)
        slots = self._mapped(self.map.find_or_insert, ids)
        if len(self) > old:
            self._init_rows(old, len(self))
            if touch:
                self.count(self.inserted_per_bucket, self.map.slot_keys[old:len(self)])
        if touch and slots.numel():
            self._before_change(slots)
            touch_meta(self.meta, slots, self.clock, self._native)
        return slots

    def delete(self, ids: torch.Tensor) -> int:
        """Remove the rows of ids (absent ids are ignored); returns how many were removed."""
        before = len(self)
        if self._frozen:  # the deleted rows, and the tail rows compaction moves into their slots
            found = torch.unique(self.find(ids))
            found = found[found >= 0]
            tail = torch.arange(before - found.numel(), before, device=self.device)
            self._before_change(torch.cat([found, tail]))
        moves = self.map.erase(ids)
        self.epoch += 1
        self.arrays.assign(moves.dst, self.arrays, moves.src)
        floor = max(_MIN_ROWS, self._reserved)
        if moves.new_size * 4 < self.capacity and self.capacity > floor:
            self._resize(max(floor, int(moves.new_size * _GROWTH)), keep=moves.new_size)
        else:  # the dead tail's memory goes back without a copy
            for array in (self.weights, self.optimizer, self.meta):
                release_rows(array, moves.new_size, before, self._native)
        return before - len(self)

    # -- reads --------------------------------------------------------------------------------
    def read(self, slots: torch.Tensor, part: RowPart = RowPart.WEIGHT, *,
             keys: torch.Tensor | None = None, arrays: RowArrays | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at live slots, as ``part``. ``arrays``: read these instead of the live ones
        (then ``keys``, the rows' ids, are needed for whole rows and ids). ``out``: a contiguous
        tensor of the result's shape and dtype to fill and return (a save reuses one per chunk:
        a fresh tensor per chunk costs a page fault per 4 KiB written)."""
        part = RowPart(part)
        slots = slots.reshape(-1).long()
        a = arrays or self.arrays
        if part is RowPart.WEIGHT:
            return _gather(a.weights, slots, out)
        if part is RowPart.OPTIMIZER:
            return _gather(a.optimizer, slots, out)
        if part is RowPart.META:
            meta = _gather(a.meta, slots, None if out is None else out.view(-1))
            return meta.unsqueeze(1) if out is None else out
        keys = self.map.slot_keys[slots] if keys is None else keys
        if part is RowPart.ID:
            return keys.unsqueeze(1) if out is None else out.copy_(keys.unsqueeze(1))
        if self._native:
            if out is None:
                out = torch.empty(slots.numel(), self.layout.row_width, dtype=self.layout.dtype)
            torch.ops.kvzch.gather_rows_into(out, a.weights, a.optimizer, a.meta, keys.contiguous(),
                                             slots.contiguous(), self.layout.optimizer_offset)
            return out
        rows = self.layout.pack(keys, a.meta[slots], a.weights[slots], a.optimizer[slots])
        return rows if out is None else out.copy_(rows)

    def read_ids(self, ids: torch.Tensor, part: RowPart = RowPart.WEIGHT) -> torch.Tensor:
        """Rows of ids; an absent id reads as zeros (as a whole row: key = id, used bit 0)."""
        ids = as_ids(ids, self.device)
        slots = self.find(ids)
        hit = slots >= 0
        if bool(hit.all()):  # the common case (checkpoint chunks): one gather, no mask
            return self.read(slots, part)
        out = torch.zeros(ids.numel(), self.layout.width(part), dtype=self.layout.part_dtype(part),
                          device=self.device)
        out[hit] = self.read(slots[hit], part)
        if RowPart(part) is RowPart.ROW and not bool(hit.all()):
            missing = ~hit
            header = out[:, : self.layout.header_width]
            keys_meta = torch.stack([ids[missing], torch.zeros_like(ids[missing])], dim=1)
            header[missing] = keys_meta.view(self.layout.dtype)
        return out

    def peek(self, ids: torch.Tensor) -> torch.Tensor:
        """Weights of ids changing nothing: a live row's weights, else the id-seeded weights
        the row would start with (what evaluation looks up)."""
        ids = self._as_ids(ids)
        slots = self.find(ids)
        out = self.weights[slots.clamp(min=0)]
        missing = torch.nonzero(slots < 0).view(-1)
        if missing.numel():
            fresh = out.new_empty(missing.numel(), out.shape[1])
            self._initial_weights(fresh, ids[missing])
            out[missing] = fresh
        return out

    def sorted_ids(self) -> torch.Tensor:
        """Live global ids in bucket order (ascending id, so ascending bucket too)."""
        return torch.sort(self.map.keys()).values

    def snapshot(self) -> RowSnapshot:
        """The live rows now, in bucket order (what checkpoints read; see ``snapshot.py``)."""
        return RowSnapshot(self)

    def pin(self, frozen) -> None:
        """Start copying rows aside for a frozen snapshot before they change."""
        with self.lock:
            self._frozen = (*self._frozen, frozen)

    def unpin(self, frozen) -> None:
        with self.lock:
            self._frozen = tuple(f for f in self._frozen if f is not frozen)

    def bucket_counts(self) -> torch.Tensor:
        """Rows per local bucket, ``[bucket_range.num_buckets]`` int64 (a snapshot's count)."""
        return self.snapshot().bucket_counts()

    # -- writes -------------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, values: torch.Tensor, part: RowPart = RowPart.WEIGHT) -> None:
        """Overwrite ``part`` of live rows at ``slots`` (whole rows: weight, optimizer and the
        header's meta word; the key is the slot's id and cannot change here)."""
        part = RowPart(part)
        if part is RowPart.ID:
            raise ValueError(f"table '{self.params.name}': ids are keys, not values; "
                             "write rows by id (write_ids / write_rows) instead")
        slots = slots.reshape(-1).long()
        values = self._check_values(values, slots.numel(), part)
        self._before_change(slots)
        if part is RowPart.WEIGHT:
            self.weights[slots] = values
        elif part is RowPart.OPTIMIZER:
            self.optimizer[slots] = values
        elif part is RowPart.META:
            self.meta[slots] = values.reshape(-1) | make_meta(0, 0, used=True)
        elif self._native:  # one pass over the rows instead of three indexed copies
            torch.ops.kvzch.scatter_rows(self.weights, self.optimizer, self.meta, values.contiguous(),
                                         slots.contiguous(), self.layout.optimizer_offset)
        else:
            _, meta, weights, optimizer = self.layout.unpack(values)
            self.weights[slots] = weights
            self.optimizer[slots] = optimizer
            self.meta[slots] = meta | make_meta(0, 0, used=True)

    def write_ids(self, ids: torch.Tensor, values: torch.Tensor, part: RowPart = RowPart.WEIGHT) -> None:
        """Write ``part`` of the rows of ids, creating absent rows first. For whole rows the ids
        must equal the header keys (use ``write_rows`` to take ids from the headers)."""
        ids = self._as_ids(ids)
        values = self._check_values(values, ids.numel(), RowPart(part))
        if RowPart(part) is RowPart.ROW:
            keys = self.layout.unpack(values)[0]
            if not torch.equal(keys, ids):
                raise ValueError(f"table '{self.params.name}': whole-row header keys differ from "
                                 "the ids given; use write_rows to write rows by their header key")
            self.find(ids)  # refuses ids outside the shard, also of rows write_rows skips (unused)
            self.write_rows(values)
            return
        self.write(self.find_or_insert(ids, touch=False), values, part)

    def write_rows(self, rows: torch.Tensor, layout: RowLayout | None = None,
                   optimizer: bool = True) -> int:
        """Write whole rows by the id in each header, creating rows as needed; rows whose used
        bit is 0 are skipped. Returns the number of rows written. ``layout``: the rows' layout
        when it is not the store's (saved with another optimizer). With another layout, or
        without ``optimizer``, only weights and headers are written: new rows' optimizer state
        starts fresh."""
        if layout is None or layout == self.layout:
            rows = self._check_values(rows, rows.shape[0] if rows.dim() else -1, RowPart.ROW)
            layout = self.layout
        elif (layout.embedding_dim, layout.dtype) != (self.layout.embedding_dim, self.layout.dtype):
            raise ValueError(f"table '{self.params.name}': rows of {layout.embedding_dim} x "
                             f"{layout.dtype} cannot become rows of {self.layout.embedding_dim} x "
                             f"{self.layout.dtype}")
        keys, meta = self.row_header(rows, layout)
        used = meta_used(meta)
        if not bool(used.all()):
            rows, keys, meta = rows[used], keys[used], meta[used]
        if keys.numel() == 0:
            return 0
        if layout is self.layout and optimizer:
            self.write(self._slots_to_overwrite(keys), rows, RowPart.ROW)
        else:
            slots = self.find_or_insert(keys, touch=False)
            self.write(slots, layout.unpack(rows)[2], RowPart.WEIGHT)
            self.write(slots, meta.unsqueeze(1), RowPart.META)
        return keys.numel()

    def _slots_to_overwrite(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots of rows about to be written whole, as ``find_or_insert(touch=False)`` gives
        them, except that new rows are not initialised: every part of them is written next,
        and the id-seeded weights of rows a load overwrites were a third of its time. Needs
        room for the new rows (a DCP load reserves it); without, ``find_or_insert`` grows."""
        if len(self) + keys.numel() > self.capacity:
            return self.find_or_insert(keys, touch=False)
        return self._mapped(self.map.find_or_insert, keys)

    def row_header(self, rows: torch.Tensor, layout: RowLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, meta words) of whole rows of ``layout`` (default: the store's), after checking
        their shape and dtype. Copies the 16 header bytes of each row, not the rows."""
        layout = layout or self.layout
        layout.unpack(rows[:0])  # raises on rows of another shape or dtype
        header = rows[:, : layout.header_width].contiguous().view(torch.long)
        return header[:, 0], header[:, 1]

    def restore_history(self, clock: int, counters: torch.Tensor, bucket_size: int) -> None:
        """Set the clock, and the inserted / evicted counters from ``counters`` ``[buckets, 2]``
        of a table whose buckets held ``bucket_size`` ids each: each saved bucket's counts go to
        the bucket here that holds its first id (exactly its own when the geometry is the same)."""
        first = torch.arange(counters.shape[0], dtype=torch.long) * bucket_size
        r = self.bucket_range
        mine = (first >= r.id_start) & (first < r.id_end)
        local = self.local_buckets(first[mine])
        for column, per_bucket in enumerate((self.inserted_per_bucket, self.evicted_per_bucket)):
            per_bucket.zero_().index_add_(0, local, counters[mine, column].long())
        self.clock = int(clock)

    def reserve(self, rows: int, id_map: bool = True) -> None:
        """Make room for ``rows`` rows without further copies; deletes never shrink the arrays
        below it. The row arrays' pages are committed as rows are written, so they cost address
        space, not memory; the id map's table (``id_map``) is written in full up front."""
        self._reserved = max(self._reserved, rows)
        if rows > self.capacity:
            self._resize(rows, keep=len(self))
        if id_map:
            self.map.reserve(rows)

    def clear(self) -> None:
        with self.lock:
            for frozen in self._frozen:
                frozen.let_go()  # the dropped arrays stay readable for it, no copy needed
            self._frozen = ()
            self.map.clear()
            self.epoch += 1
            self._alloc(_MIN_ROWS)

    # -- internals ----------------------------------------------------------------------------
    def before_header_rewrite(self) -> None:
        """Call before rewriting the header word of every row (lfu decay)."""
        for frozen in self._frozen:
            frozen.preserve_headers()

    def _before_change(self, slots: torch.Tensor) -> None:
        for frozen in self._frozen:
            frozen.preserve(slots)

    def _init_rows(self, start: int, end: int) -> None:
        if end > self.capacity:
            self._resize(max(end, int(self.capacity * _GROWTH)), keep=start)
        self._initial_weights(self.weights[start:end], self.map.slot_keys[start:end])
        self.optimizer[start:end] = 0
        self.meta[start:end] = make_meta(self.clock, 0, used=True)

    def _initial_weights(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        low, high = self.params.init_range
        fill_uniform_by_id(out, ids, low, high, self.params.init_seed, native=self._native)

    def _alloc(self, rows: int) -> None:
        # Uninitialised on purpose: rows past len(self) are written by _init_rows before use,
        # and zero-filling a grown table costs more than the copy.
        layout, dev, native = self.layout, self.device, self._native
        ids = self.bucket_range.id_end - self.bucket_range.id_start
        space = max(rows, min(ids, max(_RESERVED_ROWS, 4 * rows)))
        self.weights = empty_large((rows, layout.embedding_dim), layout.dtype, dev, native, space)
        self.optimizer = empty_large((rows, layout.optimizer_floats), torch.float32, dev, native, space)
        self.meta = empty_large(rows, torch.long, dev, native, space)

    def _resize(self, rows: int, keep: int) -> None:
        """Resize to ``rows`` rows keeping the first ``keep``: in place where the arrays' mappings
        have room (the rows past ``keep`` given back), else by copying into new arrays."""
        with self.lock:
            old = self.arrays
            arrays = [regrown(t, rows) for t in (old.weights, old.optimizer, old.meta)]
            if all(a is not None for a in arrays):
                self.weights, self.optimizer, self.meta = arrays
                if rows < old.rows:  # shrinking: the dropped rows' memory goes back
                    for array in (old.weights, old.optimizer, old.meta):
                        release_rows(array, keep, old.rows, self._native)
                return
            self._alloc(rows)
            self.arrays.assign(slice(0, keep), old, slice(0, keep))

    def _as_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` as a flat int64 tensor; their range is checked by the lookup they go to next
        (``find`` / ``find_or_insert``), in the same pass, before anything changes."""
        return as_ids(ids, self.device, check=False)

    def _mapped(self, lookup, ids: torch.Tensor) -> torch.Tensor:
        """``lookup(ids, bounds)`` of the id map, bounded to this shard's ids."""
        r = self.bucket_range
        try:
            return lookup(ids, (r.id_start, r.id_end))
        except IdOutOfRange as e:
            raise self._outside(e.id) from None

    def _outside(self, id_: int) -> ValueError:
        r = self.bucket_range
        return ValueError(
            f"table '{self.params.name}': id {id_} is outside this shard's ids "
            f"[{r.id_start}, {r.id_end}) (buckets [{r.start}, {r.end}) of size {r.size}); "
            "route ids to the rank owning their bucket (id // bucket_size)"
        )

    def _check_values(self, values: torch.Tensor, n: int, part: RowPart) -> torch.Tensor:
        width, dtype = self.layout.width(part), self.layout.part_dtype(part)
        if values.dim() != 2 or values.shape[0] != n or values.shape[1] != width:
            hint = (" (whole rows of another embedding_dim, optimizer or weight_dtype?)"
                    if part is RowPart.ROW else "")
            raise ValueError(
                f"table '{self.params.name}': {part.value} values must be [{n}, {width}], got "
                f"{list(values.shape)}{hint}"
            )
        if part is RowPart.ROW and values.dtype != dtype:
            raise ValueError(f"table '{self.params.name}': whole rows must be {dtype}, got "
                             f"{values.dtype} (saved with another weight_dtype?)")
        return values.to(device=self.device, dtype=dtype)
