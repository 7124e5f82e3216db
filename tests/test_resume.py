"""Exact resume, loads that change everything or nothing, and geometry changes by id.

Each test starts its gloo ranks once and runs many cases in them: a phase at world size W runs
on ranks [0, W) over a group of its own (the other ranks wait), so one spawn covers saving at
one world size and loading at another. The hypothesis property is driven by rank 0, which
broadcasts each drawn example to the other ranks and checks the gathered results.
"""

import os
import shutil
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from _dist import RankPool
from torchrec_kvzch import EvictionPolicy, KVZCHTableParams, RankBudget
from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.sharding import (KVZCHConstraints, KVZCHShardingPlanner, kvzch_embedding_bag_config,
                                     kvzch_sharders, kvzch_tables)

BUCKETS, BUCKET_SIZE = 6, 2**30
EVICTION = {
    "none": EvictionPolicy(),
    "ttl": EvictionPolicy("ttl", ttl_steps=2, interval_steps=1),
    "lfu": EvictionPolicy("lfu", count_threshold=2, count_decay=0.5, interval_steps=2),
    "lru": EvictionPolicy("lru", max_rows=25),
    "rank": EvictionPolicy(),  # and a rank budget over both KV-ZCH tables
}
PER_WORLD = ("none", "ttl", "lfu")  # rows do not depend on the world size; budgets do


# -- the model ---------------------------------------------------------------------------------
def table_params(kind="none", num_embeddings=BUCKETS * BUCKET_SIZE, buckets=BUCKETS,
                 optimizer="exact_rowwise_adagrad", whole_row=(True, False)):
    return [KVZCHTableParams(name, 8, num_embeddings=num_embeddings, total_num_buckets=buckets,
                             learning_rate=0.1, optimizer=optimizer, enable_optimizer_offloading=True,
                             backend_return_whole_row=whole, eviction=EVICTION[kind] if name == "t" else EvictionPolicy(),
                             checkpoint_chunk_rows=16, expected_rows=500)
            for name, whole in zip(("t", "u"), whole_row)]


class Net(nn.Module):
    def __init__(self, kv) -> None:
        super().__init__()
        plain = EmbeddingBagConfig(name="plain", embedding_dim=8, num_embeddings=40, feature_names=["f_plain"])
        self.ebc = EmbeddingBagCollection(
            tables=[kvzch_embedding_bag_config(t, [f"f_{t.name}"]) for t in kv] + [plain],
            device=torch.device("meta"))
        self.dense = nn.Linear(24, 1)

    def forward(self, kjt):
        return self.dense(self.ebc(kjt).values())


def build(pg, kind="none", **table_kw):
    """DMP over ``pg``, its fused and dense optimizers."""
    kv = table_params(kind, **table_kw)
    torch.manual_seed(0)
    net = Net(kv)
    world = dist.get_world_size(pg)
    planner = KVZCHShardingPlanner(Topology(world_size=world, compute_device="cpu", local_world_size=world),
                                   batch_size=16, constraints={t.name: KVZCHConstraints(kvzch=t) for t in kv})
    sharders = kvzch_sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
                              rank_budget=RankBudget(max_rows=50) if kind == "rank" else None)
    plan = planner.collective_plan(net, sharders, pg)
    model = DistributedModelParallel(net, device=torch.device("cpu"), plan=plan, sharders=sharders,
                                     env=ShardingEnv.from_process_group(pg))
    dense = torch.optim.Adagrad(model.module.dense.parameters(), lr=0.05)
    return model, dense


def state_of(model, dense):
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict(), "dense": dense.state_dict()}


