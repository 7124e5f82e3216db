"""Loading checkpoints saved by upstream TorchRec into KV-ZCH tables (part of ``KVZCHLoadPlanner``).

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

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from torchrec_kvzch.checkpoint.integrity import read_saved
from torchrec_kvzch.checkpoint.table_load import TableLoad
from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowLayout


class UpstreamTables:
    """The load planner's methods for tables saved by upstream TorchRec; they use its
    ``metadata``, ``_checkpoint``, ``_checkpoint_dir``, ``_tables``, ``_load_optimizer`` and
    ``_check_files``."""

    def _is_upstream(self, base: str) -> bool:
        """An upstream TorchRec virtual table: ids and rows per bucket beside the rows, none of
        our counters or clock."""
        md = self.metadata.state_dict_metadata
        return (base + "weight_id" in md and base + "bucket" in md
                and base + "counters" not in md and base + "clock" not in md)

    def _upstream_table(self, fqn: str, view: KVTensor) -> TableLoad:
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
        table = TableLoad(store, base, params, saved_layout, optimizer, upstream=True)
        counts = self._saved_rows_per_bucket(table, buckets)
        if int(counts.sum()) != weight.size[0]:
            raise ValueError(f"{where}: its rows per bucket ('{base}bucket') add up to "
                             f"{int(counts.sum())} rows, '{fqn}' holds {weight.size[0]}: the "
                             "checkpoint is inconsistent; load another one")
        r = store.bucket_range
        table.begin, table.end = int(counts[: r.start].sum()), int(counts[: r.end].sum())
        self._check_upstream_ids(table, where)
        return table

    def _saved_rows_per_bucket(self, table: TableLoad, buckets) -> torch.Tensor:
        fqn = table.base + "bucket"
        indices = [MetadataIndex(fqn, c.offsets) for c in buckets.chunks]
        self._tables[fqn] = table  # for errors naming it
        self._check_files(indices)
        counts = torch.zeros(buckets.size[0], dtype=torch.long)
        for index, c in zip(indices, buckets.chunks):
            values = read_saved(self._checkpoint_dir, self.metadata, index)
            counts[c.offsets[0] : c.offsets[0] + c.sizes[0]] = values.reshape(-1).long()
        return counts

    def _check_upstream_ids(self, table: TableLoad, where: str) -> None:
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

    def _check_upstream_optimizer(self, table: TableLoad, fqn: str, saved, columns=None) -> None:
        floats = columns[1] if columns else table.store.layout.optimizer_floats
        per_row = 1 if len(saved.size) == 1 else saved.size[1]
        if saved.properties.dtype != torch.float32 or per_row != floats:
            raise ValueError(f"{self._checkpoint}: KV-ZCH table '{table.name}' has optimizer state "
                             f"'{fqn}' of {per_row} {saved.properties.dtype} per row, this table keeps "
                             f"{floats} fp32 ({table.store.params.optimizer.value}): pass "
                             "load_optimizer=False to load the weights with fresh optimizer state")
