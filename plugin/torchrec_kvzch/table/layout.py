"""The whole-row layout shared with upstream FBGEMM's DRAM KV backend.

A whole row, in the weight dtype, is ``[metaheader | weight | optimizer state]``:

* metaheader, 16 bytes: int64 key (the global id) at byte 0, uint32 timestamp at byte 8, and at
  byte 12 a uint32 holding ``count`` in bits 0-30 and ``used`` in bit 31;
* the weight, ``embedding_dim`` values padded to a multiple of 4 elements;
* the optimizer state (fp32 values reinterpreted as weight-dtype elements), padded to 4.

The store keeps these parts in separate arrays (TBE wants contiguous weights); this module only
packs and unpacks the upstream layout. Bytes 8-15 of the header are kept as one int64 "meta" word.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from torchrec_kvzch.params import KVZCHTableParams

HEADER_BYTES = 16
TS_MASK = (1 << 32) - 1
COUNT_MAX = (1 << 31) - 1
_USED_BIT = 1 << 63  # bit 31 of the uint32 at byte 12


class RowPart(str, enum.Enum):
    """Which columns of a row a read or write addresses."""

    WEIGHT = "weight"
    OPTIMIZER = "optimizer"
    ROW = "row"  # the whole row, header included
    ID = "id"  # the row's global id (the header key), as one int64 column; read-only
    META = "meta"  # the header's second word (timestamp, count, used), as one int64 column


def pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def make_meta(timestamp: torch.Tensor | int, count: torch.Tensor | int, used: bool = True):
    """The header's second int64 word: timestamp | count << 32 | used << 63."""
    meta = (torch.as_tensor(timestamp, dtype=torch.long) & TS_MASK) | (
        (torch.as_tensor(count, dtype=torch.long) & COUNT_MAX) << 32
    )
    return meta | _USED_BIT if used else meta


def meta_timestamp(meta: torch.Tensor) -> torch.Tensor:
    return meta & TS_MASK


def meta_timestamp_view(meta: torch.Tensor) -> torch.Tensor:
    """The timestamps of contiguous meta words as a strided int32 view (the low half of each
    word on a little-endian host): no copy, for orderings over every row."""
    return meta.view(torch.int32)[0::2] if meta.numel() else meta_timestamp(meta)


def meta_count(meta: torch.Tensor) -> torch.Tensor:
    return (meta >> 32) & COUNT_MAX


def meta_count_then_timestamp(meta: torch.Tensor) -> torch.Tensor:
    """Header words as keys that order rows by count, then timestamp (the used bit cleared)."""
    return meta & (_USED_BIT - 1)


def with_timestamp(meta: torch.Tensor, clock: int) -> torch.Tensor:
    """Header words with their timestamps set to ``clock`` (count and used bit kept)."""
    return (meta & ~TS_MASK) | (clock & TS_MASK)


