"""The record a checkpoint keeps of its KV-ZCH tables, beside their rows: each table's geometry,
optimizer and rows per saving rank, the checksum side files (``integrity.py``), the
checkpoint's unique id and, for an incremental checkpoint (a delta), its base's step and id. It
is plain Python data (dicts, lists, str, int, bool) under one key of DCP's ``planner_data``
(beside DCP's own flattening mappings), so that the ``.metadata`` file unpickles with torch
alone."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchrec_kvzch.params import KVZCHTableParams

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
    deleted: tuple[int, ...] | None = None  # a delta's: ids deleted since its base, per rank

    @classmethod
    def of(cls, params: KVZCHTableParams, rows: list[int], deleted: list[int] | None = None) -> "SavedTable":
        return cls(params.name, tuple(rows), params.num_embeddings, params.total_num_buckets,
                   params.embedding_dim, params.weight_dtype, params.optimizer.value,
                   params.backend_return_whole_row, None if deleted is None else tuple(deleted))

    def params(self, current: KVZCHTableParams) -> KVZCHTableParams:
        """The saved table's parameters (for its bucket split and row layout)."""
        return dataclasses.replace(current, num_embeddings=self.num_embeddings,
                                   total_num_buckets=self.total_num_buckets,
                                   optimizer=self.optimizer)

    def to_plain(self, row_width: int) -> dict:
        """The record as plain data (what ``.metadata`` stores); ``row_width`` is informative."""
        out = {"name": self.name, "rows_per_rank": list(self.rows),
               "num_embeddings": self.num_embeddings, "total_num_buckets": self.total_num_buckets,
               "embedding_dim": self.embedding_dim, "weight_dtype": self.weight_dtype,
               "optimizer": self.optimizer, "layout": "whole_row" if self.whole_row else "split",
               "row_width": row_width}
        if self.deleted is not None:
            out["deleted_per_rank"] = list(self.deleted)
        return out

    @classmethod
    def from_plain(cls, d: dict) -> "SavedTable":
        deleted = d.get("deleted_per_rank")
        return cls(d["name"], tuple(d["rows_per_rank"]), d["num_embeddings"], d["total_num_buckets"],
                   d["embedding_dim"], d["weight_dtype"], d["optimizer"], d["layout"] == "whole_row",
                   None if deleted is None else tuple(deleted))


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


def chain_link(planner_data) -> tuple[str | None, dict | None]:
    """(this checkpoint's unique id, its base if it is a delta: ``{"step": int, "uid": str,
    "decays": {table: [count decays since the base, per saving rank]}}``) of a checkpoint's
    metadata; (None, None) for checkpoints saved before either was recorded."""
    record = planner_data.get(PLANNER_DATA_KEY) if isinstance(planner_data, dict) else None
    if not isinstance(record, dict):
        return None, None
    return record.get("uid"), record.get("base")
