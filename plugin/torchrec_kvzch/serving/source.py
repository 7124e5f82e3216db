"""A checkpoint directory read for serving: no process group, no model, one chunk at a time.

``CheckpointManager`` writes a folder per step, full checkpoints and deltas chained to them
(``checkpoint/manager.py``). Serving reads them outside any training job: ``Link`` is one
step's folder, and ``Link.rows`` streams a KV-ZCH table's saved rows whose ids lie in a range
(a replica's buckets) as ``(ids, weights)``, a chunk at a time, reading only the chunks of
the saving ranks whose buckets overlap that range, each chunk's ids before its rows (rows
without an id in range are not read). Every chunk read is checked against the checksum recorded
at save, on the bytes as read (no second pass), and every file the build will read is checked
to exist and be complete before the first byte is used.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from torchrec_kvzch.checkpoint.files import SavedFiles
from torchrec_kvzch.checkpoint.integrity import check_files, checksum, item_key, read_saved, recorded_checksums
from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.checkpoint.record import SavedTable, chain_link, saved_record
from torchrec_kvzch.params import KVZCHTableParams
from torchrec_kvzch.table.layout import RowLayout
from torchrec_kvzch.torchrec.admission_state import DEFAULT_WEIGHT, SKETCH
from torchrec_kvzch.torchrec.delta import DELETED


@dataclasses.dataclass(frozen=True)
class SavedKVTable:
    """A KV-ZCH table as one checkpoint saved it: ``base`` is its entries' key prefix
    (``<base>weight``, ``<base>weight_id``, ...)."""

    base: str
    saved: SavedTable

    @functools.cached_property
    def params(self) -> KVZCHTableParams:
        """Enough of the table's parameters for its bucket split and row layout."""
        s = self.saved
        return KVZCHTableParams(s.name, s.embedding_dim, num_embeddings=s.num_embeddings,
                                total_num_buckets=s.total_num_buckets, optimizer=s.optimizer,
                                weight_dtype=s.weight_dtype, enable_optimizer_offloading=s.whole_row,
                                backend_return_whole_row=s.whole_row)

    def rank_ids(self) -> list[tuple[int, int]]:
        """The id range of each saving rank, in rank order."""
        world = len(self.saved.rows)
        return [(r.id_start, r.id_end) for r in (self.params.bucket_range(k, world) for k in range(world))]

    def ranks_in(self, lo: int, hi: int) -> list[int]:
        """The saving ranks whose ids overlap ``[lo, hi)``."""
        return [r for r, (a, b) in enumerate(self.rank_ids()) if a < hi and lo < b]


