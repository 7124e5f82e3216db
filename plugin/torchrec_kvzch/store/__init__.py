"""The DRAM row store: id map (native op + torch twin), row layout, id-seeded initializer."""

from torchrec_kvzch.store.id_map import IdMap
from torchrec_kvzch.store.layout import RowLayout, RowPart
from torchrec_kvzch.store.row_store import RowStore

__all__ = ["IdMap", "RowLayout", "RowPart", "RowStore"]
