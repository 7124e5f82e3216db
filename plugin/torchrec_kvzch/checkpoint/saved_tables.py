"""What a checkpoint saved of a KV-ZCH table, checked against the table to load it into, and
which of its rows a rank reads (part of ``KVZCHLoadPlanner``)."""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import MetadataIndex

from torchrec_kvzch.checkpoint.integrity import read_saved
from torchrec_kvzch.checkpoint.record import SavedTable
from torchrec_kvzch.checkpoint.table_load import TableLoad, overlaps
from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowLayout


class SavedTables:
    """The load planner's checks of saved tables; they use its ``metadata``, ``_checkpoint``,
    ``_checkpoint_dir``, ``_load_optimizer``, ``_check_files`` and ``UpstreamTables``."""

    def _table(self, fqn: str, view: KVTensor, saved_tables) -> TableLoad:
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
        table = TableLoad(view.store, fqn[: -len("weight")], saved_params,
                           RowLayout.for_table(saved_params),
                           self._load_optimizer and view.store.layout.optimizer_floats > 0)
        table.begin, table.end = self._row_range(table, saved.rows)
        if saved.deleted is not None:
            table.deleted_range = self._row_range(table, saved.deleted)
        self._check_ids_fit(table, saved)
        return table

    def _row_range(self, table: TableLoad, rows: tuple[int, ...]) -> tuple[int, int]:
        """This rank's slice of the saved rows: those of the saved ranks whose ids overlap its own."""
        mine = table.store.bucket_range
        starts = [sum(rows[:r]) for r in range(len(rows))]
        overlapping = [r for r in range(len(rows)) if rows[r] and overlaps(
            table.saved.bucket_range(r, len(rows)), mine)]
        if not overlapping:
            return 0, 0
        return starts[overlapping[0]], starts[overlapping[-1]] + rows[overlapping[-1]]

    def _check_ids_fit(self, table: TableLoad, saved: SavedTable) -> None:
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

    def _check_aligned(self, table: TableLoad) -> None:
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

    def _check_admission_blocks(self, table: TableLoad, name: str, size, saved_world: int, block) -> None:
        """Admission state saved at another world size or bucket split is merged block by block
        (``admission_state.merge``) after the rows are in: its blocks must fit this shard's,
        checked here while nothing has changed."""
        rows = size[0] // saved_world  # (saved_world: the saved totals' blocks, >= 1)
        saved = [rows, *size[1:]] if rows * saved_world == size[0] else None
        if saved == list(block.shape):
            return
        shown = f"{saved} per rank (saved at world size {saved_world})" if saved else f"{list(size)} over {saved_world} ranks"
        raise ValueError(f"{self._checkpoint}: KV-ZCH table '{table.name}' was saved with a '{name}' of "
                         f"{shown}, this model's is {list(block.shape)} per rank: load it into a table "
                         "with the admission sketch (and default row) it was saved with")
