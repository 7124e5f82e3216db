"""A tensor-like view over one shard's rows, for checkpoints.

``KVTensor`` has shape ``[n, width]`` where row ``i`` is the row at position ``i`` of a
``RowSnapshot`` (bucket-sorted ids; ``table/snapshot.py``). Nothing is materialised until asked:
``narrow(0, start, length)`` reads one chunk, so a checkpoint can stream a table of any size. A
row deleted after the snapshot reads as zeros (used bit 0 in a whole row) and is skipped when
loaded back, unless the snapshot is frozen, in which case it reads as it was at the freeze.

It offers the method set of fbgemm's ``KVTensorWrapper`` with its semantics (``set_range``
writes the rows of ids ``[start, start + length)``, ``get_weights_by_ids`` reads rows of given
ids) and works wrapped in fbgemm's ``PartiallyMaterializedTensor(kv, is_virtual=True)``, which
is how TorchRec carries such views through ``state_dict`` and DCP. With ``read_only=True`` every
write is a no-op (logged once): that is how optimizer state is exposed when whole rows already
carry it.
"""

from __future__ import annotations

import logging

import torch

from torchrec_kvzch.table.layout import RowLayout, RowPart
from torchrec_kvzch.table.row_store import RowStore
from torchrec_kvzch.table.snapshot import RowSnapshot

logger = logging.getLogger(__name__)


