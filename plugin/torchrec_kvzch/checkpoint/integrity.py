"""Checkpoint integrity: everything a load will read is checked before it changes anything.

DCP's files carry no checksums, and DCP writes each entry into the model as it reads it, so a
damaged file met halfway would leave the model half loaded. So:

* saving, ``ChecksumRecorder`` keeps a CRC-32C (hardware-accelerated, from the ``crc32c``
  package: about 14 GB/s here against 4 GB/s for zlib's CRC-32) of every item a rank writes -
  KV-ZCH chunks, ordinary tensors and shards, pickled objects - in one small side file per rank
  (``kvzch_checksums_<rank>.json`` beside DCP's files, ``{"algorithm": ..., "items": {...}}``),
  and the checkpoint's metadata lists those files, so deleting them cannot turn verification
  off. Side files of earlier versions are a flat ``{item: zlib CRC-32}``; they verify as such;
* loading, while planning (DCP raises a planning error on every rank before any rank reads a
  byte), ``check_files`` checks that every file region the rank will read exists and is
  complete, and ``verify_items`` reads each item back and compares its checksum: a tensor's
  values straight from the file in cache-sized pieces where they can be (``files.py``; always
  for KV-ZCH chunks), anything else with DCP's own reader, one item at a time. That is one
  more read of the rank's share of the checkpoint; the load's own read then finds the bytes
  in the page cache.
"""

from __future__ import annotations

import glob
import io
import json
import os
import threading
import zlib
from collections.abc import Callable, Iterable

import crc32c
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from torchrec_kvzch.checkpoint.files import SavedFiles

_PATTERN = "kvzch_checksums_{rank}.json"
# Checksum functions by the name side files record, each ``f(buffer, value) -> value``. Both
# release the GIL on large buffers, so writer threads checksum in parallel.
ALGORITHMS: dict[str, Callable] = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}
SAVE_ALGORITHM = "crc32c"

Describe = Callable[[str], str]  # fqn -> how errors name the entry


def checksum_file(rank: int) -> str:
    return _PATTERN.format(rank=rank)


