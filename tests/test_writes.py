"""TorchRec's embedding writes (``DistributedModelParallel.write``) into KV-ZCH tables declared
with ``enable_embedding_update=True``: routed by buckets at any world size, written as given,
read by lookups without being trained, checkpointed (deltas too)."""

import pytest
import torch

ROWS, BUCKETS, DIM = 2**20, 8, 16


class CacheAndTrained(torch.nn.Module):
    """A written KV-ZCH sequence table ``seq`` in an EmbeddingCollection of its own (TorchRec's
    write takes the features of every row-wise table of a module) beside a trained one, ``user``."""

    def __init__(self, seq, user):
        super().__init__()
        from torchrec.modules.embedding_modules import EmbeddingCollection

        self.cache = EmbeddingCollection(tables=[seq], device=torch.device("meta"))
        self.trained = EmbeddingCollection(tables=[user], device=torch.device("meta"))

    def forward(self, seq, user):
        return self.cache(seq)["f_seq"].values(), self.trained(user)["f_user"].values()


def cache_model(rank, world):
    """Both tables declared as upstream declares them (8 buckets: uneven over 3 ranks)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_configs import EmbeddingConfig

    from _dist import sharded
    from test_declarations import config

    seq = config(cls=EmbeddingConfig, name="seq", enable_embedding_update=True)
    user = config(cls=EmbeddingConfig, name="user")
    return sharded(CacheAndTrained(seq, user), None, {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5})


def written(rank, step, repeat=False):
    """This rank's write of step ``step``: ids over every bucket, each row filled with a value
    telling id, rank and step apart (``repeat``: the first id again at the end, another row)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids = (torch.arange(6) * 7 + rank * 3 + step) % 64 * (ROWS // 64)
    rows = (ids.double() / ROWS * 100 + rank * 1000 + step * 10).float().unsqueeze(1).repeat(1, DIM)
    if repeat:
        ids, rows = torch.cat([ids, ids[:1]]), torch.cat([rows, -rows[:1]])
    return KeyedJaggedTensor(keys=["f_seq"], values=ids, lengths=torch.tensor([ids.numel()]), weights=rows)


def lookup(model, ids):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return model(*(KeyedJaggedTensor(keys=[key], values=ids, lengths=torch.tensor([ids.numel()]))
                   for key in ("f_seq", "f_user")))


def write_and_train(rank, world, root):
    from torchrec_kvzch.checkpoint.manager import CheckpointManager
    from torchrec_kvzch.torchrec import kvzch_tables

    model = cache_model(rank, world)
    manager = CheckpointManager(root)
    model.write(written(rank, 0))
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    manager.save(state, 1, incremental=True)  # in full: the base of the delta below
    model.write(written(rank, 1, repeat=True))  # overwrites some rows, adds others
    every = torch.cat([written(r, s).values() for r in range(world) for s in (0, 1)]).unique()
    seq, user = lookup(model, every)
    (seq.sum() + user.sum()).backward()  # trains user, never seq
    after, _ = lookup(model, every)
    manager.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, 2, incremental=True)
    tables = dict(kvzch_tables(model))
    store = tables["seq"].store
    keys = torch.sort(store.keys()).values
    return dict(ids=every, seq=seq.detach(), after=after.detach(), keys=keys,
                rows=store.weights[store.find(keys)].clone(), user_rows=len(tables["user"].store))


def load_rows(rank, world, root):
    from torchrec_kvzch.checkpoint.manager import CheckpointManager
    from torchrec_kvzch.torchrec import kvzch_tables

    model = cache_model(rank, world)
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    assert CheckpointManager(root).load(state) == 2
    store = dict(kvzch_tables(model))["seq"].store
    keys = torch.sort(store.keys()).values
    return keys, store.weights[store.find(keys)].clone()


@pytest.mark.parametrize("world", [2, 3])
def test_written_rows_are_read_untrained_and_resume_through_a_delta(pools, tmp_path, world):
    """Each rank writes its rows; every rank's lookup reads every written row as written (a
    repeated id: its last row), training leaves them alone, and the delta saved after the
    second write carries them: loaded on 1 rank, the same rows."""
    results = pools[world].run(write_and_train, str(tmp_path))
    expected = {}
    for step in (0, 1):
        for rank in range(world):
            kjt = written(rank, step, repeat=step == 1)
            for i, row in zip(kjt.values().tolist(), kjt.weights()):
                expected[i] = row
    for r in results:
        want = torch.stack([expected[i] for i in r["ids"].tolist()])
        assert torch.equal(r["seq"], want) and torch.equal(r["after"], want)  # read as written, untrained
    assert sum(r["user_rows"] for r in results) > 0  # (the trained table beside it made rows)
    keys = torch.cat([r["keys"] for r in results])
    rows = torch.cat([r["rows"] for r in results])
    assert sorted(keys.tolist()) == sorted(expected)  # every written id, on the rank of its bucket
    from torchrec_kvzch.checkpoint.manager import CheckpointManager

    assert CheckpointManager(tmp_path)._link(2)[1]["step"] == 1  # a delta: writes are stamped, not untracked
    [(loaded_keys, loaded_rows)] = pools[1].run(load_rows, str(tmp_path))
    order = torch.argsort(keys)
    assert torch.equal(loaded_keys, keys[order]) and torch.equal(loaded_rows, rows[order])


