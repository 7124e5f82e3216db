"""A table over a disk tier keeps the rows the same table keeps in DRAM (issue 32): the property
below feeds both the same batches under each eviction rule, takes a frozen snapshot while
training goes on (what an async save reads), loads it into shards of another world size, each
over its own disk tier, and trains on. Every row, header and optimizer state, and every history,
stays equal bit for bit, whichever tier holds the row."""

import dataclasses
import itertools

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from hypothesis import HealthCheck, given, settings, strategies as st

from torchrec_kvzch import KVZCHTableParams, TableTBE
from torchrec_kvzch.params import DiskStorage, EvictionPolicy, RankBudget
from torchrec_kvzch.table import SharedBudget
from torchrec_kvzch.table.layout import RowLayout, RowPart, meta_count
from torchrec_kvzch.table.snapshot import RowSnapshot

BUCKETS, SPACE = 8, 2**40
POLICIES = {
    "lru": dict(kind="lru", max_rows=150),
    "lru_table_rows": dict(kind="lru", table_max_rows=150),
    "lfu": dict(kind="lfu", count_threshold=1, count_decay=0.7, interval_steps=4),
    "lfu_budget": dict(kind="lfu", count_threshold=1, count_decay=0.9, interval_steps=4, max_rows=140),
    "ttl": dict(kind="ttl", ttl_steps=3, interval_steps=2),
    "ttl_rows": dict(kind="ttl", ttl_steps=3, trigger="rows", trigger_rows=150),
    "l2": dict(kind="l2", l2_threshold=1.15, interval_steps=3),
    "feature_score": dict(kind="feature_score", keep_rows=120, count_decay=0.8, trigger="rows", trigger_rows=150),
}
_dirs = itertools.count()


def params(policy: dict, optimizer: str, **kw) -> KVZCHTableParams:
    return KVZCHTableParams("t", 16, num_embeddings=SPACE, total_num_buckets=BUCKETS, learning_rate=0.05,
                            stochastic_rounding=False, init_range=(-0.5, 0.5), optimizer=optimizer,
                            eviction=EvictionPolicy(**policy), **kw)


def pair(root, p: KVZCHTableParams, cache_rows: int, world: int, rank: int, budget=None):
    """(the shard over a disk tier with a cache of ``cache_rows`` rows, the same shard in DRAM)."""
    share = cache_rows * BUCKETS // (BUCKETS // world)  # cache_bytes is the table's, split by buckets
    disk = dataclasses.replace(p, storage=DiskStorage(root / f"tier{next(_dirs)}",
                                                      RowLayout.for_table(p).stored_bytes * share))
    r = p.bucket_range(rank, world)
    budgets = budget or (None, None)
    return (TableTBE(disk, r, num_features=1, pooling=PoolingMode.SUM, budget=budgets[0]),
            TableTBE(p, r, num_features=1, pooling=PoolingMode.SUM, budget=budgets[1]))


def train(shards, gen, universe, steps: int) -> None:
    """``steps`` steps of every (disk, dram) shard on the same batches, scores (a feature-score
    table's) and gradients, each shard fed the batch's ids of its buckets; their outputs must agree."""
    for _ in range(steps):
        ids = universe[torch.randint(0, universe.numel(), (32,), generator=gen)]
        scores = torch.randint(0, 8, (32,), generator=gen) / 4
        for disk, dram in shards:
            r = disk.store.bucket_range
            mine = (ids >= r.id_start) & (ids < r.id_end)
            offsets = torch.arange(int(mine.sum()) + 1)
            out, want = (t(ids[mine], offsets, scores=scores[mine]) for t in (disk, dram))
            assert torch.equal(out, want)
            grad = torch.randn(want.shape, generator=gen)
            out.backward(grad)
            want.backward(grad)


def same_rows(disk, dram) -> None:
    a, b = disk.store, dram.store
    keys = torch.sort(b.keys()).values
    assert len(a) + len(a.cache) == len(b)
    assert torch.equal(a.read_ids(keys, RowPart.ROW).view(torch.int32), b.read_ids(keys, RowPart.ROW).view(torch.int32))
    assert torch.equal(a.history.counters, b.history.counters) and a.clock == b.clock


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(sorted(POLICIES)), optimizer=st.sampled_from(["exact_rowwise_adagrad", "exact_sgd"]),
       cache_rows=st.integers(40, 90), world=st.sampled_from([2, 3]), seed=st.integers(0, 2**16))
