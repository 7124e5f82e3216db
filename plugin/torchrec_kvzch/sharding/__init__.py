"""TorchRec integration: kernels, the sharding extension chain, table configs, the planner."""

from torchrec_kvzch.sharding.declarations import KVZCH_KERNEL, VIRTUAL_KERNELS, table_params
from torchrec_kvzch.sharding.kernels import KVZCHEmbeddingKernel
from torchrec_kvzch.sharding.modules import (
    KVZCHEmbeddingBagCollectionSharder,
    KVZCHEmbeddingCollectionSharder,
    KVZCHParameterSharding,
    kvzch_sharders,
)
from torchrec_kvzch.sharding.planner import KVZCHConstraints, KVZCHShardingPlanner
from torchrec_kvzch.sharding.tables import (
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
