"""One table shard, with no TorchRec in it: the id map (native op + torch twin), the row layout
and id-seeded initializer, eviction, snapshots, the row store, the KV tensor over it, and
``TableTBE``, which binds fbgemm's TBE to the store's rows."""

from torchrec_kvzch.table.rank_budget import SharedBudget
from torchrec_kvzch.table.id_map import IdMap
from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowLayout, RowPart
from torchrec_kvzch.table.native import native_status
from torchrec_kvzch.table.row_store import RowStore
from torchrec_kvzch.table.tbe import TableTBE

__all__ = ["IdMap", "KVTensor", "RowLayout", "RowPart", "RowStore", "SharedBudget", "TableTBE",
           "native_status"]
