"""DCP planners for state dicts holding KV-ZCH tables: thin subclasses of DCP's defaults.

Save (``KVZCHSavePlanner``): KV-ZCH entries arrive already cut into chunks (one local shard per
``checkpoint_chunk_rows`` rows), so DCP plans them like any sharded tensor; the planner only
materialises each chunk when the writer asks for it, and records each table's rows per rank in
the checkpoint metadata. Rows per rank are visible in the write items themselves, so a cached
save plan can never carry a stale layout. Each chunk's checksum goes to a side file
(``checksums.py``), and snapshots frozen for an async save (``staging.py``) are released as soon
as their last chunk has been materialised.

Load (``KVZCHLoadPlanner``): saved rows are sorted by id within each rank and ranks own
ascending bucket ranges, so the rows of a new rank's buckets lie in the saved rows of the old
ranks whose buckets overlap its own. Each rank reads exactly those ranks' rows, chunk by chunk,
and writes each whole row into its store by the id in the row's header, skipping rows of
buckets it does not own. Memory stays bounded by a chunk; any world size can load any other's
checkpoint. Optimizer state inside whole rows and the ``weight_id`` column need no loading.
Before any store changes, while planning, it checks that the files exist, are long enough and
(with ``verify=True``) hold the chunks whose checksums the save recorded.

Tables without ``backend_return_whole_row`` take the legacy path: weights, ids and optimizer
state of those rows are read in full, held until all three have arrived, then written by id.
It needs memory for all of them at once (what whole rows avoid) and exists for comparison.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import torch
import torch.distributed as dist
from fbgemm_gpu.tbe.ssd.utils.partially_materialized_tensor import PartiallyMaterializedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

from torchrec_kvzch.checkpoint.checksums import ChecksumRecorder, verify_chunks
from torchrec_kvzch.checkpoint.state_dict import kv_view
from torchrec_kvzch.kv_tensor import KVTensor
from torchrec_kvzch.store.layout import RowPart


class CheckpointMappings(dict):
    """DCP's flattening mappings (what ``planner_data`` normally is), plus ``kvzch_rows``:
    {fqn of a KV-ZCH ``weight``: rows saved by each rank, in rank order}."""

    def __init__(self, mappings=None, kvzch_rows=None) -> None:
        super().__init__(mappings or {})
        self.kvzch_rows: dict[str, list[int]] = dict(kvzch_rows or {})


class KVZCHSavePlanner(DefaultSavePlanner):
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        directory = getattr(storage_meta, "checkpoint_id", None)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._checksums = (ChecksumRecorder(str(directory), rank, is_coordinator)
                           if directory is not None else None)
        self._unwritten: Counter = Counter()  # snapshot -> its chunks not materialised yet
        self._lock = threading.Lock()  # writers resolve chunks from several threads

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        snapshots = {v.snapshot for obj in self.state_dict.values() if (v := kv_view(obj)) is not None}
        for item in plan.items:
            chunk = self.lookup_object(item.index)
            if isinstance(chunk, PartiallyMaterializedTensor):
                self._unwritten[chunk.wrapped.snapshot] += 1
        for snapshot in snapshots - set(self._unwritten):
            snapshot.release()  # nothing of it to write on this rank (a no-op unless frozen)
        if not self._unwritten:
            self._finish_checksums()
        return plan

    def resolve_data(self, write_item):
        obj = self.lookup_object(write_item.index)
        if not isinstance(obj, PartiallyMaterializedTensor):
            return super().resolve_data(write_item)
        data = obj.full_tensor()  # this chunk only
        if self._checksums is not None:
            self._checksums.add(write_item.index.fqn, write_item.index.offset[0], data)
        snapshot = obj.wrapped.snapshot
        with self._lock:
            self._unwritten[snapshot] -= 1
            if self._unwritten[snapshot] == 0:
                del self._unwritten[snapshot]
                snapshot.release()
                if not self._unwritten:
                    self._finish_checksums()
        return data

    def _finish_checksums(self) -> None:
        if self._checksums is not None:
            self._checksums.write()

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        rows = {}
        for fqn, obj in self.state_dict.items():
            view = kv_view(obj)
            if view is not None and view.part in (RowPart.ROW, RowPart.WEIGHT):
                shards = obj.metadata().shards_metadata  # every rank has >= 1 (maybe empty) chunk
                world = 1 + max(s.placement.rank() for s in shards)
                rows[fqn] = [sum(s.shard_sizes[0] for s in shards if s.placement.rank() == r)
                             for r in range(world)]
        metadata.planner_data = CheckpointMappings(metadata.planner_data, rows)
        return plans, metadata


class KVZCHLoadPlanner(DefaultLoadPlanner):
    def __init__(self, checkpoint_id: str | os.PathLike | None = None, verify: bool = True,
                 **kwargs) -> None:
        """``checkpoint_id``: the checkpoint's folder, named in errors and used to check its
        files before loading (pass it; without it those checks are skipped). ``verify``: also
        read back and checksum every chunk before loading (one more read of the rows)."""
        super().__init__(**kwargs)
        self._verify = verify
        self._checkpoint = str(checkpoint_id) if checkpoint_id is not None else "the checkpoint"
        self._checkpoint_dir = str(checkpoint_id) if checkpoint_id is not None else None
        self._sinks: dict[str, KVTensor] = {}
        self._legacy: dict = {}

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._sinks, self._legacy = {}, {}
        saved_rows = getattr(metadata.planner_data, "kvzch_rows", None)
        views = {fqn: v for fqn, obj in self.state_dict.items() if (v := kv_view(obj)) is not None}
        # The rows' layout comes from each table's weight entry; its other entries follow it.
        ranges = {v.store: self._row_range(fqn, v, metadata, saved_rows)
                  for fqn, v in views.items() if v.part in (RowPart.ROW, RowPart.WEIGHT)}
        for fqn, view in views.items():
            saved = metadata.state_dict_metadata.get(fqn)
            begin, end = ranges.get(view.store, (0, 0))
            legacy = not view.store.params.backend_return_whole_row
            if saved is None:  # not in the checkpoint (a missing weight entry failed above)
                del self.state_dict[fqn]
                continue
            if not legacy and view.part is not RowPart.ROW:
                # Whole rows already hold ids and optimizer state: read nothing for those.
                self.state_dict[fqn] = _RowSink(saved.size, 0, 0)
                continue
            self.state_dict[fqn] = _RowSink(saved.size, begin, end)
            if legacy:
                table = self._legacy.setdefault(view.store, _LegacyTable(view.store, end - begin))
                table.expect(fqn, view, saved.size[1], saved.properties.dtype)
            self._sinks[fqn] = view

    def _row_range(self, fqn: str, view: KVTensor, metadata: Metadata, saved_rows) -> tuple[int, int]:
        """This rank's slice of the saved rows: those of the old ranks overlapping its buckets."""
        table = view.store.params
        saved = metadata.state_dict_metadata.get(fqn)
        if not isinstance(saved, TensorStorageMetadata):
            raise ValueError(f"{self._checkpoint} has no rows for KV-ZCH table '{table.name}' "
                             f"(no entry '{fqn}'); was it saved from another model?")
        width = view.shape[1]
        if list(saved.size)[1:] != [width] or saved.properties.dtype != view.dtype:
            raise ValueError(
                f"{self._checkpoint}: KV-ZCH table '{table.name}' was saved with rows of "
                f"{list(saved.size)[1:]} {saved.properties.dtype}, this model has [{width}] "
                f"{view.dtype}: embedding_dim, optimizer or weight_dtype differ")
        if saved_rows is None or fqn not in saved_rows:
            raise ValueError(f"{self._checkpoint} was not saved with KVZCHSavePlanner, so the rows "
                             f"of KV-ZCH table '{table.name}' cannot be located; save with it")
        rows = saved_rows[fqn]
        mine = view.store.bucket_range
        starts = [sum(rows[:r]) for r in range(len(rows))]
        overlapping = [r for r in range(len(rows))
                       if _overlaps(table.bucket_range(r, len(rows)), mine) and rows[r]]
        begin = starts[overlapping[0]] if overlapping else 0
        end = starts[overlapping[-1]] + rows[overlapping[-1]] if overlapping else 0
        return begin, end

    def create_local_plan(self):
        plan = super().create_local_plan()
        self._check_files(plan)
        if self._verify and self._checkpoint_dir is not None:
            chunks = {item.storage_index: view.store.params.name for item in plan.items
                      if (view := self._sinks.get(item.dest_index.fqn)) is not None}
            verify_chunks(self._checkpoint_dir, self.metadata, chunks)
        return plan

    def _check_files(self, plan) -> None:
        """Every file region this rank will stream into a store exists and is complete, checked
        while planning: DCP raises planning errors on all ranks before any rank reads a byte, so
        a missing or truncated file leaves every store as it was. (Needs ``checkpoint_id``.)"""
        storage = getattr(self.metadata, "storage_data", None)
        if self._checkpoint_dir is None or not storage:
            return
        for item in plan.items:
            view = self._sinks.get(item.dest_index.fqn)
            info = storage.get(item.storage_index)
            if view is None or info is None:
                continue
            path = os.path.join(self._checkpoint_dir, info.relative_path)
            size = os.path.getsize(path) if os.path.exists(path) else -1
            if size < info.offset + info.length:
                state = "is missing" if size < 0 else f"is truncated ({size} of {info.offset + info.length} bytes)"
                raise ValueError(f"{path} {state}: it holds rows of KV-ZCH table "
                                 f"'{view.store.params.name}'; restore the file or load another checkpoint")

    def finish_plan(self, new_plan):
        # Every rank's plan is valid: replace the stores' rows with the checkpoint's, with room
        # reserved for the most rows that can arrive (no growth copies while streaming).
        for fqn, view in self._sinks.items():
            view.store.clear()
            view.store.reserve(self.state_dict[fqn].end - self.state_dict[fqn].begin)
        for table in self._legacy.values():
            table.apply_if_complete()  # a shard with no saved rows is complete already
        return super().finish_plan(new_plan)

    def resolve_tensor(self, read_item):
        view = self._sinks.get(read_item.dest_index.fqn)
        if view is None:
            return super().resolve_tensor(read_item)
        return torch.empty(list(read_item.lengths), dtype=view.dtype)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        view = self._sinks.get(fqn)
        if view is None:
            return super().commit_tensor(read_item, tensor)
        if view.store in self._legacy:
            return self._legacy[view.store].receive(fqn, read_item, tensor)
        keys = view.store.layout.unpack(tensor)[0]
        r = view.store.bucket_range
        mine = (keys >= r.id_start) & (keys < r.id_end)
        view.store.write_rows(tensor if bool(mine.all()) else tensor[mine])


