"""MEAN pooling in an EBC mixing row-wise and other shardings, against a dense reference.

TorchRec 1.8 divides a sharded EBC's whole output by bag lengths once any row-wise table pools
MEAN (1 only for row-wise SUM features): a KV-ZCH MEAN table (always row-wise) turned the
table-wise SUM outputs next to it into sum/L and the table-wise MEAN ones into sum/L^2. One EBC
holds every combination, including a feature read by row-wise MEAN, row-wise SUM and table-wise
SUM tables, with empty and uneven bags, unweighted and weighted; forward outputs and the rows
after one SGD step must match dense sums and means (MEAN: sum(row) / bag length; weighted, on
row-wise tables, KV-ZCH or not, what TorchRec's row-wise sharding computes: sum(w * row) /
(sum(w) + 1e-6)).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from _dist import run_ranks
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.torchrec import (
    KVZCHConstraints,
    KVZCHShardingPlanner,
    kvzch_embedding_bag_config,
    kvzch_sharders,
    kvzch_tables,
)
from torchrec_kvzch.table.initializer import uniform_by_id_torch

LR, ROWS, BATCH = 0.5, 20, 5
MEAN, SUM = PoolingType.MEAN, PoolingType.SUM
KV = KVZCHTableParams("kv", 12, num_embeddings=4 * 2**36, total_num_buckets=4, optimizer="exact_sgd",
                      learning_rate=LR, init_range=(-1.0, 1.0), expected_rows=100)
# table: (sharding, pooling, dim, features); "f_shared" is read by three tables.
TABLES = {"kv": ("row_wise", MEAN, KV.embedding_dim, ["f_kv", "f_shared"]),
          "tw_sum": ("table_wise", SUM, 4, ["f_tw_sum", "f_shared"]),
          "tw_mean": ("table_wise", MEAN, 8, ["f_tw_mean"]),
          "rw_mean": ("row_wise", MEAN, 4, ["f_rw_mean"]),
          "rw_sum": ("row_wise", SUM, 8, ["f_rw_sum", "f_shared"])}
KEYS = ["f_kv", "f_shared", "f_tw_sum", "f_tw_mean", "f_rw_mean", "f_rw_sum"]
# fbgemm's CPU MEAN kernel is wrong with per-sample weights: the weighted model leaves tw_mean out.
WEIGHTED_TABLES = {t: spec for t, spec in TABLES.items() if t != "tw_mean"}


def build(world_size, tables, weighted):
    configs = [kvzch_embedding_bag_config(KV, tables["kv"][3], pooling=MEAN)]
    configs += [EmbeddingBagConfig(name=t, embedding_dim=dim, num_embeddings=ROWS, feature_names=features,
                                   pooling=pooling) for t, (_, pooling, dim, features) in tables.items() if t != "kv"]
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device("meta"))
    constraints = {t: ParameterConstraints(sharding_types=[spec[0]]) for t, spec in tables.items() if t != "kv"}
    planner = KVZCHShardingPlanner(Topology(world_size=world_size, compute_device="cpu"), batch_size=BATCH,
                                   constraints={"kv": KVZCHConstraints(kvzch=KV), **constraints})
    sharders = kvzch_sharders({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    plan = planner.collective_plan(ebc, sharders, dist.group.WORLD)
    types = {t: plan.plan[""][t].sharding_type for t in tables}
    assert types == {t: spec[0] for t, spec in tables.items()}, types
    return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=sharders,
                                    env=ShardingEnv.from_process_group(dist.group.WORLD))


def batch(rank, keys, weighted):
    """Rank's batch: bags of 0-3 ids, some empty; KV ids spread over all buckets."""
    gen = torch.Generator().manual_seed(7 + rank)
    lengths = torch.randint(0, 4, (len(keys), BATCH), generator=gen)
    lengths[:, rank] = 0  # an empty bag in every feature
    lengths[1 - rank, 2] = 3
    values = [torch.randint(0, KV.num_embeddings if key == "f_kv" else ROWS, (int(n),), generator=gen)
              for key, n in zip(keys, lengths.sum(1))]
    weights = torch.rand(int(lengths.sum()), generator=gen) * 2 + 0.25 if weighted else None
    return KeyedJaggedTensor(keys, torch.cat(values), lengths=lengths.flatten(), weights=weights)


def reference(kjt, tables, weights):
    """{output key: pooled [BATCH, dim]} from dense tables ``weights`` (KV: rows of sorted ids)."""
    out = {}
    for table, (sharding, pooling, _, features) in tables.items():
        for feature in features:
            jt = kjt[feature]
            ids = jt.values() if table != "kv" else torch.searchsorted(weights["kv_ids"], jt.values())
            w = jt.weights_or_none()
            pooled = F.embedding_bag(ids, weights[table], jt.offsets(), mode="sum",
                                     per_sample_weights=w, include_last_offset=True)
            if pooling == MEAN and w is not None and sharding == "row_wise":  # TorchRec's: sum(w) + 1e-6
                bags = torch.repeat_interleave(torch.arange(BATCH), jt.lengths())
                pooled = pooled / (torch.zeros(BATCH).index_add_(0, bags, w) + 1e-6)[:, None]
            elif pooling == MEAN:
                pooled = pooled / jt.lengths().clamp(min=1)[:, None]
            shared = sum(feature in spec[3] for spec in tables.values()) > 1
            out[f"{feature}@{table}" if shared else feature] = pooled
    return out


