"""DCP planners for state dicts holding KV-ZCH tables: thin subclasses of DCP's defaults.

Save (``KVZCHSavePlanner``): KV-ZCH entries arrive already cut into chunks (one local shard per
``checkpoint_chunk_rows`` rows), so DCP plans them like any sharded tensor; the planner only
materialises each chunk when the writer asks for it. It records in the checkpoint's metadata
what a load needs to place rows by id: each table's geometry, optimizer and rows per rank
(``SavedTable``), and the checksum side files (``integrity.py``) holding a checksum of every
item written. Snapshots frozen for an async save (``staging.py``) are released as soon as
their last chunk has been materialised.

Load (``KVZCHLoadPlanner``): saved rows are sorted by id within each rank and ranks own
ascending id ranges, so the rows of a new rank's buckets lie in the saved rows of the old ranks
whose ids overlap its own - whatever the saved world size, ``num_embeddings`` or
``total_num_buckets``. Each rank reads exactly those ranks' rows, chunk by chunk, and hands
them to the table's KV tensor, which keeps the rows of its buckets (``KVTensor.load``). Memory
stays bounded by a chunk. The store's clock and counters come back with the rows.

A load changes everything or nothing: while planning, before any rank changes anything, it
refuses mismatched tables (row width, optimizer, layout, ids that do not fit), checks that
every file region this rank will read exists and is complete, and (``verify=True``) reads
every item back against its checksum.

Tables without ``backend_return_whole_row`` take the legacy path: weights, ids and optimizer
state of those rows are read in full, held until all have arrived, then loaded by id. It needs
memory for all of them at once (what whole rows avoid).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.tbe.ssd.utils.partially_materialized_tensor import PartiallyMaterializedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from torchrec_kvzch.checkpoint.integrity import (
    ChecksumRecorder, check_files, checksum_file, read_saved, verify_items)
from torchrec_kvzch.checkpoint.state_dict import kv_view
from torchrec_kvzch.kv_tensor import KVTensor
from torchrec_kvzch.params import KVZCHTableParams
from torchrec_kvzch.store.layout import RowLayout, RowPart


@dataclass(frozen=True)
class SavedTable:
    """What a checkpoint records of a KV-ZCH table besides its rows."""

    name: str
    rows: tuple[int, ...]  # rows saved by each rank, in rank order
    num_embeddings: int
    total_num_buckets: int
    embedding_dim: int
    weight_dtype: str
    optimizer: str
    whole_row: bool

    @classmethod
    def of(cls, params: KVZCHTableParams, rows: list[int]) -> "SavedTable":
        return cls(params.name, tuple(rows), params.num_embeddings, params.total_num_buckets,
                   params.embedding_dim, params.weight_dtype, params.optimizer.value,
                   params.backend_return_whole_row)

    def params(self, current: KVZCHTableParams) -> KVZCHTableParams:
        """The saved table's parameters (for its bucket split and row layout)."""
        return dataclasses.replace(current, num_embeddings=self.num_embeddings,
                                   total_num_buckets=self.total_num_buckets,
                                   optimizer=self.optimizer)


class CheckpointMappings(dict):
    """DCP's flattening mappings (what ``planner_data`` normally is), plus ``kvzch_tables``
    {fqn of a KV-ZCH ``weight``: SavedTable} and ``checksum_files`` (empty: saved without)."""

    def __init__(self, mappings=None, kvzch_tables=None, checksum_files=()) -> None:
        super().__init__(mappings or {})
        self.kvzch_tables: dict[str, SavedTable] = dict(kvzch_tables or {})
        self.checksum_files: list[str] = list(checksum_files)


