"""Rows a KV-ZCH table holds before sharding, loaded into its stores when it is sharded.

A collection built on a real device has a dense weight per table: set by the user (pretrained
rows) or only initialised by TorchRec. TorchRec copies an ordinary table's weight into its shards
(on CUDA; on CPU only for EmbeddingCollection); a KV-ZCH table has no dense shard, so its
sharders used to drop the weight, and the table trained on id-seeded rows instead. Now row ``i``
of the weight becomes the row of id ``i``: each rank writes the rows of its own buckets, with
fresh optimizer state. Set and merely initialised weights cannot be told apart reliably, so
every materialised weight is loaded; a collection built on the meta device has none, and its
rows are created id-seeded on first use, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from torch import nn

from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowPart
from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.torchrec.tables import kvzch_tables


def dense_weights(tables: nn.ModuleDict, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The materialised (not meta) weights of the tables ``names`` of an unsharded collection
    (its ``embedding_bags`` or ``embeddings``)."""
    out = {}
    for name in names:
        weight = tables[name].weight
        if weight.device.type != "meta":
            out[name] = weight.detach()
    return out


def load_rows(tables: Iterable[tuple[str, TableTBE]], weights: dict[str, torch.Tensor]) -> None:
    """Writes row ``i`` of each table's weight as the row of id ``i``, for the ids of this
    shard only, ``checkpoint_chunk_rows`` rows at a time (as a load: no counter changes)."""
    for name, tbe in tables:
        weight = weights.get(name)
        if weight is None:
            continue
        store, params = tbe.store, tbe.params
        if tuple(weight.shape) != (params.num_embeddings, params.embedding_dim):
            raise ValueError(f"KV-ZCH table '{name}': its weight before sharding is "
                             f"{list(weight.shape)}, the table {params.num_embeddings} x "
                             f"{params.embedding_dim}; build the collection from the same config")
        r, step = store.bucket_range, params.checkpoint_chunk_rows
        with torch.no_grad():
            for start in range(r.id_start, r.id_end, step):
                ids = torch.arange(start, min(start + step, r.id_end), device=store.device)
                rows = weight[start:start + ids.numel()].to(store.device, params.dtype)
                KVTensor(store, RowPart.WEIGHT, ids=ids[:0]).load(rows, ids, strict=True)


def sharded_with_rows(module: nn.Module, attr: str, names: list[str],
                      build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` (the sharded module of ``module``), with the materialised weights of its
    KV-ZCH tables ``names`` loaded into their stores; ``attr``: where ``module`` keeps its
    tables (``embedding_bags`` / ``embeddings``)."""
    weights = dense_weights(getattr(module, attr), names)
    sharded = build()
    load_rows(kvzch_tables(sharded), weights)
    return sharded


def without_kvzch_weights(state_dict, keys: set[str]):
    """``state_dict`` less ``keys`` (its ``_metadata`` kept): what a sharded module copies
    from the unsharded one while it is built (TorchRec's EmbeddingCollection always, its
    EmbeddingBagCollection on CUDA), where a KV-ZCH weight has no place (``load_rows`` loads
    it); the copy was strict for an EmbeddingCollection, which then failed on the key."""
    kept = OrderedDict((k, v) for k, v in state_dict.items() if k not in keys)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        kept._metadata = metadata
    return kept
