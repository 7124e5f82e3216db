"""State-dict entries of KV-ZCH tables, with global metadata recomputed across ranks.

Per table (``{prefix}{table}.`` below), built over one snapshot of the shard's bucket-sorted ids:

* ``weight``: whole rows ``[n, header + pad4(D) + pad4(opt)]`` when ``backend_return_whole_row``,
  else weights ``[n, D]``;
* ``weight_id``: the rows' global ids ``[n, 1]`` (read-only);
* ``bucket``: rows per bucket ``[total_num_buckets, 1]``, each rank holding its buckets.

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


@dataclass(frozen=True)
class TableSnapshot:
    """One table shard's rows at a moment, which every entry of one state dict is built from
    (model and optimizer entries alike, so freezing it for an async save pins them all)."""

    name: str
    kernel: KVZCHTableKernel
    rows: RowSnapshot

    @classmethod
    def take(cls, name: str, kernel: KVZCHTableKernel) -> "TableSnapshot":
        return cls(name, kernel, kernel.store.snapshot())

    def view(self, part: RowPart, read_only: bool = False) -> KVTensor:
        return KVTensor(self.store, part, read_only=read_only, snapshot=self.rows)

    @property
    def store(self):
        return self.kernel.store

    def bucket_counts(self) -> torch.Tensor:
        r = self.store.bucket_range
        local = torch.div(self.rows.ids, r.size, rounding_mode="floor") - r.start
        return torch.bincount(local, minlength=r.num_buckets)


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
        out[f"{prefix}{snap.name}.bucket"] = bucket_sharded_tensor(snap, pg)
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


def bucket_sharded_tensor(snap: TableSnapshot, pg) -> ShardedTensor:
    """Rows per bucket, sharded over the bucket space like the table itself."""
    params, world = snap.store.params, dist.get_world_size(pg) if dist.is_initialized() else 1
    rank = dist.get_rank(pg) if dist.is_initialized() else 0
    shards = []
    for r in range(world):
        b = params.bucket_range(r, world)
        shards.append(ShardMetadata([b.start, 0], [b.num_buckets, 1], f"rank:{r}/{snap.store.device.type}"))
    counts = snap.bucket_counts().unsqueeze(1)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(counts, shards[rank])],
        ShardedTensorMetadata(shards, torch.Size([params.total_num_buckets, 1]),
                              TensorProperties(dtype=torch.long)),
        process_group=pg)


def load_rows(store, weight, weight_id=None) -> None:
    """Replace a store's rows with materialised ones: whole rows (by their header ids) or
    weights with their ids. Rows of other shards' buckets are skipped."""
    rows = _local_rows(weight)
    store.clear()
    if store.params.backend_return_whole_row:
        keys = store.layout.unpack(rows)[0]
    else:
        if weight_id is None:
            raise ValueError(f"table '{store.params.name}': weights without backend_return_whole_row "
                             "need their 'weight_id' entry to be loaded")
        keys = _local_rows(weight_id).reshape(-1)
    r = store.bucket_range
    mine = (keys >= r.id_start) & (keys < r.id_end)
    if store.params.backend_return_whole_row:
        store.write_rows(rows[mine])
    else:
        store.write_ids(keys[mine], rows[mine], RowPart.WEIGHT)


def _local_rows(entry) -> torch.Tensor:
    if isinstance(entry, ShardedTensor):
        shards = entry.local_shards()
        return torch.cat([s.tensor for s in shards]) if shards else torch.empty(0)
    return entry