def test_a_disk_tier_table_holds_what_a_dram_table_holds(tmp_path, policy, optimizer, cache_rows, world, seed):
    gen = torch.Generator().manual_seed(seed)
    universe = torch.randint(0, SPACE, (400,), generator=gen).unique()
    p = params(POLICIES[policy], optimizer)
    disk, dram = pair(tmp_path, p, cache_rows, 1, 0)
    train([(disk, dram)], gen, universe, 12)
    same_rows(disk, dram)
    assert len(disk.store.cache) > 0 and dram.store.history.evicted > 0  # rows on disk, rows evicted

    # An async save's snapshot: frozen, read after training went on (rows moved, evicted, decayed).
    snaps = [RowSnapshot(t.store) for t in (disk, dram)]
    for s in snaps:
        s.freeze()
    frozen = snaps[1].read(0, len(snaps[1]), RowPart.ROW).clone()
    clock, counters = dram.store.clock, dram.store.history.counters.clone()
    train([(disk, dram)], gen, universe, 4)
    rows = snaps[0].read(0, len(snaps[0]), RowPart.ROW)
    assert torch.equal(snaps[0].ids, snaps[1].ids) and torch.equal(rows.view(torch.int32), frozen.view(torch.int32))
    for s in snaps:
        s.release()

    # Loaded at another world size, each shard over its own disk tier, and trained on.
    shards = [pair(tmp_path, p, cache_rows, world, rank) for rank in range(world)]
    for disk_shard, dram_shard in shards:
        r = disk_shard.store.bucket_range
        mine = (snaps[1].ids >= r.id_start) & (snaps[1].ids < r.id_end)
        for t in (disk_shard, dram_shard):
            t.store.write_rows(rows[mine])
            t.store.restore_history(clock, counters[r.start:r.end], r.size)
        same_rows(disk_shard, dram_shard)
    train(shards, gen, universe, 8)
    for disk_shard, dram_shard in shards:
        same_rows(disk_shard, dram_shard)


def test_a_rank_budget_evicts_from_both_tiers_of_its_tables(tmp_path):
    """A rank budget over two tables, one with most rows on disk: it keeps the rows it keeps
    over the same tables in DRAM."""
    budgets = (SharedBudget(RankBudget(max_rows=300, order="lfu")), SharedBudget(RankBudget(max_rows=300, order="lfu")))
    p = params({}, "exact_rowwise_adagrad")
    q = dataclasses.replace(p, name="u")
    tables = [pair(tmp_path, p, 60, 1, 0, budgets), pair(tmp_path, q, 10**6, 1, 0, budgets)]
    gen = torch.Generator().manual_seed(5)
    universe = torch.randint(0, SPACE, (900,), generator=gen).unique()
    train(tables, gen, universe, 14)
    for disk, dram in tables:
        same_rows(disk, dram)
    assert len(tables[0][0].store.cache) > 0 and tables[0][1].store.history.evicted > 0
    assert budgets[0].usage() == budgets[1].usage() and budgets[1].usage()["rows"] <= 300 + 32


def test_lfu_decay_rewrites_the_headers_on_disk_without_writing_the_file(tmp_path):
    """A decay pass rewrites the header words the tier keeps in memory: the rows on disk read
    with their decayed counts, and the pass writes nothing to disk."""
    p = params(dict(kind="lfu", count_threshold=1, count_decay=0.5, trigger="manual"), "exact_sgd")
    disk, dram = pair(tmp_path, p, 40, 1, 0)
    gen = torch.Generator().manual_seed(6)
    universe = torch.randint(0, SPACE, (300,), generator=gen).unique()
    train([(disk, dram)], gen, universe, 10)
    tier = disk.store.cache.tier
    written, counts = tier.bytes_written, meta_count(tier.meta.clone())
    for t in (disk, dram):
        t.store.evictor.run_pass()
    assert tier.bytes_written == written and len(tier) == int((counts >= 2).sum()) > 0
    same_rows(disk, dram)


@pytest.mark.parametrize("kind", ["lru", "ttl"])
def test_an_evicted_row_leaves_the_disk_and_comes_back_fresh(tmp_path, kind):
    """A row evicted while on disk is gone from the tier (its position freed); looked up again,
    it starts from its id-seeded weights, as in DRAM."""
    policy = dict(kind="lru", max_rows=100) if kind == "lru" else dict(kind="ttl", ttl_steps=1, interval_steps=1)
    disk, dram = pair(tmp_path, params(policy, "exact_rowwise_adagrad"), 40, 1, 0)
    gen = torch.Generator().manual_seed(7)
    universe = torch.randint(0, SPACE, (400,), generator=gen).unique()
    train([(disk, dram)], gen, universe, 8)
    tier = disk.store.cache.tier
    assert dram.store.history.evicted > 0 and len(tier) > 0
    gone = universe[(disk.store.find(universe) < 0) & ~tier.find(universe)]
    assert gone.numel() and int(tier.used.sum()) == len(tier)  # no position kept for an evicted row
    train([(disk, dram)], gen, gone, 2)
    same_rows(disk, dram)
