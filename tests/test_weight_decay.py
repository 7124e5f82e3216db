"""Weight decay (issue 33), fbgemm's decoupled mode on both optimizers and L2 on SGD: after
several training steps every row and accumulator equals a float64 reference - the batch's
distinct rows as a dense table, autograd for their gradients, the update written out by hand -
and what would be dropped or needs state the rows lack is refused by name (fbgemm's own CPU
rowwise Adagrad drops a decay: the last test shows it, so the table applies its own)."""

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from hypothesis import example, given, settings, strategies as st

from torchrec_kvzch import KVZCHTableParams, TableTBE
from torchrec_kvzch.params import WeightDecayMode


def reference_step(rows: dict, momentum: dict, ids, offsets, grad_out, p: KVZCHTableParams, pooling):
    """One step of ``p``'s optimizer on float64 copies (``rows``/``momentum`` by id, updated); a
    batch of empty bags updates no row."""
    if not ids.numel():
        return
    unique, inverse = torch.unique(ids, return_inverse=True)
    table = torch.stack([rows[int(i)] for i in unique]).requires_grad_()
    mode = "mean" if pooling == PoolingMode.MEAN else "sum"
    pooled = F.embedding_bag(inverse, table, offsets, mode=mode, include_last_offset=True)
    (pooled * grad_out.double()).sum().backward()
    lr, wd, eps = p.learning_rate, p.weight_decay, p.eps
    for i, w, g in zip(unique.tolist(), table.detach(), table.grad):
        if p.optimizer.value == "exact_sgd":  # L2 and decoupled: one step for SGD
            rows[i] = w * (1 - lr * wd) - lr * g
            continue
        l2 = p.weight_decay_mode is WeightDecayMode.L2
        momentum[i] = momentum[i] + ((g + wd * w) if l2 else g).pow(2).mean()
        multiplier = lr / (momentum[i].sqrt() + eps)
        rows[i] = w * (1 - (multiplier if l2 else lr) * wd) - multiplier * g


@settings(max_examples=24, deadline=None)
@given(optimizer_mode=st.sampled_from([("exact_sgd", "l2"), ("exact_sgd", "decouple"),
                                       ("exact_rowwise_adagrad", "decouple"), ("exact_rowwise_adagrad", "l2")]),
       decay=st.sampled_from([0.0, 0.01, 0.3]),
       pooling=st.sampled_from([PoolingMode.SUM, PoolingMode.MEAN]), seed=st.integers(0, 2**16))
