"""DCP's file writer, with each file sent to disk while it is written.

``FileSystemWriter`` writes a rank's items into the page cache and ``fsync``s each file at its
end, so a save is two phases back to back: the CPU copies every byte while the disk idles (a
checkpoint smaller than the kernel's dirty threshold is not written back meanwhile), then the
disk writes every byte while the CPU waits. ``KVZCHFileSystemWriter`` asks the kernel
(``sync_file_range``) to start writing each 16 MiB of a file as soon as it is in the cache, and
waits for the one two segments back before going on, so that the disk works while the next
chunk is gathered and copied, and a save holds at most a few segments of dirty pages per file
(instead of gigabytes that stall the machine's other writers). ``benchmarks/bench_checkpoint.py``
measures it against DCP's writer saving a plain tensor of the same bytes.

Where ``sync_file_range`` does not exist (not Linux) or ``sync_files=False`` (no durability
asked for, so nothing to wait for) it writes like ``FileSystemWriter``.
"""

from __future__ import annotations

import ctypes
import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

_SEGMENT = 16 << 20  # bytes handed to the disk at a time
_LAG = 2  # segments in flight before a writer waits for the oldest
_WRITE, _WAIT = 2, 1 | 2 | 4  # SYNC_FILE_RANGE_WRITE; WAIT_BEFORE | WRITE | WAIT_AFTER


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # ctypes releases the GIL during the call: writer threads wait in parallel


_sync_range = _sync_file_range()


class _WritebackFile(io.FileIO):
    """A file written from its start, whose segments are handed to the disk as they fill."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "w")
        self._written = self._handed = 0  # bytes written; bytes handed to the disk

    def write(self, data) -> int:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):  # a large write in segments, so the disk starts on the first
            room = self._handed + _SEGMENT - self._written
            n = super().write(view[done : done + room])
            done += n
            self._written += n
            if self._written - self._handed == _SEGMENT:
                self._hand_over()
        return done

    def _hand_over(self) -> None:
        fd, start = self.fileno(), self._handed
        _sync_range(fd, start, _SEGMENT, _WRITE)
        if start >= _LAG * _SEGMENT:
            _sync_range(fd, start - _LAG * _SEGMENT, _SEGMENT, _WAIT)
        self._handed += _SEGMENT  # errors surface at the fsync that ends the file

    def seek(self, *args) -> int:
        raise io.UnsupportedOperation("a checkpoint file is written from its start to its end")


class _WritebackFileSystem(FileSystem):
    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(_WritebackFile(str(Path(path)))) as stream:
            yield stream


class KVZCHFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` (same arguments) that writes each file back to disk as it goes."""

    def __init__(self, path: str | os.PathLike, *args, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        if self.sync_files and _sync_range is not None:
            self.fs = _WritebackFileSystem()
