"""Budgets across world sizes (issue 30, items 3 and 4): a budget per table is split over the
shards by buckets, a load that leaves a shard or a rank past its budget is brought under it by
the first training lookup, which says how many rows it evicted (and a delta after it restores
exactly), and a load keeps the store's up-front reservation."""

import logging
import re

import pytest
import torch

from torchrec_kvzch import EvictionPolicy, KVZCHTableParams, RankBudget, RowStore
from torchrec_kvzch.table.eviction import budget_bytes


def params(eviction, buckets=16, **kw):
    return KVZCHTableParams("t", 8, num_embeddings=buckets * 2**16, total_num_buckets=buckets,
                            eviction=eviction, **kw)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 16])
def test_a_table_budget_is_split_over_the_shards_by_buckets(world):
    p = params(EvictionPolicy("lru", table_max_rows=1000))
    stores = [RowStore(p, p.bucket_range(r, world)) for r in range(world)]
    shares = [s.evictor.max_rows for s in stores]
    assert sum(shares) == 1000  # the table's total holds at any world size
    for store, share in zip(stores, shares):
        assert abs(share - 1000 * store.bucket_range.num_buckets / 16) < 1
        assert store.capacity >= share  # reserved up front, as a per-shard budget is

    p = params(EvictionPolicy("lru", table_max_bytes=2**22))
    stores = [RowStore(p, p.bucket_range(r, world)) for r in range(world)]
    assert sum(s.evictor.policy.max_bytes for s in stores) == 2**22
    for s in stores:
        assert budget_bytes(s, s.evictor.max_rows) <= s.evictor.policy.max_bytes < budget_bytes(s, s.evictor.max_rows + 1)


def test_a_table_budget_and_a_shard_budget_together_keep_the_smaller():
    p = params(EvictionPolicy("ttl", ttl_steps=5, max_rows=200, table_max_rows=1000))
    assert [RowStore(p, p.bucket_range(r, 2)).evictor.max_rows for r in range(2)] == [200, 200]
    assert [RowStore(p, p.bucket_range(r, 8)).evictor.max_rows for r in range(8)] == [125] * 8


def test_a_shard_trains_under_its_share_of_the_table_budget():
    p = params(EvictionPolicy("lru", table_max_rows=600))
    store = RowStore(p, p.bucket_range(1, 3))  # buckets [6, 11): 5 of 16, a share of 187 rows
    r = store.bucket_range
    for step in range(10):
        store.lookup_for_update(torch.arange(64) + r.id_start + 64 * step)
        assert len(store) <= 187
    assert store.evictor.max_rows == 187 and store.counters["evicted"] > 400


@pytest.mark.parametrize("policy, world, fragment", [
    (dict(kind="lru", table_max_rows=0), 1, "eviction.table_max_rows must be a positive integer, got 0"),
    (dict(table_max_rows=100), 1, "a budget (eviction.table_max_rows / table_max_bytes) needs eviction.kind"),
    (dict(kind="lru"), 1, "or eviction.table_max_rows / table_max_bytes (per table)"),
    (dict(kind="lru", table_max_rows=10), 16,
     "eviction.table_max_rows=10 leaves the shard of buckets [0, 1) of 16 nothing (shares go by buckets); "
     "fix: set it to at least 16"),
    (dict(kind="lru", table_max_bytes=2**16), 16, "eviction.table_max_bytes=65536 leaves the shard of buckets "
     "[0, 1) 4096 bytes, less than one row takes"),
])
def test_bad_table_budgets_are_refused_naming_table_field_and_fix(policy, world, fragment):
    with pytest.raises(ValueError) as err:
        p = params(EvictionPolicy(**policy))
        RowStore(p, p.bucket_range(0, world))
    assert fragment in str(err.value) and "KV-ZCH table 't'" in str(err.value)


def test_a_table_budget_is_configured_in_yaml(tmp_path):
    from torchrec_kvzch.torchrec.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("tables:\n  - name: t\n    embedding_dim: 8\n    features: [f]\n"
                    "    kvzch: {total_num_buckets: 16, eviction: {kind: lru, table_max_rows: 2^12}}\n")
    [t] = load_config(path).kvzch_tables
    assert (t.eviction.kind.value, t.eviction.table_max_rows, t.eviction.max_rows) == ("lru", 4096, None)


def test_clearing_a_store_for_a_load_keeps_its_reservation():
    p = params(EvictionPolicy())
    store = RowStore(p, initial_rows=50_000)
    reserved, map_capacity = store.capacity, store.id_map.capacity
    store.find_or_insert(torch.arange(3000))
    store.clear()  # what a load does first
    store.reserve(3000)  # room for the rows that will arrive
    assert store.capacity >= max(reserved, 50_000) and store.id_map.capacity >= map_capacity


# -- across world sizes, through TorchRec and CheckpointManager --------------------------------
NAMES = ("shard", "table", "plain")


