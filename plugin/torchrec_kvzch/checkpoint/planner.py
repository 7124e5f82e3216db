"""DCP planners for state dicts holding KV-ZCH tables: thin subclasses of DCP's defaults.

Save (``KVZCHSavePlanner``): KV-ZCH entries arrive already cut into chunks (one local shard per
``checkpoint_chunk_rows`` rows), so DCP plans them like any sharded tensor; the planner only
materialises each chunk when the writer asks for it. It records in the checkpoint's metadata
what a load needs to place rows by id: each table's geometry, optimizer and rows per rank, and
the checksum side files (``integrity.py``) holding a checksum of every item written. That
record is plain Python data (dicts, lists, str, int, bool) under one key of DCP's
``planner_data`` (beside DCP's own flattening mappings), so that the ``.metadata`` file unpickles
with torch alone. Snapshots frozen for an async save (``staging.py``) are released as soon as
their last chunk has been materialised.

Load (``KVZCHLoadPlanner``): saved rows are sorted by id within each rank and ranks own
ascending id ranges, so the rows of a new rank's buckets lie in the saved rows of the old ranks
whose ids overlap its own - whatever the saved world size, ``num_embeddings`` or
``total_num_buckets``. Each rank reads exactly those ranks' rows, chunk by chunk, and hands
them to the table's KV tensor, which keeps the rows of its buckets (``KVTensor.load``). Memory
stays bounded by a chunk. The store's clock and counters come back with the rows.

The rows are not read by DCP's reader (a ``torch.load`` into a new tensor and a copy per chunk,
several times slower than the bytes): once every rank's plan is valid, ``finish_plan`` reads
them straight from the files into one reused buffer per entry (``files.py``) and hands DCP's
reader the rest of the plan (clock, counters, ordinary entries). Tables whose items cannot be
read that way (a storage transform, no local folder) go through DCP's reader as before.

A load changes everything or nothing: while planning, before any rank changes anything, it
refuses mismatched tables (row width, optimizer, layout, ids that do not fit), checks that
every file region this rank will read exists and is complete, locates the rows inside their
files, and (``verify=True``) reads every item back against its checksum. A load thus reads its
rows twice: the check must be over before the stores change, and holding the rows meanwhile
would cost their size in memory; the second read finds them in the page cache.

Tables without ``backend_return_whole_row`` stream weights, ids, header words and optimizer
state of the same saved chunk side by side: each chunk is loaded by id once all of its parts
have arrived. The load plan puts a chunk's parts next to each other, so with one data file per
saving rank (``FileSystemWriter``'s default) a chunk's parts are held at once; parts spread
over several files are held until their partners arrive.

Upstream TorchRec checkpoints (a virtual table saved by DCP's default planner: ``weight`` rows or
whole rows, ``weight_id`` ``[n, 1]`` int64, ``bucket`` rows per bucket ``[total_num_buckets, 1]``
int64, optionally ``metadata`` header words ``[n, 1]`` int64, one chunk per rank, no checksums,
counters or clock) load too: a rank's rows are those of its buckets, found from the saved rows
per bucket (read while planning); every id of them is read and checked against the rank's
buckets before anything changes. Upstream records no ``num_embeddings``, so such a checkpoint
loads into a table with its ``total_num_buckets`` (any world size). Counters start at zero.
Header timestamps are kept as saved (upstream stamps seconds, we count steps) and each rank's
clock becomes the newest timestamp among its loaded rows (0 without header words): no row looks
younger than the clock, relative ages are kept, and rows touched after the load are stamped
after every loaded one. DCP reads each saved item whole, so memory is bounded by one saved
chunk - for upstream checkpoints, one saving rank's rows of an entry.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.tbe.ssd.utils.partially_materialized_tensor import PartiallyMaterializedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from torchrec_kvzch.checkpoint.buffers import ChunkBuffers
from torchrec_kvzch.checkpoint.files import SavedFiles
from torchrec_kvzch.checkpoint.integrity import (
    ChecksumRecorder, check_files, checksum_file, read_saved, verify_items)
from torchrec_kvzch.checkpoint.state_dict import kv_view, newest_timestamp
from torchrec_kvzch.kv_tensor import KVTensor
from torchrec_kvzch.params import KVZCHTableParams
from torchrec_kvzch.store.layout import RowLayout, RowPart

# The key of ``Metadata.planner_data`` holding our record; DCP's flattening mappings (the rest
# of ``planner_data``) map state-dict keys, and a save refuses a state-dict key equal to it.
PLANNER_DATA_KEY = "__torchrec_kvzch__"
FORMAT = 1


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

    def to_plain(self, row_width: int) -> dict:
        """The record as plain data (what ``.metadata`` stores); ``row_width`` is informative."""
        return {"name": self.name, "rows_per_rank": list(self.rows),
                "num_embeddings": self.num_embeddings, "total_num_buckets": self.total_num_buckets,
                "embedding_dim": self.embedding_dim, "weight_dtype": self.weight_dtype,
                "optimizer": self.optimizer, "layout": "whole_row" if self.whole_row else "split",
                "row_width": row_width}

    @classmethod
    def from_plain(cls, d: dict) -> "SavedTable":
        return cls(d["name"], tuple(d["rows_per_rank"]), d["num_embeddings"], d["total_num_buckets"],
                   d["embedding_dim"], d["weight_dtype"], d["optimizer"], d["layout"] == "whole_row")


class CheckpointMappings(dict):
    """``planner_data`` of checkpoints written before the plain record (kept so that they still
    unpickle and load): DCP's mappings plus ``kvzch_tables`` {fqn: SavedTable} and
    ``checksum_files``. New checkpoints never contain it."""

    def __init__(self, mappings=None, kvzch_tables=None, checksum_files=()) -> None:
        super().__init__(mappings or {})
        self.kvzch_tables: dict[str, SavedTable] = dict(kvzch_tables or {})
        self.checksum_files: list[str] = list(checksum_files)


def saved_record(planner_data) -> tuple[dict[str, SavedTable] | None, list[str]]:
    """({fqn of a table's ``weight``: SavedTable}, checksum files) of a checkpoint's metadata, in
    either format; (None, []) for a checkpoint not written by ``KVZCHSavePlanner``."""
    if isinstance(planner_data, dict) and isinstance(planner_data.get(PLANNER_DATA_KEY), dict):
        record = planner_data[PLANNER_DATA_KEY]
        tables = {fqn: SavedTable.from_plain(t) for fqn, t in record.get("tables", {}).items()}
        return tables, list(record.get("checksum_files", []))
    old = getattr(planner_data, "kvzch_tables", None)
    if old is not None:
        return dict(old), list(getattr(planner_data, "checksum_files", []))
    return None, []


class KVZCHSavePlanner(DefaultSavePlanner):
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if PLANNER_DATA_KEY in self.state_dict:
            raise ValueError(f"the state dict to save has a key '{PLANNER_DATA_KEY}', which "
                             "KVZCHSavePlanner keeps for its record in the checkpoint's metadata; "
                             "rename that entry")
        directory = getattr(storage_meta, "checkpoint_id", None)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._checksums = (ChecksumRecorder(str(directory), rank, is_coordinator)
                           if directory is not None else None)
        self._unwritten: Counter = Counter()  # snapshot -> its chunks not materialised yet
        self._items_left = 0
        self._lock = threading.Lock()  # writers resolve items from several threads
        self._buffers = ChunkBuffers(native=any(v.store._native for obj in self.state_dict.values()
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
        plans, metadata = super().create_global_plan(all_plans)
        tables = {}
        for fqn, obj in self.state_dict.items():
            view = kv_view(obj)
            if view is not None and view.part in (RowPart.ROW, RowPart.WEIGHT):
                shards = obj.metadata().shards_metadata  # every rank has >= 1 (maybe empty) chunk
                world = 1 + max(s.placement.rank() for s in shards)
                rows = [sum(s.shard_sizes[0] for s in shards if s.placement.rank() == r)
                        for r in range(world)]
                tables[fqn] = SavedTable.of(view.store.params, rows).to_plain(view.shape[1])
        # Side files need a local folder (the writer has created it while planning).
        local = self._checksums is not None and os.path.isdir(self._checksums.directory)
        files = [checksum_file(r) for r in range(len(all_plans))] if local else []
        # (A cached plan's metadata already holds a record: replaced, not wrapped.)
        mappings = {k: v for k, v in (metadata.planner_data or {}).items() if k != PLANNER_DATA_KEY}
        mappings[PLANNER_DATA_KEY] = {"format": FORMAT, "tables": tables, "checksum_files": files}
        metadata.planner_data = mappings
        return plans, metadata


class KVZCHLoadPlanner(DefaultLoadPlanner):
    def __init__(self, checkpoint_id: str | os.PathLike | None = None, verify: bool = True,
                 load_optimizer: bool = True, **kwargs) -> None:
        """``checkpoint_id``: the checkpoint's folder, named in errors and read to check its
        files before loading (pass it: without it the file checks are skipped, and a table
        saved with a larger ``num_embeddings``, or by upstream TorchRec, cannot be checked and
        is refused). ``verify``: also read back every item against its checksum (one more
        read). ``load_optimizer``: False loads KV-ZCH tables' weights with fresh optimizer
        state (upstream's ``load_ckpt_without_opt``), e.g. from a checkpoint of another
        optimizer; other entries load as the state dict asks (leave the optimizer's out to keep
        it fresh too)."""
        super().__init__(**kwargs)
        self._verify, self._load_optimizer = verify, load_optimizer
        self._checkpoint = str(checkpoint_id) if checkpoint_id is not None else "the checkpoint"
        self._checkpoint_dir = str(checkpoint_id) if checkpoint_id is not None else None
        self._tables: dict[str, _TableLoad] = {}  # fqn of any entry read for a table -> it
        self._checksum_files: list[str] = []
        self._files: SavedFiles | None = None  # the checkpoint's files, read directly
        self._direct: list[ReadItem] = []  # rows read here rather than by DCP's reader

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._tables, self._direct = {}, []
        if self._files is not None:
            self._files.close()
        self._files = (SavedFiles(self._checkpoint_dir, metadata)
                       if self._checkpoint_dir is not None and getattr(metadata, "storage_data", None) else None)
        saved, self._checksum_files = saved_record(metadata.planner_data)
        views = {fqn: v for fqn, obj in self.state_dict.items() if (v := kv_view(obj)) is not None}
        by_store = {v.store: self._table(fqn, v, saved)
                    for fqn, v in views.items() if v.part in (RowPart.ROW, RowPart.WEIGHT)}
        for table in by_store.values():
            self._plan_table(table, views[table.base + "weight"].part)
        for fqn, view in views.items():
            if view.part is RowPart.OPTIMIZER:
                self._plan_entry(by_store[view.store], fqn, RowPart.OPTIMIZER)
        for table in by_store.values():
            if table.split and table.optimizer and RowPart.OPTIMIZER not in table.parts.values():
                raise ValueError(f"the state dict to load has no optimizer state for KV-ZCH table "
                                 f"'{table.name}' (rows without backend_return_whole_row keep it apart): "
                                 "include the optimizer's state_dict(), or pass load_optimizer=False "
                                 "to start it fresh")
            self._check_aligned(table)

    def _plan_table(self, table: "_TableLoad", part: RowPart) -> None:
        """Sinks for the entries of one table: rows streamed, the rest skipped or read whole."""
        base = table.base
        for name in ("weight_id", "bucket", "counters", "clock") + (("metaheader",) if table.split else ()):
            if base + name not in self.state_dict:
                raise ValueError(f"the state dict to load has no '{base}{name}': load "
                                 f"KV-ZCH table '{table.name}' with all of its entries "
                                 "(the module's whole state_dict())")
        self._plan_entry(table, base + "weight", part)
        self._plan_entry(table, base + "weight_id", RowPart.ID)
        if table.split and not table.upstream:
            self._plan_entry(table, base + "metaheader", RowPart.META)
        elif table.split:
            self._skip(base + "metaheader")  # not saved upstream: removed from what is read
            if base + "metadata" in self.metadata.state_dict_metadata:
                self._plan_entry(table, base + "metadata", RowPart.META)
        self._skip(base + "bucket", table)  # rows per bucket: recomputed from the rows
        for name in ("counters", "clock"):
            fqn = base + name
            if table.upstream:
                self._skip(fqn)  # upstream saves neither: zero counters, clock from the headers
                continue
            if fqn not in self.metadata.state_dict_metadata:
                raise ValueError(f"{self._checkpoint} has no '{fqn}' for KV-ZCH table "
                                 f"'{table.name}': it was saved by an older torchrec-kvzch")
            table.history[fqn] = torch.empty(self.metadata.state_dict_metadata[fqn].size,
                                             dtype=torch.long)
            self.state_dict[fqn] = table.history[fqn]
            self._tables[fqn] = table

    def _table(self, fqn: str, view: KVTensor, saved_tables) -> "_TableLoad":
        """Check a table against what the checkpoint saved of it; plan its slice of the rows."""
        params = view.store.params
        where = f"{self._checkpoint}: KV-ZCH table '{params.name}'"
        if fqn not in self.metadata.state_dict_metadata:
            raise ValueError(f"{self._checkpoint} has no rows for KV-ZCH table '{params.name}' "
                             f"(no entry '{fqn}'); was it saved from another model?")
        saved = (saved_tables or {}).get(fqn)
        if saved is None:
            if self._is_upstream(fqn[: -len("weight")]):
                return self._upstream_table(fqn, view)
            raise ValueError(f"{where} was saved neither with KVZCHSavePlanner of this "
                             "torchrec-kvzch version nor in upstream TorchRec's layout (weight_id and "
                             "bucket beside the rows), so its rows cannot be placed; save with it")
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
        saved_params = saved.params(params)
        table = _TableLoad(view.store, fqn[: -len("weight")], saved_params,
                           RowLayout.for_table(saved_params),
                           self._load_optimizer and view.store.layout.optimizer_floats > 0)
        table.begin, table.end = self._row_range(table, saved.rows)
        self._check_ids_fit(table, saved)
        return table

    def _is_upstream(self, base: str) -> bool:
        """An upstream TorchRec virtual table: ids and rows per bucket beside the rows, none of
        our counters or clock."""
        md = self.metadata.state_dict_metadata
        return (base + "weight_id" in md and base + "bucket" in md
                and base + "counters" not in md and base + "clock" not in md)

    def _upstream_table(self, fqn: str, view: KVTensor) -> "_TableLoad":
        """Plan a table saved by upstream TorchRec: check its rows fit this table, find this
        rank's rows from the saved rows per bucket, and check their ids (see the module doc)."""
        store, params, layout = view.store, view.store.params, view.store.layout
        base = fqn[: -len("weight")]
        md = self.metadata.state_dict_metadata
        where = f"{self._checkpoint}: KV-ZCH table '{params.name}' (saved by upstream TorchRec)"
        if self._checkpoint_dir is None:
            raise ValueError(f"{where}: its rows are placed by its rows per bucket and its ids are "
                             "checked, both read while planning: pass checkpoint_id to KVZCHLoadPlanner")
        weight, buckets = md[fqn], md[base + "bucket"]
        if buckets.size[0] != params.total_num_buckets:
            raise ValueError(f"{where} has {buckets.size[0]} buckets, this table "
                             f"{params.total_num_buckets}: an upstream checkpoint records no "
                             "num_embeddings, so its rows can only be placed into a table with its "
                             f"total_num_buckets; use total_num_buckets={buckets.size[0]} (and the "
                             "num_embeddings it was saved with)")
        width, dtype = weight.size[1], weight.properties.dtype
        saved_layout = layout
        if dtype != layout.dtype:
            raise ValueError(f"{where} holds {dtype} rows, this table {layout.dtype}; load it into "
                             f"a table with the weight_dtype it was saved with")
        if params.backend_return_whole_row and width != layout.row_width:
            rest = width - layout.header_width - layout.weight_width
            if width == params.embedding_dim:
                raise ValueError(f"{where} holds weights only ([n, {width}]), this table whole rows; "
                                 "load it with backend_return_whole_row=False")
            if self._load_optimizer or rest < 0 or rest % 4:
                raise ValueError(
                    f"{where} holds whole rows of {width} columns, this table's are {layout.row_width} "
                    f"(header {layout.header_width} + embedding_dim {params.embedding_dim} padded to "
                    f"{layout.weight_width} + optimizer {layout.optimizer_width}): another "
                    "embedding_dim or optimizer. Load it into a table of the same shape"
                    + (", or pass load_optimizer=False to load the weights with fresh optimizer "
                       "state" if rest >= 0 and rest % 4 == 0 else ""))
            saved_layout = RowLayout(params.embedding_dim, dtype, rest * layout.itemsize // 4)
        elif not params.backend_return_whole_row and width != params.embedding_dim:
            hint = (" whole rows: load it with backend_return_whole_row=True" if width == layout.row_width
                    else f" another embedding_dim: load it into a table with embedding_dim {width}")
            raise ValueError(f"{where} holds rows of {width} columns, this table's embedding_dim is "
                             f"{params.embedding_dim}:{hint}")
        optimizer = (self._load_optimizer and layout.optimizer_floats > 0
                     and saved_layout.optimizer_floats == layout.optimizer_floats)
        table = _TableLoad(store, base, params, saved_layout, optimizer, upstream=True)
        counts = self._saved_rows_per_bucket(table, buckets)
        if int(counts.sum()) != weight.size[0]:
            raise ValueError(f"{where}: its rows per bucket ('{base}bucket') add up to "
                             f"{int(counts.sum())} rows, '{fqn}' holds {weight.size[0]}: the "
                             "checkpoint is inconsistent; load another one")
        r = store.bucket_range
        table.begin, table.end = int(counts[: r.start].sum()), int(counts[: r.end].sum())
        self._check_upstream_ids(table, where)
        return table

    def _saved_rows_per_bucket(self, table: "_TableLoad", buckets) -> torch.Tensor:
        fqn = table.base + "bucket"
        indices = [MetadataIndex(fqn, c.offsets) for c in buckets.chunks]
        self._tables[fqn] = table  # for errors naming it
        self._check_files(indices)
        counts = torch.zeros(buckets.size[0], dtype=torch.long)
        for index, c in zip(indices, buckets.chunks):
            values = read_saved(self._checkpoint_dir, self.metadata, index)
            counts[c.offsets[0] : c.offsets[0] + c.sizes[0]] = values.reshape(-1).long()
        return counts

    def _check_upstream_ids(self, table: "_TableLoad", where: str) -> None:
        """Read the saved ids of this rank's rows (one saved chunk at a time) and check that they
        lie in this rank's buckets: else the checkpoint's bucket size (its num_embeddings)
        differs from this table's, and rows would land in the wrong shard or be lost. (Upstream
        sorts ids by bucket only, so their order within a bucket is not checked.)"""
        fqn, r = table.base + "weight_id", table.store.bucket_range
        self._tables[fqn] = table  # for errors naming it
        for c in self.metadata.state_dict_metadata[fqn].chunks:
            lo, hi = max(c.offsets[0], table.begin), min(c.offsets[0] + c.sizes[0], table.end)
            if lo >= hi:
                continue
            index = MetadataIndex(fqn, c.offsets)
            self._check_files([index])
            ids = read_saved(self._checkpoint_dir, self.metadata, index).reshape(-1)
            ids = ids[lo - c.offsets[0] : hi - c.offsets[0]]
            bad = (ids < r.id_start) | (ids >= r.id_end)
            if bool(bad.any()):
                raise ValueError(
                    f"{where}: its row of id {int(ids[bad][0])} is counted in this rank's buckets "
                    f"[{r.start}, {r.end}) but lies outside their ids [{r.id_start}, {r.id_end}): "
                    f"it was saved with another num_embeddings. Load it into a table with the "
                    "num_embeddings it was saved with")

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

    def _plan_entry(self, table: "_TableLoad", fqn: str, part: RowPart) -> None:
        """Rows to stream for ``fqn`` as ``part``, or none (``_skip``) where the rows carry it
        already or it is not loaded."""
        saved = self.metadata.state_dict_metadata.get(fqn)
        if (part is RowPart.OPTIMIZER and not table.optimizer) or (not table.split and part is not RowPart.ROW):
            return self._skip(fqn, table)  # not loaded, or held by the whole rows already
        if part is RowPart.OPTIMIZER and saved is None:
            raise ValueError(f"{self._checkpoint} has no optimizer state for KV-ZCH table "
                             f"'{table.name}' (no entry '{fqn}'): it was saved without the optimizer's "
                             "state_dict(). Pass load_optimizer=False to start it fresh")
        if saved is None:
            raise ValueError(f"{self._checkpoint} has no '{fqn}' for KV-ZCH table '{table.name}': "
                             "it was saved from another model or by an older torchrec-kvzch")
        if part is RowPart.OPTIMIZER and table.upstream:
            self._check_upstream_optimizer(table, fqn, saved)
        self.state_dict[fqn] = _RowSink(saved.size, table.begin, table.end)
        self._tables[fqn] = table
        table.parts[fqn] = part
        table.dtypes[fqn] = saved.properties.dtype

    def _check_upstream_optimizer(self, table: "_TableLoad", fqn: str, saved) -> None:
        floats = table.store.layout.optimizer_floats
        per_row = 1 if len(saved.size) == 1 else saved.size[1]
        if saved.properties.dtype != torch.float32 or per_row != floats:
            raise ValueError(f"{self._checkpoint}: KV-ZCH table '{table.name}' has optimizer state "
                             f"'{fqn}' of {per_row} {saved.properties.dtype} per row, this table keeps "
                             f"{floats} fp32 ({table.store.params.optimizer.value}): pass "
                             "load_optimizer=False to load the weights with fresh optimizer state")

    def _check_aligned(self, table: "_TableLoad") -> None:
        """The parts of a split table are joined chunk by chunk: all must be saved in chunks
        cut at the same rows (ours and upstream's are)."""
        if not table.split:
            return
        cuts = {}
        for fqn in table.parts:
            cuts[fqn] = sorted((max(c.offsets[0], table.begin), min(c.offsets[0] + c.sizes[0], table.end))
                               for c in self.metadata.state_dict_metadata[fqn].chunks
                               if c.offsets[0] < table.end and table.begin < c.offsets[0] + c.sizes[0])
        if len({tuple(c) for c in cuts.values()}) > 1:
            raise ValueError(f"{self._checkpoint}: KV-ZCH table '{table.name}' has entries "
                             f"{sorted(cuts)} saved in chunks cut at different rows; they must be "
                             "cut alike to be loaded row by row (re-save the table with one chunking)")

    def _skip(self, fqn: str, table: "_TableLoad | None" = None) -> None:
        """Read nothing for ``fqn``; a table's skipped entries are still verified."""
        saved = self.metadata.state_dict_metadata.get(fqn)
        if saved is None:
            self.state_dict.pop(fqn, None)
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
        # A table's rows are read here when all of its parts can be (a split table joins a
        # chunk's parts: some here and some through DCP's reader would hold them all at once).
        readable = {item: self._readable_rows(item) for item in plan.items}
        partly = {self._tables[item.dest_index.fqn] for item, ok in readable.items()
                  if not ok and self._tables.get(item.dest_index.fqn) is not None
                  and item.dest_index.fqn in self._tables[item.dest_index.fqn].parts}
        self._direct = [item for item, ok in readable.items()
                        if ok and self._tables[item.dest_index.fqn] not in partly]
        if self._verify and self._checkpoint_dir is not None and self._checksum_files:
            verify_items(self._checkpoint_dir, self.metadata, indices, self._checksum_files, self._describe,
                         self._files)

        # Parts of one chunk next to each other, so that a chunk is complete soon after its
        # first part (the reader goes through each file's items in plan order).
        def order(item):
            table = self._tables.get(item.dest_index.fqn)
            if table is None or item.dest_index.fqn not in table.parts:
                return ("", 0)
            return (table.base, item.dest_offsets[0])
        plan.items.sort(key=order)
        return plan

    def _readable_rows(self, item: ReadItem) -> bool:
        """Whether ``item`` is rows of a table (a slice of whole saved rows) that ``SavedFiles``
        can read straight from the file. Finding that out parses the item's zip directory, so
        a damaged one is refused here, before anything changes."""
        table = self._tables.get(item.dest_index.fqn)
        if self._files is None or table is None or item.dest_index.fqn not in table.parts:
            return False
        saved = self.metadata.state_dict_metadata[item.storage_index.fqn]
        sizes = next(c.sizes for c in saved.chunks if c.offsets == item.storage_index.offset)
        if any(item.storage_offsets[1:]) or list(item.lengths[1:]) != list(sizes[1:]):
            return False
        try:
            return self._files.span(item.storage_index) is not None
        except ValueError as e:
            where = os.path.join(self._checkpoint_dir, self.metadata.storage_data[item.storage_index].relative_path)
            raise ValueError(f"{where} is corrupt: {self._describe(item.dest_index.fqn)} cannot be "
                             f"located in it ({e}); restore the file or load another checkpoint") from e

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
            if table.upstream:  # no history saved: counters zero, clock from the loaded headers
                p = table.store.params
                table.store.restore_history(0, torch.zeros(p.total_num_buckets, 2, dtype=torch.long),
                                            p.bucket_size)
        plan = super().finish_plan(new_plan)
        # Rows are read here, straight from the files into reused buffers and on into the
        # stores; DCP's reader gets the rest (clock, counters, ordinary entries).
        direct = set(self._direct)
        try:
            self._read_rows([item for item in plan.items if item in direct])
        finally:
            if self._files is not None:
                self._files.close()
        return dataclasses.replace(plan, items=[item for item in plan.items if item not in direct])

    def _read_rows(self, items: list[ReadItem]) -> None:
        """Read ``items`` (rows of tables, a chunk's parts side by side) into one reused buffer
        per entry and hand each to its table: a chunk is in the store before the next is read."""
        buffers: dict[str, torch.Tensor] = {}
        for item in sorted(items, key=lambda i: (self._tables[i.dest_index.fqn].base, i.dest_offsets[0])):
            fqn = item.dest_index.fqn
            table = self._tables[fqn]
            dtype, shape = table.dtypes[fqn], list(item.lengths)
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            if fqn not in buffers or buffers[fqn].numel() < nbytes:
                buffers[fqn] = torch.empty(nbytes, dtype=torch.uint8)
            out = buffers[fqn][:nbytes].view(dtype).view(shape)
            self._files.read_rows(self._files.span(item.storage_index), item.storage_offsets[0], out)
            table.receive(table.parts[fqn], (item.dest_offsets[0], item.lengths[0]), out)

    def resolve_tensor(self, read_item):
        table = self._tables.get(read_item.dest_index.fqn)
        if table is None or read_item.dest_index.fqn not in table.parts:
            return super().resolve_tensor(read_item)  # ordinary entries, clock and counters
        return torch.empty(list(read_item.lengths), dtype=table.dtypes[read_item.dest_index.fqn])

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        table = self._tables.get(fqn)
        if table is None:
            return super().commit_tensor(read_item, tensor)
        if fqn not in table.parts:  # clock or counters, read in full into state_dict[fqn]
            return table.receive_history(fqn, tensor.shape[0])
        table.receive(table.parts[fqn], (read_item.dest_offsets[0], read_item.lengths[0]), tensor)


class _TableLoad:
    """One table shard's load: its slice ``[begin, end)`` of the saved rows, the entries that
    stream into it, and (split layout) each chunk's parts until all of them have arrived."""

    def __init__(self, store, base: str, saved: KVZCHTableParams, layout: RowLayout,
                 optimizer: bool, upstream: bool = False) -> None:
        self.store, self.base, self.saved, self.optimizer = store, base, saved, optimizer
        self.name = store.params.name
        self.split = not store.params.backend_return_whole_row
        self.upstream = upstream  # saved by upstream TorchRec: no history, clock from headers
        self.layout = layout  # the saved rows' layout
        self.begin = self.end = 0
        self.parts: dict[str, RowPart] = {}  # fqn -> the part its rows are
        self.dtypes: dict[str, torch.dtype] = {}  # fqn -> saved dtype
        self.skipped: list[str] = []  # entries read for nothing (still verified)
        self.pending: dict[tuple[int, int], dict[RowPart, torch.Tensor]] = {}  # split chunks
        self.history: dict[str, torch.Tensor] = {}  # clock / counters fqn -> read in full here
        self.arrived: Counter = Counter()  # clock / counters fqn -> rows arrived
        empty = torch.empty(0, dtype=torch.long)
        self._loaders = {part: KVTensor(store, part, ids=empty) for part in RowPart if part is not RowPart.ID}

    def receive_history(self, fqn: str, rows: int) -> None:
        """Rows of the clock or counters arrived (into ``history[fqn]``); once both are
        complete, they go into the store."""
        self.arrived[fqn] += rows
        if all(self.arrived[f] == len(t) for f, t in self.history.items()):
            clock, counters = (self.history[self.base + n] for n in ("clock", "counters"))
            self.store.restore_history(int(clock[0]), counters, self.saved.bucket_size)

    def receive(self, part: RowPart, key: tuple[int, int], tensor: torch.Tensor) -> None:
        """Saved rows ``key = (first row, rows)`` of one part arrived."""
        if not self.split:
            self._loaders[RowPart.ROW].load(tensor, layout=self.layout, optimizer=self.optimizer)
            if self.upstream:
                self._advance_clock(self.layout.unpack(tensor)[1])
            return
        chunk = self.pending.setdefault(key, {})
        chunk[part] = tensor
        if len(chunk) == len(set(self.parts.values())):
            self._apply(self.pending.pop(key))

    def _apply(self, chunk: dict[RowPart, torch.Tensor]) -> None:
        ids = chunk[RowPart.ID].reshape(-1)
        for part in (RowPart.WEIGHT, RowPart.META, RowPart.OPTIMIZER):  # weights create the rows
            if part in chunk:
                self._loaders[part].load(chunk[part].reshape(ids.numel(), -1), ids)
        if self.upstream and RowPart.META in chunk:
            self._advance_clock(chunk[RowPart.META].reshape(-1))

    def _advance_clock(self, meta: torch.Tensor) -> None:
        self.store.clock = max(self.store.clock, newest_timestamp(meta))


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
        rest = list(self._size[1:])
        return [ChunkStorageMetadata(offsets=torch.Size([self.begin] + [0] * len(rest)),
                                     sizes=torch.Size([self.end - self.begin] + rest))]


def _overlaps(a, b) -> bool:
    """Whether two bucket ranges (of possibly different bucket sizes) share an id."""
    return a.id_start < b.id_end and b.id_start < a.id_end
