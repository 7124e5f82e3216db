"""TorchRec integration: DMP with KV-ZCH and ordinary tables against a TorchRec FUSED twin."""

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from _dist import run_ranks
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.sharding import (
    KVZCH_KERNEL,
    KVZCHParameterSharding,
    kvzch_embedding_bag_config,
    kvzch_embedding_config,
    kvzch_sharders,
    kvzch_tables,
)
from torchrec_kvzch.store.initializer import uniform_by_id_torch as uniform_by_id

LR, EPS = 0.05, 1e-8
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": EPS}


def kv_params(dim, buckets):
    return KVZCHTableParams("kv", dim, num_embeddings=buckets * 2**37, total_num_buckets=buckets,
                            learning_rate=LR, eps=EPS, init_range=(-0.5, 0.5), expected_rows=1000)


def build(rank, world_size, dim, buckets, universe, pooling, twin: bool):
    """Our model (KV-ZCH 'kv' over buckets * 2^37 ids) or its twin ('kv' as a FUSED table over
    len(universe) rows); both also hold an ordinary FUSED table 'plain'. ``pooling=None``
    builds sequence tables (EmbeddingCollection)."""
    params = kv_params(dim, buckets)
    if pooling is None:
        table, collection, kvzch_config, sharder, extra = EmbeddingConfig, EmbeddingCollection, kvzch_embedding_config, 1, {}
        plain_dim = dim  # an EmbeddingCollection's tables share one dim
    else:
        table, collection, kvzch_config, sharder, extra = EmbeddingBagConfig, EmbeddingBagCollection, kvzch_embedding_bag_config, 0, {"pooling": pooling}
        plain_dim = 4
    plain = table(name="plain", embedding_dim=plain_dim, num_embeddings=37, feature_names=["f_plain"], **extra)
    if twin:
        kv = table(name="kv", embedding_dim=dim, num_embeddings=universe.numel(),
                   feature_names=["f_a", "f_b"], **extra)
    else:
        kv = kvzch_config(params, ["f_a", "f_b"], **extra)
    module = collection(tables=[kv, plain], device=torch.device("meta"))
    sharders = kvzch_sharders(FUSED)
    kernels = {"kv": row_wise(compute_kernel="fused") if twin else row_wise(compute_kernel=KVZCH_KERNEL, num_buckets=buckets),
               "plain": row_wise(compute_kernel="fused")}
    module_plan = construct_module_sharding_plan(module, kernels, sharder=sharders[sharder], local_size=world_size,
                                                 world_size=world_size, device_type="cpu")
    if not twin:
        module_plan["kv"] = KVZCHParameterSharding.wrap(module_plan["kv"], params)
    dmp = DistributedModelParallel(module, device=torch.device("cpu"), plan=ShardingPlan({"": module_plan}),
                                   sharders=sharders, env=ShardingEnv.from_process_group(dist.group.WORLD))
    # Equal starting rows: the twin's rows are our id-seeded initial rows of the universe ids.
    state = dmp.state_dict()
    prefix = "embeddings" if pooling is None else "embedding_bags"
    with torch.no_grad():
        for name, ids, seed in (("kv", universe, params.init_seed), ("plain", torch.arange(37), 1)):
            key = f"{prefix}.{name}.weight"
            if key not in state:
                continue
            for shard in state[key].local_shards():
                start, n = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                low, high = (-0.5, 0.5) if name == "kv" else (-0.1, 0.1)
                shard.tensor.copy_(uniform_by_id(ids[start:start + n], shard.tensor.shape[1], low, high, seed))
    return dmp


def local_batch(rank, step, universe, batch, max_len):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, max_len + 1, (3 * batch,), generator=gen)
    n_kv = int(lengths[: 2 * batch].sum())
    local = torch.randint(0, universe.numel(), (n_kv,), generator=gen)
    plain = torch.randint(0, 37, (int(lengths[2 * batch:].sum()),), generator=gen)
    return lengths, local, plain


def kjt(lengths, kv_values, plain):
    return KeyedJaggedTensor(keys=["f_a", "f_b", "f_plain"], values=torch.cat([kv_values, plain]),
                             lengths=lengths)


def values(output) -> torch.Tensor:
    """Pooled KeyedTensor values, or a sequence output's per-feature values concatenated."""
    if hasattr(output, "wait"):  # DMP returns lazy awaitables
        output = output.wait()
    if isinstance(output, KeyedTensor):
        return output.values()
    return torch.cat([output[f].values() for f in sorted(output.keys())])


def train_and_compare(rank, world_size, dim, buckets, pooling, steps, empty_rank):
    gen = torch.Generator().manual_seed(5)
    universe = torch.randint(0, buckets * 2**37, (60,), generator=gen).unique()  # ids far beyond 2^32
    ours = build(rank, world_size, dim, buckets, universe, pooling, twin=False)
    twin = build(rank, world_size, dim, buckets, universe, pooling, twin=True)
    for step in range(steps):
        lengths, local, plain = local_batch(rank, step, universe, batch=4, max_len=3)
        if rank == empty_rank:
            lengths, local, plain = lengths * 0, local[:0], plain[:0]
        out = values(ours(kjt(lengths, universe[local], plain)))
        want = values(twin(kjt(lengths, local, plain)))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        out.backward(grad)
        want.backward(grad)
    # Final rows of every id, gathered from all ranks.
    mine = {}
    for name, kernel in kvzch_tables(ours):
        ids = kernel.store.sorted_ids()
        mine.update(zip(ids.tolist(), kernel.store.read_ids(ids)))
    prefix = "embeddings" if pooling is None else "embedding_bags"
    shard = twin.state_dict()[f"{prefix}.kv.weight"].local_shards()[0]
    start = shard.metadata.shard_offsets[0]
    theirs = dict(zip(universe[start:start + shard.tensor.shape[0]].tolist(), shard.tensor.clone()))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (mine, theirs))
    ours_all = {k: v for m, _ in gathered for k, v in m.items()}
    twin_all = {k: v for _, t in gathered for k, v in t.items()}
    for i, row in ours_all.items():  # every id our store created was seen, so the twin has it
        torch.testing.assert_close(row, twin_all[i], rtol=1e-5, atol=1e-5)
    return len(mine)


def test_dmp_two_ranks_matches_fused_twin():
    rows = run_ranks(2, train_and_compare, 8, 8, PoolingType.SUM, 4, None)
    assert all(r > 0 for r in rows)  # both ranks own rows


def test_dmp_uneven_buckets_mean_pooling_and_an_empty_rank():
    # 5 buckets on 2 ranks: 3 + 2. Rank 1 sends an empty batch every step.
    rows = run_ranks(2, train_and_compare, 12, 5, PoolingType.MEAN, 3, 1)
    assert sum(rows) > 0


def test_dmp_single_rank():
    run_ranks(1, train_and_compare, 4, 4, PoolingType.SUM, 3, None)


def test_dmp_sequence_tables_two_ranks():
    rows = run_ranks(2, train_and_compare, 8, 6, None, 3, None)
    assert all(r > 0 for r in rows)
