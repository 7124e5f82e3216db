"""State-dict entries of KV-ZCH tables, with global metadata recomputed across ranks.

Per table (``{prefix}{table}.`` below), built over one snapshot of the shard's bucket-sorted ids:

* ``weight``: whole rows ``[n, header + pad4(D) + pad4(opt)]`` when ``backend_return_whole_row``,
  else weights ``[n, D]``;
* ``weight_id``: the rows' global ids ``[n, 1]`` (read-only);
* ``metaheader`` (without whole rows only): the header word after the id ``[n, 1]`` int64
  (timestamp, access count, used bit), which eviction decides by;
* ``bucket``: rows per bucket ``[total_num_buckets, 1]``, each rank holding its buckets;
* ``counters``: rows ever inserted and evicted per bucket ``[total_num_buckets, 2]``, sharded
  the same way, so they follow the rows to any world size;
* ``clock``: the store's clock ``[1]`` (training steps seen; the same on every rank), which the
  rows' header timestamps count in: eviction after a resume decides as it would have without.

``weight`` and ``weight_id`` are ShardedTensors whose local shards are ``KVTensor`` chunks of
``checkpoint_chunk_rows`` rows inside fbgemm's ``PartiallyMaterializedTensor``: nothing is
materialised until a checkpoint writer reads a chunk, so saving holds one chunk at a time. Row
counts differ per rank and change over time, so their global metadata (offsets, global size) is
recomputed from an all-gather of the counts each time a state dict is taken: building a state
dict is a collective on the module's process group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.tbe.ssd.utils.partially_materialized_tensor import PartiallyMaterializedTensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from torchrec_kvzch.kernel import KVZCHTableKernel
from torchrec_kvzch.kv_tensor import KVTensor
from torchrec_kvzch.store.layout import RowPart
from torchrec_kvzch.store.snapshot import RowSnapshot


# {prefix}{table}.<entry>; metaheader only without backend_return_whole_row
TABLE_ENTRIES = ("weight", "weight_id", "metaheader", "bucket", "counters", "clock")


@dataclass(frozen=True)
class TableSnapshot:
    """One table shard's rows at a moment, which every entry of one state dict is built from
    (model and optimizer entries alike, so freezing it for an async save pins them all)."""

    name: str
    kernel: KVZCHTableKernel
    rows: RowSnapshot
    clock: int
    counters: torch.Tensor  # [local buckets, 2]: inserted, evicted

    @classmethod
    def take(cls, name: str, kernel: KVZCHTableKernel) -> "TableSnapshot":
        store = kernel.store
        counters = torch.stack([store.inserted_per_bucket, store.evicted_per_bucket], dim=1)
        return cls(name, kernel, store.snapshot(), store.clock, counters)

    def view(self, part: RowPart, read_only: bool = False) -> KVTensor:
        return KVTensor(self.store, part, read_only=read_only, snapshot=self.rows)

    @property
    def store(self):
        return self.kernel.store

    def bucket_counts(self) -> torch.Tensor:
        return torch.bincount(self.store.local_buckets(self.rows.ids),
                              minlength=self.store.bucket_range.num_buckets)


def kv_view(entry) -> KVTensor | None:
    """The KVTensor behind a state-dict entry, if it is a KV-ZCH ShardedTensor."""
    if isinstance(entry, ShardedTensor) and entry.local_shards():
        local = entry.local_shards()[0].tensor
        if isinstance(local, PartiallyMaterializedTensor) and isinstance(local.wrapped, KVTensor):
            return local.wrapped
    return None


def table_entries(tables: Iterator[tuple[str, KVZCHTableKernel]], prefix: str,
                  pg: dist.ProcessGroup | None) -> tuple[dict[str, ShardedTensor], dict[str, dict]]:
    """Model entries ``{prefix}{table}.weight / .weight_id / .bucket`` for every KV-ZCH table
    shard here, and each table's optimizer state entries, from one snapshot of its ids.

    Optimizer state is exposed as ``{table}.momentum1`` (rowwise Adagrad's accumulator, as
    TorchRec names it): read-only when whole rows already carry it, else writable."""
    snapshots = [TableSnapshot.take(name, kernel) for name, kernel in tables]
    rows = row_counts_by_rank({s.name: len(s.rows) for s in snapshots}, pg)
    out, optimizer = {}, {}
    for snap in snapshots:
        params = snap.store.params
        part = RowPart.ROW if params.backend_return_whole_row else RowPart.WEIGHT
        counts = rows[snap.name]
        out[f"{prefix}{snap.name}.weight"] = rows_sharded_tensor(snap.view(part), counts, pg)
        out[f"{prefix}{snap.name}.weight_id"] = rows_sharded_tensor(snap.view(RowPart.ID), counts, pg)
        if part is RowPart.WEIGHT:  # whole rows hold the header word; else it goes apart
            out[f"{prefix}{snap.name}.metaheader"] = rows_sharded_tensor(snap.view(RowPart.META), counts, pg)
        out[f"{prefix}{snap.name}.bucket"] = bucket_sharded_tensor(snap, snap.bucket_counts().unsqueeze(1), pg)
        out[f"{prefix}{snap.name}.counters"] = bucket_sharded_tensor(snap, snap.counters, pg)
        out[f"{prefix}{snap.name}.clock"] = torch.tensor([snap.clock])
        optimizer[snap.name] = {} if not snap.store.layout.optimizer_floats else {
            f"{snap.name}.momentum1": rows_sharded_tensor(
                snap.view(RowPart.OPTIMIZER, read_only=params.backend_return_whole_row), counts, pg)}
    return out, optimizer


def row_counts_by_rank(local: dict[str, int], pg: dist.ProcessGroup | None) -> dict[str, list[int]]:
    """{table: [rows on rank 0, rows on rank 1, ...]}: one all-gather for all tables."""
    world = dist.get_world_size(pg) if dist.is_initialized() else 1
    gathered = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local, group=pg)
    return {name: [g.get(name, 0) for g in gathered] for name in local}


class KVChunk(PartiallyMaterializedTensor):
    """fbgemm's lazy tensor over a KVTensor chunk, except that ``copy_`` writes (into writable
    views): TorchRec's optimizer ``load_state_dict`` copies loaded state into the current one."""

    def copy_(self, src, non_blocking: bool = False):
        if not isinstance(src, PartiallyMaterializedTensor):  # else: a view loaded in place
            self.wrapped.set_range(0, 0, self.size(0), src)
        return self