class KVTensor:
    def __init__(
        self,
        store: RowStore,
        part: RowPart | str = RowPart.WEIGHT,
        ids: torch.Tensor | None = None,
        read_only: bool = False,
        *,
        snapshot: RowSnapshot | None = None,
        start: int = 0,
        length: int | None = None,
        columns: tuple[int, int] | None = None,
    ) -> None:
        """``ids``: the rows to expose, ascending; default, the store's live ids. Or
        ``snapshot``: positions ``[start, start + length)`` of that snapshot (several views may
        share one). An ``RowPart.ID`` view (the ids themselves) is always read-only.
        ``columns``: (first, count) of the part's columns alone - one named state of an
        optimizer that keeps several (Adam's ``momentum1`` and ``momentum2``)."""
        self.store = store
        self.part = RowPart(part)
        self.columns = columns
        self.snapshot = snapshot if snapshot is not None else RowSnapshot(store, ids)  # (an empty one is falsy)
        self.start = start
        self.length = len(self.snapshot) - start if length is None else length
        self.read_only = read_only or self.part is RowPart.ID
        self._warned = False

    @property
    def ids(self) -> torch.Tensor:
        return self.snapshot.ids[self.start : self.start + self.length]

    # -- tensor-like metadata -----------------------------------------------------------------
    @property
    def shape(self) -> list[int]:
        return [self.length, self.columns[1] if self.columns else self.store.layout.width(self.part)]

    def size(self, dim: int | None = None):
        return torch.Size(self.shape) if dim is None else self.shape[dim]

    @property
    def width_offset(self) -> int:
        """Column of the whole row where this view starts (0 for whole rows)."""
        layout = self.store.layout
        first = self.columns[0] * 4 // layout.itemsize if self.columns else 0  # (fp32 state columns)
        return layout.width_offset(self.part) + first

    @property
    def dtype(self) -> torch.dtype:
        return self.store.layout.part_dtype(self.part)

    @property
    def dtype_str(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def device_str(self) -> str:
        return str(self.store.device)

    @property
    def layout_str(self) -> str:
        return "Strided"

    def get_kvtensor_serializable_metadata(self) -> list[str]:
        p = self.store.params
        return [p.name, self.part.value, str(self.shape[0]), str(self.shape[1]),
                str(self.width_offset), self.dtype_str, str(int(self.read_only))]

    def __repr__(self) -> str:
        ro = ", read_only" if self.read_only else ""
        return f"KVTensor({self.store.params.name}.{self.part.value}, shape={self.shape}{ro})"

    # -- reads --------------------------------------------------------------------------------
    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Materialise rows ``[start, start + length)`` of the view."""
        self._check_slice(dim, start, length)
        return self._narrowed(self.snapshot.read(self.start + start, length, self.part))

    def read_into(self, out: torch.Tensor) -> torch.Tensor:
        """Materialise the whole view into ``out`` (contiguous, ``shape`` and ``dtype``): a save
        reuses buffers rather than a fresh tensor per chunk (``checkpoint/buffers.py``)."""
        if list(out.shape) != self.shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"{self}: read_into needs a contiguous {self.shape} {self.dtype} tensor, "
                             f"got {list(out.shape)} {out.dtype}")
        if self.columns:
            return out.copy_(self.full_tensor())
        return self.snapshot.read(self.start, self.shape[0], self.part, out)

    def slice(self, start: int, length: int) -> "KVTensor":
        """The view of rows ``[start, start + length)``, still unmaterialised."""
        self._check_slice(0, start, length)
        return KVTensor(self.store, self.part, read_only=self.read_only, snapshot=self.snapshot,
                        start=self.start + start, length=length, columns=self.columns)

    def full_tensor(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])

    def get_weights_by_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of global ``ids`` as this view's part, ``[len(ids), width]``, read from the live
        store like fbgemm's DRAM wrapper (an absent id reads as zeros; as a whole row: key = id,
        used bit 0). Any id of the table may be asked for, not only the snapshot's."""
        return self._narrowed(self.store.read_ids(ids, self.part))

    # -- writes (no-ops when read_only) --------------------------------------------------------
    def set_range(self, dim: int, start: int, length: int, values: torch.Tensor) -> None:
        """fbgemm's ``KVTensorWrapper.set_range``: write the rows of global ids
        ``[start, start + length)``, creating absent ones (a store keys rows by global id, as
        fbgemm's backend does once its ``row_offset`` is added). Whole rows follow fbgemm's
        whole-row backend instead: ``start`` is a position in this view, and each row's header
        key is replaced by the id at its position before the row is written by that key."""
        if self._skip_write("set_range"):
            return
        if dim != 0:
            raise ValueError(f"{self}: set_range writes along dim 0 only, got dim={dim}")
        if length < 0:
            raise ValueError(f"{self}: set_range needs length >= 0, got {length}")
        if self.part is not RowPart.ROW:
            self._write_ids(torch.arange(start, start + length, dtype=torch.long, device=self.store.device), values)
            return
        self._check_slice(dim, start, length)
        width, dtype = self.shape[1], self.dtype
        if values.dim() != 2 or list(values.shape) != [length, width] or values.dtype != dtype:
            raise ValueError(f"{self}: set_range of {length} whole rows needs a [{length}, {width}] "
                             f"{dtype} tensor, got {list(values.shape)} {values.dtype}")
        rows = values.to(self.store.device).clone(memory_format=torch.contiguous_format)
        rows.view(torch.long)[:, 0] = self.ids[start : start + length]
        self.store.write_rows(rows)

    def set_weights_and_ids(self, weights: torch.Tensor, ids: torch.Tensor) -> None:
        """Write rows for ``ids`` (whole rows: by header id; ``ids`` must match when given)."""
        if self._skip_write("set_weights_and_ids"):
            return
        if self.part is RowPart.ROW:
            self.store.write_rows(weights)
        else:
            self._write_ids(ids, weights)

    # -- loading checkpoints ------------------------------------------------------------------
    def load(self, values: torch.Tensor, ids: torch.Tensor | None = None,
             layout: RowLayout | None = None, optimizer: bool = True, strict: bool = False) -> int:
        """Write rows loaded from a checkpoint into the store, keeping those of this shard's
        buckets (a checkpoint's rows come from every saved shard) - the one way loaded rows
        enter a store. Whole rows go by their header ids (``layout``: theirs, when saved with
        another optimizer; ``optimizer=False``: weights and headers only; see
        ``RowStore.write_rows``), other parts by ``ids``. Ids outside the table are refused
        before anything is written; with ``strict`` so are ids outside this shard (a state
        dict of this very shard, where a foreign id means the geometry differs). Returns the
        rows written. Ignores ``read_only``: this is how a load fills the rows such views
        stand for."""
        if self.part is RowPart.ROW:
            ids = (layout or self.store.layout).header(values)[0]
        elif ids is None:
            raise ValueError(f"{self}: loading {self.part.value} values needs their ids")
        ids = ids.reshape(-1)
        table = self.store.params
        if ids.numel() and (int(ids.max()) >= table.num_embeddings or int(ids.min()) < 0):
            bad = ids[(ids < 0) | (ids >= table.num_embeddings)][0]
            raise ValueError(f"KV-ZCH table '{table.name}': the checkpoint holds id {int(bad)}, "
                             f"outside this table's [0, {table.num_embeddings}); load it into a "
                             "table whose num_embeddings holds every saved id")
        r = self.store.bucket_range
        mine = (ids >= r.id_start) & (ids < r.id_end)
        if not bool(mine.all()):
            if strict:
                raise ValueError(f"KV-ZCH table '{table.name}': the rows to load hold id "
                                 f"{int(ids[~mine][0])}, outside this shard's ids [{r.id_start}, "
                                 f"{r.id_end}); load rows of another geometry through DCP "
                                 "(KVZCHLoadPlanner), which places them by id")
            values, ids = values[mine], ids[mine]
        if self.part is RowPart.ROW:
            return self.store.write_rows(values, layout, optimizer)
        self._write_ids(ids, values)
        return ids.numel()

    # -- internals ----------------------------------------------------------------------------
    def _narrowed(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.columns:
            return rows
        first, count = self.columns
        return rows[:, first:first + count].contiguous()

    def _write_ids(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` as this view's columns of the rows of ``ids`` (the part's other
        columns kept)."""
        if self.columns:
            first, count = self.columns
            whole = self.store.read_ids(ids, self.part).clone()
            whole[:, first:first + count] = values.reshape(ids.numel(), count).to(whole)
            values = whole
        self.store.write_ids(ids, values, self.part)

    def _skip_write(self, what: str) -> bool:
        if self.read_only and not self._warned:
            logger.info("%s: %s ignored (read-only view)", self, what)
            self._warned = True
        return self.read_only

    def _check_slice(self, dim: int, start: int, length: int) -> None:
        if dim != 0:
            raise ValueError(f"{self}: only dim 0 can be narrowed, got dim={dim}")
        if start < 0 or length < 0 or start + length > self.shape[0]:
            raise IndexError(f"{self}: rows [{start}, {start + length}) out of [0, {self.shape[0]})")
