"""GPU memory as a cache over a CUDA store's rows in host memory (issue 34; ``params.device_cache``).

A shard too large for GPU memory keeps its weights, and optimizer state wider than a value per
row, in host memory (CUDA managed memory: the GPU reads and writes it over the bus), while the id
map, the headers and row-wise optimizer state stay in GPU memory. fbgemm's TBE caches hot rows in
GPU memory itself (its managed-caching placement, LRU or LFU): before a lookup it brings the
batch's rows in, writing the rows it drops back to host memory, and its fused update writes the
cached copies. This class owns that cache's arrays and binds them to the TBE; a row's linear
index in the cache is its store slot.

A cached copy is the fresh one. So around every access to host rows outside the TBE the store
keeps two rules: before reading rows, their cached copies are written back (``flush``,
``flush_rows``); after writing rows (a load, a user's write, a compaction moving rows between
slots) their cached copies are dropped (``forget``), so that a slot reused for another row is
never served the old one. Updates the table runs itself read and write through the cache
(``gather``, ``scatter``). Misses of those masked reads and writes land on one spare row and one
spare cache entry past what the TBE sees, so none of them waits for the GPU.
"""

from __future__ import annotations

import torch

from torchrec_kvzch.params.storage import CachePolicy, DeviceCache
from torchrec_kvzch.table.arrays import GROWTH, estimated_bytes
from torchrec_kvzch.table.layout import RowLayout

ASSOC = 32  # ways per cache set: fbgemm's DEFAULT_ASSOC, which its CUDA cache kernels are built for
_LFU_MAX_SETS = 2**24 - 1  # fbgemm's bound for an LFU cache


class FbgemmCacheOps:
    """The fbgemm CUDA cache ops the row cache calls itself (the TBE calls its populate)."""

    def lookup(self, slots: torch.Tensor, state: torch.Tensor, invalid: int) -> torch.Tensor:
        return torch.ops.fbgemm.lxu_cache_lookup(slots, state, invalid)

    def flush(self, weights: torch.Tensor, cache: "RowCache") -> None:
        torch.ops.fbgemm.lxu_cache_flush(
            weights.view(-1), cache.cumsum(1), cache.index_map, cache.zeros_long, cache.dim_offsets,
            weights.shape[1], cache.state, cache.weights, False)