def rows_sharded_tensor(view: KVTensor, rows_per_rank: list[int], pg) -> ShardedTensor:
    """A row-wise ShardedTensor over all ranks' rows, rank r's rows after those of ranks < r,
    each rank's rows in chunks of ``checkpoint_chunk_rows`` (at least one, possibly empty)."""
    rank = dist.get_rank(pg) if dist.is_initialized() else 0
    width, chunk = view.shape[1], view.store.params.checkpoint_chunk_rows
    shards, local, offset = [], [], 0
    for r, n in enumerate(rows_per_rank):
        for start in range(0, max(n, 1), chunk):
            length = min(chunk, n - start)
            md = ShardMetadata([offset + start, 0], [length, width], f"rank:{r}/{view.store.device.type}")
            shards.append(md)
            if r == rank:
                local.append(Shard(KVChunk(view.slice(start, length), is_virtual=True), md))
        offset += n
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(shards, torch.Size([offset, width]),
                                     TensorProperties(dtype=view.dtype)), process_group=pg)


def bucket_sharded_tensor(snap: TableSnapshot, values: torch.Tensor, pg) -> ShardedTensor:
    """Per-bucket ``values`` ``[local buckets, k]``, sharded over the bucket space like the table."""
    params, world = snap.store.params, dist.get_world_size(pg) if dist.is_initialized() else 1
    rank = dist.get_rank(pg) if dist.is_initialized() else 0
    width = values.shape[1]
    shards = []
    for r in range(world):
        b = params.bucket_range(r, world)
        shards.append(ShardMetadata([b.start, 0], [b.num_buckets, width], f"rank:{r}/{snap.store.device.type}"))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(values, shards[rank])],
        ShardedTensorMetadata(shards, torch.Size([params.total_num_buckets, width]),
                              TensorProperties(dtype=torch.long)),
        process_group=pg)


def load_materialised(view: KVTensor, entries: dict) -> None:
    """Replace the rows and history of ``view``'s store with materialised entries of one table
    (``weight``, ``weight_id`` unless rows are whole, ``clock``, ``counters``), e.g. a state
    dict written with ``torch.save`` and read back at the same world size."""
    store = view.store
    name, r = store.params.name, store.bucket_range
    needed = ("weight", "clock", "counters") + (() if view.part is RowPart.ROW else ("weight_id", "metaheader"))
    missing = [k for k in needed if k not in entries]
    if missing:
        raise ValueError(f"KV-ZCH table '{name}': the state dict lacks its {missing} entries; "
                         "load a whole state dict of this table")
    counters = entries["counters"]
    local = counters.local_shards() if isinstance(counters, ShardedTensor) else []
    if len(local) != 1 or local[0].metadata.shard_offsets[0] != r.start \
            or local[0].tensor.shape[0] != r.num_buckets:
        raise ValueError(f"KV-ZCH table '{name}': the counters entry does not hold this rank's "
                         f"buckets [{r.start}, {r.end}); load through DCP (KVZCHLoadPlanner), "
                         "which loads at any world size")
    by_bucket = torch.zeros(store.params.total_num_buckets, 2, dtype=torch.long)
    by_bucket[r.start : r.end] = local[0].tensor
    rows = _local_rows(entries["weight"])
    ids = None if view.part is RowPart.ROW else _local_rows(entries["weight_id"])
    store.clear()
    view.load(rows, ids)
    if ids is not None:
        KVTensor(store, RowPart.META, ids=ids.reshape(-1)).load(_local_rows(entries["metaheader"]), ids)
    store.restore_history(int(entries["clock"][0]), by_bucket, store.params.bucket_size)


def _local_rows(entry) -> torch.Tensor:
    if isinstance(entry, ShardedTensor):
        shards = entry.local_shards()
        return torch.cat([s.tensor for s in shards]) if shards else torch.empty(0)
    return entry