def batch(step, rank, world, high=BUCKETS * BUCKET_SIZE, examples=12, seed=0):
    """Step ``step``'s global batch (one id per feature and example: no pooled sums, so outputs
    and updates are bitwise the same at every world size), rank's slice of it."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    population = torch.randint(0, high, (40,), generator=torch.Generator().manual_seed(seed))
    def ids():
        known = population[torch.randint(0, 40, (examples,), generator=gen)]
        fresh = torch.randint(0, high, (examples,), generator=gen)
        return torch.where(torch.rand(examples, generator=gen) < 0.3, fresh, known)
    values = torch.stack([ids(), ids(), torch.randint(0, 40, (examples,), generator=gen)])
    part = examples // world
    mine = values[:, rank * part:(rank + 1) * part]
    return KeyedJaggedTensor(keys=["f_t", "f_u", "f_plain"], values=mine.reshape(-1),
                             lengths=torch.ones(mine.numel(), dtype=torch.long))


def train_step(model, dense, step, rank, world):
    out = model(batch(step, rank, world))
    out.sum().backward()
    dense.step()
    dense.zero_grad()
    return out.detach()


def snapshot(model, dense, pg):
    """Everything the model is, gathered over the group: every KV-ZCH row with its header (raw
    bits), each rank's clock and counters per table, the ordinary table's weights and optimizer
    state, and the dense weights and optimizer state."""
    rows, history = {}, {}
    for name, kernel in kvzch_tables(model):
        store = kernel.store
        ids = store.sorted_ids()
        rows.update(((name, i), r) for i, r in zip(ids.tolist(), store.read_ids(ids, "row").view(torch.int32)))
        history[name] = (store.clock, store.inserted, store.evicted, len(store))
    fused = model.fused_optimizer.state_dict()["state"]["ebc.embedding_bags.plain.weight"]["plain.momentum1"]
    mine = {"rows": rows, "history": history,
            "plain": _shards(model.state_dict()["ebc.embedding_bags.plain.weight"]), "plain_opt": _shards(fused)}
    gathered = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, mine, group=pg)
    merged = {"rows": {}, "history": [g["history"] for g in gathered], "plain": {}, "plain_opt": {}}
    for g in gathered:
        for key in ("rows", "plain", "plain_opt"):
            merged[key].update(g[key])
    merged["dense"] = [p.detach().clone() for p in model.module.dense.parameters()]
    merged["dense_opt"] = [dense.state[p]["sum"].clone() for p in model.module.dense.parameters()]
    return merged


def _shards(entry):
    if isinstance(entry, ShardedTensor):
        return {tuple(s.metadata.shard_offsets): s.tensor.clone() for s in entry.local_shards()}
    return {(0, 0): entry.clone()}


def same(a, b) -> list[str]:
    """The parts where two snapshots differ (bit for bit)."""
    diff = [k for k in ("history",) if a[k] != b[k]]
    for key in ("rows", "plain", "plain_opt"):
        if a[key].keys() != b[key].keys():
            diff.append(f"{key}: keys {len(a[key])} vs {len(b[key])}")
        else:
            diff += [f"{key} {k}" for k in a[key] if not torch.equal(a[key][k], b[key][k])][:3]
    diff += [f"dense {i}" for i, (x, y) in enumerate(zip(a["dense"] + a["dense_opt"], b["dense"] + b["dense_opt"]))
             if not torch.equal(x, y)]
    return diff


# -- 1. resume is exact ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pools():
    """Ranks for world sizes 1-3, started once for every case of this module."""
    started = {w: RankPool(w, timeout=600) for w in (1, 2, 3)}
    yield started
    for pool in started.values():
        pool.close()


def reference_run(rank, world, kind, n, m):
    """N + M steps, with evaluation forwards of unseen ids between steps (they must change
    nothing); the state at the end and the last M steps' outputs."""
    pg = dist.group.WORLD
    model, dense = build(pg, kind)
    outs = []
    for step in range(n + m):
        outs.append(train_step(model, dense, step, rank, world))
        with torch.no_grad():
            model(batch(step, rank, world, seed=7))
    return snapshot(model, dense, pg), outs[n:]


def save_run(rank, world, kind, n, m, root, asynchronous):
    """N steps, save (async: on a group of its own, training on while it is written)."""
    pg = dist.group.WORLD
    model, dense = build(pg, kind)
    for step in range(n):
        train_step(model, dense, step, rank, world)
    group = dist.new_group(backend="gloo") if asynchronous else pg
    manager = CheckpointManager(root, process_group=group)
    manager.save(state_of(model, dense), n, asynchronous=asynchronous)
    for step in range(n, n + m):
        train_step(model, dense, step, rank, world)
    manager.close()


def resume_run(rank, world, kind, n, m, root):
    """A model with other rows loads step N's checkpoint, then trains M steps."""
    pg = dist.group.WORLD
    model, dense = build(pg, kind)
    train_step(model, dense, 99, rank, world)  # rows and history the load must replace
    state = state_of(model, dense)
    assert CheckpointManager(root, process_group=pg).load(state) == n
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    dense.load_state_dict(state["dense"])
    outs = [train_step(model, dense, step, rank, world) for step in range(n, n + m)]
    return snapshot(model, dense, pg), outs


@settings(max_examples=max(8, settings().max_examples // 4), deadline=None)
@given(kind=st.sampled_from(sorted(EVICTION)), w_save=st.integers(1, 3), data=st.data(),
       n=st.integers(1, 6), m=st.integers(1, 4), asynchronous=st.booleans())
def _resume_property(pools, seen, kind, w_save, data, n, m, asynchronous):
    w_load = data.draw(st.integers(1, 3), label="w_load") if kind in PER_WORLD else w_save
    expected = pools[w_load].run(reference_run, kind, n, m)
    with tempfile.TemporaryDirectory() as tmp:
        pools[w_save].run(save_run, kind, n, m, tmp, asynchronous)
        got = pools[w_load].run(resume_run, kind, n, m, tmp)
    assert same(expected[0][0], got[0][0]) == []
    for (_, want), (_, outs) in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(want, outs))
    evicted = sum(h[2] for h in got[0][0]["history"][0].values())
    seen.append((kind, w_save != w_load, asynchronous, evicted > 0))


def test_resume_is_exact_for_every_eviction_kind_save_mode_and_world_size(pools):
    """Train N, save, resume (at the same or another world size), train M == train N + M:
    rows with their headers, clocks, counters, the ordinary table and its optimizer state,
    dense weights and optimizer state, and every output, bit for bit."""
    seen = []
    _resume_property(pools, seen)
    assert len({kind for kind, *_ in seen}) >= 3 and any(resharded for _, resharded, _, _ in seen)
    assert any(a for _, _, a, _ in seen) and any(e for *_, e in seen)