def checksum(data: torch.Tensor | io.BytesIO, algorithm: str = SAVE_ALGORITHM) -> int:
    """Checksum of a tensor's values or a pickled object's bytes."""
    update = ALGORITHMS[algorithm]
    if isinstance(data, io.BytesIO):
        return update(data.getbuffer())
    return update(data.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def item_key(index: MetadataIndex) -> str:
    offset = ",".join(map(str, index.offset)) if index.offset is not None else ""
    return f"{index.fqn}@{offset}"


class ChecksumRecorder:
    """Collects one rank's item checksums during a save (from any writer thread)."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.path = os.path.join(directory, checksum_file(rank))
        self._sums: dict[str, int] = {}
        self._lock = threading.Lock()

    def remove_stale(self) -> None:
        """Remove an earlier save's side files from the folder: on the coordinator, once every rank's
        writer has accepted the folder (a writer refusing to overwrite leaves them) and before any
        rank writes its own."""
        for stale in glob.glob(os.path.join(self.directory, _PATTERN.format(rank="*"))):
            os.remove(stale)

    def add(self, index: MetadataIndex, data: torch.Tensor | io.BytesIO) -> None:
        value = checksum(data)
        with self._lock:
            self._sums[item_key(index)] = value

    def write(self) -> None:
        if not os.path.isdir(self.directory):
            return  # not a checkpoint in a local folder: the metadata lists no side files
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"algorithm": SAVE_ALGORITHM, "items": self._sums}, f)
        os.replace(tmp, self.path)


def check_files(directory: str, metadata: Metadata, indices: Iterable[MetadataIndex],
                describe: Describe) -> None:
    """Every saved item in ``indices`` lies in a file that exists and is long enough."""
    for index in indices:
        info = metadata.storage_data[index]
        path = os.path.join(directory, info.relative_path)
        size = os.path.getsize(path) if os.path.exists(path) else -1
        if size < info.offset + info.length:
            state = "is missing" if size < 0 else f"is truncated ({size} of {info.offset + info.length} bytes)"
            raise ValueError(f"{path} {state}: it holds {describe(index.fqn)}; restore the file or "
                             "load another checkpoint")


def verify_items(directory: str, metadata: Metadata, indices: Iterable[MetadataIndex],
                 checksum_files: list[str], describe: Describe, files: SavedFiles | None = None) -> None:
    """Read each saved item in ``indices`` and compare it with the checksum recorded at save;
    raise ``ValueError`` naming the file and the entry at the first mismatch. Tensors whose
    values ``files`` can read raw are checksummed from the file, without deserialising them."""
    recorded = recorded_checksums(directory, checksum_files)
    reader = _reader(directory, metadata)
    for index in indices:  # one at a time: the load's memory bound holds here too
        where = os.path.join(directory, metadata.storage_data[index].relative_path)
        want = recorded.get(item_key(index))
        if want is None:
            raise ValueError(f"{directory} has no checksum for {describe(index.fqn)} (in {where}); "
                             "restore the checkpoint's kvzch_checksums_*.json files or load another "
                             "checkpoint")
        algorithm, value = want
        try:
            span = files.span(index) if files is not None else None
            if span is not None:
                got = files.checksum(span, ALGORITHMS[algorithm])
            else:
                got = checksum(read_item(reader, metadata, index), algorithm)
        except Exception as e:
            raise ValueError(f"{where} is corrupt: reading {describe(index.fqn)} failed ({e}); "
                             "restore the file or load another checkpoint") from e
        if got != value:
            raise ValueError(f"{where} is corrupt: {describe(index.fqn)} does not match the "
                             "checksum recorded at save; restore the file or load another checkpoint")


def recorded_checksums(directory: str, checksum_files: list[str]) -> dict[str, tuple[str, int]]:
    """{item key: (algorithm, checksum)} of the side files, in either format."""
    recorded: dict[str, tuple[str, int]] = {}
    for name in checksum_files:
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                data = json.load(f)
            if isinstance(data.get("items"), dict):
                algorithm, items = data["algorithm"], data["items"]
                if algorithm not in ALGORITHMS:
                    raise ValueError(f"unknown checksum algorithm {algorithm!r}, written by a newer "
                                     "torchrec-kvzch")
            else:  # earlier versions: a flat {item: zlib CRC-32}
                algorithm, items = "crc32", data
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{path} cannot be read ({e}): the checkpoint was saved with checksums "
                             "and this file holds some of them; restore it, load another checkpoint, "
                             "or load with verify=False to skip the check") from e
        recorded.update((key, (algorithm, value)) for key, value in items.items())
    return recorded


def read_saved(directory: str, metadata: Metadata, index: MetadataIndex) -> torch.Tensor | io.BytesIO:
    """One saved item (a tensor chunk or a pickled object), read outside a load."""
    return read_item(_reader(directory, metadata), metadata, index)


def _reader(directory: str, metadata: Metadata) -> FileSystemReader:
    reader = FileSystemReader(directory)
    reader.set_up_storage_reader(metadata, is_coordinator=False)
    return reader


def read_item(reader: FileSystemReader, metadata: Metadata, index: MetadataIndex):
    saved = metadata.state_dict_metadata[index.fqn]
    if isinstance(saved, TensorStorageMetadata):
        sizes = next(c.sizes for c in saved.chunks if c.offsets == index.offset)
        zeros = torch.Size([0] * len(sizes))
        item = ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=zeros,
                        storage_index=index, storage_offsets=zeros, lengths=sizes)
        sink = _Sink(saved.properties.dtype)
    else:
        item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size([0]),
                        storage_index=index, storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
        sink = _Sink(None)
    reader.read_data(LoadPlan([item]), sink).wait()
    return sink.value


class _Sink:
    """What DCP's reader hands an item to (the LoadPlanner hooks ``read_data`` calls)."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype, self.value = dtype, None

    def resolve_tensor(self, read_item):
        return torch.empty(list(read_item.lengths), dtype=self.dtype)

    def commit_tensor(self, read_item, tensor) -> None:
        self.value = tensor

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.value = value
