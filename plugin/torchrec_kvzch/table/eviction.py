"""Eviction: which rows a table shard drops, decided from the rows' metaheaders.

The store calls ``Evictor.before_insert(ids)`` in each training lookup before looking the batch
up, when no fused update is pending (a delete moves rows between slots). Three triggers:

* a pass of the policy's rule (``ttl``, ``lfu``, ``l2``) when its trigger says so (every
  ``interval_steps`` steps of the store's clock by default; past a row count or a byte size;
  below an amount of free host memory; or only on request, ``run_pass``): ``ttl`` drops rows
  not touched for more than ``ttl_steps`` steps or ``ttl_minutes`` minutes; ``lfu`` first decays
  every row's access count (``count := floor(count * count_decay)``), then drops rows whose
  count is below ``count_threshold`` (with a TTL: only those also past it); ``l2`` drops rows
  whose weights' L2 norm is below ``l2_threshold``. Headers count time in steps; for a
  wall-clock TTL the evictor notes when steps happened (``time_source``, injectable for tests,
  one note a second at most) and finds the last step older than the TTL;
* the table's budget (``max_rows``, ``max_bytes`` per table shard, or this shard's share of
  ``table_max_rows`` / ``table_max_bytes``, by buckets): when the batch's new rows
  would take the shard past it, the least valuable rows go first - oldest timestamp for ``lru``
  and ``ttl``, lowest count (then oldest) for ``lfu``, ties by ascending id - down to 1/64 below
  the budget, so that the next batches do not each pay for a selection;
* a rank's budget, shared by several stores (``rank_budget.py``): the same, over the rows of
  all of them.

Rows of the batch being looked up are never evicted for it; if they alone exceed a budget the
shard (or rank) goes past it by at most that batch. A load (``loaded``) may leave a shard or a
rank past its budget (e.g. on fewer ranks than saved): the first training lookup after it evicts
down to the budget as every lookup does - as an uninterrupted run would at that step, so a
resume stays exact - and logs how many rows it evicted. Every decision depends on the rows and the
clock only, never on whether a checkpoint is being written: a frozen snapshot copies the rows
an eviction removes, and ``lfu`` decay, which rewrites every header, first has it keep the
header words (8 bytes a row, once per freeze), not whole rows.

Over a disk tier (``disk_cache.py``) a shard's rows are those in DRAM and those on disk, and
every rule, budget and trigger above counts both (a byte budget counts a row on disk as the
DRAM it would take), so a table keeps the rows it would keep without the tier: the rules read
the header words and weight norms the tier keeps in memory, never the disk, and an evicted row
leaves whichever tier holds it.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from torchrec_kvzch.params import EvictionKind, EvictionPolicy, EvictionTrigger
from torchrec_kvzch.table.id_map import as_ids
from torchrec_kvzch.table.layout import (
    RowLayout,
    decayed,
    meta_count,
    meta_count_then_timestamp,
    meta_score,
    meta_timestamp,
    meta_timestamp_view,
    touch_scores,
    weight_norms,
)
from torchrec_kvzch.table.shard_rows import batch_rows, locate, meta_parts, new_rows, shard_ids, shard_meta, shard_rows

logger = logging.getLogger(__name__)

# Peak scratch of one eviction, per live row: two masks, the order keys and their candidate copy
# (int64 for lfu, which the budget accounting assumes for every order).
SCRATCH_BYTES_PER_ROW = 1 + 1 + 8 + 8


def budget_bytes(store, rows: int) -> int:
    """What ``rows`` rows of ``store`` count against a byte budget, a table's or a rank's: the
    store's upper bound with its arrays reserved (``RowStore.estimated_bytes``)."""
    return store.estimated_bytes(store.layout, rows, reserved=True)


def shard_budget(params, r, estimated_bytes) -> tuple[EvictionPolicy, int | None]:
    """The eviction policy of ``params``' shard of buckets ``r`` and its row budget (None: no
    budget), ``estimated_bytes(layout, rows, reserved=True)`` counting a byte budget's rows: the
    store's, which the planner charges too."""
    policy = params.eviction.for_shard(r.start, r.end, params.total_num_buckets, params.name)
    layout = RowLayout.for_table(params)
    return policy, budget_rows(policy, lambda rows: estimated_bytes(layout, rows, reserved=True))


def budget_rows(policy: EvictionPolicy | RankBudget, bytes_for_rows) -> int | None:
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


def order_key(meta: torch.Tensor, order: EvictionKind) -> torch.Tensor:
    """Per row, a key that is smaller for rows that should go first: the count (a feature
    score's bits order as the score) then the timestamp for ``lfu``, the timestamp otherwise."""
    if order is EvictionKind.LFU:
        return meta_count_then_timestamp(meta)
    return meta_timestamp_view(meta)


