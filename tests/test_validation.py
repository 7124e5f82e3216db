"""Bad batches into a sharded model: each fails with an error naming the feature and table,
raised before any row, clock or counter changes (tables are created on demand, so a bad id
would otherwise become a row)."""

import torch

from _dist import run_ranks

USER_ROWS = 2**40


def _bad_batches():
    """(what, keys, values, lengths, weights) -> the error fragment expected."""
    ones = [1, 1, 1, 1]
    return [
        ("negative id", ["user_id", "category"], [5, -5, 1, 2], ones, None,
         f"feature 'user_id' (table 'user') has id -5, outside [0, {USER_ROWS})"),
        ("id past the virtual table", ["user_id", "category"], [5, USER_ROWS, 1, 2], ones, None,
         f"feature 'user_id' (table 'user') has id {USER_ROWS}, outside [0, {USER_ROWS})"),
        ("id past an ordinary table", ["user_id", "category"], [5, 6, 1, 100], ones, None,
         "feature 'category' (table 'category') has id 100, outside [0, 100)"),
        ("float ids", ["user_id", "category"], [5.0, 6.0, 1.0, 2.0], ones, None,
         "(tables ['category', 'user']) are torch.float32; ids must be int32 or int64"),
        ("lengths and values disagree", ["user_id", "category"], [5, 6, 1], ones, None,
         "add up to 4, but the batch has 3 ids"),
        ("negative length", ["user_id", "category"], [5, 6, 1, 2], [3, -1, 1, 1], None, "negative lengths"),
        ("lengths per feature", ["user_id", "category"], [5, 6, 1, 2], [1, 1, 1, 1, 0], None,
         "5 lengths for the 2 features"),
        ("weights per id", ["user_id", "category"], [5, 6, 1, 2], ones, [1.0, 1.0], "2 weights for 4 ids"),
        ("misspelt feature", ["user_idd", "category"], [5, 6, 1, 2], ones, None,
         "features ['user_id'] (tables ['user']) are missing from the batch; pass them, with zero lengths "
         "if they have no ids (the batch's features ['user_idd'] are read by no table here)"),
        ("missing feature", ["user_id"], [5, 6], [1, 1], None,
         "features ['category'] (tables ['category']) are missing from the batch"),
        ("features reordered", ["category", "user_id"], [1, 2, 5, 6], ones, None,
         "TorchRec routes features by the first batch's order"),
    ]


def _battery(rank, world_size, sequence):
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvzch import KVZCHTableParams
    from torchrec_kvzch.torchrec import (KVZCHConstraints, KVZCHShardingPlanner, kvzch_embedding_bag_config,
                                         kvzch_embedding_config, kvzch_sharders, kvzch_tables)

    user = KVZCHTableParams("user", 8, num_embeddings=USER_ROWS, total_num_buckets=64, expected_rows=1000)
    if sequence:
        tables = [kvzch_embedding_config(user, ["user_id"]),
                  EmbeddingConfig(name="category", embedding_dim=8, num_embeddings=100, feature_names=["category"])]
        module = EmbeddingCollection(tables=tables, device=torch.device("meta"))
    else:
        tables = [kvzch_embedding_bag_config(user, ["user_id"]),
                  EmbeddingBagConfig(name="category", embedding_dim=8, num_embeddings=100, feature_names=["category"])]
        module = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharders = kvzch_sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    planner = KVZCHShardingPlanner(Topology(world_size=world_size, compute_device="cpu"), batch_size=8,
                                   constraints={"user": KVZCHConstraints(kvzch=user)})
    model = DistributedModelParallel(module, device=torch.device("cpu"), sharders=sharders,
                                     plan=planner.collective_plan(module, sharders, dist.group.WORLD),
                                     env=ShardingEnv.from_process_group(dist.group.WORLD))

    def run(keys, values, lengths, weights=None):
        kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor(values), lengths=torch.tensor(lengths),
                                weights=None if weights is None else torch.tensor(weights))
        out = model(kjt).wait()
        loss = sum(jt.values().sum() for jt in out.values()) if sequence else out.values().sum()
        loss.backward()

    run(["user_id", "category"], [7, 2**39, 3, 4], [1, 1, 1, 1])  # a good batch first
    [(_, tbe)] = list(kvzch_tables(model))
    store = tbe.store

    def state():
        return (store.clock, dict(store.counters), store.read_ids(torch.sort(store.keys()).values, "row").clone(),
                {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).clone()
                 for k, v in model.state_dict().items() if "category" in k})

    before = state()
    errors = {}
    for what, keys, values, lengths, weights, _ in _bad_batches():
        try:
            run(keys, values, lengths, weights)
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    if not sequence:  # TorchRec's variable batch (a batch size per feature): pooled modules take it
        vbe = KeyedJaggedTensor(keys=["user_id", "category"], values=torch.tensor([7, 8, 3, 4, 5]),
                                lengths=torch.ones(5, dtype=torch.long), stride_per_key_per_rank=[[2], [3]],
                                inverse_indices=(["user_id", "category"], torch.tensor([[0, 1, 1], [0, 1, 2]])))
        try:
            model(vbe).wait()
            errors["variable batch"] = None
        except ValueError as e:
            errors["variable batch"] = str(e)
    after = state()
    unchanged = (before[0] == after[0] and before[1] == after[1] and torch.equal(before[2], after[2])
                 and all(torch.equal(before[3][k], after[3][k]) for k in before[3]))
    run(["user_id", "category"], [7, 11, 3, 4], [1, 1, 1, 1])  # the model still trains afterwards
    # Another module's feature passes, ids unread, as in TorchRec; between ours it would move them.
    run(["user_id", "category", "other"], [7, 11, 3, 4, -5, 10**15], [1] * 6)
    try:
        run(["user_id", "other", "category"], [7, 11, -5, 10**15, 3, 4], [1] * 6)
        errors["other module's feature between ours"] = None
    except ValueError as e:
        errors["other module's feature between ours"] = str(e)
    return errors, unchanged, len(store)


def test_bad_batches_fail_naming_feature_and_table_before_anything_changes():
    for sequence in (False, True):
        [(errors, unchanged, rows)] = run_ranks(1, _battery, sequence)
        for what, *_, fragment in _bad_batches():
            assert errors[what] is not None and fragment in errors[what], (sequence, what, errors[what])
        assert unchanged, sequence
        assert "TorchRec routes features by the first batch's order" in errors["other module's feature between ours"]
        if not sequence:
            assert "(TorchRec's variable batch, VBE), which KV-ZCH tables ['user'] (features ['user_id']) do not" \
                in errors["variable batch"]
        assert rows == 3  # 7 and 2**39 from the first batch, 11 from the last
