"""Eviction: which rows a table shard drops, decided from the rows' metaheaders.

The kernel calls ``Evictor.before_insert(ids)`` in each forward before looking the batch up, the
one moment no fused update is pending (a delete moves rows between slots). Two triggers:

* a periodic pass (``ttl``, ``lfu``) every ``interval_steps`` steps of the store's clock:
  ``ttl`` drops rows not touched for more than ``ttl_steps`` steps; ``lfu`` first decays every
  row's access count (``count := floor(count * count_decay)``), then drops rows whose count is
  below ``count_threshold``;
* a budget (``max_rows``, ``max_bytes``): when the batch's new rows would take the shard past it,
  the least valuable rows go first - oldest timestamp for ``lru`` and ``ttl``, lowest count (then
  oldest) for ``lfu``, ties by ascending id - down to 1/64 below the budget, so that the next
  batches do not each pay for a selection.

Rows of the batch being looked up are never evicted for it; if they alone exceed the budget the
shard goes past it by at most that batch. A pass that would rewrite every header (``lfu`` decay)
or scan them all waits while a checkpoint snapshot is frozen (the rewrite would make it copy the
table), and runs at the first forward after the snapshot is released. Budget evictions do not
wait: they copy only the rows they remove.
"""

from __future__ import annotations

import torch

from torchrec_kvzch.params import EvictionKind, EvictionPolicy
from torchrec_kvzch.store.layout import meta_count, meta_timestamp

_COUNT_SHIFT = 32
_COUNT_MASK = (1 << 31) - 1
# Peak scratch of one eviction, per live row: two masks, the sort keys and their candidate copy
# (int64 for lfu, which the budget accounting assumes for every policy).
SCRATCH_BYTES_PER_ROW = 1 + 1 + 8 + 8


def budget_rows(policy: EvictionPolicy, bytes_for_rows) -> int | None:
    """The row budget of a policy: ``max_rows``, and/or the most rows whose memory
    (``bytes_for_rows(rows)``, the store's upper bound) fits ``max_bytes``."""
    limits = [policy.max_rows] if policy.max_rows is not None else []
    if policy.max_bytes is not None:
        low, high = 0, 1
        while bytes_for_rows(high) <= policy.max_bytes:
            low, high = high, high * 2
        while high - low > 1:  # bytes_for_rows grows with rows: bisect the largest that fits
            mid = (low + high) // 2
            low, high = (mid, high) if bytes_for_rows(mid) <= policy.max_bytes else (low, mid)
        limits.append(low)
    return min(limits) if limits else None


class Evictor:
    def __init__(self, store) -> None:
        self.store = store
        self.policy = store.params.eviction
        self.kind = EvictionKind(self.policy.kind)
        self.max_rows = budget_rows(self.policy, lambda rows: store.estimated_bytes(store.layout, rows, reserved=True))
        self.evicted = 0
        self._pass_due = False

    def before_insert(self, ids: torch.Tensor) -> int:
        """Run a due pass, then make room under the budget for the batch ``ids``; returns the
        number of rows evicted."""
        if self.kind is EvictionKind.NONE:
            return 0
        store = self.store
        ids = store._check_ids(ids)
        present = store.find(ids)
        protected = torch.zeros(len(store), dtype=torch.bool, device=store.device)
        protected[present[present >= 0]] = True
        doomed = torch.zeros_like(protected)
        if self.kind in (EvictionKind.TTL, EvictionKind.LFU) and store.clock % self.policy.interval_steps == 0:
            self._pass_due = True
        if self._pass_due and not store._frozen:
            self._pass_due = False
            doomed |= self._expired() & ~protected
        if self.max_rows is not None:
            new = int(torch.unique(ids[present < 0]).numel()) if ids.numel() else 0
            survivors = len(store) - int(doomed.sum())
            if survivors + new > self.max_rows:
                need = survivors + new - (self.max_rows - self.max_rows // 64)
                doomed |= self._least_valuable(need, ~(protected | doomed))
        victims = torch.nonzero(doomed).view(-1)
        if victims.numel():
            store.delete(store.map.keys()[victims])
            self.evicted += victims.numel()
        return victims.numel()

    def _expired(self) -> torch.Tensor:
        """The periodic pass's verdict per live row (``lfu``: after decaying the counts)."""
        store = self.store
        meta = store.meta[: len(store)]
        if self.kind is EvictionKind.TTL:
            return store.clock - meta_timestamp(meta) > self.policy.ttl_steps
        if self.policy.count_decay < 1.0:
            count = (meta_count(meta).double() * self.policy.count_decay).floor().long()
            meta.copy_((meta & ~(_COUNT_MASK << _COUNT_SHIFT)) | (count << _COUNT_SHIFT))
        return meta_count(meta) < self.policy.count_threshold

    def _least_valuable(self, need: int, candidates: torch.Tensor) -> torch.Tensor:
        """The ``need`` least valuable candidate rows; ties go by ascending id, so the choice
        never depends on where rows sit in the arrays."""
        meta = self.store.meta[: len(self.store)]
        if self.kind is EvictionKind.LFU:
            key = meta_timestamp(meta) | (meta_count(meta) << _COUNT_SHIFT)
        else:  # the timestamp is the low int32 of the meta word: a view, no copy
            key = meta.view(torch.int32)[0::2] if meta.numel() else meta_timestamp(meta)
        pool = key[candidates]
        if need >= pool.numel():
            return candidates.clone()
        cutoff = torch.kthvalue(pool, need).values
        del pool
        chosen = candidates & (key < cutoff)
        tied = torch.nonzero(candidates & (key == cutoff)).view(-1)
        rest = need - int(chosen.sum())
        ids = self.store.map.keys()[tied]
        chosen[tied[torch.topk(ids, rest, largest=False).indices]] = True
        return chosen
