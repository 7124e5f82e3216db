"""``DiskStorage``: where a KV-ZCH table keeps the rows its DRAM cache does not hold."""

from __future__ import annotations

import os
from dataclasses import dataclass

from torchrec_kvzch.params.checks import positive_int


@dataclass(frozen=True)
class DiskStorage:
    """Rows beyond a DRAM cache, on local disk (``table/disk_cache.py``). ``path``: a directory
    on local disk, this job's alone (each shard takes ``<path>/<table>/buckets-<start>-<end>``);
    ``cache_bytes``: the DRAM the table's rows may take, over all its shards (each shard gets
    its buckets' share, as a table budget is split). The default, no path, keeps every row in
    DRAM."""

    path: str | os.PathLike | None = None
    cache_bytes: int | None = None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def validate(self, table: str) -> "DiskStorage":
        def fail(problem: str, fix: str):
            raise ValueError(f"KV-ZCH table '{table}': storage {problem}; fix: {fix}")

        if self.path is None:
            if self.cache_bytes is not None:
                fail("cache_bytes is set without a path", "give the disk tier's directory as storage.path")
            return self
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            fail(f"path must be a directory name, got {self.path!r}", "e.g. DiskStorage('/mnt/ssd/kvzch', ...)")
        if not positive_int(self.cache_bytes):
            fail(f"cache_bytes must be a positive integer, got {self.cache_bytes!r}",
                 "give the DRAM the table's cached rows may take, e.g. 2 << 30")
        return self
