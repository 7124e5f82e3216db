"""A shard's history per bucket: rows ever created by lookups, and rows evicted.

Kept per bucket, not per shard, so that checkpoints carry it by bucket and it follows the rows
to any world size (``restore`` maps a saved bucket geometry onto this shard's).
"""

from __future__ import annotations

import torch

from torchrec_kvzch.params import BucketRange

INSERTED, EVICTED = 0, 1


class BucketHistory:
    def __init__(self, bucket_range: BucketRange) -> None:
        self.bucket_range = bucket_range
        self.counters = torch.zeros(bucket_range.num_buckets, 2, dtype=torch.long)  # [buckets, 2]

    @property
    def inserted(self) -> int:
        return int(self.counters[:, INSERTED].sum())

    @property
    def evicted(self) -> int:
        return int(self.counters[:, EVICTED].sum())

    def count(self, column: int, ids: torch.Tensor) -> None:
        """Add one to ``column`` (``INSERTED`` or ``EVICTED``) of each id's bucket."""
        if ids.numel():
            local = self.bucket_range.local_buckets(ids.cpu())
            self.counters[:, column].index_add_(0, local, torch.ones_like(local))

    def restore(self, counters: torch.Tensor, bucket_size: int) -> None:
        """Take the counts of a table saved with ``bucket_size`` ids per bucket (``counters``
        ``[saved buckets, 2]``): each saved bucket's counts go to the bucket here that holds its
        first id (exactly its own when the geometry is the same)."""
        first = torch.arange(counters.shape[0], dtype=torch.long) * bucket_size
        r = self.bucket_range
        mine = (first >= r.id_start) & (first < r.id_end)
        self.counters.zero_().index_add_(0, r.local_buckets(first[mine]), counters[mine].long())
