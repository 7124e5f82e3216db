"""The DCP save planner for state dicts holding KV-ZCH tables: a thin subclass of DCP's default.

KV-ZCH entries arrive already cut into chunks (one local shard per
``checkpoint_chunk_rows`` rows), so DCP plans them like any sharded tensor; the planner only
materialises each chunk when the writer asks for it. It records in the checkpoint's metadata
what a load needs to place rows by id: each table's geometry, optimizer and rows per rank, and
the checksum side files (``integrity.py``) holding a checksum of every item written, a unique
id for the checkpoint and, for a delta (``torchrec/delta.py``), its base's. That
record is plain Python data (dicts, lists, str, int, bool) under one key of DCP's
``planner_data`` (beside DCP's own flattening mappings), so that the ``.metadata`` file unpickles
with torch alone. Snapshots frozen for an async save (``staging.py``) are released as soon as
their last chunk has been materialised.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from collections import Counter

import torch
import torch.distributed as dist
from fbgemm_gpu.tbe.ssd.utils.partially_materialized_tensor import PartiallyMaterializedTensor
from torch.distributed.checkpoint import DefaultSavePlanner

from torchrec_kvzch.checkpoint.buffers import ChunkBuffers
from torchrec_kvzch.checkpoint.integrity import ChecksumRecorder, checksum_file
from torchrec_kvzch.checkpoint.record import FORMAT, PLANNER_DATA_KEY, SavedTable
from torchrec_kvzch.table.layout import RowPart
from torchrec_kvzch.torchrec.delta import DELETED
from torchrec_kvzch.torchrec.state_dict import kv_view


class KVZCHSavePlanner(DefaultSavePlanner):
    def __init__(self, *args, base: dict | None = None, **kwargs) -> None:
        """``base``: for a delta (a state dict from ``delta_state``), the checkpoint it is a
        delta of and the count decays since (``record.chain_link``; ``CheckpointManager``
        passes it)."""
        super().__init__(*args, **kwargs)
        self._base = base

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if PLANNER_DATA_KEY in self.state_dict:
            raise ValueError(f"the state dict to save has a key '{PLANNER_DATA_KEY}', which "
                             "KVZCHSavePlanner keeps for its record in the checkpoint's metadata; "
                             "rename that entry")
        _check_snapshots(self.state_dict)
        directory = getattr(storage_meta, "checkpoint_id", None)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._checksums = ChecksumRecorder(str(directory), rank) if directory is not None else None
        self._unwritten: Counter = Counter()  # snapshot -> its chunks not materialised yet
        self._items_left = 0
        self._lock = threading.Lock()  # writers resolve items from several threads
        self._buffers = ChunkBuffers(native=any(v.store.native for obj in self.state_dict.values()
                                                if (v := kv_view(obj)) is not None))

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        snapshots = {v.snapshot for obj in self.state_dict.values() if (v := kv_view(obj)) is not None}
        for item in plan.items:
            chunk = self.lookup_object(item.index)
            if isinstance(chunk, PartiallyMaterializedTensor):
                self._unwritten[chunk.wrapped.snapshot] += 1
        for snapshot in snapshots - set(self._unwritten):
            snapshot.release()  # nothing of it to write on this rank (a no-op unless frozen)
        self._items_left = len(plan.items)
        if not self._items_left:
            self._finish_checksums()
        return plan

    def resolve_data(self, write_item):
        obj = self.lookup_object(write_item.index)
        snapshot = None
        if isinstance(obj, PartiallyMaterializedTensor):  # this chunk only, into a reused buffer
            view, snapshot = obj.wrapped, obj.wrapped.snapshot
            data = (view.read_into(self._buffers.take(view.shape, view.dtype))
                    if view.store.device.type == "cpu" else view.full_tensor().cpu())
        else:
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor) and data.device.type != "cpu":
                data = data.cpu()  # its checksum reads host memory; the writer would copy it anyway
        if self._checksums is not None:
            self._checksums.add(write_item.index, data)
        with self._lock:
            if snapshot is not None:
                self._unwritten[snapshot] -= 1
                if self._unwritten[snapshot] == 0:
                    del self._unwritten[snapshot]
                    snapshot.release()
            self._items_left -= 1
            if self._items_left == 0:
                self._finish_checksums()
                self._buffers.close()
        return data

    def _finish_checksums(self) -> None:
        if self._checksums is not None:
            self._checksums.write()

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(_without_shadowed_empty_chunks(all_plans))
        tables = {}
        for fqn, obj in self.state_dict.items():
            view = kv_view(obj)
            if view is not None and view.part in (RowPart.ROW, RowPart.WEIGHT):
                deleted = self.state_dict.get(fqn[: -len("weight")] + DELETED)
                tables[fqn] = SavedTable.of(view.store.params, _rows_per_rank(obj),
                                            None if deleted is None else _rows_per_rank(deleted)
                                            ).to_plain(view.shape[1])
        # Side files need a local folder (the writer has created it while planning).
        local = self._checksums is not None and os.path.isdir(self._checksums.directory)
        files = [checksum_file(r) for r in range(len(all_plans))] if local else []
        if local:
            self._checksums.remove_stale()
        # (A cached plan's metadata already holds a record: replaced, not wrapped.)
        mappings = {k: v for k, v in (metadata.planner_data or {}).items() if k != PLANNER_DATA_KEY}
        mappings[PLANNER_DATA_KEY] = {"format": FORMAT, "tables": tables, "checksum_files": files,
                                      "uid": uuid.uuid4().hex, "base": self._base}
        metadata.planner_data = mappings
        return plans, metadata


def _without_shadowed_empty_chunks(plans: list) -> list:
    """Plans without the empty row chunks that share their DCP index (entry, offset) with a chunk
    of rows: a rank holding no rows of a table has one empty chunk at the offset where the next
    rank's rows start, and DCP's dedup, taking the two for copies of one item, could keep the
    empty one and lose the rows."""
    def empty(item) -> bool:
        return item.tensor_data is not None and 0 in item.tensor_data.chunk.sizes

    full = {item.index for plan in plans for item in plan.items if not empty(item)}
    return [dataclasses.replace(plan, items=[i for i in plan.items if not (empty(i) and i.index in full)])
            for plan in plans]


def _rows_per_rank(entry) -> list[int]:
    """Rows of a row-wise ShardedTensor per rank (every rank has >= 1, maybe empty, chunk)."""
    shards = entry.metadata().shards_metadata
    world = 1 + max(s.placement.rank() for s in shards)
    return [sum(s.shard_sizes[0] for s in shards if s.placement.rank() == r) for r in range(world)]


def _check_snapshots(state_dict: dict) -> None:
    """Every entry of a table must come from one state dict taken right before the save (the
    optimizer's after the model's, which builds its views): else the checkpoint would mix
    moments. A frozen snapshot (an async save's) was checked when it was frozen."""
    by_store: dict = {}
    for fqn, obj in state_dict.items():
        view = kv_view(obj)
        if view is not None and view.part is not RowPart.ID:  # (a delta's deleted ids: their own)
            by_store.setdefault(view.store, {}).setdefault(view.snapshot, []).append(fqn)
    for store, snapshots in by_store.items():
        if len(snapshots) > 1:
            raise ValueError(f"the state dict to save holds entries of KV-ZCH table '{store.params.name}' "
                             f"from {len(snapshots)} state_dict() calls ({sorted(min(f) for f in snapshots.values())}"
                             " first of each): take the model's state_dict() and then the optimizer's, right "
                             "before the save")
        [snapshot] = snapshots
        if not snapshot.frozen:
            snapshot.check_fresh()