class KVZCHSavePlanner(DefaultSavePlanner):
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        directory = getattr(storage_meta, "checkpoint_id", None)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._checksums = (ChecksumRecorder(str(directory), rank, is_coordinator)
                           if directory is not None else None)
        self._unwritten: Counter = Counter()  # snapshot -> its chunks not materialised yet
        self._items_left = 0
        self._lock = threading.Lock()  # writers resolve items from several threads

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
        if isinstance(obj, PartiallyMaterializedTensor):
            data, snapshot = obj.full_tensor(), obj.wrapped.snapshot  # this chunk only
        else:
            data = super().resolve_data(write_item)
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
        return data

    def _finish_checksums(self) -> None:
        if self._checksums is not None:
            self._checksums.write()

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        tables = {}
        for fqn, obj in self.state_dict.items():
            view = kv_view(obj)
            if view is not None and view.part in (RowPart.ROW, RowPart.WEIGHT):
                shards = obj.metadata().shards_metadata  # every rank has >= 1 (maybe empty) chunk
                world = 1 + max(s.placement.rank() for s in shards)
                rows = [sum(s.shard_sizes[0] for s in shards if s.placement.rank() == r)
                        for r in range(world)]
                tables[fqn] = SavedTable.of(view.store.params, rows)
        # Side files need a local folder (the writer has created it while planning).
        local = self._checksums is not None and os.path.isdir(self._checksums.directory)
        files = [checksum_file(r) for r in range(len(all_plans))] if local else []
        metadata.planner_data = CheckpointMappings(metadata.planner_data, tables, files)
        return plans, metadata