def with_count(meta: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Header words with their access counts replaced by ``count`` (timestamp and used bit kept)."""
    return (meta & ~(COUNT_MAX << 32)) | ((count & COUNT_MAX) << 32)


def decayed(meta: torch.Tensor, factor: float, scores: bool = False) -> torch.Tensor:
    """Header words with their access counts decayed, ``count := floor(count * factor)``, or
    with ``scores`` their feature scores, ``score := fp32(score * factor)`` (the product in
    fp64, as fbgemm's): lfu and feature_score eviction's decay, and its replay when an
    incremental checkpoint is applied."""
    if scores:
        return with_score(meta, (meta_score(meta).double() * factor).float())
    return with_count(meta, (meta_count(meta).double() * factor).floor().long())


# A feature-score table keeps each row's score in the count field: the fp32 bits of |score|
# (the sign bit dropped, as upstream stores it), so that, as integers, they order as the scores.
def meta_score(meta: torch.Tensor) -> torch.Tensor:
    return meta_count(meta).to(torch.int32).view(torch.float32)


def with_score(meta: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    return with_count(meta, score.float().abs().contiguous().view(torch.int32).long())


def touch_scores(meta: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor | None, clock: int,
                 native: bool) -> None:
    """A feature-score table's lookup: timestamp := clock, and each row's score grows by the
    scores of its occurrences (``scores`` per slot, >= 0; None: by nothing), in place. The
    native op adds them one by one in batch order, as fbgemm does; this twin adds their fp32
    sum per row (the same but for the rounding of that sum)."""
    if native:
        scores = torch.zeros(slots.numel()) if scores is None else scores.float().contiguous()
        torch.ops.kvzch.touch_scores(meta, slots, scores, clock)
        return
    rows, where = torch.unique(slots, return_inverse=True)
    old = meta[rows]
    stamped = with_timestamp(old, clock)
    if scores is None:
        meta[rows] = stamped
        return
    added = torch.zeros(rows.numel(), dtype=torch.float32, device=meta.device)
    added.index_add_(0, where, scores.to(meta.device, torch.float32))
    meta[rows] = with_score(stamped, meta_score(old) + added)


def weight_norms(weights: torch.Tensor) -> torch.Tensor:
    """Each row's weight L2 norm in fp32 (the ``l2`` eviction rule), computed the same way
    wherever the rows are (DRAM, or leaving for the disk tier)."""
    return weights.float().contiguous().norm(dim=1)


def meta_used(meta: torch.Tensor) -> torch.Tensor:
    return meta < 0  # the used bit is the int64 sign bit


def touch_meta(meta: torch.Tensor, slots: torch.Tensor, clock: int, native: bool) -> None:
    """Rows read by a batch: timestamp := clock, count += occurrences (saturating), in place."""
    if native:
        torch.ops.kvzch.touch(meta, slots, clock)
        return
    rows, hits = torch.unique(slots, return_counts=True)
    old = meta[rows]
    count = torch.clamp(meta_count(old) + hits, max=COUNT_MAX)
    meta[rows] = (old & _USED_BIT) | (count << 32) | (clock & TS_MASK)


@dataclass(frozen=True)
class RowLayout:
    embedding_dim: int
    dtype: torch.dtype
    optimizer_floats: int  # fp32 optimizer values per row

    @classmethod
    def for_table(cls, params: KVZCHTableParams) -> "RowLayout":
        return cls(params.embedding_dim, params.dtype,
                   params.optimizer.state_floats(params.embedding_dim))

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def stored_bytes(self) -> int:
        """Bytes a row takes in a store's arrays: weights, fp32 optimizer state, the meta word
        (the key lives once, in the id map)."""
        return self.embedding_dim * self.itemsize + self.optimizer_floats * 4 + 8

    @property
    def header_width(self) -> int:
        return HEADER_BYTES // self.itemsize

    @property
    def weight_width(self) -> int:
        return pad4(self.embedding_dim)

    @property
    def optimizer_offset(self) -> int:
        return self.header_width + self.weight_width

    @property
    def optimizer_width(self) -> int:
        return pad4(self.optimizer_floats * 4 // self.itemsize)

    @property
    def row_width(self) -> int:
        return self.optimizer_offset + self.optimizer_width

    def width(self, part: RowPart) -> int:
        """Columns of a part as the store returns it (weights unpadded, optimizer in fp32)."""
        return {RowPart.WEIGHT: self.embedding_dim, RowPart.OPTIMIZER: self.optimizer_floats,
                RowPart.ROW: self.row_width, RowPart.ID: 1, RowPart.META: 1}[RowPart(part)]

    def width_offset(self, part: RowPart) -> int:
        """Column where a part starts inside the whole row."""
        return {RowPart.WEIGHT: self.header_width, RowPart.OPTIMIZER: self.optimizer_offset,
                RowPart.ROW: 0, RowPart.ID: 0, RowPart.META: self.header_width // 2}[RowPart(part)]

    def part_dtype(self, part: RowPart) -> torch.dtype:
        return {RowPart.OPTIMIZER: torch.float32, RowPart.ID: torch.long,
                RowPart.META: torch.long}.get(RowPart(part), self.dtype)

    def pack(self, keys: torch.Tensor, meta: torch.Tensor, weights: torch.Tensor,
             optimizer: torch.Tensor) -> torch.Tensor:
        """Whole rows ``[n, row_width]`` from the separate parts."""
        n = keys.numel()
        rows = torch.empty(n, self.row_width, dtype=self.dtype, device=keys.device)
        header = torch.stack([keys.long(), meta.long()], dim=1)
        rows[:, : self.header_width] = header.view(self.dtype)
        w_end = self.header_width + self.embedding_dim
        rows[:, self.header_width : w_end] = weights
        rows[:, w_end : self.optimizer_offset] = 0  # padding
        opt_end = self.optimizer_offset
        if self.optimizer_floats:
            opt = optimizer.to(torch.float32).contiguous().view(self.dtype)
            opt_end += opt.shape[1]
            rows[:, self.optimizer_offset : opt_end] = opt
        rows[:, opt_end:] = 0  # padding
        return rows

    def unpack(self, rows: torch.Tensor):
        """(keys, meta, weights, optimizer) from whole rows; the inverse of ``pack``."""
        if rows.dim() != 2 or rows.shape[1] != self.row_width or rows.dtype != self.dtype:
            raise ValueError(
                f"whole rows must be [n, {self.row_width}] {self.dtype}, got "
                f"{list(rows.shape)} {rows.dtype}: was the checkpoint saved with another "
                "embedding_dim, optimizer or weight_dtype?"
            )
        header = rows[:, : self.header_width].contiguous().view(torch.long)
        weights = rows[:, self.header_width : self.header_width + self.embedding_dim]
        opt_cols = self.optimizer_floats * 4 // self.itemsize
        optimizer = (
            rows[:, self.optimizer_offset : self.optimizer_offset + opt_cols]
            .contiguous()
            .view(torch.float32)
        )
        return header[:, 0], header[:, 1], weights, optimizer

    def header(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, meta words) of whole rows, after checking their shape and dtype. Copies the
        16 header bytes of each row, not the rows."""
        self.unpack(rows[:0])  # raises on rows of another shape or dtype
        header = rows[:, : self.header_width].contiguous().view(torch.long)
        return header[:, 0], header[:, 1]

    def checked(self, values: torch.Tensor, n: int, part: RowPart, table: str,
                device: torch.device) -> torch.Tensor:
        """``values`` for ``n`` rows' ``part``, on ``device`` in the part's dtype; an error
        naming ``table`` if their shape (or a whole row's dtype) is not this layout's."""
        width, dtype = self.width(part), self.part_dtype(part)
        if values.dim() != 2 or values.shape[0] != n or values.shape[1] != width:
            hint = (" (whole rows of another embedding_dim, optimizer or weight_dtype?)"
                    if part is RowPart.ROW else "")
            raise ValueError(f"table '{table}': {part.value} values must be [{n}, {width}], got "
                             f"{list(values.shape)}{hint}")
        if part is RowPart.ROW and values.dtype != dtype:
            raise ValueError(f"table '{table}': whole rows must be {dtype}, got {values.dtype} "
                             "(saved with another weight_dtype?)")
        return values.to(device=device, dtype=dtype)
