"""A rank's memory budget (``params.RankBudget``) shared by all KV-ZCH table shards of a rank.

Each store under it (``kvzch_sharders(rank_budget=...)`` attaches every store it shards) asks
``make_room`` in each training lookup, after its table's own policy (``eviction.py``): when
the batch's new rows would take the rank past the budget, the least valuable rows of any of
the stores go, in the budget's order (ties by store, then id), down to 1/64 below it. A store
whose fused update is pending (looked up earlier in this step) cannot lose rows now - a delete
would move rows under the update - so its share of the chosen rows stays until its next
forward, which finds the rank still past the budget and evicts them then.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref

import torch

from torchrec_kvzch.params import EvictionKind, RankBudget
from torchrec_kvzch.table.eviction import Evictor, budget_bytes, budget_rows, least_valuable, order_key
from torchrec_kvzch.table.shard_rows import batch_rows, locate, new_rows, shard_meta, shard_rows
from torchrec_kvzch.table.id_map import as_ids

logger = logging.getLogger(__name__)


class SharedBudget:
    """A ``RankBudget`` over the stores attached to it: all KV-ZCH table shards of a rank
    (``kvzch_sharders(rank_budget=...)`` attaches every store it shards). Stores are held weakly,
    so the tables of a dropped model leave the budget."""

    def __init__(self, budget: RankBudget) -> None:
        if not isinstance(budget, RankBudget):
            raise TypeError(f"SharedBudget needs a RankBudget, got {type(budget).__name__}")
        self.budget = budget
        self._stores: list[weakref.ref] = []
        self.loaded = False  # a store under it was loaded since the last make_room (Evictor.loaded)

    def _register(self, store, evictor: Evictor) -> None:
        """Put ``store`` (being built, with ``evictor``) under this budget. On CPU its row arrays
        are reserved for as many rows as the whole budget holds of its rows (address space
        only), so it never grows by copying."""
        if evictor.shared is not None:
            raise ValueError(f"table '{store.params.name}': this store is already under a rank budget")
        other = next((s for s in self.stores if s.evictor.scored != evictor.scored), None)
        if other is not None and self.budget.order is EvictionKind.LFU:  # (count fields hold scores there)
            scored, counted = (store, other) if evictor.scored else (other, store)
            raise ValueError(f"rank budget: order 'lfu' compares access counts, but table '{scored.params.name}' "
                             f"keeps feature scores where table '{counted.params.name}' keeps counts; use "
                             "order='lru', or give the feature-score tables a budget of their own")
        evictor.shared = self
        self._stores.append(weakref.ref(store))
        if store.device.type == "cpu":  # at most the machine's memory: a larger mapping may be refused
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            most = dataclasses.replace(self.budget, max_bytes=min(self.budget.max_bytes or physical, physical))
            store.reserve(budget_rows(most, lambda rows: budget_bytes(store, rows)), id_map=False)

    @property
    def stores(self) -> list:
        """The live stores under the budget, in the order they were attached."""
        alive = [(ref, ref()) for ref in self._stores]
        self._stores = [ref for ref, store in alive if store is not None]
        return [store for _, store in alive if store is not None]

    def usage(self) -> dict[str, int]:
        """Rows and counted bytes over all stores under the budget."""
        stores = self.stores
        return {"rows": sum(map(shard_rows, stores)), "bytes": sum(budget_bytes(s, shard_rows(s)) for s in stores)}

    def make_room(self, store, ids: torch.Tensor) -> int:
        """Evict from the stores under the budget so that the new rows of ``ids`` in ``store``
        fit; returns the rows evicted (from any store)."""
        stores = self.stores
        if store not in stores:
            raise ValueError(f"table '{store.params.name}': this store is not under the rank budget")
        ids = as_ids(ids, store.device, check=False)  # range: checked by find
        present = locate(store, ids)
        new = new_rows(ids, present)
        at, budget = stores.index(store), self.budget

        def over(removed: list[int], slack: bool) -> bool:
            """Past the budget (``slack``: past 1/64 below it) after removing and inserting."""
            rows = [shard_rows(s) - r + (new if i == at else 0) for i, (s, r) in enumerate(zip(stores, removed))]
            used = []
            if budget.max_rows is not None:
                used.append((sum(rows), budget.max_rows))
            if budget.max_bytes is not None:
                used.append((sum(map(budget_bytes, stores, rows)), budget.max_bytes))
            return any(total > limit - (limit // 64 if slack else 0) for total, limit in used)

        loaded, self.loaded = self.loaded, False
        if not over([0] * len(stores), slack=False):
            return 0
        held = self.usage() if loaded else {}
        past = [f"{n}={getattr(budget, n)}" for n in ("max_rows", "max_bytes")
                if getattr(budget, n) is not None and held.get(n[4:], 0) > getattr(budget, n)]
        protected = batch_rows(store, present)
        candidates = [~protected if s is store else torch.ones(shard_rows(s), dtype=torch.bool, device=s.device)
                      for s in stores]
        keys = [order_key(shard_meta(s), budget.order) for s in stores]
        doomed = least_valuable(stores, candidates, keys, lambda removed: not over(removed, slack=True))
        # Rows chosen in a store whose fused update is pending stay until its next forward.
        evicted = sum(s.evictor.remove(mask) for s, mask in zip(stores, doomed)
                      if s is store or s.pending_update is None)
        if past:
            logger.warning("KV-ZCH rank budget (%s): after a load, this rank's KV-ZCH table shards held "
                           "%d rows, %d bytes at the first training lookup, past it; it evicted %d rows "
                           "(%s order) before the batch was looked up", ", ".join(past), held["rows"],
                           held["bytes"], evicted, budget.order.value)
        return evicted
