"""Eviction: a plain-Python model of each policy agrees with the store, the kernel keeps training
under a budget, and checkpoints after eviction hold exactly the surviving rows."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torchrec_kvzch import EvictionPolicy, KVZCHTableParams, RowStore
from torchrec_kvzch.kernel import KVZCHTableKernel
from torchrec_kvzch.store.eviction import budget_rows
from torchrec_kvzch.store.initializer import uniform_by_id_torch
from torchrec_kvzch.store.layout import meta_count, meta_timestamp

COUNT_MAX = (1 << 31) - 1


class Model:
    """What the policies promise, row by row, in plain Python."""

    def __init__(self, policy: EvictionPolicy, max_rows):
        self.policy, self.max_rows = policy, max_rows
        self.kind = policy.kind.value
        self.rows = {}  # id -> [timestamp, count]
        self.clock, self.due, self.frozen, self.evicted = 0, False, False, 0

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
        doomed = set()
        if self.kind in ("ttl", "lfu") and self.clock % self.policy.interval_steps == 0:
            self.due = True
        if self.due and not self.frozen:
            self.due = False
            for i, row in self.rows.items():
                if self.kind == "ttl":
                    expired = self.clock - row[0] > self.policy.ttl_steps
                else:
                    if self.policy.count_decay < 1.0:
                        row[1] = math.floor(row[1] * self.policy.count_decay)
                    expired = row[1] < self.policy.count_threshold
                if expired and i not in protected:
                    doomed.add(i)
        if self.max_rows is not None:
            new = len(set(ids) - self.rows.keys())
            survivors = len(self.rows) - len(doomed)
            if survivors + new > self.max_rows:
                need = survivors + new - (self.max_rows - self.max_rows // 64)
                pool = sorted((i for i in self.rows if i not in protected and i not in doomed), key=self.key)
                doomed.update(pool[:need])
        for i in doomed:
            del self.rows[i]
        self.evicted += len(doomed)


def store_rows(store):
    ids = store.sorted_ids()
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
        st.tuples(st.just("release"), st.none())), max_size=30))
    for op, arg in ops:
        if op == "batch":  # what the kernel does in a forward
            store.clock += 1
            store.evictor.before_insert(torch.tensor(arg, dtype=torch.long))
            store.find_or_insert(torch.tensor(arg, dtype=torch.long))
            model.forward(arg)
            if model.max_rows is not None:
                assert len(store) <= max(model.max_rows, len(set(arg)))  # past it by one batch at most
        elif op == "idle":
            for _ in range(arg):
                store.clock += 1
                store.evictor.before_insert(torch.empty(0, dtype=torch.long))
                model.forward([])
        elif op == "freeze" and snapshot is None:
            snapshot, model.frozen = store.snapshot(), True
            snapshot.freeze()
        elif op == "release" and snapshot is not None:
            snapshot.release()
            snapshot, model.frozen = None, False
        assert store_rows(store) == model.rows
        assert store.counters["evicted"] == model.evicted
        assert store.counters["rows"] == len(model.rows)


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
    kernel = KVZCHTableKernel(params, params.bucket_range(0, 1))
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, 2**30, (64,), generator=gen)
    for step in range(30):
        ids = first if step == 0 else torch.randint(0, 2**30, (64,), generator=gen)
        out = kernel(ids, torch.arange(0, 65, 4))
        out.sum().backward()
        assert len(kernel.store) <= 500 + 64
    assert kernel.store.counters["evicted"] > 1000
    assert (kernel.store.find(first) == -1).all()  # the oldest rows are gone from lookups
    # Seen again, an evicted id gets a new id-seeded row (not zeros, not its old trained row).
    out = kernel(first[:4], torch.tensor([0, 4]))
    expected = uniform_by_id_torch(first[:4], 8, *params.init_range, params.init_seed).sum(0)
    assert torch.allclose(out[0], expected)


def test_eviction_is_configured_in_yaml():
    from pathlib import Path

    from torchrec_kvzch.config import load_config

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "eviction.yaml")
    user, item = config.kvzch_tables
    assert (user.eviction.kind.value, user.eviction.ttl_steps, user.eviction.interval_steps) == ("ttl", 50, 10)
    assert (item.eviction.kind.value, item.eviction.max_bytes) == ("lru", 2**23)


def _train_evict_save_load(rank, world_size, path):
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvzch.checkpoint.manager import CheckpointManager
    from torchrec_kvzch.sharding import (KVZCHConstraints, KVZCHShardingPlanner, kvzch_embedding_bag_config,
                                         kvzch_sharders, kvzch_tables)

    tables = [KVZCHTableParams("lru", 8, num_embeddings=2**36, total_num_buckets=8, learning_rate=0.1,
                               enable_optimizer_offloading=True, backend_return_whole_row=True,
                               eviction=EvictionPolicy("lru", max_rows=300)),
              KVZCHTableParams("ttl", 8, num_embeddings=2**36, total_num_buckets=8, learning_rate=0.1,
                               enable_optimizer_offloading=True, backend_return_whole_row=True,
                               eviction=EvictionPolicy("ttl", ttl_steps=3))]

    def build():
        ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(t, [f"f_{t.name}"]) for t in tables],
                                     device=torch.device("meta"))
        planner = KVZCHShardingPlanner(Topology(world_size=world_size, compute_device="cpu"), batch_size=64,
                                       constraints={t.name: KVZCHConstraints(kvzch=t) for t in tables})
        sharders = kvzch_sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
        plan = planner.collective_plan(ebc, sharders, dist.group.WORLD)
        return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=sharders,
                                        env=ShardingEnv.from_process_group(dist.group.WORLD))

    model = build()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(12):  # 2 x 128 fresh ids per rank and step: far past the budget and the ttl
        ids = torch.randint(0, 2**36, (256,), generator=gen)
        features = KeyedJaggedTensor(keys=["f_lru", "f_ttl"], values=ids, lengths=torch.ones(256, dtype=torch.long))
        model(features).wait().values().sum().backward()
    evicted = {name: k.store.evictor.evicted for name, k in kvzch_tables(model)}
    survivors = {name: k.store.read_ids(k.store.sorted_ids(), "row") for name, k in kvzch_tables(model)}
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    CheckpointManager(path).save(state, step=12)
    fresh = build()
    state = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    CheckpointManager(path).load(state)
    fresh.load_state_dict(state["model"])
    loaded = {name: k.store.read_ids(k.store.sorted_ids(), "row") for name, k in kvzch_tables(fresh)}
    return evicted, {n: torch.equal(loaded[n].view(torch.int32), survivors[n].view(torch.int32)) for n in loaded}


def test_checkpoints_after_eviction_hold_exactly_the_surviving_rows(tmp_path):
    from _dist import run_ranks

    for evicted, same in run_ranks(2, _train_evict_save_load, str(tmp_path / "ckpt")):
        assert evicted["lru"] > 500 and evicted["ttl"] > 500
        assert same == {"lru": True, "ttl": True}
