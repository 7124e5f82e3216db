"""Where a KV-ZCH table keeps its rows beyond fast memory: ``DiskStorage`` (rows past a DRAM cache,
on disk) and ``DeviceCache`` (on CUDA, rows in host memory under a GPU cache)."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass

from torchrec_kvzch.params.checks import member, positive_int


class CachePolicy(str, enum.Enum):
    """Which rows leave a disk tier's DRAM cache first, by their headers."""

    LRU = "lru"  # the least recently looked up
    LFU = "lfu"  # the least often looked up, then the least recently


@dataclass(frozen=True)
class DiskStorage:
    """Rows beyond a DRAM cache, on local disk (``table/disk_cache.py``). ``path``: a directory
    on local disk, this job's alone (each shard takes ``<path>/<table>/buckets-<start>-<end>``);
    ``cache_bytes``: the DRAM the table's rows may take, over all its shards (each shard gets
    its buckets' share, as a table budget is split); or ``shard_cache_bytes``, the DRAM of each
    shard (as TorchRec's ``KeyValueParams.l2_cache_size`` sizes a rank's cache). ``policy``:
    which rows go to disk first (``CachePolicy``; ``lfu`` keeps the rows of a steady skewed
    distribution better, ``lru`` follows a drifting one). The default, no path, keeps every row
    in DRAM."""

    path: str | os.PathLike | None = None
    cache_bytes: int | None = None
    shard_cache_bytes: int | None = None
    policy: CachePolicy | str = CachePolicy.LRU

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def shard_bytes(self, shard_buckets: int, total_buckets: int) -> int:
        """The DRAM of a shard of ``shard_buckets`` of the table's ``total_buckets``."""
        if self.shard_cache_bytes is not None:
            return self.shard_cache_bytes
        return self.cache_bytes * shard_buckets // total_buckets

    def validate(self, table: str) -> "DiskStorage":
        def fail(problem: str, fix: str):
            raise ValueError(f"KV-ZCH table '{table}': storage {problem}; fix: {fix}")

        sizes = {k: v for k, v in (("cache_bytes", self.cache_bytes), ("shard_cache_bytes", self.shard_cache_bytes))
                 if v is not None}
        if self.path is None:
            if sizes:
                fail(f"{' and '.join(sizes)} set without a path", "give the disk tier's directory as storage.path")
            return self
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            fail(f"path must be a directory name, got {self.path!r}", "e.g. DiskStorage('/mnt/ssd/kvzch', ...)")
        if len(sizes) != 1:
            fail("needs one of cache_bytes (the table's DRAM) and shard_cache_bytes (each shard's), "
                 f"got {sorted(sizes) or 'neither'}", "give the DRAM the cached rows may take, e.g. cache_bytes=2 << 30")
        name, value = next(iter(sizes.items()))
        if not positive_int(value):
            fail(f"{name} must be a positive integer, got {value!r}",
                 "give the DRAM the table's cached rows may take, e.g. 2 << 30")
        policy = member(CachePolicy, self.policy, "policy", lambda problem: fail(problem, "e.g. policy='lfu'"))
        return dataclasses.replace(self, policy=policy)


@dataclass(frozen=True)
class DeviceCache:
    """On CUDA, rows in host memory under a cache in GPU memory (``table/row_cache.py``): each
    shard keeps its weights (and optimizer state wider than one value per row) in host memory,
    and fbgemm's TBE caches the rows its batches read in GPU memory. The cache holds ``rows``
    rows per shard, or ``load_factor`` of the rows the shard expects (its buckets' share of the
    table's ``expected_rows``; TorchRec's ``cache_load_factor``), or the smaller of the two when
    both are given (as TorchRec's ``max_l1_cache_size`` caps a load factor); ``policy`` picks the
    rows it drops first (fbgemm's LRU or LFU cache). ``prefetch_pipeline``: TorchRec's
    ``PrefetchTrainPipelineSparseDist`` brings each next batch's rows in while a batch trains
    (fbgemm's prefetch pipeline: LRU only; the table's parameters refuse it with an update the
    table runs itself or eviction in the lookups). The default, neither size, keeps every row in
    GPU memory."""

    rows: int | None = None
    load_factor: float | None = None
    policy: CachePolicy | str = CachePolicy.LRU
    prefetch_pipeline: bool = False

    @property
    def enabled(self) -> bool:
        return self.rows is not None or self.load_factor is not None

    def shard_rows(self, expected_rows: int, shard_buckets: int, total_buckets: int) -> int:
        """The cache's rows on a shard of ``shard_buckets`` of ``total_buckets``."""
        sizes = [] if self.rows is None else [self.rows]
        if self.load_factor is not None:
            sizes.append(max(1, math.ceil(self.load_factor * expected_rows * shard_buckets / total_buckets)))
        return min(sizes)

    def validate(self, table: str) -> "DeviceCache":
        def fail(problem: str, fix: str):
            raise ValueError(f"KV-ZCH table '{table}': device_cache {problem}; fix: {fix}")

        if self.rows is not None and not positive_int(self.rows):
            fail(f"rows must be a positive integer, got {self.rows!r}", "e.g. rows=1_000_000")
        lf = self.load_factor
        if lf is not None and not (isinstance(lf, (int, float)) and not isinstance(lf, bool) and 0 < lf <= 1):
            fail(f"load_factor must be a number in (0, 1], got {lf!r}", "e.g. load_factor=0.2")
        policy = member(CachePolicy, self.policy, "policy", lambda problem: fail(problem, "e.g. policy='lfu'"))
        if not isinstance(self.prefetch_pipeline, bool):
            fail(f"prefetch_pipeline must be True or False, got {self.prefetch_pipeline!r}", "pass a bool")
        if self.prefetch_pipeline and not self.enabled:
            fail("prefetch_pipeline is set without a cache to prefetch into", "give rows or load_factor too")
        if policy is not CachePolicy.LRU and not self.enabled:
            fail(f"policy {policy.value!r} is set without a cache size", "give rows or load_factor too")
        if self.prefetch_pipeline and policy is not CachePolicy.LRU:
            fail("prefetch_pipeline needs policy 'lru' (fbgemm's prefetch pipeline locks LRU cache lines only)",
                 "use policy='lru', or drop prefetch_pipeline")
        return dataclasses.replace(self, policy=policy)