def least_valuable(stores: Sequence, candidates: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
                   enough: Callable[[list[int]], bool]) -> list[torch.Tensor]:
    """The rows to evict from several stores: the shortest prefix of the candidate rows, in order
    of (key, store, id), whose removal makes ``enough(rows removed per store)`` true (all of
    them when even that is not enough). Masks and keys are over each store's ``shard_rows``;
    returns a mask per store.

    ``enough`` must be monotone (removing more never hurts), so the cut-off key is found by
    bisection over key values, each step counting rows below it with one vectorised pass per
    store, and the ties at the cut-off go by store, then ascending id."""
    pools = [key[mask] for key, mask in zip(keys, candidates)]
    if enough([0] * len(stores)) or not any(p.numel() for p in pools):
        return [torch.zeros_like(mask) for mask in candidates]
    if not enough([p.numel() for p in pools]):
        return [mask.clone() for mask in candidates]
    low = min(int(p.min()) for p in pools if p.numel())
    high = max(int(p.max()) for p in pools if p.numel())
    while low < high:  # the smallest key c such that removing every row with key <= c is enough
        mid = (low + high) // 2
        if enough([int((p <= mid).sum()) for p in pools]):
            high = mid
        else:
            low = mid + 1
    below = [int((p < low).sum()) for p in pools]
    del pools
    ties = [0] * len(stores)
    for j, key in enumerate(keys):  # ties at the cut-off: store by store, as few as needed
        tied = int((candidates[j] & (key == low)).sum())
        removed = [below[i] + ties[i] for i in range(len(stores))]
        removed[j] += tied
        if not enough(removed):
            ties[j] = tied
            continue
        fewest, most = 0, tied
        while fewest < most:
            mid = (fewest + most) // 2
            removed[j] = below[j] + mid
            fewest, most = (fewest, mid) if enough(removed) else (mid + 1, most)
        ties[j] = fewest
        break
    chosen = []
    for store, mask, key, take in zip(stores, candidates, keys, ties):
        picked = mask & (key < low)
        if take:
            tied = torch.nonzero(mask & (key == low)).view(-1)
            ids = shard_ids(store)[tied]
            picked[tied[torch.topk(ids, take, largest=False).indices]] = True
        chosen.append(picked)
    return chosen


