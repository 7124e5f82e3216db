"""torchrec-kvzch: KV-ZCH (key-value, zero-collision hashing) embedding tables for TorchRec."""

from torchrec_kvzch.kv_tensor import KVTensor, RowPart
from torchrec_kvzch.params import (
    BucketRange,
    EvictionPolicy,
    KVZCHTableParams,
    OptimizerKind,
    RankBudget,
)
from torchrec_kvzch.store import IdMap, RowLayout, RowStore
from torchrec_kvzch.store.eviction import SharedBudget
from torchrec_kvzch.store.id_map import native_status

__all__ = [
    "BucketRange",
    "EvictionPolicy",
    "IdMap",
    "KVTensor",
    "KVZCHTableParams",
    "OptimizerKind",
    "RankBudget",
    "RowLayout",
    "RowPart",
    "RowStore",
    "SharedBudget",
    "native_status",
]
