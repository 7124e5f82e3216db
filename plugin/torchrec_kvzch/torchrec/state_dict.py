"""State-dict entries of KV-ZCH tables, with global metadata recomputed across ranks.

Per table (``{prefix}{table}.`` below), built over one snapshot of the shard's bucket-sorted ids:

* ``weight``: whole rows ``[n, header + pad4(D) + pad4(opt)]`` when ``backend_return_whole_row``,
  else weights ``[n, D]``;
* ``weight_id``: the rows' global ids ``[n, 1]`` int64, as plain tensors (views of the snapshot's
  ids, which it holds in memory anyway: no copy), so ``torch.sort`` and friends work on them as
  on upstream TorchRec's;
* ``metaheader`` (without whole rows only): the header word after the id ``[n, 1]`` int64
  (timestamp, access count, used bit), which eviction decides by;
* ``bucket``: rows per bucket ``[total_num_buckets, 1]``, each rank holding its buckets;
* ``counters``: rows ever inserted and evicted per bucket ``[total_num_buckets, 2]``, sharded
  the same way, so they follow the rows to any world size;
* ``clock``: the store's clock ``[1]`` (training steps seen; the same on every rank), which the
  rows' header timestamps count in: eviction after a resume decides as it would have without.

``weight`` (and ``metaheader``) are ShardedTensors whose local shards are ``KVTensor`` chunks of
``checkpoint_chunk_rows`` rows inside fbgemm's ``PartiallyMaterializedTensor``: nothing is
materialised until a checkpoint writer reads a chunk, so saving holds one chunk at a time
(``weight_id`` is chunked the same way, so that each chunk's ids sit beside its rows). Row
counts differ per rank and change over time, so their global metadata (offsets, global size) is
recomputed from an all-gather of the counts each time a state dict is taken: building a state
dict is a collective on the module's process group.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.tbe.ssd.utils.partially_materialized_tensor import PartiallyMaterializedTensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.torchrec.admission_state import admission_entries, placement
from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowPart, meta_timestamp, meta_used
from torchrec_kvzch.table.snapshot import RowSnapshot


# {prefix}{table}.<entry>; metaheader only without backend_return_whole_row
TABLE_ENTRIES = ("weight", "weight_id", "metaheader", "bucket", "counters", "clock")
# What upstream TorchRec's state dict of a virtual table holds beyond ours: ``metadata``, each
# row's header word after the key ``[n, 1]`` int64 (fbgemm's ``get_kv_zch_eviction_metadata``),
# the same word as our ``metaheader``. Upstream has no ``counters``, ``clock`` or ``metaheader``.
UPSTREAM_ONLY_ENTRIES = ("metadata",)


@dataclass(frozen=True)
class TableSnapshot:
    """One table shard's rows at a moment, which every entry of one state dict is built from
    (model and optimizer entries alike, so freezing it for an async save pins them all)."""

    name: str
    tbe: TableTBE
    rows: RowSnapshot
    clock: int
    counters: torch.Tensor  # [local buckets, 2]: inserted, evicted

    @classmethod
    def take(cls, name: str, tbe: TableTBE) -> "TableSnapshot":
        store = tbe.store
        return cls(name, tbe, RowSnapshot(store), store.clock, store.history.counters.clone())

    def view(self, part: RowPart, read_only: bool = False, columns: tuple[int, int] | None = None) -> KVTensor:
        return KVTensor(self.store, part, read_only=read_only, snapshot=self.rows, columns=columns)

    @property
    def store(self):
        return self.tbe.store


def kv_view(entry) -> KVTensor | None:
    """The KVTensor behind a state-dict entry, if it is a KV-ZCH ShardedTensor."""
    if isinstance(entry, ShardedTensor) and entry.local_shards():
        local = entry.local_shards()[0].tensor
        if isinstance(local, PartiallyMaterializedTensor) and isinstance(local.wrapped, KVTensor):
            return local.wrapped
    return None


def table_entries(tables: Iterator[tuple[str, TableTBE]], prefix: str, pg: dist.ProcessGroup | None,
                  empty: bool = False) -> tuple[dict[str, ShardedTensor], dict[str, dict]]:
    """Model entries ``{prefix}{table}.weight / .weight_id / .bucket`` for every KV-ZCH table
    shard here, and each table's optimizer state entries, from one snapshot of its ids.
    ``empty``: every rank's tables are known to hold no rows (just built), so no collective.

    Optimizer state is exposed as TorchRec names it, ``{table}.momentum1`` (row-wise
    Adagrad's accumulator, Adam's first moment) and ``{table}.momentum2`` (Adam's second):
    read-only when whole rows already carry it, else writable."""
    snapshots = [TableSnapshot.take(name, tbe) for name, tbe in tables]
    if empty:
        world = dist.get_world_size(pg) if dist.is_initialized() else 1
        rows = {s.name: [0] * world for s in snapshots}
    else:
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
        per_bucket = snap.rows.bucket_counts().unsqueeze(1)
        out[f"{prefix}{snap.name}.bucket"] = bucket_sharded_tensor(snap, per_bucket, pg)
        out[f"{prefix}{snap.name}.counters"] = bucket_sharded_tensor(snap, snap.counters, pg)
        out[f"{prefix}{snap.name}.clock"] = torch.tensor([snap.clock])
        out.update(admission_entries(snap.tbe, f"{prefix}{snap.name}.", pg))
        optimizer[snap.name] = {}
        named = params.optimizer.state_names(params.embedding_dim)
        for state_name, first, count in named:
            columns = (first, count) if len(named) > 1 else None
            state = rows_sharded_tensor(
                snap.view(RowPart.OPTIMIZER, read_only=params.backend_return_whole_row, columns=columns), counts, pg)
            # TorchRec's KeyedOptimizer.load_state_dict calls a state object's own
            # load_state_dict where it has one, instead of copying shard by shard.
            state.load_state_dict = functools.partial(load_optimizer_state, state)
            optimizer[snap.name][f"{snap.name}.{state_name}"] = state
    return out, optimizer


def load_optimizer_state(entry: ShardedTensor, source) -> None:
    """Write ``source`` (optimizer state of this table shard's rows) into the rows behind
    ``entry``, whatever its chunking: TorchRec copies state shard by shard and so needs the
    same chunks, which upstream's one shard per rank or another model's row count lack. Lazy
    chunks of another store go by their own ids; lazy chunks of this store were loaded in place
    (DCP); plain tensors hold this shard's rows in id order (same world size), as the state
    dict of the model's rows just loaded. Read-only entries (whole rows, which carry the state)
    take it too when it comes from elsewhere (e.g. TorchRec's own table of the same config)."""
    views = [s.tensor.wrapped for s in entry.local_shards()]
    if not views:
        return
    view, name = views[0], views[0].store.params.name
    chunks = local_chunks(source) if isinstance(source, ShardedTensor) else [(0, source)]
    lazy = [c for _, c in chunks if isinstance(c, PartiallyMaterializedTensor) and isinstance(c.wrapped, KVTensor)]
    if lazy and len(lazy) == len(chunks):
        for chunk in lazy:
            if chunk.wrapped.store is not view.store:
                view.load(chunk.full_tensor(), chunk.wrapped.ids)
        return
    ids = view.snapshot.ids
    total = sum(c.shape[0] for _, c in chunks)
    if total != ids.numel():
        raise ValueError(f"KV-ZCH table '{name}': the optimizer state to load holds {total} rows "
                         f"here, the table {ids.numel()}: load the model's state dict first (at the "
                         "same world size), or load both through DCP (KVZCHLoadPlanner)")
    at = 0
    for _, chunk in chunks:
        values = read_chunk(chunk)
        n = values.shape[0]
        view.load(values.reshape(n, -1), ids[at : at + n])
        at += n


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
    views): TorchRec's optimizer ``load_state_dict`` copies loaded state into the current one;
    and that a copy (``copy.deepcopy``) or a pickle (``torch.save``) holds the chunk's rows
    themselves, as any state dict's would, where fbgemm's would share (or fail to pickle) the
    store."""

    def __deepcopy__(self, memo):
        rows = self._materialised("copy")
        memo[id(self)] = rows
        return rows

    def __reduce_ex__(self, protocol):  # (a plain tensor's: weights_only loads take it)
        if self.wrapped.snapshot.frozen:  # (staged for an async save: DCP's process-based one pickles it)
            raise ValueError(f"KV-ZCH table '{self.wrapped.store.params.name}': a state dict staged for an async "
                             "save is pickled (dcp.async_save with a process-based checkpointer sends it to another "
                             "process, where its rows lose the ids KVZCHSavePlanner records); fix: async_save with "
                             "async_checkpointer_type=AsyncCheckpointerType.THREAD (the default), or dcp.save")
        return self._materialised("pickle").__reduce_ex__(protocol)

    def _materialised(self, what: str) -> torch.Tensor:
        snapshot = self.wrapped.snapshot
        if not snapshot.frozen:
            snapshot.check_fresh(what)
        return self.full_tensor()

    def copy_(self, src, non_blocking: bool = False):
        """A lazy ``src`` over this store was loaded in place (nothing to do); over another store
        its rows are read and written by their own ids. A plain ``src`` carries no ids: what
        writes one (DCP's default load planner, copying by position) is refused, naming the fix."""
        view = self.wrapped
        if not isinstance(src, PartiallyMaterializedTensor):
            raise _by_position(view, "load")
        other = src.wrapped
        if view.shape[0] and not (isinstance(other, KVTensor) and other.store is view.store):
            view.set_weights_and_ids(src.full_tensor(), other.ids if isinstance(other, KVTensor) else view.ids)
        return self

    def cpu(self):
        """DCP's default save planner's writer reads a chunk through ``cpu()``: refused, naming the fix."""
        raise _by_position(self.wrapped, "save")


def _by_position(view: KVTensor, what: str) -> ValueError:
    return ValueError(f"KV-ZCH table '{view.store.params.name}': DCP's default planners {what} a row entry by "
                      "position, while a KV-ZCH table's rows go by id (and its checkpoints carry a record of them); "
                      "fix: dcp.save(..., planner=KVZCHSavePlanner()) and dcp.load(..., planner=KVZCHLoadPlanner("
                      "checkpoint_id=path)), or CheckpointManager")


def rows_sharded_tensor(view: KVTensor, rows_per_rank: list[int], pg) -> ShardedTensor:
    """A row-wise ShardedTensor over all ranks' rows, rank r's rows after those of ranks < r,
    each rank's rows in chunks of ``checkpoint_chunk_rows`` (at least one, possibly empty)."""
    rank = dist.get_rank(pg) if dist.is_initialized() else 0
    width, chunk = view.shape[1], view.store.params.checkpoint_chunk_rows
    shards, local, offset = [], [], 0
    for r, n in enumerate(rows_per_rank):
        for start in range(0, max(n, 1), chunk):
            length = min(chunk, n - start)
            md = ShardMetadata([offset + start, 0], [length, width], placement(r, rank, view.store.device))
            shards.append(md)
            if r == rank:
                local.append(Shard(_chunk(view, start, length), md))
        offset += n
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(shards, torch.Size([offset, width]),
                                     TensorProperties(dtype=view.dtype)), process_group=pg)


def _chunk(view: KVTensor, start: int, length: int):
    """Rows ``[start, start + length)`` of ``view`` as a local shard: the ids as a plain view of
    the snapshot's id tensor, anything else lazily."""
    if view.part is RowPart.ID:
        return view.ids[start : start + length].unsqueeze(1)
    return KVChunk(view.slice(start, length), is_virtual=True)


def bucket_sharded_tensor(snap: TableSnapshot, values: torch.Tensor, pg) -> ShardedTensor:
    """Per-bucket ``values`` ``[local buckets, k]``, sharded over the bucket space like the table."""
    params, world = snap.store.params, dist.get_world_size(pg) if dist.is_initialized() else 1
    rank = dist.get_rank(pg) if dist.is_initialized() else 0
    width = values.shape[1]
    shards = []
    for r in range(world):
        b = params.bucket_range(r, world)
        shards.append(ShardMetadata([b.start, 0], [b.num_buckets, width], placement(r, rank, values.device)))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(values, shards[rank])],
        ShardedTensorMetadata(shards, torch.Size([params.total_num_buckets, width]),
                              TensorProperties(dtype=torch.long)),
        process_group=pg)


def newest_timestamp(meta: torch.Tensor) -> int:
    """The largest timestamp among header words of used rows (0 if none)."""
    stamps = meta_timestamp(meta[meta_used(meta)])
    return int(stamps.max()) if stamps.numel() else 0


def local_chunks(entry) -> list[tuple[int | None, object]]:
    """(row offset, local chunk) of an entry, ascending; lazy chunks stay lazy."""
    if isinstance(entry, ShardedTensor):
        shards = sorted(entry.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
        return [(s.metadata.shard_offsets[0], s.tensor) for s in shards]
    return [(None, entry)]


def read_chunk(chunk) -> torch.Tensor:
    return chunk.full_tensor() if isinstance(chunk, PartiallyMaterializedTensor) else chunk
