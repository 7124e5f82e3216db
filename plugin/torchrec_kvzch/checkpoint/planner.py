"""DCP planners for state dicts holding KV-ZCH tables: thin subclasses of DCP's defaults.

Save (``KVZCHSavePlanner``): KV-ZCH entries arrive already cut into chunks (one local shard per
``checkpoint_chunk_rows`` rows), so DCP plans them like any sharded tensor; the planner only
materialises each chunk when the writer asks for it, and records each table's rows per rank in
the checkpoint metadata. Rows per rank are visible in the write items themselves, so a cached
save plan can never carry a stale layout.

Load (``KVZCHLoadPlanner``): saved rows are sorted by id within each rank and ranks own
ascending bucket ranges, so the rows of a new rank's buckets lie in the saved rows of the old
ranks whose buckets overlap its own. Each rank reads exactly those ranks' rows, chunk by chunk,
and writes each whole row into its store by the id in the row's header, skipping rows of
buckets it does not own. Memory stays bounded by a chunk; any world size can load any other's
checkpoint. Optimizer state inside whole rows and the ``weight_id`` column need no loading.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from fbgemm_gpu.tbe.ssd.utils.partially_materialized_tensor import PartiallyMaterializedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

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
    def resolve_data(self, write_item):
        obj = self.lookup_object(write_item.index)
        if isinstance(obj, PartiallyMaterializedTensor):
            return obj.full_tensor()  # this chunk only
        return super().resolve_data(write_item)

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        rows = {}
        for fqn, md in metadata.state_dict_metadata.items():
            obj = self.state_dict.get(fqn)
            view = kv_view(obj)
            if view is not None and view.part in (RowPart.ROW, RowPart.WEIGHT):
                rows[fqn] = [sum(s.shard_sizes[0] for s in obj.metadata().shards_metadata
                                 if s.placement.rank() == r) for r in range(_world())]
        metadata.planner_data = CheckpointMappings(metadata.planner_data, rows)
        return plans, metadata


class KVZCHLoadPlanner(DefaultLoadPlanner):
    def __init__(self, checkpoint_id: str | None = None, **kwargs) -> None:
        """``checkpoint_id`` only names the checkpoint in error messages."""
        super().__init__(**kwargs)
        self._checkpoint = checkpoint_id or "the checkpoint"
        self._sinks: dict[str, KVTensor] = {}

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._sinks = {}
        saved_rows = getattr(metadata.planner_data, "kvzch_rows", None)
        for fqn, obj in list(self.state_dict.items()):
            view = kv_view(obj)
            if view is None:
                continue
            if view.read_only:  # ids / optimizer state already inside whole rows: read nothing
                saved = metadata.state_dict_metadata.get(fqn)
                self.state_dict[fqn] = _RowSink(saved.size, 0, 0) if saved is not None else None
                if saved is None:
                    del self.state_dict[fqn]
                continue
            if view.part is not RowPart.ROW:
                raise NotImplementedError(
                    f"table '{view.store.params.name}': loading without backend_return_whole_row "
                    "is not supported yet")
            self.state_dict[fqn] = self._destination(fqn, view, metadata, saved_rows)
            self._sinks[fqn] = view

    def _destination(self, fqn: str, view: KVTensor, metadata: Metadata, saved_rows) -> "_RowSink":
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
        return _RowSink(saved.size, begin, end)

    def finish_plan(self, new_plan):
        # Every rank's plan is valid: replace the stores' rows with the checkpoint's.
        for view in self._sinks.values():
            view.store.clear()
        return super().finish_plan(new_plan)

    def resolve_tensor(self, read_item):
        view = self._sinks.get(read_item.dest_index.fqn)
        if view is None:
            return super().resolve_tensor(read_item)
        return torch.empty(list(read_item.lengths), dtype=view.dtype)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        view = self._sinks.get(read_item.dest_index.fqn)
        if view is None:
            return super().commit_tensor(read_item, tensor)
        keys = view.store.layout.unpack(tensor)[0]
        r = view.store.bucket_range
        mine = (keys >= r.id_start) & (keys < r.id_end)
        view.store.write_rows(tensor if bool(mine.all()) else tensor[mine])


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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
