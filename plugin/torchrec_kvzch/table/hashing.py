"""The id map's hash table: its hashing, entry format and sizes, shared by its backends
(``id_map.py``, the C++ op in ``csrc/id_map.h``, the GPU kernels in ``gpu_kernels.py``), by the
memory estimates, and by the id-seeded draws (initial weights, admission, the synthetic click
log). Each hash is bit-identical to its C++ twin.

A hash table entry is an (id, slot) pair of int64; an id of ``EMPTY`` ends a probe, ``TOMB``
(an erased id) does not. Probes are linear, starting at the first entry of the id's bucket of
``BUCKET`` entries (a 64-byte cache line), chosen by Fibonacci hashing. Tables are powers of
two kept at load <= ``MAX_LOAD``.
"""

from __future__ import annotations

import torch

EMPTY = -1
TOMB = -2
BUCKET = 4  # entries per cache line; a probe starts at the first entry of its id's line
MAX_LOAD = 0.7
MIN_CAPACITY = 1024
REHASH_CHUNK = 1 << 18  # ids reinserted at a time by a rehash
REHASH_BYTES_PER_ID = 6 * 8  # a rehash's temporaries: a copy of the chunk and the insert's five arrays of it

_M1 = 0xBF58476D1CE4E5B9 - 2**64  # the splitmix64 constants as signed int64
_M2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors; bit-identical to ``mix64`` in the C++ op."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def unit_uniform(hashes: torch.Tensor) -> torch.Tensor:
    """The top 53 bits of int64 hashes (``mix64``) as float64 uniforms in [0, 1)."""
    return ((hashes >> 11) & ((1 << 53) - 1)).double() / 2.0**53


FIBONACCI = 0x9E3779B97F4A7C15 - 2**64  # 2^64 / golden ratio, as a signed int64


def home(ids: torch.Tensor, capacity: int) -> torch.Tensor:
    """Where each id's probe starts (as ``home`` in the C++ op): the first entry of its bucket,
    from the top log2(capacity) bits of ``id * 2^64 / phi`` (Fibonacci hashing)."""
    return _shr(ids * FIBONACCI, 64 - (capacity.bit_length() - 1)) & (capacity - BUCKET)


def capacity_for(n: int) -> int:
    """Smallest power-of-two table holding n keys at load <= MAX_LOAD."""
    capacity = MIN_CAPACITY
    while n > MAX_LOAD * capacity:
        capacity *= 2
    return capacity


def table_bytes(n: int) -> int:
    """Bytes of the hash table that holds n keys (16-byte entries)."""
    return capacity_for(n) * 16


def map_bytes(n: int, slack: float = 1.0, rehash: bool = False) -> int:
    """Bytes of a map holding n keys: its hash table, and its slot -> id array with room for
    ``slack`` times n ids (the array grows geometrically). ``rehash``: at its peak, while the
    table is rebuilt to drop tombstones (a chunk of ids reinserted at a time)."""
    return table_bytes(n) + int(n * slack) * 8 + (min(n, REHASH_CHUNK) * REHASH_BYTES_PER_ID if rehash else 0)
