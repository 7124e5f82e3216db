"""Eviction: a plain-Python model of each policy agrees with the store, the kernel keeps training
under a budget, and checkpoints after eviction hold exactly the surviving rows."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torchrec_kvzch import EvictionPolicy, KVZCHTableParams, RankBudget, RowStore, SharedBudget
from torchrec_kvzch.job import config_path
from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.table.eviction import budget_rows
from torchrec_kvzch.table.initializer import uniform_by_id_torch
from torchrec_kvzch.table.layout import RowPart
from torchrec_kvzch.table.snapshot import RowSnapshot
from torchrec_kvzch.table.layout import meta_count, meta_timestamp

COUNT_MAX = (1 << 31) - 1


class Model:
    """What the policies promise, row by row, in plain Python."""

    def __init__(self, policy: EvictionPolicy, max_rows):
        self.policy, self.max_rows = policy, max_rows
        self.kind = policy.kind.value
        self.rows = {}  # id -> [timestamp, count]
        self.clock, self.evicted = 0, 0

    def forward(self, ids):
        self.clock += 1
        self.before_insert(ids)
        for i in ids:
            row = self.rows.setdefault(i, [self.clock, 0])
            row[0], row[1] = self.clock, min(row[1] + 1, COUNT_MAX)

    def key(self, i):
        ts, count = self.rows[i]
        return (count, ts, i) if self.kind == "lfu" else (ts, i)

    def before_insert(self, ids):
        if self.kind == "none":
            return
        protected = set(ids) & self.rows.keys()
        doomed = self.run_pass(protected) if self.kind in ("ttl", "lfu") and self.due() else set()
        if self.max_rows is not None:
            new = len(set(ids) - self.rows.keys())
            survivors = len(self.rows) - len(doomed)
            if survivors + new > self.max_rows:
                need = survivors + new - (self.max_rows - self.max_rows // 64)
                pool = sorted((i for i in self.rows if i not in protected and i not in doomed), key=self.key)
                doomed.update(pool[:need])
        self.drop(doomed)

    def due(self):
        trigger = self.policy.trigger.value
        if trigger == "rows":
            return len(self.rows) > self.policy.trigger_rows
        return trigger == "interval" and self.clock % self.policy.interval_steps == 0

    def run_pass(self, protected=frozenset()):
        doomed = set()
        for i, row in self.rows.items():
            old = self.clock - row[0] > (self.policy.ttl_steps or 0)
            if self.kind == "ttl":
                expired = old
            else:
                if self.policy.count_decay < 1.0:
                    row[1] = math.floor(row[1] * self.policy.count_decay)
                expired = row[1] < self.policy.count_threshold and (old or self.policy.ttl_steps is None)
            if expired and i not in protected:
                doomed.add(i)
        return doomed

    def drop(self, doomed):
        for i in doomed:
            del self.rows[i]
        self.evicted += len(doomed)


def store_rows(store):
    ids = torch.sort(store.keys()).values
    meta = store.meta[store.find(ids)]
    return {i: [t, c] for i, t, c in zip(ids.tolist(), meta_timestamp(meta).tolist(), meta_count(meta).tolist())}


POLICIES = {
    "lru": lambda d: EvictionPolicy("lru", max_rows=d.draw(st.integers(1, 40))),
    "ttl": lambda d: EvictionPolicy("ttl", ttl_steps=d.draw(st.integers(1, 4)),
                                    interval_steps=d.draw(st.integers(1, 3)),
                                    max_rows=d.draw(st.one_of(st.none(), st.integers(5, 40)))),
    "lfu": lambda d: EvictionPolicy("lfu", count_threshold=d.draw(st.integers(1, 3)),
                                    count_decay=d.draw(st.sampled_from([1.0, 0.5, 0.9])),
                                    interval_steps=d.draw(st.integers(1, 3)),
                                    max_rows=d.draw(st.one_of(st.none(), st.integers(5, 40)))),
    # fbgemm's count-and-timestamp rule: rare and old
    "lfu+ttl": lambda d: EvictionPolicy("lfu", count_threshold=d.draw(st.integers(1, 3)),
                                        ttl_steps=d.draw(st.integers(1, 4)),
                                        count_decay=d.draw(st.sampled_from([1.0, 0.5]))),
    "ttl@rows": lambda d: EvictionPolicy("ttl", ttl_steps=d.draw(st.integers(1, 4)), trigger="rows",
                                         trigger_rows=d.draw(st.integers(1, 30))),
    "lfu@manual": lambda d: EvictionPolicy("lfu", count_threshold=d.draw(st.integers(1, 3)), trigger="manual"),
}


@settings(max_examples=max(10, settings().max_examples // 2))
@pytest.mark.parametrize("kind", sorted(POLICIES))
@given(data=st.data())
def test_store_agrees_with_a_plain_model_of_the_policy(kind, data):
    policy = POLICIES[kind](data)
    params = KVZCHTableParams("t", 4, num_embeddings=2**20, total_num_buckets=16, eviction=policy)
    store = RowStore(params, backend=data.draw(st.sampled_from(["native", "torch"])))
    model = Model(params.eviction, store.evictor.max_rows)
    snapshot = None
    ops = data.draw(st.lists(st.one_of(
        st.tuples(st.just("batch"), st.lists(st.integers(0, 60), max_size=25)),
        st.tuples(st.just("idle"), st.integers(1, 3)),
        st.tuples(st.just("freeze"), st.none()),
        st.tuples(st.just("pass"), st.none()),
        st.tuples(st.just("release"), st.none())), max_size=30))
    for op, arg in ops:
        if op == "batch":  # a training forward's lookup
            store.lookup_for_update(torch.tensor(arg, dtype=torch.long))
            model.forward(arg)
            if model.max_rows is not None:
                assert len(store) <= max(model.max_rows, len(set(arg)))  # past it by one batch at most
        elif op == "idle":
            for _ in range(arg):
                store.lookup_for_update(torch.empty(0, dtype=torch.long))
                model.forward([])
        elif op == "pass":  # asked for between steps (the manual trigger's only pass)
            store.evictor.run_pass()
            if model.kind in ("ttl", "lfu"):
                model.drop(model.run_pass())
        elif op == "freeze" and snapshot is None:  # eviction goes on as if nothing were frozen
            snapshot = RowSnapshot(store)
            snapshot.freeze()
            at_freeze = snapshot.read(0, len(snapshot), "row").clone()
        elif op == "release" and snapshot is not None:
            assert torch.equal(snapshot.read(0, len(snapshot), "row"), at_freeze)  # headers too
            snapshot.release()
            snapshot = None
        assert store_rows(store) == model.rows
        assert store.counters["evicted"] == model.evicted
        assert store.counters["rows"] == len(model.rows)


class RankModel:
    """A rank budget over several tables, in plain Python: after each table's own policy, the
    rows of all tables in (budget order, table, id) order are chosen until the rank is 1/64
    below it; chosen rows of tables looked up earlier in the step (busy) stay for now."""

    def __init__(self, budget: RankBudget, tables: list[Model], layouts):
        self.budget, self.tables, self.layouts = budget, tables, layouts
        self.busy = set()  # tables looked up earlier in this step: their update is pending

    def over(self, rows: list[int], slack: bool) -> bool:
        used = []
        if self.budget.max_rows is not None:
            used.append((sum(rows), self.budget.max_rows))
        if self.budget.max_bytes is not None:
            used.append((sum(RowStore.estimated_bytes(lay, n, reserved=True) for lay, n in zip(self.layouts, rows)),
                         self.budget.max_bytes))
        return any(total > limit - (limit // 64 if slack else 0) for total, limit in used)

    def forward(self, j, ids):
        table = self.tables[j]
        table.clock += 1
        table.before_insert(ids)
        rows = [len(t.rows) for t in self.tables]
        rows[j] += len(set(ids) - table.rows.keys())
        if self.over(rows, slack=False):
            def key(ti):
                t, i = ti
                ts, count = self.tables[t].rows[i]
                return ((count, ts) if self.budget.order.value == "lfu" else (ts,)) + (t, i)
            pool = sorted(((t, i) for t, m in enumerate(self.tables) for i in m.rows
                           if not (t == j and i in ids)), key=key)
            for t, i in pool:
                if not self.over(rows, slack=True):
                    break
                rows[t] -= 1
                if t not in self.busy or t == j:
                    del self.tables[t].rows[i]
                    self.tables[t].evicted += 1
        for i in ids:
            row = table.rows.setdefault(i, [table.clock, 0])
            row[0], row[1] = table.clock, min(row[1] + 1, COUNT_MAX)
        self.busy.add(j)


@settings(max_examples=max(10, settings().max_examples // 2))
@given(data=st.data())
def test_rank_budget_agrees_with_a_plain_model(data):
    order = data.draw(st.sampled_from(["lru", "lfu"]))
    # Byte budgets: each store counts 24 KiB of hash tables, plus 54-294 bytes per row.
    budget = data.draw(st.one_of(
        st.builds(RankBudget, max_rows=st.integers(5, 130), order=st.just(order)),
        st.builds(RankBudget, max_bytes=st.integers(30_000, 120_000), order=st.just(order)),
        st.builds(RankBudget, max_rows=st.integers(10, 150), max_bytes=st.integers(30_000, 120_000),
                  order=st.just(order))))
    shared = SharedBudget(budget)
    stores, models = [], []
    for t in range(data.draw(st.integers(1, 3))):
        own = data.draw(st.sampled_from([EvictionPolicy(), EvictionPolicy("lru", max_rows=25),
                                         EvictionPolicy("ttl", ttl_steps=3)]))
        params = KVZCHTableParams(f"t{t}", data.draw(st.sampled_from([4, 16, 64])), num_embeddings=2**20,
                                  total_num_buckets=16, eviction=own)
        stores.append(RowStore(params, backend=data.draw(st.sampled_from(["native", "torch"])), budget=shared))
        models.append(Model(params.eviction, stores[-1].evictor.max_rows))
    model = RankModel(budget, models, [s.layout for s in stores])
    # A training step, as under DMP: every table's forward in turn (its clock advances even for an
    # empty batch), then every backward.
    batch = st.lists(st.integers(0, 200), max_size=30)
    steps = data.draw(st.lists(st.lists(batch, min_size=len(stores), max_size=len(stores)), min_size=3, max_size=15))
    for step in steps:
        new_this_step = 0
        for j, ids in enumerate(step):
            store = stores[j]
            store.expect_update(store.lookup_for_update(torch.tensor(ids, dtype=torch.long)))
            model.forward(j, ids)
            if budget.max_rows is not None:  # past it by at most the rows this step added
                assert shared.usage()["rows"] <= budget.max_rows + new_this_step + len(set(ids))
            new_this_step += len(set(ids))
        for store in stores:
            store.update_started()
        model.busy.clear()
        for store, m in zip(stores, models):
            assert store_rows(store) == m.rows
            assert store.counters["evicted"] == m.evicted


def test_rank_budget_takes_ties_by_table_then_id_and_defers_pending_tables():
    shared = SharedBudget(RankBudget(max_rows=4))
    a, b = (RowStore(KVZCHTableParams(name, 4, num_embeddings=2**20, total_num_buckets=16), budget=shared)
            for name in "ab")

    def forward(store, ids):
        store.expect_update(store.lookup_for_update(torch.tensor(ids, dtype=torch.long)))

    def step(batch_a, batch_b):
        forward(a, batch_a)
        forward(b, batch_b)
        a.update_started()
        b.update_started()

    step([10, 11], [1, 2])  # 4 rows, all last touched at step 1
    step([20], [])  # one must go: of the tied oldest rows, table a's (the first attached), lowest id
    assert torch.sort(a.keys()).values.tolist() == [11, 20] and torch.sort(b.keys()).values.tolist() == [1, 2]
    step([], [3])  # a's 11 is chosen, but a's update is pending: it stays, the rank is over by 1
    assert torch.sort(a.keys()).values.tolist() == [11, 20] and torch.sort(b.keys()).values.tolist() == [1, 2, 3]
    step([], [])  # a's next forward finds the rank over and evicts 11 then
    assert torch.sort(a.keys()).values.tolist() == [20] and torch.sort(b.keys()).values.tolist() == [1, 2, 3]
    assert (a.counters["evicted"], b.counters["evicted"]) == (2, 0)


def test_rank_budget_validation_and_one_budget_per_store():
    for kwargs, fragment in [({}, "set max_rows and/or max_bytes"),
                             ({"max_rows": 0}, "max_rows must be a positive integer"),
                             ({"max_bytes": 2**20, "order": "ttl"}, "order 'ttl' is unknown")]:
        with pytest.raises(ValueError, match=fragment):
            RankBudget(**kwargs)
    shared = SharedBudget(RankBudget(max_rows=10))
    store = RowStore(KVZCHTableParams("t", 4, num_embeddings=2**20, total_num_buckets=16), budget=shared)
    assert shared.stores == [store] and store.evictor.shared is shared
    with pytest.raises(ValueError, match="table 't': this store is already under a rank budget"):
        shared._register(store, store.evictor)


def test_byte_budget_is_the_most_rows_that_fit_and_is_reserved_up_front():
    params = KVZCHTableParams("t", 64, num_embeddings=2**20, total_num_buckets=16,
                              eviction=EvictionPolicy("lru", max_bytes=50 * 2**20))
    store = RowStore(params)
    rows, layout = store.evictor.max_rows, store.layout
    assert RowStore.estimated_bytes(layout, rows, reserved=True) <= 50 * 2**20
    assert RowStore.estimated_bytes(layout, rows + 1, reserved=True) > 50 * 2**20
    assert store.capacity >= rows  # the budget never pays for a growth copy
    both = EvictionPolicy("lru", max_rows=100, max_bytes=50 * 2**20)
    assert budget_rows(both, lambda r: RowStore.estimated_bytes(layout, r, reserved=True)) == 100


def test_kernel_trains_under_a_budget_and_evicted_ids_come_back_fresh():
    params = KVZCHTableParams("t", 8, num_embeddings=2**30, total_num_buckets=16, learning_rate=0.5,
                              eviction=EvictionPolicy("lru", max_rows=500))
    tbe = TableTBE(params, params.bucket_range(0, 1))
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, 2**30, (64,), generator=gen)
    for step in range(30):
        ids = first if step == 0 else torch.randint(0, 2**30, (64,), generator=gen)
        out = tbe(ids, torch.arange(0, 65, 4))
        out.sum().backward()
        assert len(tbe.store) <= 500 + 64
    assert tbe.store.counters["evicted"] > 1000
    assert (tbe.store.find(first) == -1).all()  # the oldest rows are gone from lookups
    # Seen again, an evicted id gets a new id-seeded row (not zeros, not its old trained row).
    out = tbe(first[:4], torch.tensor([0, 4]))
    expected = uniform_by_id_torch(first[:4], 8, *params.init_range, params.init_seed).sum(0)
    assert torch.allclose(out[0], expected)


def test_eviction_is_configured_in_yaml():

    from torchrec_kvzch.torchrec.config import load_config

    config = load_config(config_path("eviction"))
    user, item = config.kvzch_tables
    assert (user.eviction.kind.value, user.eviction.ttl_steps, user.eviction.interval_steps) == ("ttl", 50, 10)
    assert (item.eviction.kind.value, item.eviction.max_bytes) == ("lru", 2**23)
    assert config.rank_budget == RankBudget(max_bytes=2**24, order="lru")
    [sharder, _] = config.sharders()
    assert sharder.shared_budget.budget == config.rank_budget


def _train_evict_save_load(rank, world_size, path):
    from _dist import sharded
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvzch.checkpoint.manager import CheckpointManager
    from torchrec_kvzch.torchrec import KVZCHConstraints, kvzch_embedding_bag_config, kvzch_sharders, kvzch_tables

    tables = [KVZCHTableParams("lru", 8, num_embeddings=2**36, total_num_buckets=8, learning_rate=0.1,
                               enable_optimizer_offloading=True, backend_return_whole_row=True,
                               eviction=EvictionPolicy("lru", max_rows=300)),
              KVZCHTableParams("ttl", 8, num_embeddings=2**36, total_num_buckets=8, learning_rate=0.1,
                               enable_optimizer_offloading=True, backend_return_whole_row=True,
                               eviction=EvictionPolicy("ttl", ttl_steps=3)),
              KVZCHTableParams("plain", 8, num_embeddings=2**36, total_num_buckets=8, learning_rate=0.1,
                               enable_optimizer_offloading=True, backend_return_whole_row=True)]

    def build():
        ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(t, [f"f_{t.name}"]) for t in tables],
                                     device=torch.device("meta"))
        sharders = kvzch_sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
                                  rank_budget=RankBudget(max_rows=900))
        return sharded(ebc, {t.name: KVZCHConstraints(kvzch=t) for t in tables}, batch_size=64,
                       sharders=sharders), sharders

    model, sharders = build()
    gen = torch.Generator().manual_seed(rank)
    most_rows = 0
    for _ in range(12):  # 3 x 128 fresh ids per rank and step: far past the budgets and the ttl
        ids = torch.randint(0, 2**36, (384,), generator=gen)
        features = KeyedJaggedTensor(keys=["f_lru", "f_ttl", "f_plain"], values=ids,
                                     lengths=torch.ones(384, dtype=torch.long))
        model(features).wait().values().sum().backward()
        most_rows = max(most_rows, sharders[0].shared_budget.usage()["rows"])
    evicted = {name: k.store.history.evicted for name, k in kvzch_tables(model)}
    survivors = {name: k.store.read_ids(torch.sort(k.store.keys()).values, "row") for name, k in kvzch_tables(model)}
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    CheckpointManager(path).save(state, step=12)
    fresh, _ = build()
    state = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    CheckpointManager(path).load(state)
    fresh.load_state_dict(state["model"])
    loaded = {name: k.store.read_ids(torch.sort(k.store.keys()).values, "row") for name, k in kvzch_tables(fresh)}
    same = {n: torch.equal(loaded[n].view(torch.int32), survivors[n].view(torch.int32)) for n in loaded}
    return evicted, same, most_rows


def test_checkpoints_after_eviction_hold_exactly_the_surviving_rows(tmp_path):
    """On 2 ranks: a table's own lru budget, a ttl, and a rank budget over all three tables
    (``plain`` has no policy of its own), through the sharders; then a checkpoint round trip."""
    from _dist import run_ranks

    for evicted, same, most_rows in run_ranks(2, _train_evict_save_load, str(tmp_path / "ckpt")):
        assert evicted["lru"] > 500 and evicted["ttl"] > 500 and evicted["plain"] > 500
        assert most_rows <= 900 + 3 * 384  # past the rank budget by at most one step's new rows
        assert same == {"lru": True, "ttl": True, "plain": True}


def test_wall_clock_ttl_counts_minutes_from_an_injectable_clock():
    policy = EvictionPolicy("ttl", ttl_minutes=2)
    store = RowStore(KVZCHTableParams("t", 4, num_embeddings=2**20, total_num_buckets=16, eviction=policy))
    now = [1000.0]
    store.evictor.time_source = lambda: now[0]

    def step(ids, seconds):
        now[0] += seconds
        store.lookup_for_update(torch.tensor(ids, dtype=torch.long))

    step([1, 2], 0)
    step([3], 60)    # t = 60 s
    step([2], 50)    # t = 110 s: nothing is 2 minutes old yet
    assert sorted(torch.sort(store.keys()).values.tolist()) == [1, 2, 3]
    step([4], 15)    # t = 125 s: id 1 (t = 0) is past 120 s, id 2 was touched at 110 s
    assert sorted(torch.sort(store.keys()).values.tolist()) == [2, 3, 4]
    step([], 100)    # t = 225 s: id 3 (t = 60) goes, id 2 (110) and 4 (125) stay
    assert sorted(torch.sort(store.keys()).values.tolist()) == [2, 4]
    now[0] += 10_000
    assert store.evictor.run_pass() == 2 and len(store) == 0


def test_a_load_restarts_the_wall_clock_notes_so_loaded_rows_count_as_touched_at_resume():
    """Rolled back in the same process (a store that trained before its load): the notes of
    the steps before the load must not date the loaded rows (a load ends in restore_history)."""
    params = KVZCHTableParams("t", 4, num_embeddings=2**20, total_num_buckets=16,
                              eviction=EvictionPolicy("ttl", ttl_minutes=1))
    saved, store = RowStore(params), RowStore(params)
    saved.lookup_for_update(torch.arange(5))
    rows = saved.read(torch.arange(5), RowPart.ROW)
    now = [0.0]
    store.evictor.time_source = lambda: now[0]
    for _ in range(3):  # trained at t = 0, 1, 2 s
        store.lookup_for_update(torch.tensor([100]))
        now[0] += 1.0
    now[0] = 2000.0  # the rollback, half an hour later
    store.clear()
    store.write_rows(rows)
    store.restore_history(saved.clock, saved.history.counters, params.bucket_size)
    now[0] = 2001.0
    store.lookup_for_update(torch.tensor([50]))
    assert sorted(store.keys().tolist()) == [0, 1, 2, 3, 4, 50]


def test_a_refused_training_batch_leaves_the_clock_alone():
    """Ids outside the shard are refused before any row changes, and the step does not count:
    a TTL in steps keeps what it would have kept without the refused batch."""
    params = KVZCHTableParams("t", 4, num_embeddings=800, total_num_buckets=8,
                              eviction=EvictionPolicy("ttl", ttl_steps=2))
    store = RowStore(params, params.bucket_range(0, 2))  # ids [0, 400)
    store.lookup_for_update(torch.tensor([1]))
    store.lookup_for_update(torch.tensor([2]))
    for bad in ([3, 999], [3, -1]):
        with pytest.raises(ValueError, match="outside this shard's ids"):
            store.lookup_for_update(torch.tensor(bad))
    assert store.clock == 2
    store.lookup_for_update(torch.tensor([2]))  # step 3: id 1 is 2 steps old, kept
    assert sorted(store.keys().tolist()) == [1, 2]


def test_l2_rule_and_memory_triggers():
    params = KVZCHTableParams("t", 4, num_embeddings=2**20, total_num_buckets=16, init_range=(-1.0, 1.0),
                              eviction=EvictionPolicy("l2", l2_threshold=1.0, trigger="rows", trigger_rows=50))
    store = RowStore(params)
    ids = torch.arange(100)
    store.find_or_insert(ids)
    norms = store.weights[store.find(ids)].norm(dim=1)
    store.clock += 1
    store.evictor.before_insert(torch.empty(0, dtype=torch.long))  # 100 rows > 50: a pass
    assert torch.equal(torch.sort(store.keys()).values, ids[norms >= 1.0])

    free = [10 << 30]
    byfree = RowStore(dataclasses.replace(params, eviction=EvictionPolicy(
        "l2", l2_threshold=1.0, trigger="free_memory", free_memory_bytes=1 << 30, interval_steps=2)))
    byfree.evictor.available_memory = lambda: free[0]
    byfree.find_or_insert(ids)
    for clock, available, rows in [(1, 10 << 30, 100), (2, 10 << 30, 100), (3, 0, 100), (4, 0, int((norms >= 1).sum()))]:
        free[0] = available
        byfree.clock = clock
        byfree.evictor.before_insert(torch.empty(0, dtype=torch.long))
        assert len(byfree) == rows  # checked every 2 steps, and only below 1 GB free

    bybytes = RowStore(dataclasses.replace(params, eviction=EvictionPolicy(
        "l2", l2_threshold=1.0, trigger="bytes", trigger_bytes=RowStore.estimated_bytes(store.layout, 60, reserved=True))))
    bybytes.find_or_insert(ids[:50])
    bybytes.evictor.before_insert(torch.empty(0, dtype=torch.long))
    assert len(bybytes) == 50  # under the byte trigger: no pass
    bybytes.find_or_insert(ids)
    bybytes.evictor.before_insert(torch.empty(0, dtype=torch.long))
    assert len(bybytes) == int((norms >= 1).sum())