class Link:
    """One complete checkpoint folder (a full checkpoint or a delta)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = Path(path), step
        try:
            self.metadata: Metadata = FileSystemReader(self.path).read_metadata()
        except Exception as e:
            raise ValueError(f"{self.path / '.metadata'} cannot be read ({type(e).__name__}: {e}); "
                             "restore the file or serve another checkpoint") from e
        tables, self.checksum_files = saved_record(self.metadata.planner_data)
        if tables is None:
            raise ValueError(f"{self.path} was not saved by torchrec-kvzch's CheckpointManager (no record "
                             "of KV-ZCH tables in its .metadata); serve a directory it wrote")
        self.tables = {t.name: SavedKVTable(fqn[: -len("weight")], t) for fqn, t in tables.items()}
        self.uid, self.base = chain_link(self.metadata.planner_data)
        self._files = SavedFiles(str(self.path), self.metadata)
        self._sums: dict | None = None

    @property
    def is_delta(self) -> bool:
        return self.base is not None

    # -- KV-ZCH rows --------------------------------------------------------------------------
    def chunks(self, table: SavedKVTable, lo: int, hi: int, entry: str = "weight") -> list[MetadataIndex]:
        """The saved chunks of ``<base><entry>`` (rows, or ``deleted_id``) that may hold ids in
        ``[lo, hi)``: those of the saving ranks whose ids overlap it."""
        fqn = table.base + entry
        meta = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"{self.path}: KV-ZCH table '{table.saved.name}' has no entry '{fqn}'; "
                             "the checkpoint is damaged or was not saved by CheckpointManager")
        per_rank = (table.saved.rows if entry == "weight" else table.saved.deleted) or ()
        firsts = [sum(per_rank[:r]) for r in range(len(per_rank))]
        spans = [(firsts[r], firsts[r] + per_rank[r]) for r in table.ranks_in(lo, hi)
                 if r < len(per_rank) and per_rank[r]]
        return [MetadataIndex(fqn, c.offsets) for c in sorted(meta.chunks, key=lambda c: c.offsets[0])
                if any(a < c.offsets[0] + c.sizes[0] and c.offsets[0] < b for a, b in spans)]

    def check(self, indices: list[MetadataIndex]) -> None:
        """Every file region ``indices`` lie in exists and is complete."""
        check_files(str(self.path), self.metadata, indices, self._describe)

    def rows(self, table: SavedKVTable, lo: int, hi: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(ids, weights [n, D])`` of the saved rows with ids in ``[lo, hi)``, a chunk at a
        time, each chunk checked against its checksum. ``weights`` may be a strided view of a
        buffer the next chunk overwrites: use it before asking for the next. The next chunk is
        read (and checksummed) in the background meanwhile, into the other of two buffers."""
        layout = RowLayout.for_table(table.params)
        weights = slice(layout.header_width, layout.header_width + table.saved.embedding_dim) \
            if table.saved.whole_row else slice(None)
        indices = self.chunks(table, lo, hi)
        buffers: list[torch.Tensor | None] = [None, None]

        def read(i: int):
            index = indices[i]
            ids = self._read(MetadataIndex(table.base + "weight_id", index.offset)).view(-1)
            keep = (ids >= lo) & (ids < hi)
            if not bool(keep.any()):
                return index, ids, keep, None
            rows = buffers[i % 2] = self._read(index, buffers[i % 2])
            return index, ids, keep, rows

        with ThreadPoolExecutor(1, thread_name_prefix="kvzch-serving-read") as reader:
            ahead = reader.submit(read, 0) if indices else None
            for i in range(len(indices)):
                index, ids, keep, rows = ahead.result()
                ahead = reader.submit(read, i + 1) if i + 1 < len(indices) else None
                if rows is None:
                    continue
                if rows.shape[0] != ids.numel():
                    raise ValueError(f"{self._where(index)}: a chunk of {rows.shape[0]} rows beside "
                                     f"{ids.numel()} ids; the checkpoint is damaged")
                if bool(keep.all()):  # (most chunks: no copy here)
                    yield ids, rows[:, weights]
                else:
                    yield ids[keep], rows[keep][:, weights]

    def deleted(self, table: SavedKVTable, lo: int, hi: int) -> torch.Tensor:
        """A delta's ids deleted since its base, those in ``[lo, hi)``."""
        if table.saved.deleted is None:
            raise ValueError(f"{self.path}: KV-ZCH table '{table.saved.name}' has no deleted ids although the "
                             "checkpoint is a delta; the checkpoint is damaged")
        ids = [self._read(index).view(-1) for index in self.chunks(table, lo, hi, DELETED)]
        ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
        return ids[(ids >= lo) & (ids < hi)]

    def admits(self, table: SavedKVTable) -> bool:
        """Whether the table was saved with admission (its sketch): absent ids then read its default row."""
        return table.base + SKETCH in self.metadata.state_dict_metadata

    def default_rows(self, table: SavedKVTable) -> torch.Tensor | None:
        """Admission's trainable default row of each saving rank ``[world, D]``, or None."""
        fqn = table.base + DEFAULT_WEIGHT
        meta = self.metadata.state_dict_metadata.get(fqn)
        if meta is None:
            return None
        return torch.cat([self._read(MetadataIndex(fqn, c.offsets))
                          for c in sorted(meta.chunks, key=lambda c: c.offsets[0])]).float()

    # -- reading ------------------------------------------------------------------------------
    def _read(self, index: MetadataIndex, out: torch.Tensor | None = None) -> torch.Tensor:
        """One saved chunk, checked against its recorded checksum; into ``out`` when it is large
        enough and of the chunk's dtype (the returned tensor is then a view of it)."""
        try:
            span = self._files.span(index)
            if span is not None:
                meta = self.metadata.state_dict_metadata[index.fqn]
                sizes = next(c.sizes for c in meta.chunks if c.offsets == index.offset)
                n, dtype = sizes.numel(), meta.properties.dtype
                if out is None or out.numel() < n or out.dtype != dtype:
                    out = torch.empty(n, dtype=dtype)
                value = self._files.read_rows(span, 0, out.view(-1)[:n]).view(sizes)
            else:
                value = read_saved(str(self.path), self.metadata, index)
        except ValueError as e:
            raise ValueError(f"{self._where(index)} is damaged ({e}); restore it or serve another "
                             "checkpoint") from e
        except Exception as e:  # (torch.load of a damaged item: IndexError, UnpicklingError, RuntimeError...)
            first = str(e).strip().split(". ")[0]  # (not the advice to trust the file that torch.load gives)
            raise ValueError(f"{self._where(index)} is corrupt: reading {self._describe(index.fqn)} failed "
                             f"({type(e).__name__}: {first}); restore the file or serve another checkpoint") from e
        self._verify(index, value)
        return value

    def _verify(self, index: MetadataIndex, value: torch.Tensor) -> None:
        if self._sums is None:
            self._sums = recorded_checksums(str(self.path), self.checksum_files)
        want = self._sums.get(item_key(index))
        if want is None:
            raise ValueError(f"{self.path} has no checksum for {self._describe(index.fqn)}; restore the "
                             "checkpoint's kvzch_checksums_*.json files or serve another checkpoint")
        algorithm, expected = want
        if checksum(value, algorithm) != expected:
            raise ValueError(f"{self._where(index)} is corrupt: {self._describe(index.fqn)} does not match "
                             "the checksum recorded at save; restore the file or serve another checkpoint")

    def _where(self, index: MetadataIndex) -> str:
        return os.path.join(str(self.path), self.metadata.storage_data[index].relative_path)

    def _describe(self, fqn: str) -> str:
        return f"'{fqn}'"


class CheckpointSource:
    """The checkpoints under a ``CheckpointManager`` root, for serving."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._manager = CheckpointManager(self.root)

    def latest(self) -> int | None:
        return self._manager.latest()

    def steps(self) -> list[int]:
        return self._manager.steps()

    def chain(self, step: int) -> list[Link]:
        """The links that restore ``step``, its full checkpoint first, each named base checked
        (``CheckpointManager.chain``)."""
        self._complete(step)
        return [Link(self._manager.path(s), s) for s in self._manager.chain(step)]

    def path(self, step: int) -> Path:
        return self._manager.path(step)

    def link(self, step: int) -> Link:
        return Link(self._complete(step), step)

    def _complete(self, step: int) -> Path:
        """The folder of ``step``, refused (listing the complete ones) unless it is complete."""
        path = self._manager.path(step)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata); complete ones "
                                    f"under {self.root}: {self.steps()}")
        return path