@example(optimizer_mode=("exact_rowwise_adagrad", "l2"), decay=0.3, pooling=PoolingMode.SUM, seed=39072)  # (a batch of empty bags)
def test_rows_after_training_with_weight_decay_equal_the_float64_reference(optimizer_mode, decay, pooling, seed):
    optimizer, mode = optimizer_mode
    p = KVZCHTableParams("t", 8, num_embeddings=2**20, total_num_buckets=4, optimizer=optimizer,
                         learning_rate=0.1, weight_decay=decay, weight_decay_mode=mode, init_range=(-1.0, 1.0))
    tbe = TableTBE(p, p.bucket_range(0, 1), pooling=pooling)
    gen = torch.Generator().manual_seed(seed)
    universe = torch.randint(0, 2**20, (12,), generator=gen).unique()
    rows, momentum = {}, {}
    for _ in range(4):
        lengths = torch.randint(0, 4, (6,), generator=gen)
        ids = universe[torch.randint(0, universe.numel(), (int(lengths.sum()),), generator=gen)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        fresh = [i for i in ids.unique().tolist() if i not in rows]
        tbe.store.find_or_insert(torch.tensor(fresh, dtype=torch.long), touch=False)
        for i in fresh:  # a new row: its id-seeded weights, a zero accumulator
            rows[i] = tbe.store.read_ids(torch.tensor([i]))[0].double()
            momentum[i] = torch.zeros((), dtype=torch.float64)
        grad = torch.randn(6, 8, generator=gen)
        tbe(ids, offsets).backward(grad)
        reference_step(rows, momentum, ids, offsets, grad, p, pooling)
    ids = torch.tensor(sorted(rows))
    torch.testing.assert_close(tbe.store.read_ids(ids).double(), torch.stack([rows[i] for i in ids.tolist()]),
                               rtol=1e-5, atol=1e-6)
    if optimizer == "exact_rowwise_adagrad":
        torch.testing.assert_close(tbe.store.read_ids(ids, "optimizer").view(-1).double(),
                                   torch.stack([momentum[i] for i in ids.tolist()]), rtol=1e-5, atol=1e-7)


def test_a_decay_that_would_be_dropped_or_needs_state_is_refused_by_name():
    for kw, message in [(dict(weight_decay=0.1), "weight_decay 0.1 with weight_decay_mode none would be dropped"),
                        (dict(weight_decay=0.1, weight_decay_mode="counter"), "per-row counters"),
                        (dict(weight_decay=0.1, weight_decay_mode="sideways"), "weight_decay_mode 'sideways' is unknown; use one of none, l2, decouple"),
                        (dict(weight_decay=float("nan"), weight_decay_mode="l2"), "weight_decay must be a finite"),
                        (dict(weight_decay=True, weight_decay_mode="l2"), "weight_decay must be a finite")]:
        with pytest.raises(ValueError, match=f"KV-ZCH table 'user': .*{message}"):
            KVZCHTableParams("user", 8, **kw)
    assert KVZCHTableParams("user", 8, weight_decay_mode="L2").weight_decay_mode is WeightDecayMode.L2


@pytest.mark.parametrize("optimizer", ["exact_sgd", "exact_rowwise_adagrad"])
def test_the_trainable_default_row_decays_like_a_row(optimizer):
    from torchrec_kvzch.params import AdmissionPolicy

    lr, wd = 0.1, 0.2
    p = KVZCHTableParams("t", 8, num_embeddings=2**20, total_num_buckets=4, optimizer=optimizer, learning_rate=lr,
                         weight_decay=wd, weight_decay_mode="decouple",
                         admission=AdmissionPolicy("count", min_count=5, default="trainable"))
    tbe = TableTBE(p, p.bucket_range(0, 1))
    row, momentum = torch.zeros(8, dtype=torch.float64), 0.0
    for step in range(3):  # one bag of 10 ids not admitted yet, gradient 1: the row's gradient is 10
        tbe(torch.arange(100 * step, 100 * step + 10), torch.tensor([0, 10])).sum().backward()
        g = torch.full((8,), 10.0, dtype=torch.float64)
        if optimizer == "exact_sgd":
            row = row * (1 - lr * wd) - lr * g
        else:
            momentum += float(g.pow(2).mean())
            row = row * (1 - lr * wd) - lr / (momentum ** 0.5 + p.eps) * g
    assert len(tbe.store) == 0
    torch.testing.assert_close(tbe.default.split_embedding_weights()[0][0].double(), row, rtol=1e-6, atol=1e-6)


def test_fbgemm_cpu_rowwise_adagrad_drops_a_weight_decay():
    """Why the table decays rows itself: fbgemm's CPU rowwise Adagrad, given a decay, updates as
    without one (if a new fbgemm applies it, this fails: pass it to fbgemm then, not both)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # (WeightDecayMode: both stacks have it here)
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen, WeightDecayMode as FbgemmMode)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    outs = []
    for decay in ({}, {"weight_decay": 0.5, "weight_decay_mode": FbgemmMode.DECOUPLE}):
        torch.manual_seed(0)
        tbe = SplitTableBatchedEmbeddingBagsCodegen([(4, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                    optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                    learning_rate=0.5, **decay)
        tbe(torch.tensor([1, 2]), torch.tensor([0, 2])).sum().backward()
        outs.append(tbe.weights_host.clone())
    assert torch.equal(*outs)