def _build():
    from _dist import sharded
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_kvzch.torchrec import KVZCHConstraints, kvzch_embedding_bag_config, kvzch_sharders

    evictions = {"shard": EvictionPolicy("lru", max_rows=300), "table": EvictionPolicy("lru", table_max_rows=600),
                 "plain": EvictionPolicy()}
    tables = [KVZCHTableParams(n, 8, num_embeddings=2**36, total_num_buckets=8, learning_rate=0.1,
                               enable_optimizer_offloading=True, backend_return_whole_row=True,
                               eviction=evictions[n], expected_rows=40_000) for n in NAMES]
    ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(t, [f"f_{t.name}"]) for t in tables],
                                 device=torch.device("meta"))
    sharders = kvzch_sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
                              rank_budget=RankBudget(max_rows=2000))
    model = sharded(ebc, {t.name: KVZCHConstraints(kvzch=t) for t in tables}, batch_size=64, sharders=sharders)
    return model, sharders[0].shared_budget


def _step(model, gen):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids = torch.randint(0, 2**36, (3 * 128,), generator=gen)
    features = KeyedJaggedTensor(keys=[f"f_{n}" for n in NAMES], values=ids,
                                 lengths=torch.ones(3 * 128, dtype=torch.long))
    model(features).wait().values().sum().backward()


def _stores(model):
    from torchrec_kvzch.torchrec import kvzch_tables

    return {name: k.store for name, k in kvzch_tables(model)}


def _state(model):
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def _train_and_save(rank, world_size, root):
    from torchrec_kvzch.checkpoint.manager import CheckpointManager

    model, _ = _build()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):  # 128 new ids per table shard and step: past 300 rows by the third
        _step(model, gen)
    CheckpointManager(root, full_every=2).save(_state(model), step=6)
    return {n: len(s) for n, s in _stores(model).items()}


def _load_train_save_reload(rank, world_size, root):
    from torchrec_kvzch.checkpoint.manager import CheckpointManager

    model, shared = _build()
    manager = CheckpointManager(root, full_every=2)
    assert manager.load(_state(model)) == 6
    stores = _stores(model)
    out = {"loaded": {n: len(s) for n, s in stores.items()}, "capacity": stores["plain"].capacity,
           "map_capacity": stores["plain"].id_map.capacity, "rank_rows": shared.usage()["rows"]}
    evicted = {n: s.history.evicted for n, s in stores.items()}
    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("torchrec_kvzch.table").addHandler(handler)
    _step(model, torch.Generator().manual_seed(100))
    logging.getLogger("torchrec_kvzch.table").removeHandler(handler)
    out["notes"] = notes
    out["after"] = {n: len(s) for n, s in stores.items()}
    out["evicted"] = {n: s.history.evicted - evicted[n] for n, s in stores.items()}
    manager.save(_state(model), step=7)
    out["chain"] = manager.chain(7)
    rows = {n: s.read_ids(torch.sort(s.keys()).values, "row").view(torch.int32) for n, s in stores.items()}
    counters = {n: s.history.counters.clone() for n, s in stores.items()}
    fresh, _ = _build()
    assert CheckpointManager(root).load(_state(fresh)) == 7
    again = _stores(fresh)
    out["same"] = {n: torch.equal(again[n].read_ids(torch.sort(again[n].keys()).values, "row").view(torch.int32),
                                  rows[n]) and torch.equal(again[n].history.counters, counters[n])
                   for n in NAMES}
    return out


def test_after_a_load_on_fewer_ranks_the_budgets_hold_and_say_what_they_evicted(tmp_path):
    """Saved on 2 ranks, loaded on 1: ``shard`` (lru, 300 rows per shard) holds both shards'
    rows, past its budget; ``table`` (lru, 600 rows per table) does not; the rank holds more
    than its budget of 2000 rows. The first training step evicts down to the budgets and logs
    it, a delta saved after it restores exactly, and the load kept ``plain``'s reservation."""
    from _dist import run_ranks

    saved = run_ranks(2, _train_and_save, str(tmp_path))
    assert all(s["shard"] <= 300 and s["table"] <= 300 for s in saved)
    [out] = run_ranks(1, _load_train_save_reload, str(tmp_path))
    loaded = out["loaded"]
    assert loaded["shard"] == sum(s["shard"] for s in saved) > 300
    assert loaded["table"] == sum(s["table"] for s in saved) <= 600
    assert out["rank_rows"] > 2000
    # The load kept the reservation (expected_rows: 40,000 on one rank): no growth copies after it.
    assert out["capacity"] >= 40_000 and out["map_capacity"] >= 40_000
    after = out["after"]
    assert after["shard"] <= 300 and after["table"] <= 600 and sum(after.values()) <= 2000 + 3 * 128
    [shard_note] = [m for m in out["notes"] if "KV-ZCH table 'shard'" in m]
    assert (f"a load left {loaded['shard']} rows in the shard of buckets [0, 8), past its budget of 300 rows "
            f"(eviction.max_rows=300); the lru policy evicted ") in shard_note
    said = int(re.search(r"policy evicted (\d+) rows", shard_note).group(1))
    assert loaded["shard"] - 300 <= said <= out["evicted"]["shard"]  # (the rank budget may take more)
    assert not [m for m in out["notes"] if "KV-ZCH table 'table'" in m]  # within its table budget
    [rank_note] = [m for m in out["notes"] if "rank budget" in m]
    assert rank_note.startswith("KV-ZCH rank budget (max_rows=2000): after a load, this rank's KV-ZCH table "
                                "shards held") and "past it; it evicted" in rank_note
    # The evictions are recorded as any are: the next save is a delta that restores exactly.
    assert out["chain"] == [6, 7]
    assert out["same"] == {n: True for n in NAMES}
