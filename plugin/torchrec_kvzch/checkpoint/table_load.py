"""One table shard's part in a streamed load: which saved rows are its own, and how the
parts of a saved chunk come together before they enter the store (through the KV tensor)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from torchrec_kvzch.params import KVZCHTableParams
from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowLayout, RowPart, decayed
from torchrec_kvzch.torchrec.admission_state import merge
from torchrec_kvzch.torchrec.state_dict import newest_timestamp


class TableLoad:
    """One table shard's load: its slice ``[begin, end)`` of the saved rows, the entries that
    stream into it, and (split layout) each chunk's parts until all of them have arrived."""

    def __init__(self, store, base: str, saved: KVZCHTableParams, layout: RowLayout,
                 optimizer: bool, upstream: bool = False) -> None:
        self.store, self.base, self.saved, self.optimizer = store, base, saved, optimizer
        self.name = store.params.name
        self.split = not store.params.backend_return_whole_row
        self.upstream = upstream  # saved by upstream TorchRec: no history, clock from headers
        self.layout = layout  # the saved rows' layout
        self.begin = self.end = 0
        self.parts: dict[str, RowPart] = {}  # fqn -> the part its rows are
        self.columns: dict[str, tuple[int, int] | None] = {}  # fqn -> (first, count) of its part, or all
        self.dtypes: dict[str, torch.dtype] = {}  # fqn -> saved dtype
        self.skipped: list[str] = []  # entries read for nothing (still verified)
        self.pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # split chunks, by fqn
        self.history: dict[str, torch.Tensor] = {}  # clock / counters fqn -> read in full here
        self.arrived: Counter = Counter()  # clock / counters / admission fqn -> rows arrived
        self.admission_live: dict[str, torch.Tensor] = {}  # admission entry -> this shard's block
        self.admission_saved: dict[str, torch.Tensor] = {}  # fqn -> whole saved entry, to merge
        self.deleted_fqn: str | None = None  # a delta's ids deleted since its base
        self.deleted_range = (0, 0)  # this rank's slice of them
        empty = torch.empty(0, dtype=torch.long)
        self._loaders = {part: KVTensor(store, part, ids=empty) for part in RowPart if part is not RowPart.ID}

    def receive_history(self, fqn: str, rows: int) -> None:
        """Rows of the clock or counters arrived (into ``history[fqn]``); once both are
        complete, they go into the store."""
        self.arrived[fqn] += rows
        if all(self.arrived[f] == len(t) for f, t in self.history.items()):
            clock, counters = (self.history[self.base + n] for n in ("clock", "counters"))
            self.store.restore_history(int(clock[0]), counters, self.saved.bucket_size)

    def receive_admission(self, fqn: str, rows: int) -> None:
        """Rows of a whole saved admission entry arrived; once all are complete, they are
        merged into this shard's admission state (saved at another world size)."""
        self.arrived[fqn] += rows
        if all(self.arrived[f] == len(t) for f, t in self.admission_saved.items()):
            merge(self.admission_live, {f[len(self.base):]: t for f, t in self.admission_saved.items()},
                  self.name)

    def replay_decays(self, decays: list[list[float]]) -> None:
        """A delta's count decays, per saving rank: the rows of each rank's ids decay as they
        did there (before the delta's rows, which carry their counts, arrive)."""
        store, mine = self.store, self.store.bucket_range
        keys = store.keys()
        for rank, factors in enumerate(decays):
            theirs = self.saved.bucket_range(rank, len(decays))
            if not factors or not keys.numel() or not overlaps(theirs, mine):
                continue
            slots = torch.nonzero((keys >= theirs.id_start) & (keys < theirs.id_end)).view(-1)
            meta = store.read(slots, RowPart.META).reshape(-1)
            for factor in factors:
                meta = decayed(meta, factor, scores=store.evictor.scored)
            store.write(slots, meta.unsqueeze(1), RowPart.META)

    def receive_deleted(self, ids: torch.Tensor) -> None:
        """A delta's deleted ids arrived: the rows of those in this shard go. (They are never
        among the delta's rows, so the order of the two does not matter.)"""
        ids, r = ids.reshape(-1), self.store.bucket_range
        ids = ids[(ids >= r.id_start) & (ids < r.id_end)]
        if ids.numel():
            self.store.delete(ids)

    def receive(self, fqn: str, key: tuple[int, int], tensor: torch.Tensor) -> None:
        """Saved rows ``key = (first row, rows)`` of entry ``fqn`` arrived."""
        if not self.split:
            self._loaders[RowPart.ROW].load(tensor, layout=self.layout, optimizer=self.optimizer)
            if self.upstream:
                self._advance_clock(self.layout.unpack(tensor)[1])
            return
        chunk = self.pending.setdefault(key, {})
        chunk[fqn] = tensor
        if len(chunk) == len(self.parts):
            self._apply(self.pending.pop(key))

    def _apply(self, entries: dict[str, torch.Tensor]) -> None:
        """A saved chunk whose every entry arrived: its parts enter the store (an optimizer's
        named states put together into its rows' state first)."""
        chunk: dict[RowPart, torch.Tensor] = {}
        for fqn, tensor in entries.items():
            part, columns = self.parts[fqn], self.columns.get(fqn)
            if columns is None:
                chunk[part] = tensor.reshape(tensor.shape[0], -1)
                continue
            if part not in chunk:
                chunk[part] = tensor.new_zeros(tensor.shape[0], self.store.layout.width(part))
            chunk[part][:, columns[0]:columns[0] + columns[1]] = tensor.reshape(tensor.shape[0], -1)
        ids = chunk[RowPart.ID].reshape(-1)
        for part in (RowPart.WEIGHT, RowPart.META, RowPart.OPTIMIZER):  # weights create the rows
            if part in chunk:
                self._loaders[part].load(chunk[part], ids)
        if self.upstream and RowPart.META in chunk:
            self._advance_clock(chunk[RowPart.META].reshape(-1))

    def _advance_clock(self, meta: torch.Tensor) -> None:
        self.store.clock = max(self.store.clock, newest_timestamp(meta))


class RowSink:
    """The destination of a streamed load as DCP sees it: saved rows ``[begin, end)`` of a
    tensor of ``size`` (DCP's ``_Checkpointable`` protocol, as DTensor uses). The rows arrive
    chunk by chunk through ``commit_tensor``; nothing is allocated for the range."""

    def __init__(self, size: torch.Size, begin: int, end: int) -> None:
        self._size, self.begin, self.end = torch.Size(size), begin, end

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        if self.end == self.begin:
            return []
        rest = list(self._size[1:])
        return [ChunkStorageMetadata(offsets=torch.Size([self.begin] + [0] * len(rest)),
                                     sizes=torch.Size([self.end - self.begin] + rest))]


def overlaps(a, b) -> bool:
    """Whether two bucket ranges (of possibly different bucket sizes) share an id."""
    return a.id_start < b.id_end and b.id_start < a.id_end
