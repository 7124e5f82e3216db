"""The kernel against fbgemm's own TBE on a dense table: same outputs, rows and optimizer state."""

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from hypothesis import given, strategies as st

from torchrec_kvzch import EvictionPolicy, KVZCHTableParams
from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.table.layout import RowPart

POOLINGS = [PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE]


def dense_twin(tbe: TableTBE, universe: torch.Tensor, pooling) -> SplitTableBatchedEmbeddingBagsCodegen:
    """fbgemm TBE whose row r starts equal to the KV row of universe[r]."""
    p = tbe.params
    twin = SplitTableBatchedEmbeddingBagsCodegen(
        [(universe.numel(), p.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        feature_table_map=[0] * tbe.num_features, optimizer=p.optimizer.to_fbgemm(),
        learning_rate=p.learning_rate, eps=p.eps, pooling_mode=pooling)
    tbe.store.find_or_insert(universe, touch=False)
    with torch.no_grad():
        twin.weights_host.copy_(tbe.store.read_ids(universe).view(-1))
    return twin


@given(
    dim=st.sampled_from([4, 8, 12, 20]),
    features=st.integers(1, 3),
    batch=st.integers(1, 9),
    max_len=st.integers(0, 6),
    pooling=st.sampled_from(POOLINGS),
    optimizer=st.sampled_from(["exact_rowwise_adagrad", "exact_sgd"]),
    weighted=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_kernel_matches_fbgemm_tbe_over_training_steps(dim, features, batch, max_len, pooling,
                                                       optimizer, weighted, seed):
    weighted = weighted and pooling is not PoolingMode.NONE  # fbgemm: weights only when pooled
    gen = torch.Generator().manual_seed(seed)
    p = KVZCHTableParams("t", dim, num_embeddings=2**62, total_num_buckets=64, optimizer=optimizer,
                         learning_rate=0.05, init_range=(-0.5, 0.5))
    tbe = TableTBE(p, p.bucket_range(0, 1), num_features=features, pooling=pooling)
    # Ids far beyond 2^32; the twin sees their index in `universe` instead.
    universe = torch.randint(0, 2**62, (40,), generator=gen).unique()
    twin = dense_twin(tbe, universe, pooling)
    for _ in range(3):
        lengths = torch.randint(0, max_len + 1, (features * batch,), generator=gen)
        local = torch.randint(0, universe.numel(), (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        psw = torch.rand(local.numel(), generator=gen) if weighted else None
        out = tbe(universe[local], offsets, psw)
        want = twin(local, offsets, psw)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        want.backward(grad)
    rows = twin.weights_host.view(universe.numel(), dim)
    torch.testing.assert_close(tbe.store.read_ids(universe), rows, rtol=1e-5, atol=1e-5)
    if optimizer == "exact_rowwise_adagrad":
        torch.testing.assert_close(tbe.store.read_ids(universe, RowPart.OPTIMIZER).view(-1),
                                   twin.momentum1_host, rtol=1e-5, atol=1e-5)


def test_fp16_rows_round_as_declared():
    """``stochastic_rounding`` reaches fbgemm's optimizer arguments, and fp16 rows update bit for
    bit like a dense fp16 TBE's (fbgemm's CPU kernels round to nearest either way; its CUDA
    kernels round stochastically when asked)."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    def trained(stochastic):
        p = KVZCHTableParams("h", 8, num_embeddings=2**20, total_num_buckets=8, weight_dtype="fp16",
                             learning_rate=0.01, init_range=(-0.5, 0.5), stochastic_rounding=stochastic)
        tbe = TableTBE(p, p.bucket_range(0, 1))
        universe = torch.arange(0, 2**20, 2**14)
        twin = SplitTableBatchedEmbeddingBagsCodegen(
            [(universe.numel(), 8, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=p.optimizer.to_fbgemm(),
            learning_rate=p.learning_rate, eps=p.eps, weights_precision=SparseType.FP16,
            stochastic_rounding=False)
        tbe.store.find_or_insert(universe, touch=False)
        with torch.no_grad():
            twin.weights_host.copy_(tbe.store.read_ids(universe).view(-1))
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            local = torch.randint(0, universe.numel(), (64,), generator=gen)
            offsets = torch.arange(0, 65, 4)
            grad = torch.randn(16, 8, generator=gen)
            tbe(universe[local], offsets).backward(grad)
            twin(local, offsets).backward(grad)
        mine = tbe.store.read_ids(universe).view(torch.int16)
        assert tbe.tbe.optimizer_args.stochastic_rounding is stochastic
        return torch.equal(mine, twin.weights_host.view(universe.numel(), 8).view(torch.int16))

    assert trained(stochastic=False) and trained(stochastic=True)


def test_growth_during_training_keeps_updates():
    """Rows created over many steps force several reallocations; updates must survive each."""
    p = KVZCHTableParams("g", 4, num_embeddings=2**40, total_num_buckets=8, learning_rate=0.1)
    tbe = TableTBE(p, p.bucket_range(0, 1))
    gen = torch.Generator().manual_seed(0)
    seen = torch.empty(0, dtype=torch.long)
    for _ in range(12):
        ids = torch.randint(0, 2**40, (700,), generator=gen)
        offsets = torch.arange(0, 701, 7)
        tbe(ids, offsets).sum().backward()
        seen = torch.cat([seen, ids])
    assert len(tbe.store) == seen.unique().numel() and tbe.store.capacity > 1024
    accumulators = tbe.store.read_ids(seen.unique(), RowPart.OPTIMIZER)
    assert (accumulators > 0).all()  # every row received its fused update


def test_second_forward_that_would_grow_before_backward_is_refused():
    p = KVZCHTableParams("h", 4, num_embeddings=2**40, total_num_buckets=8)
    tbe = TableTBE(p, p.bucket_range(0, 1))
    first = tbe(torch.arange(10), torch.tensor([0, 5, 10]))
    with pytest.raises(RuntimeError, match="'h': a forward before the backward of the one before it .* grow"):
        tbe(torch.arange(10, 5000), torch.tensor([0, 4990]))
    assert len(tbe.store) == 10  # refused before any change
    first.sum().backward()
    tbe(torch.arange(10, 5000), torch.tensor([0, 4990])).sum().backward()  # fine now
    with torch.no_grad():  # evaluation never holds a pending update
        tbe(torch.arange(10**6, 10**6 + 3000), torch.tensor([0, 3000]))


@pytest.mark.parametrize("optimizer", ["exact_sgd", "exact_rowwise_adagrad"])
def test_forwards_ahead_of_backwards_apply_each_update_to_its_rows(optimizer):
    """TorchRec's semi-sync pipeline: batch i+1's lookup (creating rows) before batch i's
    backward. Given the same gradients, each update lands on its own rows as when every
    backward follows its forward (before the fix, autograd refused the second forward's new rows
    as a change of what the first had saved)."""
    p = KVZCHTableParams("s", 8, num_embeddings=2**40, total_num_buckets=8, learning_rate=0.1,
                         optimizer=optimizer, expected_rows=4096)
    ahead, stepwise = (TableTBE(p, p.bucket_range(0, 1)) for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 300, (400,), generator=gen) for _ in range(4)]  # shared and new ids
    offsets = torch.arange(0, 401, 4)
    grads = [torch.randn(100, 8, generator=gen) for _ in batches]
    for ids, grad in zip(batches, grads):
        stepwise(ids, offsets).backward(grad)
    outputs = [ahead(batches[0], offsets)]
    for i, grad in enumerate(grads):
        if i + 1 < len(batches):
            outputs.append(ahead(batches[i + 1], offsets))
        outputs.pop(0).backward(grad)
    assert ahead.store.pending_update is None
    ids = torch.sort(stepwise.store.keys()).values
    assert torch.equal(torch.sort(ahead.store.keys()).values, ids)
    for part in (RowPart.WEIGHT, RowPart.OPTIMIZER):
        torch.testing.assert_close(ahead.store.read_ids(ids, part), stepwise.store.read_ids(ids, part),
                                   rtol=0, atol=0)


def test_each_pending_update_ends_with_its_own_backward_or_graph():
    p = KVZCHTableParams("q", 4, num_embeddings=2**40, total_num_buckets=8)
    tbe = TableTBE(p, p.bucket_range(0, 1))
    first = tbe(torch.arange(10), torch.tensor([0, 10]))
    second = tbe(torch.arange(10, 20), torch.tensor([0, 10]))
    first.sum().backward()
    assert torch.equal(tbe.store.pending_update, tbe.store.find(torch.arange(10, 20)))  # second's
    with pytest.raises(RuntimeError, match="'q': a forward before the backward"):
        tbe(torch.arange(100, 5000), torch.tensor([0, 4900]))
    del second  # dropped without a backward: its update never comes
    assert tbe.store.pending_update is None
    tbe(torch.arange(100, 5000), torch.tensor([0, 4900])).sum().backward()  # may grow now


@pytest.mark.parametrize("kind", ["lru", "lfu", "rank_budget", "disk"])
def test_a_lookup_ahead_is_refused_before_it_changes_anything_where_rows_may_move(kind, tmp_path):
    """A training lookup before the previous one's backward (semi-sync, prefetch) may not move
    rows: a table that may evict in its lookups (budget, automatic pass, rank budget) or move rows
    to its disk tier is refused at once, naming it, with its clock, counts, admission sketch and
    rows as they were, even when this lookup would have evicted nothing."""
    from torchrec_kvzch.params import AdmissionPolicy, DiskStorage, RankBudget
    from torchrec_kvzch.table.layout import meta_count
    from torchrec_kvzch.table.rank_budget import SharedBudget

    eviction = {"lru": EvictionPolicy("lru", max_rows=1000),
                "lfu": EvictionPolicy("lfu", count_threshold=2, count_decay=0.5, interval_steps=1)}.get(kind)
    p = KVZCHTableParams("e", 4, num_embeddings=2**40, total_num_buckets=8, eviction=eviction or EvictionPolicy(),
                         admission=AdmissionPolicy("count", min_count=2),
                         storage=DiskStorage(tmp_path, 1 << 20) if kind == "disk" else DiskStorage())
    budget = SharedBudget(RankBudget(max_rows=1000)) if kind == "rank_budget" else None
    tbe = TableTBE(p, p.bucket_range(0, 1), budget=budget)
    for _ in range(3):
        tbe(torch.arange(90), torch.tensor([0, 90])).sum().backward()
    first = tbe(torch.arange(90), torch.tensor([0, 90]))
    store = tbe.store
    before = (store.clock, store.keys().clone(), meta_count(store.meta[: len(store)]).clone(),
              store.admission.counts.clone(), store.admission.totals.clone())
    with pytest.raises(RuntimeError, match="'e': a forward before the backward of the one before it .* would have"):
        tbe(torch.arange(90, 95), torch.tensor([0, 5]))  # (room for these, a pass that would drop none)
    after = (store.clock, store.keys(), meta_count(store.meta[: len(store)]), store.admission.counts,
             store.admission.totals)
    assert before[0] == after[0] and all(torch.equal(x, y) for x, y in zip(before[1:], after[1:]))
    first.sum().backward()
    tbe(torch.arange(90, 95), torch.tensor([0, 5])).sum().backward()  # after the backward: fine


def test_a_lookup_ahead_goes_on_where_no_row_can_move():
    """Without eviction in the lookups (none, or passes on the manual trigger), a lookup ahead
    is the semi-sync pipeline's, and works while the store has room."""
    for eviction in (EvictionPolicy(), EvictionPolicy("ttl", ttl_steps=3, trigger="manual")):
        p = KVZCHTableParams("m", 4, num_embeddings=2**40, total_num_buckets=8, eviction=eviction,
                             expected_rows=5000)
        tbe = TableTBE(p, p.bucket_range(0, 1), initial_rows=5000)
        first = tbe(torch.arange(90), torch.tensor([0, 90]))
        second = tbe(torch.arange(90, 95), torch.tensor([0, 5]))
        with pytest.raises(RuntimeError, match="'m': an eviction pass cannot run between a forward and its backward"):
            tbe.store.evictor.run_pass()
        (first.sum() + second.sum()).backward()


def test_dims_fbgemm_cannot_run_are_refused_with_a_clear_error():
    p = KVZCHTableParams("d", 6, num_embeddings=2**40, total_num_buckets=8)
    with pytest.raises(ValueError, match="embedding_dim 6 is not a multiple of 4"):
        TableTBE(p, p.bucket_range(0, 1))


@given(pooling=st.sampled_from(POOLINGS), weighted=st.booleans(), mode=st.sampled_from(["no_grad", "eval"]),
       known=st.lists(st.integers(0, 2**40 - 1), min_size=1, max_size=8),
       fresh=st.lists(st.integers(0, 2**40 - 1), max_size=8))
def test_evaluation_changes_nothing_and_reads_what_training_would(pooling, weighted, mode, known, fresh):
    """An evaluation lookup (no_grad or eval mode) creates, evicts and touches no row and
    leaves the clock and counters; its output equals a training forward's, unseen ids reading
    as the id-seeded rows they would get (even with no id at all)."""
    params = KVZCHTableParams("t", 8, learning_rate=0.1, optimizer="exact_sgd")
    tbe = TableTBE(params, params.bucket_range(0, 1), pooling=pooling)
    tbe(torch.tensor(known), torch.tensor([0, len(known)])).sum().backward()  # some rows, trained
    ids = torch.tensor(known + fresh, dtype=torch.long)
    offsets = torch.tensor([0, len(known), ids.numel()])
    weights = torch.rand(ids.numel()) if weighted and pooling is not PoolingMode.NONE else None
    store = tbe.store
    def bits():  # whole rows as raw bits (a header's id can read as a float NaN)
        return store.read_ids(torch.sort(store.keys()).values, RowPart.ROW).view(torch.int32).clone()

    before = (store.clock, dict(store.counters), bits())
    if mode == "eval":
        tbe.eval()
        out = tbe(ids, offsets, weights)
        tbe.train()
    else:
        with torch.no_grad():
            out = tbe(ids, offsets, weights)
    assert (store.clock, dict(store.counters)) == before[:2]
    assert torch.equal(bits(), before[2])
    with torch.no_grad():  # the same batch through a training forward, on a copy of the rows
        twin = TableTBE(params, params.bucket_range(0, 1), pooling=pooling)
        twin.store.write_rows(store.read_ids(torch.sort(store.keys()).values, RowPart.ROW))
        twin.train()
    with torch.enable_grad():
        want = twin(ids, offsets, weights)
    assert torch.equal(out, want.detach())
    empty = torch.empty(0, dtype=torch.long)
    with torch.no_grad():
        assert tbe(empty, torch.zeros(3, dtype=torch.long)).shape[0] in (0, 2)


@pytest.mark.parametrize("offsets, weights", [([0, 2], None), ([0, 4], None), ([1, 3], None), ([0, 2, 1, 3], None),
                                              ([0, 3], [1.0, 2.0])])
def test_a_malformed_batch_is_refused_before_anything_changes(offsets, weights):
    """fbgemm's TBE runs without bounds checks: offsets that do not rise from 0 to the number of
    ids, or per-sample weights not one per id, are refused by name before admission counts the
    batch, the clock steps or a row is made (training and evaluation alike)."""
    from torchrec_kvzch import AdmissionPolicy

    p = KVZCHTableParams("b", 4, num_embeddings=2**20, total_num_buckets=8,
                         admission=AdmissionPolicy("count", min_count=2))
    tbe = TableTBE(p, p.bucket_range(0, 1))
    ids, weights = torch.tensor([5, 6, 6]), None if weights is None else torch.tensor(weights)
    for train in (True, False):
        tbe.train(train)
        with pytest.raises(ValueError, match="KV-ZCH table 'b': (offsets must rise|2 per-sample weights for 3 ids)"):
            tbe(ids, torch.tensor(offsets), weights)
        assert (tbe.store.clock, len(tbe.store), int(tbe.store.admission.counts.sum())) == (0, 0, 0)
