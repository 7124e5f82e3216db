"""Reusable buffers for the chunks a save materialises.

Every chunk of rows a save writes is gathered into a buffer first. A fresh buffer per chunk
costs a page fault per 4 KiB (or the zeroing of each huge page), about half as much again as
the gather itself; so buffers are reused. DCP's writer keeps some chunks alive after writing
them (the last one of each entry, until its file is done), so a buffer goes back to the pool
only once no tensor over it is left: each handed-out tensor is made with ``torch.frombuffer``
over a numpy view of its own, which torch holds for as long as any tensor shares the memory,
and a finalizer on that view returns the buffer.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

from torchrec_kvzch.table.native import empty_large


class ChunkBuffers:
    def __init__(self, native: bool) -> None:
        """``native``: buffers in mappings of their own (``empty_large``), else ``torch.empty``."""
        self._native = native
        self._free: dict[int, list] = {}  # bytes -> numpy arrays not in use
        # Writer threads take and return buffers concurrently. Reentrant: a lease's finalizer
        # (``_give_back``) may run inside the collector in a thread holding it already.
        self._lock = threading.RLock()
        self._open = True

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype`` with arbitrary contents."""
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            free = self._free.get(nbytes)
            array = free.pop() if free else None
        if array is None:
            array = empty_large(nbytes, torch.uint8, torch.device("cpu"), self._native).numpy()
        lease = array[:]  # a view of its own, alive while any tensor over the buffer is
        weakref.finalize(lease, self._give_back, nbytes, array)
        return torch.frombuffer(lease, dtype=torch.uint8).view(dtype).view(shape)

    def _give_back(self, nbytes: int, array) -> None:
        with self._lock:
            if self._open:
                self._free.setdefault(nbytes, []).append(array)

    def close(self) -> None:
        """Free the buffers not in use now, and each other one once it is no longer used."""
        with self._lock:
            self._open = False
            self._free.clear()