class Evictor:
    """The eviction of one store: its table's policy, and the rank budget it shares, if any
    (``budget``, a ``rank_budget.SharedBudget``)."""

    def __init__(self, store, budget=None) -> None:
        self.store = store
        params, r = store.params, store.bucket_range
        self.policy, self.max_rows = shard_budget(params, r, store.estimated_bytes)
        self.kind = EvictionKind(self.policy.kind)
        self.scored = self.kind is EvictionKind.FEATURE_SCORE  # scores, not counts, in the headers
        if params.eviction.table_max_bytes is not None and self.max_rows == 0:
            one = budget_bytes(store, 1)
            raise ValueError(
                f"KV-ZCH table '{params.name}': eviction.table_max_bytes={params.eviction.table_max_bytes} "
                f"leaves the shard of buckets [{r.start}, {r.end}) {self.policy.max_bytes} bytes, less than "
                f"one row takes ({one}); fix: set it to at least "
                f"{-(-one * params.total_num_buckets // r.num_buckets)}, or use fewer buckets per rank")
        given = [f"{n}={getattr(params.eviction, n)}" for n in
                 ("max_rows", "max_bytes", "table_max_rows", "table_max_bytes") if getattr(params.eviction, n)]
        self._budget_note = "eviction." + ", ".join(given)  # for the note after a load
        self._loaded = False
        self.shared = None  # the rank's SharedBudget (rank_budget.py), set by its _register
        if budget is not None:
            budget._register(store, self)
        self.time_source: Callable[[], float] = time.time  # seconds; for ttl_minutes
        self.available_memory: Callable[[], int] = _available_memory  # bytes; free_memory trigger
        self._step_times: collections.deque = collections.deque()  # (step, seconds), ascending
        self._decayed_at: float | None = None  # seconds: the last decay, or the first training batch

    @property
    def in_lookups(self) -> bool:
        """Whether training lookups may evict rows of this store (its policy, or the rank's budget)."""
        return self.policy.in_lookups or self.shared is not None

    def before_insert(self, ids: torch.Tensor) -> int:
        """Run a due pass, then make room for the batch ``ids`` under the table's budget and the
        rank's; returns the number of rows evicted from this store and others."""
        held, self._loaded = (shard_rows(self.store) if self._loaded else None), False
        if self._decayed_at is None and self.policy.decay_interval_minutes is not None:
            self._decayed_at = self.time_source()  # (fbgemm counts from its start)
        evicted = self._own_policy(ids) if self.kind is not EvictionKind.NONE else 0
        if held is not None and self.max_rows is not None and held > self.max_rows:
            r = self.store.bucket_range
            logger.warning("KV-ZCH table '%s': a load left %d rows in the shard of buckets [%d, %d), past "
                           "its budget of %d rows (%s); the %s policy evicted %d rows before the first "
                           "training batch looked up", self.store.params.name, held, r.start, r.end,
                           self.max_rows, self._budget_note, self.kind.value, evicted)
        if self.shared is not None:
            evicted += self.shared.make_room(self.store, ids)
        return evicted

    def check_scores(self, scores: torch.Tensor | None) -> None:
        """Refuse a batch's scores that fbgemm's running sum of ``|score|`` would not add up."""
        if scores is None or not scores.numel() or bool((scores >= 0).all()):
            return
        at = int(torch.nonzero(~(scores >= 0))[0])
        raise ValueError(f"KV-ZCH table '{self.store.params.name}': feature score {float(scores[at])} at position "
                         f"{at} of the batch; scores must be >= 0 (fbgemm keeps |score| after each "
                         "occurrence, so a negative one has no order-free meaning): check the KJT's weights "
                         "or eviction.feature_scores")

    def touch(self, slots: torch.Tensor, scores: torch.Tensor | None) -> None:
        """A training lookup's header update: timestamps, and the access counts (the id map's
        kernels) or, in a feature-score table, the scores (``scores`` per slot)."""
        store = self.store
        if self.scored:
            touch_scores(store.meta, slots, scores, store.clock, store.native)
        else:
            store.id_map.backend.touch(store.meta, slots, store.clock)

    def loaded(self) -> None:
        """A load replaced or changed the rows (``RowStore.restore_history``, which every load
        ends with): the next training lookup says what it evicts if the load left the shard,
        or the rank, past a budget."""
        self._loaded = True
        self._step_times.clear()  # (of steps before the load: its rows count as touched at the next one)
        if self.shared is not None:
            self.shared.loaded = True

    def remove(self, doomed: torch.Tensor) -> int:
        """Evict the rows of the mask ``doomed`` (over ``shard_rows``)."""
        victims = torch.nonzero(doomed).view(-1)
        if victims.numel():
            self.store.evict(shard_ids(self.store)[victims])
        return victims.numel()

    def run_pass(self) -> int:
        """Run the policy's pass now (``trigger="manual"``, or between steps for any trigger);
        returns the rows evicted. Refused while a fused update of this store is pending."""
        if self.store.pending_update is not None:
            raise RuntimeError(f"KV-ZCH table '{self.store.params.name}': an eviction pass cannot run "
                               "between a forward and its backward; run it after the step")
        if not self.kind.has_pass:
            return 0
        self._note_time()
        return self.remove(self._expired())

    def _own_policy(self, ids: torch.Tensor) -> int:
        store = self.store
        ids = as_ids(ids, store.device, check=False)  # range: checked by find
        present = locate(store, ids)
        protected = batch_rows(store, present)
        doomed = torch.zeros_like(protected)
        self._note_time()
        if self.kind.has_pass and self._pass_due():
            doomed |= self._expired() & ~protected
        if self.max_rows is not None:
            new = new_rows(ids, present)
            survivors = shard_rows(store) - int(doomed.sum())
            if survivors + new > self.max_rows:
                target = self.max_rows - self.max_rows // 64
                by_count = self.kind in (EvictionKind.LFU, EvictionKind.FEATURE_SCORE)  # (scores order as counts)
                order = EvictionKind.LFU if by_count else EvictionKind.LRU
                key = order_key(shard_meta(store), order)
                [extra] = least_valuable([store], [~(protected | doomed)], [key],
                                         lambda removed: survivors - removed[0] + new <= target)
                doomed |= extra
        return self.remove(doomed)

    def _pass_due(self) -> bool:
        policy, store = self.policy, self.store
        trigger = policy.trigger
        if trigger is EvictionTrigger.INTERVAL:
            return store.clock % policy.interval_steps == 0
        if trigger is EvictionTrigger.ROWS:
            return shard_rows(store) > policy.trigger_rows
        if trigger is EvictionTrigger.BYTES:
            return budget_bytes(store, shard_rows(store)) > policy.trigger_bytes
        if trigger is EvictionTrigger.FREE_MEMORY:
            return (store.clock % policy.interval_steps == 0
                    and self.available_memory() < policy.free_memory_bytes)
        return False  # manual

    def _expired(self) -> torch.Tensor:
        """The pass's verdict per live row (``lfu``: after decaying the counts)."""
        store, policy = self.store, self.policy
        if self.kind is EvictionKind.L2:
            if store.row_cache is not None:  # (the fresh weights are the cached ones)
                store.row_cache.flush()
            norms = weight_norms(store.weights[: len(store)])
            return (norms if store.cache is None else torch.cat([norms, store.cache.tier.norm])) < policy.l2_threshold
        # fbgemm sets a feature-score cut from the scores before the pass decays them, and
        # compares the decayed ones with it.
        decay = self.kind is not EvictionKind.TTL and policy.count_decay < 1.0 and self._decay_due()
        before = meta_score(shard_meta(store)) if self.scored and decay else None
        if decay:
            store.before_header_rewrite(decay=policy.count_decay)
            for words in meta_parts(store):
                words.copy_(decayed(words, policy.count_decay, scores=self.scored))
        meta = shard_meta(store)
        if self.kind is EvictionKind.TTL:
            return self._past_ttl(meta)
        if self.scored:
            after = meta_score(meta)
            return lowest_scores(after if before is None else before, policy.keep_rows, policy.score_bucket_width,
                                 policy.score_buckets, after)
        rare = meta_count(meta) < policy.count_threshold
        if policy.ttl_steps is None and policy.ttl_minutes is None:
            return rare
        return rare & self._past_ttl(meta)

    def _decay_due(self) -> bool:
        """Whether this pass decays (``decay_interval_minutes``: once that long has passed
        since the last decay, or since the first training batch)."""
        minutes = self.policy.decay_interval_minutes
        if minutes is None:
            return True
        now = self.time_source()
        if self._decayed_at is not None and now - self._decayed_at < minutes * 60.0:
            return False
        self._decayed_at = now
        return True

    def _past_ttl(self, meta: torch.Tensor) -> torch.Tensor:
        stamps = meta_timestamp(meta)
        if self.policy.ttl_steps is not None:
            return self.store.clock - stamps > self.policy.ttl_steps
        return stamps < self._last_expired_step()

    def _note_time(self) -> None:
        """Remember when this step happened (wall-clock TTL only), at most once a second; drop
        the notes no cut-off can need any more (all but the newest one past the TTL)."""
        if self.policy.ttl_minutes is None:
            return
        now, notes = self.time_source(), self._step_times
        if not notes or now - notes[-1][1] >= 1.0:
            notes.append((self.store.clock, now))
        cutoff = now - self.policy.ttl_minutes * 60.0
        while len(notes) > 1 and notes[1][1] < cutoff:
            notes.popleft()

    def _last_expired_step(self) -> int:
        """Rows stamped before the returned step were last touched more than ``ttl_minutes``
        ago. A step is as old as the newest note at or before it; rows from before the first
        note (e.g. loaded from a checkpoint) count as touched at the first note."""
        cutoff = self.time_source() - self.policy.ttl_minutes * 60.0
        notes = self._step_times
        if not notes or notes[0][1] >= cutoff:
            return -1
        fresh = [step for step, seconds in notes if seconds >= cutoff]
        return fresh[0] if fresh else self.store.clock + 1


