"""The per-slot arrays of a row store: weights ``[rows, D]``, optimizer state ``[rows, F]`` fp32
and the header's meta word ``[rows]`` int64, and how a part of a row is read from or written to
them. The row store decides which slots; this module only moves their bytes.

Whole rows (``RowPart.ROW``) are packed into, or unpacked from, the upstream layout
(``layout.py``), with the native op's one-pass copies where it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrec_kvzch.table.eviction import SCRATCH_BYTES_PER_ROW
from torchrec_kvzch.table.hashing import map_bytes
from torchrec_kvzch.table.layout import RowLayout, RowPart, make_meta
from torchrec_kvzch.table.native import empty_large, regrown, release_rows

GROWTH = 1.5  # a store's arrays grow by this factor when they run out of room


def estimated_bytes(layout: RowLayout, rows: int, reserved: bool = False) -> int:
    """Upper bound on what a store holding ``rows`` rows occupies: row arrays and the slot
    array at their largest growth slack, plus the hash table (what the planner counts).
    ``reserved``: arrays reserved up front (a budget), so no growth slack; instead the peak
    working memory counts - a second hash table while tombstones are rehashed away, and
    eviction's per-row scratch (``eviction.py``)."""
    if reserved:
        return rows * (layout.stored_bytes + SCRATCH_BYTES_PER_ROW) + map_bytes(rows, rehash=True)
    return int(rows * layout.stored_bytes * GROWTH) + map_bytes(rows, GROWTH)

_COPY_CHUNK_BYTES = 4 << 20
_USED = make_meta(0, 0, used=True)


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

    @classmethod
    def allocate(cls, layout: RowLayout, rows: int, device: torch.device, native: bool,
                 reserve: int = 0, host: bool = False) -> "RowArrays":
        """Uninitialised arrays for ``rows`` rows, each with address space for ``reserve`` rows
        so that ``resized`` can grow them in place (``native.empty_large``). ``host``: on CUDA,
        the weights and optimizer state wider than a value per row in host memory (a device
        cache's store, ``row_cache.py``)."""
        wide = host and layout.optimizer_floats > 1
        return cls(empty_large((rows, layout.embedding_dim), layout.dtype, device, native, reserve, host),
                   empty_large((rows, layout.optimizer_floats), torch.float32, device, native, reserve, wide),
                   empty_large(rows, torch.long, device, native, reserve))

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.weights, self.optimizer, self.meta

    @property
    def rows(self) -> int:
        return self.weights.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def empty_like(self, rows: int) -> "RowArrays":
        return RowArrays(*(t.new_empty((rows, *t.shape[1:])) for t in self.tensors))

    def grown(self, rows: int) -> "RowArrays":
        out = self.empty_like(rows)
        out.assign(slice(0, self.rows), self, slice(None))
        return out

    def resized(self, rows: int, keep: int, native: bool, allocate) -> "RowArrays":
        """These arrays at ``rows`` rows keeping the first ``keep``: in place where their mappings
        have room (the rows past ``keep`` given back to the OS when shrinking), else copied into
        ``allocate(rows)``."""
        arrays = [regrown(t, rows) for t in self.tensors]
        if any(a is None for a in arrays):
            new = allocate(rows)
            new.assign(slice(0, keep), self, slice(0, keep))
            return new
        if rows < self.rows:
            self.release(keep, self.rows, native)
        return RowArrays(*arrays)

    def release(self, start: int, end: int, native: bool) -> None:
        """Give the memory of rows ``[start, end)`` back to the OS (dead rows past the end)."""
        for array in self.tensors:
            release_rows(array, start, end, native)

    def assign(self, at, source: "RowArrays", slots) -> None:
        """``self[at] = source[slots]`` for every array. Gathers by index tensors go in chunks of
        about 4 MiB: one gather of every row a large eviction moves would be a temporary copy
        as big as those rows, outside any memory budget."""
        for dst, src in zip(self.tensors, source.tensors):
            if not isinstance(slots, torch.Tensor):
                dst[at] = src[slots]  # slices: a view, no copy
                continue
            step = max(1, _COPY_CHUNK_BYTES // max(1, src[:1].nbytes))
            for start in range(0, slots.numel(), step):
                piece = slice(start, min(start + step, slots.numel()))
                dst[at[piece] if isinstance(at, torch.Tensor) else _shift(at, piece)] = src[slots[piece]]

    def read(self, slots: torch.Tensor, part: RowPart, keys: torch.Tensor, layout: RowLayout,
             native: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """``part`` of the rows at ``slots`` (``keys``: their ids, for ids and whole rows); into
        ``out`` (contiguous, of the result's shape and dtype) when given."""
        if part is RowPart.WEIGHT:
            return _gather(self.weights, slots, out)
        if part is RowPart.OPTIMIZER:
            return _gather(self.optimizer, slots, out)
        if part is RowPart.META:
            meta = _gather(self.meta, slots, None if out is None else out.view(-1))
            return meta.unsqueeze(1) if out is None else out
        if part is RowPart.ID:
            return keys.unsqueeze(1) if out is None else out.copy_(keys.unsqueeze(1))
        if native:
            if out is None:
                out = torch.empty(slots.numel(), layout.row_width, dtype=layout.dtype)
            torch.ops.kvzch.gather_rows_into(out, self.weights, self.optimizer, self.meta,
                                             keys.contiguous(), slots.contiguous(), layout.optimizer_offset)
            return out
        rows = layout.pack(keys, self.meta[slots], self.weights[slots], self.optimizer[slots])
        return rows if out is None else out.copy_(rows)

    def write(self, slots: torch.Tensor, values: torch.Tensor, part: RowPart, layout: RowLayout,
              native: bool) -> None:
        """Overwrite ``part`` of the rows at ``slots`` (whole rows: all but the key, which the
        slot fixes); written rows are marked used."""
        if part is RowPart.WEIGHT:
            self.weights[slots] = values
        elif part is RowPart.OPTIMIZER:
            self.optimizer[slots] = values
        elif part is RowPart.META:
            self.meta[slots] = values.reshape(-1) | _USED
        elif native:  # one pass over the rows instead of three indexed copies
            torch.ops.kvzch.scatter_rows(self.weights, self.optimizer, self.meta, values.contiguous(),
                                         slots.contiguous(), layout.optimizer_offset)
        else:
            _, meta, weights, optimizer = layout.unpack(values)
            self.weights[slots] = weights
            self.optimizer[slots] = optimizer
            self.meta[slots] = meta | _USED

