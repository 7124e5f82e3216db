"""The table's own fused updates (issue 33): Adam, partial row-wise Adam, row-wise Adagrad
with L2 decay, and fp16 SGD and row-wise Adagrad with a decay. After several steps every output, row and moment equals a float64 reference -
the batch's distinct rows as a dense table, autograd for their gradients, fbgemm's update rules
written out by hand - for SUM, MEAN and NONE pooling, with per-sample weights (and their
gradient), weight decay and fp16 rows rounded stochastically."""

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from hypothesis import given, settings, strategies as st

from torchrec_kvzch import KVZCHTableParams, TableTBE
from torchrec_kvzch.params import AdmissionPolicy
from torchrec_kvzch.table import row_optimizers
from torchrec_kvzch.table.row_optimizers import _round

DIM = 8


def reference_step(rows: dict, state: dict, ids, offsets, weights, grad_out, p: KVZCHTableParams, pooling, step):
    """One step of ``p``'s optimizer on float64 copies (``rows``/``state`` by id, updated);
    returns the output and the per-sample weights' gradient."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    table = torch.stack([rows[int(i)] for i in unique]).requires_grad_()
    sample = None if weights is None else weights.detach().double().requires_grad_()
    if pooling == PoolingMode.NONE:
        out = table[inverse]
    elif pooling == PoolingMode.MEAN and sample is not None:  # fbgemm: sum(w e) / L
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).double()
        out = F.embedding_bag(inverse, table, offsets, mode="sum", per_sample_weights=sample,
                              include_last_offset=True) / lengths.unsqueeze(1)
    else:
        out = F.embedding_bag(inverse, table, offsets, mode="mean" if pooling == PoolingMode.MEAN else "sum",
                              per_sample_weights=sample, include_last_offset=True)
    (out * grad_out.double()).sum().backward()
    lr, wd, eps, b1, b2 = p.learning_rate, p.weight_decay, p.eps, p.beta1, p.beta2
    l2 = p.weight_decay_mode.value == "l2"
    for i, w, g in zip(unique.tolist(), table.detach(), table.grad):
        g = g + wd * w if l2 else g
        s = state[i]
        if p.optimizer.value in ("exact_row_wise_adagrad", "exact_sgd"):
            multiplier = lr
            if p.optimizer.value == "exact_row_wise_adagrad":
                s[0] += g.pow(2).mean()
                multiplier = lr / (s[0].sqrt() + eps)
            w = w * (1 - lr * wd) if not l2 else w
            rows[i] = w - multiplier * g
            continue
        if p.optimizer.value == "adam":
            m, v = s[:DIM], s[DIM:]
            v[:] = b2 * v + (1 - b2) * g.pow(2)
        else:
            v, m = s[:1], s[1:]
            v[:] = b2 * v + (1 - b2) * g.pow(2).mean()
        m[:] = b1 * m + (1 - b1) * g
        update = m / (1 - b1 ** step) / ((v / (1 - b2 ** step)).sqrt() + eps)
        rows[i] = w - lr * (update + (0.0 if l2 else wd) * w)
    return out.detach(), (None if sample is None else sample.grad)


def train_against_reference(p, pooling, seed, weighted=False, steps=4, tolerance=(1e-5, 1e-6)):
    tbe = TableTBE(p, p.bucket_range(0, 1), pooling=pooling)
    gen = torch.Generator().manual_seed(seed)
    universe = torch.randint(0, 2**20, (12,), generator=gen).unique()
    rows, state, floats = {}, {}, p.optimizer.state_floats(DIM)
    for step in range(1, steps + 1):
        lengths = torch.randint(0, 4, (6,), generator=gen)
        ids = universe[torch.randint(0, universe.numel(), (int(lengths.sum()),), generator=gen)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        for i in ids.unique().tolist():
            if i not in rows:  # a new row: its id-seeded weights, zero state
                rows[i] = tbe.store.peek(torch.tensor([i]))[0].double()
                state[i] = torch.zeros(floats, dtype=torch.float64)
        weights = torch.rand(ids.numel(), generator=gen).requires_grad_() if weighted else None
        out = tbe(ids, offsets, weights)
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        expected, weight_grad = reference_step(rows, state, ids, offsets, weights, grad, p, pooling, step)
        torch.testing.assert_close(out.double(), expected, rtol=tolerance[0], atol=tolerance[1])
        if weighted:
            torch.testing.assert_close(weights.grad.double(), weight_grad, rtol=tolerance[0], atol=tolerance[1])
    return tbe, rows, state


@settings(max_examples=40, deadline=None)
@given(optimizer=st.sampled_from(["adam", "partial_row_wise_adam", "exact_row_wise_adagrad"]),
       mode=st.sampled_from(["l2", "decouple"]), decay=st.sampled_from([0.0, 0.01, 0.3]),
       pooling=st.sampled_from([PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE]),
       weighted=st.booleans(), native=st.booleans(), seed=st.integers(0, 2**16))
def test_rows_and_moments_after_training_equal_the_float64_reference(optimizer, mode, decay, pooling, weighted,
                                                                    native, seed):
    """The native op (on the CPU) and the torch twin (else), both."""
    if optimizer == "exact_row_wise_adagrad":  # (fbgemm's own update without an L2 decay)
        mode, decay = "l2", decay or 0.01
    weighted = weighted and pooling != PoolingMode.NONE
    p = KVZCHTableParams("t", DIM, num_embeddings=2**20, total_num_buckets=4, optimizer=optimizer,
                         learning_rate=0.05, weight_decay=decay, weight_decay_mode=mode if decay else "none",
                         init_range=(-1.0, 1.0), **(dict(beta1=0.8, beta2=0.95) if "adam" in optimizer else {}))
    with mock.patch.object(row_optimizers, "native_status", lambda: native):
        tbe, rows, state = train_against_reference(p, pooling, seed, weighted)
    ids = torch.tensor(sorted(rows))
    torch.testing.assert_close(tbe.store.read_ids(ids).double(), torch.stack([rows[i] for i in ids.tolist()]),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tbe.store.read_ids(ids, "optimizer").double(),
                               torch.stack([state[i] for i in ids.tolist()]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["adam", "partial_row_wise_adam"])
def test_fp16_rows_round_stochastically_and_alike_on_a_rerun_and_in_both_twins(optimizer):
    p = KVZCHTableParams("t", DIM, num_embeddings=2**20, total_num_buckets=4, optimizer=optimizer,
                         learning_rate=0.05, weight_dtype="fp16", init_range=(-1.0, 1.0))
    fp16 = (4e-3, 4e-3)  # (the reference keeps fp64 rows, the table rounds them to fp16 every step)
    first, rows, _ = train_against_reference(p, PoolingMode.SUM, seed=3, tolerance=fp16)
    ids = torch.tensor(sorted(rows))
    got, want = first.store.read_ids(ids).double(), torch.stack([rows[i] for i in ids.tolist()])
    assert got.dtype == torch.float64 and bool(((got - want).abs() <= 4e-3 * want.abs() + 1e-3).all())
    again, _, _ = train_against_reference(p, PoolingMode.SUM, seed=3, tolerance=fp16)
    assert torch.equal(again.store.read_ids(ids), first.store.read_ids(ids))
    with mock.patch.object(row_optimizers, "native_status", lambda: False):  # the twin draws alike
        twin, _, _ = train_against_reference(p, PoolingMode.SUM, seed=3, tolerance=fp16)
    assert float((twin.store.read_ids(ids).float() - first.store.read_ids(ids).float()).abs().max()) <= 2.0 ** -9


@pytest.mark.parametrize("optimizer,mode", [("exact_sgd", "decouple"), ("exact_sgd", "l2"),
                                            ("exact_row_wise_adagrad", "decouple")])
@pytest.mark.parametrize("native", [True, False])
def test_fp16_rows_with_a_weight_decay_round_once_per_update(optimizer, mode, native):
    """fbgemm computes ``c w - m g`` and rounds it once: a decay applied apart, rounded to the
    nearest fp16 on its own, would vanish whenever ``lr * wd * |w|`` is below half a step. Such
    tables run their own update: trained, the rows follow the reference; with zero gradients
    and stochastic rounding, they shrink as fp32 rows do."""
    p = KVZCHTableParams("t", DIM, num_embeddings=2**20, total_num_buckets=4, optimizer=optimizer,
                         learning_rate=0.05, weight_decay=0.01, weight_decay_mode=mode, weight_dtype="fp16",
                         init_range=(-1.0, 1.0))
    with mock.patch.object(row_optimizers, "native_status", lambda: native):
        tbe, rows, _ = train_against_reference(p, PoolingMode.SUM, seed=5, tolerance=(4e-3, 4e-3))
        ids = torch.tensor(sorted(rows))
        got, want = tbe.store.read_ids(ids).double(), torch.stack([rows[i] for i in ids.tolist()])
        assert bool(((got - want).abs() <= 4e-3 * want.abs() + 1e-3).all())
        small = KVZCHTableParams("s", DIM, num_embeddings=2**20, total_num_buckets=4, optimizer=optimizer,
                                 learning_rate=0.01, weight_decay=0.01, weight_decay_mode=mode,
                                 weight_dtype="fp16", init_range=(-1.0, 1.0))  # 1e-4 a step: below half an fp16 step
        still = TableTBE(small, small.bucket_range(0, 1))
        ids, offsets = torch.arange(64), torch.tensor([0, 64])
        start = still.store.peek(ids).float().abs().sum()  # (the rows the first step creates, then decays)
        for _ in range(300):
            (still(ids, offsets) * 0).sum().backward()
        ratio = float(still.store.read_ids(ids).float().abs().sum() / start)
    assert abs(ratio - (1 - 0.01 * 0.01) ** 300) < 0.003, ratio


def test_stochastic_rounding_to_fp16_is_unbiased_and_lands_on_a_neighbour():
    x = torch.full((20000, 1), 1.0 + 0.3 * 2.0 ** -10)  # 0.3 of an fp16 step above 1
    rounded = _round(x, torch.float16, True, torch.arange(20000), step=7).float()
    assert set(rounded.view(-1).tolist()) == {1.0, 1.0 + 2.0 ** -10}
    assert abs(float(rounded.mean()) - float(x.mean())) < 0.02 * 2.0 ** -10
    assert torch.equal(_round(x, torch.float16, False, torch.arange(20000), 7), x.half())
    negative = _round(-x, torch.float16, True, torch.arange(20000), step=7).float()
    assert torch.equal(negative, -rounded)


def test_the_default_row_trains_with_the_tables_own_update():
    p = KVZCHTableParams("t", DIM, optimizer="adam", learning_rate=0.1,
                         admission=AdmissionPolicy(kind="count", min_count=5, default="trainable"))
    tbe = TableTBE(p, p.bucket_range(0, 1))
    ids, offsets = torch.tensor([3, 4]), torch.tensor([0, 2])
    for step in range(1, 3):
        tbe(ids, offsets).backward(torch.ones(1, DIM))
    state = tbe.default_state()
    assert set(state) == {"weight", "momentum1", "momentum2"}
    g = torch.full((DIM,), 2.0)  # both ids read the default row
    m = (1 - 0.9 ** 2) * g
    v = (1 - 0.999 ** 2) * g * g
    torch.testing.assert_close(state["momentum1"].view(-1), m)
    torch.testing.assert_close(state["momentum2"].view(-1), v)
    assert float(state["weight"].abs().sum()) > 0


def test_betas_are_checked_by_name():
    for value in (1.0, -0.1, math.nan, True, "0.9"):
        with pytest.raises(ValueError, match=r"KV-ZCH table 'user': beta1 must be a number in \[0, 1\)"):
            KVZCHTableParams("user", DIM, optimizer="adam", beta1=value)
