"""Loading a state dict's KV-ZCH entries in place: ``model.load_state_dict`` of materialised
entries (``torch.load``), upstream TorchRec's, or another model's, at the same world size (DCP
loads at any, ``checkpoint/``). Each function checks everything it can without reading rows and
returns the load to run, so that a load of several tables changes none when one is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowPart
from torchrec_kvzch.torchrec.state_dict import local_chunks, newest_timestamp, read_chunk


def materialised_load(view: KVTensor, entries: dict) -> Callable[[], None]:
    """The load that replaces the rows and history of ``view``'s store with the entries of one table from a
    state dict of this same shard (same world size and buckets): materialised tensors (e.g.
    ``torch.save`` / ``torch.load``), another model's lazy entries, or upstream TorchRec's
    (``weight``, ``weight_id``, ``bucket``, optionally ``metadata``; it has no ``clock`` or
    ``counters``: counters start at zero and the clock at the newest saved header timestamp,
    as a DCP load of an upstream checkpoint does).

    Rows are read and written one local chunk at a time. Everything checkable without reading
    rows is checked here, before the load is returned: entries present, this shard's buckets, widths
    and dtypes, and (from ``weight_id``, held in memory) that every id belongs to this shard."""
    store = view.store
    name, r, layout = store.params.name, store.bucket_range, store.layout
    if entries.keys() == {"weight"}:
        return _dense_load(store, entries["weight"])
    whole = view.part is RowPart.ROW
    upstream = "clock" not in entries and "counters" not in entries
    if upstream:
        needed = ("weight", "bucket") + (() if whole else ("weight_id",))
    else:
        needed = ("weight", "clock", "counters") + (() if whole else ("weight_id", "metaheader"))
    missing = [k for k in needed if k not in entries]
    if missing:
        kind = "an upstream TorchRec state dict (no clock or counters) " if upstream else ""
        raise ValueError(f"KV-ZCH table '{name}': {kind}lacks its {missing} entries; load a whole "
                         "state dict of this table")
    history = _local_buckets(entries["bucket" if upstream else "counters"], store, name)
    parts = {"weight": view.part}
    if not whole:
        parts["weight_id"] = RowPart.ID
        meta = "metadata" if upstream else "metaheader"
        if meta in entries:
            parts[meta] = RowPart.META
    chunks = {k: local_chunks(entries[k]) for k in parts}
    for _, tensor in chunks["weight"]:
        width, dtype = layout.width(view.part), layout.part_dtype(view.part)
        if len(tensor.shape) != 2 or tensor.shape[1] != width or tensor.dtype != dtype:
            raise ValueError(f"KV-ZCH table '{name}': its weight entry has chunks of "
                             f"{list(tensor.shape)} {tensor.dtype}, this table's rows are [n, {width}] "
                             f"{dtype}: saved with another embedding_dim, optimizer, weight_dtype or "
                             "backend_return_whole_row? Load it into a table of the same shape")
    if "weight_id" in entries:
        for _, chunk in local_chunks(entries["weight_id"]):
            ids = read_chunk(chunk)
            outside = (ids < r.id_start) | (ids >= r.id_end)
            if bool(outside.any()):
                raise ValueError(f"KV-ZCH table '{name}': the state dict holds id {int(ids[outside][0])}, "
                                 f"outside this shard's ids [{r.id_start}, {r.id_end}); it is another "
                                 "shard's: load through DCP (KVZCHLoadPlanner), which places rows by id")
    if upstream:
        counters, clock = torch.zeros(store.params.total_num_buckets, 2, dtype=torch.long), 0
    else:
        counters, clock = history, int(entries["clock"][0])

    def load() -> None:
        newest = clock
        store.clear()
        if upstream:  # rows created without header words are stamped with the clock: 0, not the old one
            store.restore_history(0, counters, store.params.bucket_size)
        for chunk in _aligned(chunks):
            if whole:
                rows = chunk["weight"]
                view.load(rows, strict=True)
                if upstream:
                    newest = max(newest, newest_timestamp(layout.unpack(rows)[1]))
                continue
            ids = chunk["weight_id"].reshape(-1)
            KVTensor(store, view.part, ids=ids[:0]).load(chunk["weight"], ids, strict=True)
            if "metadata" in chunk or "metaheader" in chunk:
                meta = chunk.get("metadata", chunk.get("metaheader"))
                KVTensor(store, RowPart.META, ids=ids[:0]).load(meta.reshape(-1, 1), ids, strict=True)
                if upstream:
                    newest = max(newest, newest_timestamp(meta.reshape(-1)))
        store.restore_history(newest, counters, store.params.bucket_size)
    return load


def _dense_load(store, weight) -> Callable[[], None]:
    """The load of a dense table's weights (a ``weight`` without ids, e.g. TorchRec's own FUSED table
    of the same config): row ``i`` of the table is id ``i``. Its local shards must cover exactly
    this shard's ids, so that every id gets its row; the store then holds those rows, with
    fresh optimizer state and counters, its clock kept."""
    name, r, dim = store.params.name, store.bucket_range, store.params.embedding_dim
    chunks = local_chunks(weight)
    spans = [((offset or 0), (offset or 0) + chunk.shape[0]) for offset, chunk in chunks]
    covered = all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans \
        and spans[0][0] == r.id_start and spans[-1][1] == r.id_end
    if not covered:
        raise ValueError(f"KV-ZCH table '{name}': the state dict's weight holds no ids, so it is read as "
                         f"a dense table's rows {spans}, which do not cover exactly this shard's ids "
                         f"[{r.id_start}, {r.id_end}); load a state dict sharded like this table, or "
                         "one with its weight_id entry")
    for _, chunk in chunks:
        if len(chunk.shape) != 2 or chunk.shape[1] != dim:
            raise ValueError(f"KV-ZCH table '{name}': the dense weight has rows of {list(chunk.shape)[1:]}, "
                             f"this table's weights are [{dim}]; load a table of the same embedding_dim")

    def load() -> None:
        clock = store.clock
        store.clear()
        for (start, end), (_, chunk) in zip(spans, chunks):
            ids = torch.arange(start, end, device=store.device)
            KVTensor(store, RowPart.WEIGHT, ids=ids[:0]).load(read_chunk(chunk).to(store.params.dtype), ids, strict=True)
        store.restore_history(clock, torch.zeros(store.params.total_num_buckets, 2, dtype=torch.long),
                              store.params.bucket_size)
    return load


def _local_buckets(entry, store, name: str) -> torch.Tensor:
    """A per-bucket entry's values ``[total_num_buckets, k]``, checked to hold exactly this
    shard's buckets (else the state dict is another shard's or another geometry's)."""
    r = store.bucket_range
    local = entry.local_shards() if isinstance(entry, ShardedTensor) else []
    if len(local) != 1 or local[0].metadata.shard_offsets[0] != r.start \
            or local[0].tensor.shape[0] != r.num_buckets:
        raise ValueError(f"KV-ZCH table '{name}': the state dict's per-bucket entries do not hold "
                         f"this rank's buckets [{r.start}, {r.end}); load through DCP "
                         "(KVZCHLoadPlanner), which loads at any world size")
    values = local[0].tensor.reshape(r.num_buckets, -1)
    out = torch.zeros(store.params.total_num_buckets, values.shape[1], dtype=torch.long)
    out[r.start : r.end] = values
    return out


def _aligned(chunks: dict[str, list]) -> Iterator[dict[str, torch.Tensor]]:
    """The entries' chunks side by side, read one chunk at a time where all entries are cut at
    the same rows (as ours are); otherwise each entry's chunks are concatenated (read at once)."""
    offsets = {k: [o for o, _ in c] for k, c in chunks.items()}
    if len({tuple(o) for o in offsets.values()}) == 1:
        n = len(next(iter(offsets.values())))
        for i in range(n):
            yield {k: read_chunk(c[i][1]) for k, c in chunks.items()}
        return
    yield {k: torch.cat([read_chunk(t) for _, t in c]) if c else torch.empty(0) for k, c in chunks.items()}