def write_refused(rank, world):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from _dist import refusals
    from torchrec_kvzch.torchrec import kvzch_tables

    model = cache_model(rank, world)
    bad = KeyedJaggedTensor(keys=["f_seq"], values=torch.tensor([5]), lengths=torch.tensor([1]),
                            weights=torch.ones(1, DIM + 1))
    beyond = KeyedJaggedTensor(keys=["f_seq"], values=torch.tensor([5, ROWS + 1]), lengths=torch.tensor([2]),
                               weights=torch.ones(2, DIM))
    messages = refusals(lambda: model.write(bad), lambda: model.write(beyond),
                        lambda: dict(kvzch_tables(model))["seq"].write(torch.tensor([ROWS + 5]), torch.ones(1, DIM)))
    return messages, len(dict(kvzch_tables(model))["seq"].store)


def test_bad_writes_are_refused_by_name(pools):
    [(messages, rows)] = pools[1].run(write_refused)
    assert len(messages) == 3 and rows == 0
    assert "KV-ZCH table 'seq': an embedding write needs one row of 16 values per id, got (1, 17)" in messages[0]
    assert (f"embedding write of feature 'f_seq' (table 'seq'): id {ROWS + 1} is outside [0, {ROWS}); hash or "
            "remap ids into the table's num_embeddings") in messages[1]
    assert "table 'seq': id 1048581 is outside this shard's ids" in messages[2]


def test_a_trained_table_trains_its_written_rows():
    """``TableTBE.write`` on a table that trains (our own API, any KV-ZCH table): the written rows
    are then trained like any other, from the values written (SGD: row - lr * gradient)."""
    from torchrec_kvzch import KVZCHTableParams
    from torchrec_kvzch.table.tbe import TableTBE

    p = KVZCHTableParams("t", 4, num_embeddings=2**20, total_num_buckets=4, optimizer="exact_sgd", learning_rate=0.5)
    tbe = TableTBE(p, p.bucket_range(0, 1))
    ids = torch.tensor([3, 70_000, 3])
    tbe.write(ids, torch.tensor([[1.0] * 4, [2.0] * 4, [5.0] * 4]))  # id 3: its last row
    out = tbe(torch.tensor([3, 70_000]), torch.tensor([0, 1, 2]))
    assert torch.equal(out, torch.tensor([[5.0] * 4, [2.0] * 4]))
    out.backward(torch.ones_like(out))
    assert torch.equal(tbe.store.read_ids(torch.tensor([3, 70_000])), torch.tensor([[4.5] * 4, [1.5] * 4]))


@pytest.mark.parametrize("grad", [True, False])
def test_an_embedding_cache_table_makes_rows_in_training_lookups_only(grad):
    """A written table (``embedding_cache``) in train mode makes and stamps rows of the ids it looks
    up, and trains none; under ``torch.no_grad()`` (evaluation, as documented for every table)
    it changes nothing: no row, no clock step, no eviction."""
    from torchrec_kvzch import EvictionPolicy, KVZCHTableParams
    from torchrec_kvzch.table.tbe import TableTBE

    p = KVZCHTableParams("c", 4, num_embeddings=2**20, total_num_buckets=4, eviction=EvictionPolicy("lru", max_rows=4))
    tbe = TableTBE(p, p.bucket_range(0, 1))
    tbe.embedding_cache = True
    tbe.write(torch.tensor([1, 2, 3]), torch.ones(3, 4))
    with torch.set_grad_enabled(grad):
        out = tbe(torch.arange(10, 14), torch.arange(5))
    assert not out.requires_grad
    if grad:  # (the budget of 4 rows makes room for the batch's)
        assert tbe.store.clock == 1 and torch.sort(tbe.store.keys()).values.tolist() == [10, 11, 12, 13]
    else:
        assert tbe.store.clock == 0 and torch.sort(tbe.store.keys()).values.tolist() == [1, 2, 3]
        assert tbe.store.counters["evicted"] == 0
        assert torch.equal(tbe.store.read_ids(torch.tensor([1, 2, 3])), torch.ones(3, 4))