def estimated_split(layout: RowLayout, rows: int, cache_rows: int) -> tuple[int, int]:
    """(GPU bytes, host bytes) of a store of ``rows`` rows under a cache of ``cache_rows``, as
    ``arrays.estimated_bytes`` counts a store: the weights (and optimizer state wider than a value
    per row) in host memory; the cache, its per-slot index (and lfu counts) in GPU memory."""
    wide_state = 4 * layout.optimizer_floats if layout.optimizer_floats > 1 else 0
    host = int(rows * (layout.embedding_dim * layout.itemsize + wide_state) * GROWTH)
    entries = -(-cache_rows // ASSOC) * ASSOC
    cache = entries * (layout.embedding_dim * layout.itemsize + 16) + int(rows * GROWTH) * 12
    return estimated_bytes(layout, rows) - host + cache, host


def refusal(table: str, where: str) -> ValueError:
    """The error for a device cache asked of a store whose rows are in host memory already."""
    return ValueError(f"KV-ZCH table '{table}': a device cache serves a CUDA store (rows in host memory, hot "
                      f"ones in GPU memory); on {where} the rows are in host memory already: drop device_cache")


def default_ops(device: torch.device, table: str):
    if device.type != "cuda":
        raise refusal(table, str(device))
    return FbgemmCacheOps()


class RowCache:
    """The GPU cache of ``store`` (a CUDA ``RowStore`` whose weights are in host memory)."""

    def __init__(self, store, params: DeviceCache, ops=None) -> None:
        p, r = store.params, store.bucket_range
        self.rows = params.shard_rows(p.expected_rows, r.num_buckets, p.total_num_buckets)
        self.policy = CachePolicy(params.policy)
        self.prefetch_pipeline = params.prefetch_pipeline
        self.sets = -(-self.rows // ASSOC)
        if self.policy is CachePolicy.LFU and self.sets >= _LFU_MAX_SETS:
            raise ValueError(f"KV-ZCH table '{p.name}': an lfu device cache of {self.rows} rows has more than "
                             f"fbgemm's {_LFU_MAX_SETS} sets of {ASSOC}; use policy='lru' or fewer rows")
        self.ops = ops or default_ops(store.device, p.name)
        self.store = store
        device, dim = store.device, store.layout.embedding_dim
        # (one spare set and one spare row past the views the TBE sees: see the module's docstring)
        self._state = torch.full((self.sets + 1, ASSOC), -1, dtype=torch.long, device=device)
        self._weights = torch.zeros(self.sets * ASSOC + 1, dim, dtype=store.layout.dtype, device=device)
        self._lru = torch.zeros(self.sets + 1, ASSOC, dtype=torch.long, device=device)
        self.locks = torch.zeros(self.sets, ASSOC, dtype=torch.int32, device=device)  # (prefetch pipeline's)
        self.lfu = torch.zeros(1, dtype=torch.long, device=device)  # counts by slot (+ one), lfu only
        self.zeros_long = torch.zeros(1, dtype=torch.long, device=device)
        self.dim_offsets = torch.tensor([0, dim], dtype=torch.int32, device=device)
        self.index_map = torch.zeros(0, dtype=torch.int32, device=device)
        self.capacity = 0  # (followed lazily: the store makes its arrays after this)

    @property
    def state(self) -> torch.Tensor:
        """``[sets, ASSOC]``: the slot each cache entry holds, -1 for none (fbgemm's ``lxu_cache_state``)."""
        return self._state[:-1]

    @property
    def lru(self) -> torch.Tensor:
        """``[sets, ASSOC]``: each entry's last use, an LRU cache's (fbgemm's ``lxu_state``)."""
        return self._lru[:-1]

    @property
    def weights(self) -> torch.Tensor:
        """``[sets * ASSOC, D]``: the cached rows (fbgemm's ``lxu_cache_weights``)."""
        return self._weights[:-1]

    def _fit(self) -> None:
        """Follow the store's capacity: the linear indices the cache takes are its slots
        ``[0, capacity)``, and ``capacity`` is the index of no row (fbgemm's invalid index)."""
        capacity = self.store.capacity
        if capacity == self.capacity:
            return
        self.index_map = torch.zeros(capacity, dtype=torch.int32, device=self.index_map.device)  # one table
        if self.policy is CachePolicy.LFU:
            counts = self.lfu.new_zeros(capacity + 1)
            keep = min(capacity, self.capacity)
            counts[:keep] = self.lfu[:keep]
            self.lfu = counts
        self.capacity = capacity

    def cumsum(self, features: int) -> torch.Tensor:
        """fbgemm's ``cache_hash_size_cumsum`` for a TBE of ``features`` features of this one table."""
        return torch.tensor([0] * features + [self.capacity], dtype=torch.long, device=self.index_map.device)

    def bind(self, tbe, features: int) -> None:
        """Point a managed-caching TBE (bound to the store's rows, ``TableTBE._bind``) at this cache,
        again after growth."""
        self._fit()
        for name, value in (("lxu_cache_state", self.state), ("lxu_cache_weights", self.weights),
                            ("lxu_state", self.lfu if self.policy is CachePolicy.LFU else self.lru),
                            ("cache_hash_size_cumsum", self.cumsum(features)),
                            ("cache_index_table_map", self.index_map), ("total_cache_hash_size", self.capacity),
                            ("lxu_cache_locking_counter", self.locks)):
            if name in tbe._buffers and not isinstance(value, torch.Tensor):
                del tbe._buffers[name]  # (an int where fbgemm registered a placeholder tensor)
            # (.data: autograd's version counter apart from ours, as TableTBE binds the store's
            # rows; the table's own writes between a forward and its backward are planned ones)
            setattr(tbe, name, value.data if isinstance(value, torch.Tensor) else value)

    # -- the two rules ------------------------------------------------------------------------
    def locations(self, slots: torch.Tensor) -> torch.Tensor:
        """Each slot's cache entry, -1 where it has none."""
        self._fit()
        return self.ops.lookup(slots.long(), self.state, self.capacity).long()

    def flush(self) -> None:
        """Write every cached row back to the store's rows; the copies stay cached."""
        self._fit()
        self.ops.flush(self.store.weights, self)

    def flush_rows(self, slots: torch.Tensor) -> None:
        """Write the cached copies of the rows at ``slots`` back to the store's rows."""
        if slots.numel():
            self.store.weights[slots] = self.gather(slots)

    def forget(self, slots: torch.Tensor) -> None:
        """Drop the cached copies of the rows at ``slots`` (the store's rows there changed)."""
        if not slots.numel():
            return
        at = self.locations(slots)
        self._state.view(-1)[at] = -1  # (misses: the spare set)
        self._lru.view(-1)[at] = 0  # the entry goes first when its set needs room
        if self.policy is CachePolicy.LFU:
            self.lfu[slots.long()] = 0  # a count belongs to the row that was at the slot

    def before_compaction(self, moves, before: int) -> None:
        """A delete moves rows ``moves.src`` to ``moves.dst`` and ends the store at
        ``moves.new_size`` (of ``before``): the moved rows' fresh copies go back first, then no
        slot written or left dead keeps a copy."""
        self.flush_rows(moves.src)
        tail = torch.arange(moves.new_size, before, device=self.store.device)
        self.forget(torch.cat([moves.dst.long(), tail]))

    def reset(self) -> None:
        """Every cached copy goes without a write back (the store's rows were all replaced)."""
        self._state.fill_(-1)
        self._lru.zero_()
        self.lfu.zero_()

    # -- through the cache --------------------------------------------------------------------
    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The fresh rows at ``slots``: cached copies where there are some, else the store's rows."""
        at = self.locations(slots)
        return torch.where((at >= 0).unsqueeze(1), self._weights[at], self.store.weights[slots])

    def scatter(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` as the rows at distinct ``slots``: into the cached copies where there are
        some (the spare row takes the others), else into the store's rows."""
        at, weights = self.locations(slots), self.store.weights
        values = values.to(weights.dtype)
        self._weights[at] = values
        weights[slots] = torch.where((at >= 0).unsqueeze(1), weights[slots], values)