class KVZCHLoadPlanner(DefaultLoadPlanner):
    def __init__(self, checkpoint_id: str | os.PathLike | None = None, verify: bool = True,
                 load_optimizer: bool = True, **kwargs) -> None:
        """``checkpoint_id``: the checkpoint's folder, named in errors and read to check its
        files before loading (pass it: without it the file checks are skipped, and a table
        saved with a larger ``num_embeddings`` cannot be checked and is refused). ``verify``:
        also read back every item against its checksum (one more read). ``load_optimizer``:
        False loads KV-ZCH tables' weights with fresh optimizer state (upstream's
        ``load_ckpt_without_opt``), e.g. from a checkpoint of another optimizer; other entries
        load as the state dict asks (leave the optimizer's out to keep it fresh too)."""
        super().__init__(**kwargs)
        self._verify, self._load_optimizer = verify, load_optimizer
        self._checkpoint = str(checkpoint_id) if checkpoint_id is not None else "the checkpoint"
        self._checkpoint_dir = str(checkpoint_id) if checkpoint_id is not None else None
        self._tables: dict[str, _TableLoad] = {}  # fqn of any entry read for a table -> it

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._tables = {}
        saved = getattr(metadata.planner_data, "kvzch_tables", None)
        views = {fqn: v for fqn, obj in self.state_dict.items() if (v := kv_view(obj)) is not None}
        by_store = {v.store: self._table(fqn, v, saved)
                    for fqn, v in views.items() if v.part in (RowPart.ROW, RowPart.WEIGHT)}
        for table in by_store.values():
            for name in ("weight_id", "bucket", "counters", "clock") + (("metaheader",) if table.legacy else ()):
                if table.base + name not in self.state_dict:
                    raise ValueError(f"the state dict to load has no '{table.base}{name}': load "
                                     f"KV-ZCH table '{table.name}' with all of its entries "
                                     "(the module's whole state_dict())")
            self._plan_entry(table, table.base + "weight", views[table.base + "weight"])
            self._plan_entry(table, table.base + "weight_id", views[table.base + "weight_id"])
            if table.legacy:
                self._plan_entry(table, table.base + "metaheader", views[table.base + "metaheader"])
            self._skip(table.base + "bucket", table)  # rows per bucket: recomputed from the rows
            for name in ("counters", "clock"):
                fqn = table.base + name
                if fqn not in self.metadata.state_dict_metadata:
                    raise ValueError(f"{self._checkpoint} has no '{fqn}' for KV-ZCH table "
                                     f"'{table.name}': it was saved by an older torchrec-kvzch")
                table.history[fqn] = torch.empty(self.metadata.state_dict_metadata[fqn].size,
                                                 dtype=torch.long)
                self.state_dict[fqn] = table.history[fqn]
                self._tables[fqn] = table
        optimizer_views = {fqn: v for fqn, v in views.items() if v.part is RowPart.OPTIMIZER}
        for fqn, view in optimizer_views.items():
            self._plan_entry(by_store[view.store], fqn, view)
        for table in by_store.values():
            if table.legacy and table.optimizer and table.expected_parts != len(table.parts):
                raise ValueError(f"the state dict to load has no optimizer state for KV-ZCH table "
                                 f"'{table.name}' (rows without backend_return_whole_row keep it apart): "
                                 "include the optimizer's state_dict(), or pass load_optimizer=False "
                                 "to start it fresh")

    def _table(self, fqn: str, view: KVTensor, saved_tables) -> "_TableLoad":
        """Check a table against what the checkpoint saved of it; plan its slice of the rows."""
        params = view.store.params
        where = f"{self._checkpoint}: KV-ZCH table '{params.name}'"
        if fqn not in self.metadata.state_dict_metadata:
            raise ValueError(f"{self._checkpoint} has no rows for KV-ZCH table '{params.name}' "
                             f"(no entry '{fqn}'); was it saved from another model?")
        saved = (saved_tables or {}).get(fqn)
        if saved is None:
            raise ValueError(f"{where} was not saved with KVZCHSavePlanner of this torchrec-kvzch "
                             "version, so its rows cannot be placed; save with it")
        if (saved.embedding_dim, saved.weight_dtype) != (params.embedding_dim, params.weight_dtype):
            raise ValueError(f"{where} was saved with embedding_dim {saved.embedding_dim} "
                             f"({saved.weight_dtype}), this model has {params.embedding_dim} "
                             f"({params.weight_dtype}); load it into a table of the same shape")
        if saved.whole_row != params.backend_return_whole_row:
            raise ValueError(f"{where} was saved with backend_return_whole_row={saved.whole_row}, "
                             f"this model has {params.backend_return_whole_row}; load with the setting "
                             "it was saved with")
        if saved.optimizer != params.optimizer.value and self._load_optimizer:
            raise ValueError(f"{where} was saved with optimizer {saved.optimizer}, this model uses "
                             f"{params.optimizer.value}: its optimizer state does not fit. Pass "
                             "load_optimizer=False to load the weights with fresh optimizer state")
        table = _TableLoad(view.store, fqn[: -len("weight")], saved.params(params),
                           self._load_optimizer and view.store.layout.optimizer_floats > 0)
        table.begin, table.end = self._row_range(table, saved.rows)
        self._check_ids_fit(table, saved)
        return table

    def _row_range(self, table: "_TableLoad", rows: tuple[int, ...]) -> tuple[int, int]:
        """This rank's slice of the saved rows: those of the saved ranks whose ids overlap its own."""
        mine = table.store.bucket_range
        starts = [sum(rows[:r]) for r in range(len(rows))]
        overlapping = [r for r in range(len(rows)) if rows[r] and _overlaps(
            table.saved.bucket_range(r, len(rows)), mine)]
        if not overlapping:
            return 0, 0
        return starts[overlapping[0]], starts[overlapping[-1]] + rows[overlapping[-1]]

    def _check_ids_fit(self, table: "_TableLoad", saved: SavedTable) -> None:
        """A table saved with a larger id space may hold ids this one cannot: the largest saved
        id (the last row of ``weight_id``: rows ascend by id) must fit."""
        limit = table.store.params.num_embeddings
        total = sum(saved.rows)
        if saved.num_embeddings <= limit or not total:
            return
        if self._checkpoint_dir is None:
            raise ValueError(f"KV-ZCH table '{table.name}' was saved with num_embeddings "
                             f"{saved.num_embeddings}, more than this model's {limit}: pass "
                             "checkpoint_id to KVZCHLoadPlanner so the saved ids can be checked")
        fqn = table.base + "weight_id"
        chunk = next(c for c in self.metadata.state_dict_metadata[fqn].chunks
                     if c.offsets[0] <= total - 1 < c.offsets[0] + c.sizes[0])
        self._check_files([MetadataIndex(fqn, chunk.offsets)])
        largest = int(read_saved(self._checkpoint_dir, self.metadata, MetadataIndex(fqn, chunk.offsets))[-1])
        if largest >= limit:
            raise ValueError(
                f"{self._checkpoint}: KV-ZCH table '{table.name}' holds ids up to {largest}, saved "
                f"with num_embeddings {saved.num_embeddings}; this model's num_embeddings {limit} "
                f"cannot hold them. Use num_embeddings > {largest} (a multiple of total_num_buckets) "
                "or remap the ids")

    def _plan_entry(self, table: "_TableLoad", fqn: str, view: KVTensor) -> None:
        """Rows to stream for ``fqn``, or none (``_skip``) where the rows carry it already or
        it is not loaded."""
        saved = self.metadata.state_dict_metadata.get(fqn)
        if view.part is RowPart.OPTIMIZER and not table.optimizer:
            return self._skip(fqn, table)
        if view.part is RowPart.OPTIMIZER and saved is None:
            raise ValueError(f"{self._checkpoint} has no optimizer state for KV-ZCH table "
                             f"'{table.name}' (no entry '{fqn}'): it was saved without the optimizer's "
                             "state_dict(). Pass load_optimizer=False to start it fresh")
        if not table.legacy and view.part is not RowPart.ROW:
            return self._skip(fqn, table)  # whole rows hold ids and optimizer state already
        if saved is None:
            raise ValueError(f"{self._checkpoint} has no '{fqn}' for KV-ZCH table '{table.name}': "
                             "it was saved from another model or by an older torchrec-kvzch")
        self.state_dict[fqn] = _RowSink(saved.size, table.begin, table.end)
        self._tables[fqn] = table
        table.parts[fqn] = view
        if table.legacy:
            table.buffers[view.part] = torch.empty(table.end - table.begin, saved.size[1],
                                                   dtype=saved.properties.dtype)

    def _skip(self, fqn: str, table: "_TableLoad | None" = None) -> None:
        """Read nothing for ``fqn``; a table's skipped entries are still verified."""
        saved = self.metadata.state_dict_metadata.get(fqn)
        if saved is None:
            del self.state_dict[fqn]
            return
        self.state_dict[fqn] = _RowSink(saved.size, 0, 0)
        if table is not None:
            table.skipped.append(fqn)
            self._tables[fqn] = table  # for errors naming it

    def create_local_plan(self):
        plan = super().create_local_plan()
        indices = [item.storage_index for item in plan.items] + self._skipped_items()
        indices = list(dict.fromkeys(indices))
        self._check_files(indices)
        files = getattr(self.metadata.planner_data, "checksum_files", [])
        if self._verify and self._checkpoint_dir is not None and files:
            verify_items(self._checkpoint_dir, self.metadata, indices, files, self._describe)
        return plan

    def _skipped_items(self) -> list[MetadataIndex]:
        """Saved chunks of the tables' entries this load reads nothing of (ids and optimizer
        state inside whole rows, rows per bucket): checked all the same, each rank its slice
        of the rows, so a damaged checkpoint is refused whichever entry is damaged."""
        out = []
        for table in set(self._tables.values()):
            for fqn in table.skipped:
                for c in self.metadata.state_dict_metadata[fqn].chunks:
                    start, rows = c.offsets[0], c.sizes[0]
                    if fqn.endswith(".bucket") or (start < table.end and table.begin < start + rows):
                        out.append(MetadataIndex(fqn, c.offsets))
        return out

    def _check_files(self, indices) -> None:
        if self._checkpoint_dir is not None and getattr(self.metadata, "storage_data", None):
            check_files(self._checkpoint_dir, self.metadata, indices, self._describe)

    def _describe(self, fqn: str) -> str:
        table = self._tables.get(fqn)
        return f"entry '{fqn}'" + (f" of KV-ZCH table '{table.name}'" if table else "")

    def finish_plan(self, new_plan):
        # Every rank's plan is valid: replace the stores' rows with the checkpoint's, with room
        # reserved for the most rows that can arrive (no growth copies while streaming).
        for table in set(self._tables.values()):
            table.store.clear()
            table.store.reserve(table.end - table.begin)
            table.apply_legacy_if_complete()  # a shard with no saved rows is complete already
        return super().finish_plan(new_plan)

    def resolve_tensor(self, read_item):
        table = self._tables.get(read_item.dest_index.fqn)
        if table is None or read_item.dest_index.fqn not in table.parts:
            return super().resolve_tensor(read_item)  # ordinary entries, clock and counters
        return torch.empty(list(read_item.lengths),
                           dtype=table.parts[read_item.dest_index.fqn].dtype)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        table = self._tables.get(fqn)
        if table is None:
            return super().commit_tensor(read_item, tensor)
        if fqn not in table.parts:  # clock or counters, read in full into state_dict[fqn]
            return table.receive_history(fqn, tensor.shape[0])
        if table.legacy:
            return table.receive_legacy(table.parts[fqn].part, read_item.dest_offsets[0], tensor)
        table.parts[fqn].load(tensor, layout=table.layout, optimizer=table.optimizer)