class _LegacyTable:
    """Holds a table's weights, ids and optimizer state until all have arrived, then writes
    the rows of this shard's buckets by id."""

    def __init__(self, store, rows: int) -> None:
        self.store, self.rows = store, rows
        self.buffers: dict[RowPart, torch.Tensor] = {}
        self.begin: dict[str, int] = {}
        self.parts: dict[str, RowPart] = {}
        self.filled = 0

    def expect(self, fqn: str, view: KVTensor, width: int, dtype: torch.dtype) -> None:
        self.parts[fqn] = view.part
        self.buffers[view.part] = torch.empty(self.rows, width, dtype=dtype)

    def receive(self, fqn: str, read_item, tensor: torch.Tensor) -> None:
        start = read_item.dest_offsets[0]
        self.buffers[self.parts[fqn]][start : start + tensor.shape[0]] = tensor
        self.filled += tensor.shape[0]
        self.apply_if_complete()

    def apply_if_complete(self) -> None:
        if self.filled != self.rows * len(self.buffers) or not self.buffers:
            return
        ids = self.buffers[RowPart.ID].reshape(-1)
        r = self.store.bucket_range
        mine = (ids >= r.id_start) & (ids < r.id_end)
        self.store.write_ids(ids[mine], self.buffers[RowPart.WEIGHT][mine], RowPart.WEIGHT)
        if RowPart.OPTIMIZER in self.buffers:
            self.store.write_ids(ids[mine], self.buffers[RowPart.OPTIMIZER][mine], RowPart.OPTIMIZER)
        self.buffers.clear()


class _RowSink:
    """The destination of a streamed load as DCP sees it: saved rows ``[begin, end)`` of a
    tensor of ``size`` (DCP's ``_Checkpointable`` protocol, as DTensor uses). The rows arrive
    chunk by chunk through ``commit_tensor``; nothing is allocated for the range."""

    def __init__(self, size: torch.Size, begin: int, end: int) -> None:
        self._size, self.begin, self.end = torch.Size(size), begin, end

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        if self.end == self.begin:
            return []
        return [ChunkStorageMetadata(offsets=torch.Size([self.begin, 0]),
                                     sizes=torch.Size([self.end - self.begin, self._size[1]]))]


def _overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end

