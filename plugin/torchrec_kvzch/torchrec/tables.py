"""KV-ZCH parameters -> TorchRec table configs, and finding KV-ZCH tables in a sharded model.

A KV-ZCH table is declared to TorchRec as a virtual table (``use_virtual_table=True``) with
``total_num_buckets``: that makes TorchRec's planner split its rows at bucket boundaries and its
row-wise input distribution route each id to the rank owning the id's bucket. Build such
modules on the meta device: the virtual size (2^40 rows) must never be materialised (a small
table's materialised weight becomes its rows when sharded: ``pretrained.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType

from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.params import KVZCHTableParams
from torchrec_kvzch.torchrec.embedding_kernel import KVZCHEmbeddingKernel


def kvzch_embedding_bag_config(params: KVZCHTableParams, feature_names: Sequence[str],
                               pooling: PoolingType = PoolingType.SUM) -> EmbeddingBagConfig:
    """The EmbeddingBagConfig (pooled) of a KV-ZCH table."""
    return EmbeddingBagConfig(**_common(params, feature_names), pooling=pooling)


def kvzch_embedding_config(params: KVZCHTableParams, feature_names: Sequence[str]) -> EmbeddingConfig:
    """The EmbeddingConfig (sequence) of a KV-ZCH table."""
    return EmbeddingConfig(**_common(params, feature_names))


def _common(params: KVZCHTableParams, feature_names: Sequence[str]) -> dict:
    if not feature_names:
        raise ValueError(f"KV-ZCH table '{params.name}': give at least one feature name")
    return dict(name=params.name, embedding_dim=params.embedding_dim,
                num_embeddings=params.num_embeddings, feature_names=list(feature_names),
                total_num_buckets=params.total_num_buckets, use_virtual_table=True,
                data_type=DataType.FP16 if params.weight_dtype == "fp16" else DataType.FP32,
                weight_init_min=params.init_range[0], weight_init_max=params.init_range[1])


def kvzch_kernels(model: nn.Module) -> Iterator[KVZCHEmbeddingKernel]:
    """The KV-ZCH kernels (one per group of tables) on this rank of a sharded model."""
    for module in model.modules():
        for lookup in getattr(module, "_lookups", ()):
            for emb in getattr(lookup, "_emb_modules", ()):
                if isinstance(emb, KVZCHEmbeddingKernel):
                    yield emb


def kvzch_tables(model: nn.Module) -> Iterator[tuple[str, TableTBE]]:
    """(table name, TableTBE) for every KV-ZCH table shard held by this rank of a sharded model;
    ``tbe.store`` is the table's row store."""
    for emb in kvzch_kernels(model):
        yield from emb.tables.items()
