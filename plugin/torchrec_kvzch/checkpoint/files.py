"""Saved tensor items read straight from a checkpoint's files.

DCP's ``FileSystemReader`` reads every tensor item with ``torch.load`` into a new tensor and
copies that into the destination: two fresh allocations (a page fault per 4 KiB) and a copy per
chunk, which made a KV-ZCH load several times slower than reading its bytes. Each item DCP
writes is a ``torch.save`` zip (stored, not compressed) whose one storage record holds the
tensor's storage. When the tensor is contiguous from the storage's start (KV-ZCH chunks always
are: the save materialises each one fresh), those bytes are its values in order.
``SavedFiles`` finds them once (from the zip's directory, with torch's own zip reader, and the
tensor's geometry from its pickle, read without building anything) and reads them with
``preadv`` into a buffer the caller reuses, or checksums them in cache-sized pieces. Items it
cannot read this way (a storage transform such as compression, another byte order, a strided
tensor, anything unexpected in the pickle) are left to DCP's reader.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import sys
import weakref
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.utils import _create_file_view

_PIECE_BYTES = 4 << 20  # checksummed piece: stays in the cache between the read and the CRC


@dataclass(frozen=True)
class Span:
    """Where the values of one saved tensor chunk lie: ``nbytes`` at ``offset`` of ``path``."""

    path: str
    offset: int
    nbytes: int
    row_bytes: int  # bytes of one row (dim 0) of the chunk


class SavedFiles:
    def __init__(self, directory: str, metadata: Metadata) -> None:
        self.directory, self.metadata = directory, metadata
        self._fds: dict[str, int] = {}
        self._spans: dict[MetadataIndex, Span | None] = {}
        self._piece: torch.Tensor | None = None
        weakref.finalize(self, _close_all, self._fds)  # closed when dropped unclosed

    def span(self, index: MetadataIndex) -> Span | None:
        """Where saved tensor item ``index``'s values lie, or None when they cannot be read
        raw. Raises ``ValueError`` when the item's zip cannot be parsed (a damaged file)."""
        if index not in self._spans:
            self._spans[index] = self._locate(index)
        return self._spans[index]

    def _locate(self, index: MetadataIndex) -> Span | None:
        saved = self.metadata.state_dict_metadata.get(index.fqn)
        info = self.metadata.storage_data[index]
        if not isinstance(saved, TensorStorageMetadata) or info.transform_descriptors:
            return None
        sizes = next((c.sizes for c in saved.chunks if c.offsets == index.offset), None)
        if sizes is None:
            return None
        itemsize = torch.empty(0, dtype=saved.properties.dtype).element_size()
        nbytes = math.prod(sizes) * itemsize
        path = os.path.join(self.directory, info.relative_path)
        with open(path, "rb") as f:
            try:
                view = _create_file_view(f, info.offset, info.length)
                archive = torch._C.PyTorchFileReader(view)
                records = [r for r in archive.get_all_records() if r.startswith("data/")]
                order = (bytes(archive.get_record("byteorder")).decode()
                         if archive.has_record("byteorder") else sys.byteorder)
                if len(records) != 1 or order != sys.byteorder or _record_size(archive, view, records[0]) != nbytes:
                    return None
                if not _plain(_geometry(bytes(archive.get_record("data.pkl"))), records[0][5:], sizes):
                    return None
                start = archive.get_record_offset(records[0])
            except Exception as e:  # torch's zip reader raises RuntimeError, views ValueError
                raise ValueError(f"its zip structure cannot be read ({e})") from e
        if start + nbytes > info.length:
            raise ValueError(f"its values run past the item's {info.length} bytes")
        row_bytes = math.prod(sizes[1:]) * itemsize if len(sizes) else itemsize
        return Span(path, info.offset + start, nbytes, row_bytes)

    def read_rows(self, span: Span, first: int, out: torch.Tensor) -> torch.Tensor:
        """Fill contiguous ``out`` with the rows from ``first`` on of the chunk at ``span``."""
        nbytes = out.numel() * out.element_size()
        if first * span.row_bytes + nbytes > span.nbytes:
            raise ValueError(f"{span.path}: rows past the end of a saved chunk were asked for")
        self._read(span.path, span.offset + first * span.row_bytes, out.view(-1).view(torch.uint8))
        return out

    def checksum(self, span: Span, update: Callable[[memoryview, int], int]) -> int:
        """``update(piece, value)`` (zlib.crc32's signature) over the values at ``span``, read in
        pieces small enough to stay in the cache."""
        if self._piece is None:
            self._piece = torch.empty(_PIECE_BYTES, dtype=torch.uint8)
        value, done = 0, 0
        while done < span.nbytes:
            n = min(_PIECE_BYTES, span.nbytes - done)
            piece = self._read(span.path, span.offset + done, self._piece[:n])
            value = update(memoryview(piece.numpy()), value)
            done += n
        return value

    def _read(self, path: str, offset: int, out: torch.Tensor) -> torch.Tensor:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        view, done = memoryview(out.numpy()), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"{path} ended {len(view) - done} bytes early (truncated meanwhile?)")
            done += n
        return out

    def close(self) -> None:
        """Close the files opened so far (a later read opens them again)."""
        _close_all(self._fds)
        self._piece = None


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def _plain(geometry, key: str, sizes) -> bool:
    """Whether a pickled tensor's ``geometry`` is ``sizes``, contiguous from the start of its
    storage ``key`` (strides of size-1 dims do not matter)."""
    if geometry is None or geometry[:3] != (key, 0, tuple(sizes)):
        return False
    step = 1
    for size, stride in reversed(list(zip(sizes, geometry[3]))):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


class _GeometryUnpickler(pickle.Unpickler):
    """Reads what ``torch.save`` of one tensor pickles - (storage key, offset, size, stride) -
    without building a tensor or reading its storage; refuses anything else."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage[2], offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid):
        return pid  # ("storage", storage type, key, location, numel)


def _record_size(archive, view, name: str) -> int:
    """The stored size of record ``name``: torch 2.13's zip reader tells it; torch 2.11's has no
    ``get_record_size``, so there the zip's central directory (stdlib ``zipfile``) does."""
    if hasattr(archive, "get_record_size"):
        return archive.get_record_size(name)
    with zipfile.ZipFile(_Window(view.base_stream, view.offset, view.len)) as z:
        # torch names its entries "<archive>/<record>"
        [entry] = [e for e in z.infolist() if e.filename.split("/", 1)[-1] == name]
        return entry.file_size


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file of their own (for
    ``zipfile``, whose seeks from the end DCP's own view does not take)."""

    def __init__(self, f, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(0, base + offset), self._length)
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._pos)
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got

def _geometry(pickled: bytes):
    """(storage key, storage offset, size, stride) of a pickled tensor, or None."""
    try:
        return _GeometryUnpickler(io.BytesIO(pickled)).load()
    except Exception:
        return None
