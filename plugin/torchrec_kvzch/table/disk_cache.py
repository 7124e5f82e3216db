"""A row store's DRAM rows as a bounded cache over its disk tier (issue 32; ``params.storage``).

The logical table is the rows in DRAM and the rows on disk (``disk_tier.py``), each id in one of
them. Before a training lookup, the batch's rows on disk come into DRAM (``before_lookup``);
room is made first by moving the least recently used other rows out to disk, so that DRAM holds
at most ``max_rows`` rows (the shard's share of ``cache_bytes``) and every row of the batch, and
fbgemm's TBE binds to the DRAM rows as it does without a tier. Moving a row between the tiers
changes nothing a model or a checkpoint sees: its bytes (header, weights, optimizer state) move
whole, and it is neither a new row nor a deleted one. Reads that change nothing (evaluation's
``peek``, ``read_ids``) read rows on disk where they are, without moving them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from torchrec_kvzch.params.storage import DiskStorage
from torchrec_kvzch.table.disk_tier import DiskTier
from torchrec_kvzch.table.id_map import as_ids
from torchrec_kvzch.table.layout import RowPart, meta_timestamp


class DiskCache:
    """The disk tier of ``store`` (a ``RowStore``) and the policy that moves rows between them."""

    def __init__(self, store, storage: DiskStorage) -> None:
        params, r, layout = store.params, store.bucket_range, store.layout
        if store.device.type != "cpu":
            raise ValueError(f"KV-ZCH table '{params.name}': a disk tier serves a CPU store; on {store.device} "
                             "keep the rows in device memory (no storage.path)")
        share = storage.cache_bytes * r.num_buckets // params.total_num_buckets
        self.max_rows = share // layout.stored_bytes
        if self.max_rows < 1:
            raise ValueError(f"KV-ZCH table '{params.name}': storage.cache_bytes {storage.cache_bytes} leaves the "
                             f"shard of buckets [{r.start}, {r.end}) less than one row ({layout.stored_bytes} bytes); "
                             "raise it")
        self.store, self.layout = store, layout
        self.tier = DiskTier(Path(storage.path) / params.name / f"buckets-{r.start}-{r.end}",
                             layout.row_width * layout.itemsize, params.name)
        self.moved_out = self.moved_in = 0

    def __len__(self) -> int:
        """Rows on disk."""
        return len(self.tier)

    @property
    def counters(self) -> dict[str, int]:
        return {"disk_rows": len(self.tier), "disk_bytes_read": self.tier.bytes_read,
                "disk_bytes_written": self.tier.bytes_written}

    def known(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each id has a row on disk."""
        return self.tier.find(ids)

    def before_lookup(self, ids: torch.Tensor) -> None:
        """Make DRAM hold every row of the batch ``ids`` that exists, and room for its new ones,
        within ``max_rows``."""
        store = self.store
        ids = torch.unique(as_ids(ids, store.device, check=False))
        if ids.numel() > self.max_rows:
            raise ValueError(f"KV-ZCH table '{store.params.name}': a batch of {ids.numel()} distinct ids on the "
                             f"shard of buckets [{store.bucket_range.start}, {store.bucket_range.end}) does not fit "
                             f"its DRAM cache of {self.max_rows} rows; raise storage.cache_bytes")
        absent = ids[store.find(ids) < 0]
        incoming = absent[self.tier.find(absent)]
        excess = len(store) + absent.numel() - self.max_rows
        if (excess > 0 or incoming.numel()) and store.pending_update is not None:
            raise RuntimeError(f"KV-ZCH table '{store.params.name}': rows would move between DRAM and disk while "
                               "a fused update is pending (a forward before the previous backward); run the "
                               "step's backward first (no semi-sync pipeline with a disk tier)")
        if excess > 0:
            self._move_out(excess, ids)
        if incoming.numel():
            _, rows = self.tier.take(incoming)
            store.write_rows(rows.view(self.layout.dtype).view(incoming.numel(), -1), moved=True)
            self.moved_in += incoming.numel()

    def _move_out(self, n: int, keep: torch.Tensor) -> None:
        """The ``n`` least recently used rows not in ``keep`` go to disk."""
        store = self.store
        stamps = meta_timestamp(store.meta[: len(store)]).clone()
        kept = store.find(keep)
        stamps[kept[kept >= 0]] = torch.iinfo(stamps.dtype).max
        slots = torch.topk(stamps, n, largest=False, sorted=False).indices
        keys = store.keys()[slots].clone()
        rows = store.read(slots, RowPart.ROW).contiguous()
        self.tier.put(keys, rows.view(torch.uint8).view(n, -1))
        store.delete(keys, moved=True)
        self.moved_out += n

    def read(self, ids: torch.Tensor, part: RowPart) -> tuple[torch.Tensor, torch.Tensor]:
        """(which ``ids`` have a row on disk, their ``part``), moving nothing."""
        found, rows = self.tier.read(ids)
        rows = rows.view(self.layout.dtype).view(int(found.sum()), -1)
        if RowPart(part) is RowPart.ROW:
            return found, rows
        keys, meta, weights, optimizer = self.layout.unpack(rows)
        return found, {RowPart.WEIGHT: weights, RowPart.OPTIMIZER: optimizer, RowPart.META: meta.unsqueeze(1),
                       RowPart.ID: keys.unsqueeze(1)}[RowPart(part)]

    def close(self) -> None:
        self.tier.close()
