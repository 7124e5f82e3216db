"""TorchRec glue: table declarations, the sharders and sharded modules, the embedding kernel
TorchRec groups tables into, the planner, state-dict hooks and the YAML sharding config."""

from torchrec_kvzch.torchrec.declarations import KVZCH_KERNEL, VIRTUAL_KERNELS, table_params
from torchrec_kvzch.torchrec.embedding_kernel import KVZCHEmbeddingKernel
from torchrec_kvzch.torchrec.modules import (
    KVZCHEmbeddingBagCollectionSharder,
    KVZCHEmbeddingCollectionSharder,
    KVZCHParameterSharding,
    kvzch_sharders,
)
from torchrec_kvzch.torchrec.planner import KVZCHConstraints, KVZCHShardingPlanner
from torchrec_kvzch.torchrec.tables import (
    kvzch_embedding_bag_config,
    kvzch_embedding_config,
    kvzch_tables,
)

__all__ = [
    "KVZCH_KERNEL",
    "KVZCHConstraints",
    "KVZCHShardingPlanner",
    "KVZCHEmbeddingBagCollectionSharder",
    "KVZCHEmbeddingCollectionSharder",
    "KVZCHEmbeddingKernel",
    "VIRTUAL_KERNELS",
    "KVZCHParameterSharding",
    "kvzch_embedding_bag_config",
    "kvzch_embedding_config",
    "kvzch_sharders",
    "kvzch_tables",
    "table_params",
]