_ZERO_SCORE = 1e-9  # (fbgemm's: a score below it is none)


def lowest_scores(scores: torch.Tensor, keep: int, width: float, buckets: int,
                  decayed: torch.Tensor | None = None) -> torch.Tensor:
    """The rows a feature-score pass drops, chosen as fbgemm's ``FeatureScoreBasedEvict`` does:
    none if at most ``keep`` rows; every zero score if those alone leave at most ``keep``;
    else, with scores in buckets (0: zero; ``b``: ``[(b - 1) * width, b * width)``; the last
    also every higher score), the smallest ``b`` whose buckets up to it hold enough rows, and
    every row scoring at most ``b * width`` goes (fbgemm 1.6 on: ``<=``). ``scores`` set the cut, which ``decayed`` (the
    same rows after the pass's decay; default: ``scores``) are compared with."""
    decayed = scores if decayed is None else decayed
    excess = scores.numel() - keep
    if excess <= 0:
        return torch.zeros(decayed.shape, dtype=torch.bool, device=decayed.device)
    zero = scores.abs() < _ZERO_SCORE
    if int(zero.sum()) >= excess:
        return decayed.abs() < _ZERO_SCORE
    wide = scores.double()
    bucket = torch.where(zero, 0, ((wide / width).long() + 1).clamp(max=buckets - 1))
    bucket[wide >= buckets * width] = buckets - 1  # (also where the quotient overflowed int64)
    held = torch.bincount(bucket, minlength=buckets).cumsum(0)
    cut = max(1, int(torch.searchsorted(held, excess)))
    return decayed.double() <= cut * width


def _available_memory() -> int:
    """The host's available memory in bytes (``MemAvailable``; free pages where unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