def initial_weights(model, tables, kv_ids):
    """Dense copies of every table's starting rows: ordinary tables gathered from the state
    dict, the KV-ZCH table from its id-seeded initialiser."""
    weights = {"kv_ids": kv_ids, "kv": uniform_by_id_torch(kv_ids, KV.embedding_dim, *KV.init_range, KV.init_seed)}
    state = model.state_dict()
    for table in [t for t in tables if t != "kv"]:  # same order on every rank
        local = {s.metadata.shard_offsets[0]: s.tensor.clone()
                 for s in state[f"embedding_bags.{table}.weight"].local_shards()}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        shards = {k: v for g in gathered for k, v in g.items()}
        weights[table] = torch.cat([shards[k] for k in sorted(shards)])
    return weights


def check_variable_batch_divisor(sharded, kjt):
    """A batch with variable batch sizes per feature can't run end to end on CPU (fbgemm's CPU
    TBE refuses TorchRec's VBE output, KV-ZCH kernels refuse VBE): its MEAN divisor must be that
    of the batch expanded by the inverse indices, as TorchRec expands the output."""
    gen = torch.Generator().manual_seed(11)
    keys, jts = kjt.keys(), [kjt[k] for k in kjt.keys()]
    strides = torch.randint(1, BATCH + 1, (len(keys),), generator=gen).tolist()
    inverse = torch.stack([torch.randint(0, s, (BATCH + 2,), generator=gen) for s in strides])
    vbe = KeyedJaggedTensor(keys, torch.cat([jt.values()[:jt.offsets()[s]] for jt, s in zip(jts, strides)]),
                            lengths=torch.cat([jt.lengths()[:s] for jt, s in zip(jts, strides)]),
                            stride_per_key_per_rank=[[s] for s in strides],
                            inverse_indices=(keys[::-1], inverse.flip(0)))  # in another key order
    expanded = torch.cat([jt.lengths()[row] for jt, row in zip(jts, inverse)])
    full = KeyedJaggedTensor(keys, torch.zeros(int(expanded.sum()), dtype=torch.long), lengths=expanded)
    divisor = sharded._mean_divisor(vbe)
    assert divisor.shape == (BATCH + 2, sum(sharded._embedding_dims))
    torch.testing.assert_close(divisor, sharded._mean_divisor(full), rtol=0, atol=0)


def check(rank, world_size, tables, weighted):
    model = build(world_size, tables, weighted)
    keys = [k for k in KEYS if any(k in spec[3] for spec in tables.values())]
    kjts = [batch(r, keys, weighted) for r in range(world_size)]
    kv_ids = torch.cat([k[f].values() for k in kjts for f in tables["kv"][3]]).unique()
    dense = {k: v if k == "kv_ids" else v.requires_grad_() for k, v in initial_weights(model, tables, kv_ids).items()}
    want = [reference(kjt, tables, dense) for kjt in kjts]
    grads = [{k: torch.randn(v.shape, generator=torch.Generator().manual_seed(r)) for k, v in sorted(w.items())}
             for r, w in enumerate(want)]

    out = model(kjts[rank]).wait().to_dict()
    assert sorted(out) == sorted(want[rank])
    for key in out:
        torch.testing.assert_close(out[key], want[rank][key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}, weighted={weighted}: {m}")
    check_variable_batch_divisor(model.module, kjts[rank])
    sum((out[k] * grads[rank][k]).sum() for k in out).backward()
    # TorchRec averages embedding gradients over ranks (its default gradient division, as DDP).
    (sum((w[k] * g[k]).sum() for w, g in zip(want, grads) for k in w) / world_size).backward()

    updated = {k: (v - LR * v.grad).detach() for k, v in dense.items() if k != "kv_ids"}
    state = model.state_dict()
    for table in [t for t in tables if t != "kv"]:
        for shard in state[f"embedding_bags.{table}.weight"].local_shards():
            start, n = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
            torch.testing.assert_close(shard.tensor, updated[table][start:start + n], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{table} rows, weighted={weighted}: {m}")
    [(_, tbe)] = list(kvzch_tables(model))
    ids = torch.sort(tbe.store.keys()).values
    torch.testing.assert_close(tbe.store.read_ids(ids, "weight"),
                               updated["kv"][torch.searchsorted(kv_ids, ids)], rtol=1e-5, atol=1e-6)
    held = torch.tensor(ids.numel())
    dist.all_reduce(held)
    assert int(held) == kv_ids.numel()  # every id looked up has its row, on exactly one rank
    return ids.numel()


def cases(rank, world_size):
    rows = [check(rank, world_size, TABLES, False), check(rank, world_size, WEIGHTED_TABLES, True)]
    with pytest.raises(ValueError, match="table 'tw_mean': MEAN pooling with per-sample weights"):
        build(world_size, TABLES, weighted=True)
    return rows


def test_mean_pooling_with_row_wise_and_table_wise_tables_matches_dense_reference():
    rows = run_ranks(2, cases)
    assert all(n > 0 for r in rows for n in r)  # both ranks own KV-ZCH rows
