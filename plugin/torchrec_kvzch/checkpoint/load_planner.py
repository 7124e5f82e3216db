"""The DCP load planner for state dicts holding KV-ZCH tables: a subclass of DCP's default.

saved rows are sorted by id within each rank and ranks own
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

Checkpoints saved by upstream TorchRec load too (``upstream.py``).

An incremental checkpoint (a delta, ``torchrec/delta.py``) is one link of a chain and loads
only with ``delta=True``, onto the state at its base: the count decays it lists are replayed on
the rows there, its rows are written by id over them (nothing is cleared), its deleted ids are
removed, clock and counters are replaced.
``CheckpointManager.load`` walks a chain with ``check_only`` (plan and verify every link before
any changes) and ``tables_only`` (the links before the last: KV-ZCH rows only).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from torchrec_kvzch.checkpoint.files import SavedFiles
from torchrec_kvzch.checkpoint.integrity import check_files, verify_items
from torchrec_kvzch.checkpoint.record import chain_link, saved_record
from torchrec_kvzch.checkpoint.saved_tables import SavedTables
from torchrec_kvzch.checkpoint.table_load import RowSink, TableLoad
from torchrec_kvzch.checkpoint.upstream import UpstreamTables
from torchrec_kvzch.table.layout import RowPart
from torchrec_kvzch.torchrec.admission_state import ADMISSION_ENTRIES, TOTALS
from torchrec_kvzch.torchrec.delta import DELETED
from torchrec_kvzch.torchrec.state_dict import kv_view


class KVZCHLoadPlanner(SavedTables, UpstreamTables, DefaultLoadPlanner):
    def __init__(self, checkpoint_id: str | os.PathLike | None = None, verify: bool = True,
                 load_optimizer: bool = True, *, delta: bool = False, check_only: bool = False,
                 tables_only: bool = False, **kwargs) -> None:
        """``checkpoint_id``: the checkpoint's folder, named in errors and read to check its
        files before loading. DCP does not tell a planner where it reads from, so ``verify=True``
        (the default) refuses to go without it; with ``verify=False`` and no folder nothing is
        checked before the stores change (a damaged file can leave them half loaded), and a
        table saved with a larger ``num_embeddings``, or by upstream TorchRec, is refused.
        ``verify``: also read back every item against its checksum (one more read).
        ``load_optimizer``: False loads KV-ZCH tables' weights with fresh optimizer state
        (upstream's ``load_ckpt_without_opt``), e.g. from a checkpoint of another optimizer;
        other entries load as the state dict asks (leave the optimizer's out to keep it fresh
        too). ``delta``: the checkpoint is a delta, applied onto the current state.
        ``check_only``: plan and verify, change nothing. ``tables_only``: load the KV-ZCH
        tables' rows, clock and counters, nothing else (a chain's links before the last)."""
        if verify and checkpoint_id is None:
            raise ValueError("KVZCHLoadPlanner(verify=True) needs the checkpoint's folder to check its files "
                             "before anything changes: pass checkpoint_id (the folder given to dcp.load), or "
                             "verify=False to load unchecked")
        super().__init__(**kwargs)
        self._verify, self._load_optimizer = verify, load_optimizer
        self._delta, self._check_only, self._tables_only = delta, check_only, tables_only
        self._checkpoint = str(checkpoint_id) if checkpoint_id is not None else "the checkpoint"
        self._checkpoint_dir = str(checkpoint_id) if checkpoint_id is not None else None
        self._tables: dict[str, TableLoad] = {}  # fqn of any entry read for a table -> it
        self._checksum_files: list[str] = []
        self._files: SavedFiles | None = None  # the checkpoint's files, read directly
        self._direct: list[ReadItem] = []  # rows read here rather than by DCP's reader
        self._ignored: set[str] = set()  # entries not loaded (tables_only)

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._tables, self._direct, self._ignored = {}, [], set()
        if self._files is not None:
            self._files.close()
        self._files = (SavedFiles(self._checkpoint_dir, metadata)
                       if self._checkpoint_dir is not None and getattr(metadata, "storage_data", None) else None)
        saved, self._checksum_files = saved_record(metadata.planner_data)
        base = chain_link(metadata.planner_data)[1]
        self._decays = (base or {}).get("decays") or {}  # a delta's, {table: per saving rank}
        if (base is not None) != self._delta:
            raise ValueError(
                f"{self._checkpoint} is an incremental checkpoint (a delta of step {base['step']}): load it "
                "with CheckpointManager.load, which applies its chain" if base is not None else
                f"{self._checkpoint} is a full checkpoint, not a delta: load it with delta=False")
        views = {fqn: v for fqn, obj in self.state_dict.items() if (v := kv_view(obj)) is not None}
        by_store = {v.store: self._table(fqn, v, saved)
                    for fqn, v in views.items() if v.part in (RowPart.ROW, RowPart.WEIGHT)}
        for table in by_store.values():
            self._plan_table(table, views[table.base + "weight"].part)
            if self._delta:
                self._plan_deleted(table)
            if not self._tables_only:
                self._plan_admission(table)
        for fqn, view in views.items():
            if view.part is RowPart.OPTIMIZER:
                if view.store not in by_store:
                    raise ValueError(f"the state dict to load has optimizer state for KV-ZCH table "
                                     f"'{view.store.params.name}' ('{fqn}') but not its rows: include the "
                                     "model's state_dict() (taken before the optimizer's)")
                self._plan_entry(by_store[view.store], fqn, RowPart.OPTIMIZER, view.columns)
        for table in by_store.values():
            if table.split and table.optimizer and RowPart.OPTIMIZER not in table.parts.values():
                raise ValueError(f"the state dict to load has no optimizer state for KV-ZCH table "
                                 f"'{table.name}' (rows without backend_return_whole_row keep it apart): "
                                 "include the optimizer's state_dict(), or pass load_optimizer=False "
                                 "to start it fresh")
            named = [f for f, c in table.columns.items() if c is not None]
            if named and sum(table.columns[f][1] for f in named) != table.store.layout.optimizer_floats:
                raise ValueError(f"the state dict to load has only {sorted(named)} of KV-ZCH table "
                                 f"'{table.name}''s optimizer state: include the optimizer's whole "
                                 "state_dict(), or pass load_optimizer=False to start it fresh")
            self._check_aligned(table)
        if self._tables_only:
            self._ignore_all_but_tables()

    def _ignore_all_but_tables(self) -> None:
        """Nothing but the tables' rows, clock and counters: other saved tensors become sinks
        that read nothing, other saved objects are left out of the plan (DCP takes keys missing
        from the state dict for an old format), entries the checkpoint lacks go."""
        saved = self.metadata.state_dict_metadata
        for fqn in [f for f in self.state_dict if f not in self._tables]:
            if fqn not in saved:
                del self.state_dict[fqn]
            elif isinstance(saved[fqn], TensorStorageMetadata):
                self.state_dict[fqn] = RowSink(saved[fqn].size, 0, 0)
            else:
                self._ignored.add(fqn)

    def _plan_deleted(self, table: TableLoad) -> None:
        """A delta's ids deleted since its base: this rank reads the slice its rows come from."""
        fqn = table.base + DELETED
        if fqn not in self.metadata.state_dict_metadata:
            raise ValueError(f"{self._checkpoint} has no '{fqn}' for KV-ZCH table '{table.name}': "
                             "it is not a delta saved by CheckpointManager")
        table.deleted_fqn = fqn
        self.state_dict[fqn] = RowSink(self.metadata.state_dict_metadata[fqn].size, *table.deleted_range)
        self._tables[fqn] = table

    def _plan_admission(self, table: TableLoad) -> None:
        """Admission state (``torchrec/admission_state.py``): loaded in place when saved at this
        world size with these buckets, else read whole and merged; cleared when not saved."""
        md = self.metadata.state_dict_metadata
        mine = {n: self.state_dict[table.base + n] for n in ADMISSION_ENTRIES if table.base + n in self.state_dict}
        table.admission_live = {n: entry.local_shards()[0].tensor for n, entry in mine.items()}
        world = dist.get_world_size() if dist.is_initialized() else 1
        saved = md.get(table.base + TOTALS)
        same = (saved is not None and saved.size[0] == world and not table.upstream
                and table.saved.total_num_buckets == table.store.params.total_num_buckets)
        for name, entry in mine.items():
            fqn = table.base + name
            if fqn not in md or saved is None:  # not saved: starts afresh (cleared in finish_plan)
                self.state_dict.pop(fqn)
            elif same and md[fqn].size != entry.size():
                raise ValueError(f"{self._checkpoint}: KV-ZCH table '{table.name}' was saved with a "
                                 f"'{name}' of {list(md[fqn].size)}, this model's is {list(entry.size())}: "
                                 "load it into a table with the admission sketch it was saved with")
            elif not same:
                self._check_admission_blocks(table, name, md[fqn].size, saved.size[0], entry.local_shards()[0].tensor)
                self.state_dict[fqn] = torch.empty(md[fqn].size, dtype=md[fqn].properties.dtype)
                table.admission_saved[fqn] = self.state_dict[fqn]
                self._tables[fqn] = table

    def _plan_table(self, table: TableLoad, part: RowPart) -> None:
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

    def _plan_entry(self, table: TableLoad, fqn: str, part: RowPart, columns: tuple[int, int] | None = None) -> None:
        """Rows to stream for ``fqn`` as ``part`` (``columns``: of it), or none (``_skip``) where
        the rows carry it already or it is not loaded."""
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
            self._check_upstream_optimizer(table, fqn, saved, columns)
        self.state_dict[fqn] = RowSink(saved.size, table.begin, table.end)
        self._tables[fqn] = table
        table.parts[fqn] = part
        table.columns[fqn] = columns
        table.dtypes[fqn] = saved.properties.dtype

    def _skip(self, fqn: str, table: TableLoad | None = None) -> None:
        """Read nothing for ``fqn``; a table's skipped entries are still verified."""
        saved = self.metadata.state_dict_metadata.get(fqn)
        if saved is None:
            self.state_dict.pop(fqn, None)
            return
        self.state_dict[fqn] = RowSink(saved.size, 0, 0)
        if table is not None:
            table.skipped.append(fqn)
            self._tables[fqn] = table  # for errors naming it

    def create_local_plan(self):
        plan = super().create_local_plan()
        if self._ignored:
            plan = dataclasses.replace(plan, items=[i for i in plan.items if i.dest_index.fqn not in self._ignored])
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
        if self._check_only:  # every rank's plan is valid: that was all to find out
            if self._files is not None:
                self._files.close()
            return dataclasses.replace(super().finish_plan(new_plan), items=[])
        # Every rank's plan is valid: replace the stores' rows with the checkpoint's (a delta:
        # write them over), with room reserved for the most rows that can arrive (no growth
        # copies while streaming).
        for table in set(self._tables.values()):
            if not self._delta:
                table.store.clear()
            for block in table.admission_live.values():
                block.zero_()
            table.store.reserve(len(table.store) + table.end - table.begin)
            if table.name in self._decays:
                table.replay_decays(self._decays[table.name])
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
            table.receive(fqn, (item.dest_offsets[0], item.lengths[0]), out)

    def resolve_tensor(self, read_item):
        table = self._tables.get(read_item.dest_index.fqn)
        if table is not None and read_item.dest_index.fqn == table.deleted_fqn:
            return torch.empty(list(read_item.lengths), dtype=torch.long)
        if table is None or read_item.dest_index.fqn not in table.parts:
            return super().resolve_tensor(read_item)  # ordinary entries, clock and counters
        return torch.empty(list(read_item.lengths), dtype=table.dtypes[read_item.dest_index.fqn])

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        table = self._tables.get(fqn)
        if table is None:
            return super().commit_tensor(read_item, tensor)
        if fqn in table.admission_saved:
            return table.receive_admission(fqn, tensor.shape[0])
        if fqn == table.deleted_fqn:
            return table.receive_deleted(tensor)
        if fqn not in table.parts:  # clock or counters, read in full into state_dict[fqn]
            return table.receive_history(fqn, tensor.shape[0])
        table.receive(fqn, (read_item.dest_offsets[0], read_item.lengths[0]), tensor)