class _TableLoad:
    """One table shard's load: its slice ``[begin, end)`` of the saved rows, the entries that
    stream into it, and (legacy layout) the buffers holding them until all have arrived."""

    def __init__(self, store, base: str, saved: KVZCHTableParams, optimizer: bool) -> None:
        self.store, self.base, self.saved, self.optimizer = store, base, saved, optimizer
        self.name = store.params.name
        self.legacy = not store.params.backend_return_whole_row
        self.layout = RowLayout.for_table(saved)  # the saved rows' layout
        self.begin = self.end = 0
        self.parts: dict[str, KVTensor] = {}  # fqn -> the view its rows load through
        self.skipped: list[str] = []  # entries read for nothing (still verified)
        self.buffers: dict[RowPart, torch.Tensor] = {}
        self.filled = 0
        self.history: dict[str, torch.Tensor] = {}  # clock / counters fqn -> read in full here
        self.arrived: Counter = Counter()  # clock / counters fqn -> rows arrived

    @property
    def expected_parts(self) -> int:
        """Entries streamed: whole rows; else weight, ids, header words and (with
        ``optimizer``) its state."""
        return 1 if not self.legacy else 3 + self.optimizer

    def receive_history(self, fqn: str, rows: int) -> None:
        """Rows of the clock or counters arrived (into ``history[fqn]``); once both are
        complete, they go into the store."""
        self.arrived[fqn] += rows
        if all(self.arrived[f] == len(t) for f, t in self.history.items()):
            clock, counters = (self.history[self.base + n] for n in ("clock", "counters"))
            self.store.restore_history(int(clock[0]), counters, self.saved.bucket_size)

    def receive_legacy(self, part: RowPart, start: int, tensor: torch.Tensor) -> None:
        self.buffers[part][start : start + tensor.shape[0]] = tensor
        self.filled += tensor.shape[0]
        self.apply_legacy_if_complete()

    def apply_legacy_if_complete(self) -> None:
        if not self.legacy or not self.buffers or self.filled != (self.end - self.begin) * len(self.buffers):
            return
        ids = self.buffers.pop(RowPart.ID)
        views = {view.part: view for view in self.parts.values()}
        for part in (RowPart.WEIGHT, RowPart.META, RowPart.OPTIMIZER):  # weights create the rows
            if part in self.buffers:
                views[part].load(self.buffers[part], ids)
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
    """Whether two bucket ranges (of possibly different bucket sizes) share an id."""
    return a.id_start < b.id_end and b.id_start < a.id_end
