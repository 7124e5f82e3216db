"""Checksums of KV-ZCH checkpoint chunks: a corrupted file is refused before a load changes a row.

DCP's files carry no checksums, and a load that met a bad chunk halfway through would leave the
stores half replaced. So the save planner records a crc32 of every KV-ZCH chunk it materialises
in one small side file per rank (``kvzch_checksums_<rank>.json`` beside DCP's files; the
coordinator removes those of an earlier save into the same folder while planning), and the
load planner, while planning (before any store is cleared), reads back every chunk it is about
to stream with DCP's own reader and compares. That pass reads this rank's share of the rows once
more, one chunk in memory at a time.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import zlib

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

_PATTERN = "kvzch_checksums_{rank}.json"


def checksum(tensor: torch.Tensor) -> int:
    """crc32 of a tensor's bytes (zlib releases the GIL, so writer threads run it in parallel)."""
    return zlib.crc32(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _key(fqn: str, row_offset: int) -> str:
    return f"{fqn}@{row_offset}"


class ChecksumRecorder:
    """Collects one rank's chunk checksums during a save (from any writer thread)."""

    def __init__(self, directory: str, rank: int, is_coordinator: bool) -> None:
        self.path = os.path.join(directory, _PATTERN.format(rank=rank))
        self._sums: dict[str, int] = {}
        if is_coordinator:  # before the plan collective, so before any rank writes its file
            for stale in glob.glob(os.path.join(directory, _PATTERN.format(rank="*"))):
                os.remove(stale)
        self._lock = threading.Lock()

    def add(self, fqn: str, row_offset: int, tensor: torch.Tensor) -> None:
        value = checksum(tensor)
        with self._lock:
            self._sums[_key(fqn, row_offset)] = value

    def write(self) -> None:
        if not os.path.isdir(os.path.dirname(self.path)):
            return  # not a checkpoint in a local folder: no side file, no verification
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self._sums, f)
        os.replace(tmp, self.path)


def verify_chunks(directory: str, metadata: Metadata, chunks: dict[MetadataIndex, str]) -> None:
    """Read each saved chunk ``{storage index: table name}`` and compare it with its recorded
    checksum; raise ``ValueError`` naming the file and the table at the first mismatch.
    Checkpoints saved without checksums (no side files) are not verified."""
    recorded: dict[str, int] = {}
    for path in glob.glob(os.path.join(directory, _PATTERN.format(rank="*"))):
        with open(path) as f:
            recorded.update(json.load(f))
    if not recorded or not chunks:
        return
    reader = FileSystemReader(directory)
    reader.set_up_storage_reader(metadata, is_coordinator=False)

    for index, table in chunks.items():  # one at a time: the load's memory bound holds here too
        where = os.path.join(directory, metadata.storage_data[index].relative_path)
        want = recorded.get(_key(index.fqn, index.offset[0]))
        if want is None:
            raise ValueError(f"{directory} has no checksum for rows {index.offset[0]}+ of KV-ZCH "
                             f"table '{table}' (in {where}): is a kvzch_checksums_*.json file "
                             "missing? Restore it or load another checkpoint")
        check = _Check(metadata.state_dict_metadata[index.fqn].properties.dtype)
        item = ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size([0, 0]),
                        storage_index=index, storage_offsets=torch.Size([0, 0]),
                        lengths=_chunk_size(metadata, index))
        try:
            reader.read_data(LoadPlan([item]), check).wait()
        except Exception as e:
            raise ValueError(f"{where} is corrupt: reading rows {index.offset[0]}+ of KV-ZCH table "
                             f"'{table}' failed ({e}); restore the file or load another checkpoint") from e
        if check.value != want:
            raise ValueError(f"{where} is corrupt: rows {index.offset[0]}+ of KV-ZCH table '{table}' "
                             f"do not match the checksum recorded at save; restore the file or load "
                             "another checkpoint")


def _chunk_size(metadata: Metadata, index: MetadataIndex) -> torch.Size:
    for chunk in metadata.state_dict_metadata[index.fqn].chunks:
        if chunk.offsets == index.offset:
            return chunk.sizes
    raise KeyError(index)


class _Check:
    """What DCP's reader hands a chunk to (the two LoadPlanner hooks ``read_data`` calls for a
    tensor): keeps only the chunk's checksum."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.value = dtype, None

    def resolve_tensor(self, read_item):
        return torch.empty(list(read_item.lengths), dtype=self.dtype)

    def commit_tensor(self, read_item, tensor) -> None:
        self.value = checksum(tensor)
