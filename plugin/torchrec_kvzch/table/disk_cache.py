"""A row store's DRAM rows as a bounded cache over its disk tier (issue 32; ``params.storage``).

The logical table is the rows in DRAM and the rows on disk (``disk_tier.py``), each id in one of
them. Before a training lookup, the batch's rows on disk come into DRAM (``before_lookup``);
room is made first by moving the other rows the cache's policy ranks lowest (least recently or,
with ``lfu``, least often looked up) out to disk, so that DRAM holds
at most ``max_rows`` rows (the shard's share of ``cache_bytes``) and every row of the batch, and
fbgemm's TBE binds to the DRAM rows as it does without a tier. Moving a row between the tiers
changes nothing a model or a checkpoint sees: its bytes (header, weights, optimizer state) move
whole, and it is neither a new row nor a deleted one. Reads that change nothing (evaluation's
``peek``, ``read_ids``) read rows on disk where they are, without moving them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from torchrec_kvzch.params import EvictionKind
from torchrec_kvzch.params.storage import CachePolicy, DiskStorage
from torchrec_kvzch.table.disk_tier import DiskTier
from torchrec_kvzch.table.id_map import as_ids
from torchrec_kvzch.table.layout import RowPart, meta_count_then_timestamp, meta_timestamp, weight_norms

PIECE = 1 << 15  # rows moved between the tiers at a time: the step's buffers stay a few MiB
SAMPLE = 1 << 16  # keys sampled to guess the n-th lowest before selecting exactly


class DiskCache:
    """The disk tier of ``store`` (a ``RowStore``) and the policy that moves rows between them."""

    def __init__(self, store, storage: DiskStorage) -> None:
        params, r, layout = store.params, store.bucket_range, store.layout
        if store.device.type != "cpu":
            raise ValueError(f"KV-ZCH table '{params.name}': a disk tier serves a CPU store; on {store.device} "
                             "keep the rows in device memory (no storage.path)")
        share = storage.shard_bytes(r.num_buckets, params.total_num_buckets)
        self.max_rows = share // layout.stored_bytes
        if self.max_rows < 1:
            raise ValueError(f"KV-ZCH table '{params.name}': storage {storage} leaves the shard of buckets "
                             f"[{r.start}, {r.end}) less than one row ({layout.stored_bytes} bytes); raise it")
        self.store, self.layout = store, layout
        self.policy = CachePolicy(storage.policy)
        self.tier = DiskTier(Path(storage.path) / params.name / f"buckets-{r.start}-{r.end}",
                             layout.row_width * layout.itemsize, params.name,
                             meta_at=layout.width_offset(RowPart.META) * layout.itemsize,
                             keep_norms=EvictionKind(params.eviction.kind) is EvictionKind.L2)
        self.moved_out = self.moved_in = 0
        self.hits = self.misses = 0  # a training batch's existing rows found in DRAM, or brought from disk
        self.writing = False  # inside ``write``: the store writes to DRAM
        self.reserved = 0  # rows the tier's index has room for (``reserve``)

    def __len__(self) -> int:
        """Rows on disk."""
        return len(self.tier)

    @property
    def counters(self) -> dict[str, int]:
        return {"disk_rows": len(self.tier), "disk_bytes_read": self.tier.bytes_read,
                "disk_bytes_written": self.tier.bytes_written, "cache_hits": self.hits, "cache_misses": self.misses}

    def reserve(self, rows: int, index: bool) -> int:
        """The store reserves room for ``rows`` rows: the tier's part beyond the cache (with
        ``index``: the store reserves its id map too); returns the rows DRAM may hold."""
        beyond = rows - self.max_rows
        if index and beyond > 0:  # (and a piece more: a piece's rows go out before the rows read in leave)
            self.reserved = max(self.reserved, beyond + min(PIECE, beyond))
            self.tier.reserve(self.reserved)
        return min(rows, self.max_rows)

    def clear(self) -> None:
        """Every row on disk goes (a load starts so); the reservation stays."""
        self.tier.remove(self.tier.keys().clone())
        self.tier.reserve(self.reserved)

    def known(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each id has a row on disk."""
        return self.tier.find(ids)

    def check_fits(self, ids: torch.Tensor) -> None:
        """Refuse a training batch whose distinct ids (admitted or not) outnumber the DRAM cache,
        before admission or eviction changes anything."""
        store, ids = self.store, as_ids(ids, self.store.device, check=False)
        if ids.numel() > self.max_rows and (n := torch.unique(ids).numel()) > self.max_rows:
            raise ValueError(f"KV-ZCH table '{store.params.name}': a batch of {n} distinct ids on the shard of "
                             f"buckets [{store.bucket_range.start}, {store.bucket_range.end}) does not fit its DRAM "
                             f"cache of {self.max_rows} rows; raise storage.cache_bytes")

    def before_lookup(self, ids: torch.Tensor) -> None:
        """Make DRAM hold every row of the batch ``ids`` that exists, and room for its new ones,
        within ``max_rows``."""
        store = self.store
        ids = torch.unique(as_ids(ids, store.device, check=False))
        absent = ids[store.find(ids) < 0]
        incoming = absent[self.tier.find(absent)]
        if not self.writing:
            self.hits += ids.numel() - absent.numel()
            self.misses += incoming.numel()
        excess = len(store) + absent.numel() - self.max_rows
        if (excess > 0 or incoming.numel()) and store.pending_update is not None:
            raise RuntimeError(f"KV-ZCH table '{store.params.name}': rows would move between DRAM and disk while "
                               "a fused update is pending (a forward before the previous backward); run the "
                               "step's backward first (no semi-sync pipeline with a disk tier)")
        # A piece at a time, each piece's reads in flight while the room for them is made (the
        # rows leaving ranked under the first reads): DRAM holds at most max_rows rows after
        # every piece (as many leave as come, the room for new rows first).
        leaving = self._leaving(excess, ids)
        for at in range(0, max(excess, incoming.numel()), PIECE):
            into = incoming[at:at + PIECE]
            make_room = lambda: self._move_out(next(leaving, None))  # noqa: E731
            if into.numel():
                _, rows = self.tier.take(into, during=make_room)
                store.write_rows(self._part(self._checked(rows, into), RowPart.ROW), moved=True)
                self.moved_in += into.numel()
            else:
                make_room()

    def write(self, ids: torch.Tensor, values: torch.Tensor, write_piece) -> int:
        """A write from outside training (a load, a user's write) of the rows of ``ids``:
        ``write_piece(ids, values)`` writes DRAM rows, a piece of at most half the cache at a
        time, after the piece's rows on disk came in (so that each id is in one tier, and a
        part written keeps the others). Returns the rows written."""
        piece, written = max(1, self.max_rows // 2), 0
        self.store.find(ids)  # (ids outside the shard: refused before the first piece changes anything)
        self.writing = True
        try:
            for at in range(0, ids.numel(), piece):
                self.before_lookup(ids[at:at + piece])
                written += write_piece(ids[at:at + piece], values[at:at + piece]) or 0
        finally:
            self.writing = False
        return written

    def _leaving(self, n: int, keep: torch.Tensor):
        """The ids of the ``n`` DRAM rows not in ``keep`` that the policy ranks lowest, ascending,
        ``PIECE`` at a time (ranked when the first piece is asked for). In id order: the tier
        places rows put together so, neighbours in units, which a checkpoint (reading in id
        order) then reads a run of units at a time instead of a unit per row."""
        if n <= 0:
            return
        store = self.store
        meta = store.meta[: len(store)]
        # (new tensors either way: marked freely below)
        stamps = meta_timestamp(meta) if self.policy is CachePolicy.LRU else meta_count_then_timestamp(meta)
        kept = store.find(keep)
        stamps[kept[kept >= 0]] = torch.iinfo(stamps.dtype).max
        leaving = torch.sort(store.keys()[lowest(stamps, n)]).values
        del meta, stamps, kept  # (a key per DRAM row: not held while the pieces move)
        yield from leaving.split(PIECE)

    def _move_out(self, ids: torch.Tensor | None) -> None:
        """The DRAM rows of ``ids`` (if any) go to disk."""
        if ids is None:
            return
        store = self.store
        rows = store.read(store.find(ids), RowPart.ROW).contiguous()
        norms = weight_norms(self.layout.unpack(rows)[2]) if self.tier.keep_norms else None
        self.tier.put(ids, rows.view(torch.uint8).view(ids.numel(), -1), norms=norms)
        store.delete(ids, moved=True)
        self.moved_out += ids.numel()

    def read(self, ids: torch.Tensor, part: RowPart) -> tuple[torch.Tensor, torch.Tensor]:
        """(which ``ids`` have a row on disk, their ``part``), moving nothing."""
        found, rows = self.tier.read(ids)
        return found, self._part(self._checked(rows, as_ids(ids, torch.device("cpu"), check=False)[found]), part)

    def read_mixed(self, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, part: RowPart,
                   out: torch.Tensor | None = None, arrays=None, meta: torch.Tensor | None = None) -> torch.Tensor:
        """``part`` of rows in either tier: at DRAM ``slots`` (of ``arrays``, default the store's)
        where ``positions`` is -1, else at those tier positions (held by the caller), with header
        words ``meta`` (default: the tier's now); ``keys``: their ids."""
        disk = positions >= 0
        rows = self.store.read(slots.masked_fill(disk, 0), part, keys=keys, arrays=arrays, out=out)
        if bool(disk.any()):
            at = torch.nonzero(disk).view(-1)
            words = self.stamps(keys[at]) if meta is None else meta[at]
            rows[at] = self._part(self._checked(self.tier.read_at(positions[at], words), keys[at]), part).to(rows.dtype)
        return rows

    def snapshot(self, dram_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every live row of both tiers in ascending id order: (ids, DRAM slots or -1, tier
        positions or -1); ``dram_keys``: the store's keys by slot."""
        n, tier = dram_keys.numel(), self.tier
        ids, order = torch.sort(torch.cat([dram_keys, tier.keys()]), stable=True)
        on_disk = order >= n
        positions = torch.full_like(order, -1)  # (in place from here: a save holds these for its whole run)
        positions[on_disk] = tier.position[order[on_disk].sub_(n)]
        return ids, order.masked_fill_(on_disk, -1), positions

    def stamps(self, ids: torch.Tensor) -> torch.Tensor:
        """The header words of ``ids`` (rows on disk) now."""
        return self.tier.meta[self.tier.index.find(ids)]

    def _checked(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``rows`` (bytes read from the tier) if each begins with its id, as every row written
        does; else the file changed under the table (another writer, a damaged disk), and no
        row of it can be trusted."""
        held = rows[:, :8].contiguous().view(torch.int64).view(-1)
        wrong = torch.nonzero(held != ids.to(held.device).view(-1)).view(-1)
        if wrong.numel():
            i = int(wrong[0])
            raise RuntimeError(f"KV-ZCH table '{self.store.params.name}': the disk tier's file {self.tier.path} "
                               f"holds id {int(held[i])} where the row of id {int(ids.view(-1)[i])} was written "
                               f"({wrong.numel()} of {ids.numel()} rows read), so it was changed outside this "
                               "table; no process but this one may write the tier's folder: resume the job "
                               "from its last checkpoint")
        return rows

    def _part(self, rows: torch.Tensor, part: RowPart) -> torch.Tensor:
        rows = rows.view(self.layout.dtype).view(rows.shape[0], self.layout.row_width)
        if RowPart(part) is RowPart.ROW:
            return rows
        keys, meta, weights, optimizer = self.layout.unpack(rows)
        return {RowPart.WEIGHT: weights, RowPart.OPTIMIZER: optimizer, RowPart.META: meta.unsqueeze(1),
                RowPart.ID: keys.unsqueeze(1)}[RowPart(part)]

    def close(self) -> None:
        self.tier.close()


def lowest(keys: torch.Tensor, n: int) -> torch.Tensor:
    """The indices of ``n`` lowest ``keys`` (1-D, ``0 < n <= numel``), in no order, ties broken
    either way. A cache moves out a batch's misses at a time, a thin slice of its rows:
    rather than a top-k over every key (43 ms at 4M rows), the keys below a sampled guess of the
    n-th lowest are taken, and the rest from the keys equal to it (LRU stamps tie by the
    thousand: a step's rows share one) or by a top-k of the few below it."""
    total = keys.numel()
    if total > 4 * SAMPLE and n < total // 8:
        sample = keys[:: total // SAMPLE]
        guess = torch.kthvalue(sample, min(sample.numel(), int(1.5 * n * sample.numel() / total) + 64)).values
        below = torch.nonzero(keys < guess).view(-1)
        if below.numel() < n:
            equal = torch.nonzero(keys == guess).view(-1)[: n - below.numel()]
            if below.numel() + equal.numel() == n:
                return torch.cat([below, equal])
        elif below.numel() <= total // 4:  # every one of the n lowest is below the guess
            return below[torch.topk(keys[below], n, largest=False, sorted=False).indices]
    return torch.topk(keys, n, largest=False, sorted=False).indices
