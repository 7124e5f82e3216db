"""The CUDA path against the CPU path: TableTBE, DMP on a CUDA rank, checkpoints between them.

Skipped without a CUDA device, an error on a GPU machine where torch sees none (``_cuda.py``);
``tools/gpu/check.sh`` runs them on a GPU machine (docs/gpu.md). One GPU suffices: the CUDA
side runs on one NCCL rank, the CPU side of a checkpoint test on two gloo ranks.
"""

import json
import tempfile

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

from _cuda import BACKEND, DEVICE, requires_cuda
from _dist import run_ranks
from test_resume import build, snapshot, state_of, train_step
from test_sharding import BASE, random_cases, sweep
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.table.layout import RowPart

pytestmark = requires_cuda()
CUDA = DEVICE  # the CPU only where _cuda.py rehearses these tests without a GPU


# -- the kernel --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE])
@pytest.mark.parametrize("optimizer", ["exact_rowwise_adagrad", "exact_sgd", "adam", "partial_row_wise_adam"])
def test_kernel_on_cuda_trains_like_the_kernel_on_cpu(optimizer, pooling, dtype):
    """Outputs, the ids that got rows, weights and optimizer state after fused steps that grow
    the store past its first capacity (1024 rows) on CUDA. fbgemm's CUDA and CPU kernels sum
    in other orders, so values agree to rounding, not bits; fp16 rows to fp16 rounding."""
    gen = torch.Generator().manual_seed(0)
    p = KVZCHTableParams("t", 16, num_embeddings=2**62, total_num_buckets=64, optimizer=optimizer,
                         weight_dtype=dtype, stochastic_rounding=False, learning_rate=0.05,
                         init_range=(-0.5, 0.5))
    ours = TableTBE(p, p.bucket_range(0, 1), num_features=2, pooling=pooling, device=CUDA)
    ref = TableTBE(p, p.bucket_range(0, 1), num_features=2, pooling=pooling)
    universe = torch.randint(0, 2**62, (3000,), generator=gen).unique()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "fp32" else dict(rtol=1e-2, atol=2e-3)
    for _ in range(6):
        lengths = torch.randint(0, 8, (2 * 256,), generator=gen)
        ids = universe[torch.randint(0, universe.numel(), (int(lengths.sum()),), generator=gen)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        out, want = ours(ids.to(CUDA), offsets.to(CUDA)), ref(ids, offsets)
        torch.testing.assert_close(out.cpu(), want, **tol)
        grad = torch.randn(want.shape, generator=gen)
        out.backward(grad.to(CUDA))
        want.backward(grad)
    assert ours.store.capacity > 1024 and ours.store.weights.device.type == CUDA.type
    seen = torch.sort(ref.store.keys()).values
    assert torch.equal(torch.sort(ours.store.keys()).values.cpu(), seen)
    parts = [RowPart.WEIGHT] + ([RowPart.OPTIMIZER] if optimizer != "exact_sgd" else [])
    for part in parts:
        torch.testing.assert_close(ours.store.read_ids(seen.to(CUDA), part).cpu(),
                                   ref.store.read_ids(seen, part), **tol)
    # Headers (timestamp, count of occurrences, used bit): the GPU kernels' touch, bit for bit.
    assert torch.equal(ours.store.read_ids(seen.to(CUDA), RowPart.META).cpu(), ref.store.read_ids(seen, RowPart.META))
    with torch.no_grad():  # evaluation reads the same rows
        torch.testing.assert_close(ours.eval()(ids.to(CUDA), offsets.to(CUDA)).cpu(),
                                   ref.eval()(ids, offsets), **tol)


def test_kernel_on_cuda_keeps_feature_scores_and_takes_writes_like_the_cpu():
    """A feature-score table on CUDA (the torch twin adds the scores) against the CPU's native
    op: headers (timestamps, scores) bit for bit through passes that decay and cut (scores are
    multiples of 1/4, so sums are exact), and embedding writes (a repeated id: its last row)."""
    from torchrec_kvzch import EvictionPolicy

    gen = torch.Generator().manual_seed(1)
    p = KVZCHTableParams("t", 8, num_embeddings=2**40, total_num_buckets=16, learning_rate=0.05,
                         eviction=EvictionPolicy("feature_score", keep_rows=300, count_decay=0.5,
                                                 trigger="rows", trigger_rows=400))
    ours, ref = (TableTBE(p, p.bucket_range(0, 1), device=d) for d in (CUDA, torch.device("cpu")))
    universe = torch.randint(0, 2**40, (2000,), generator=gen).unique()
    for _ in range(6):
        ids = universe[torch.randint(0, universe.numel(), (600,), generator=gen)]
        scores = torch.randint(0, 9, (600,), generator=gen) / 4
        offsets = torch.arange(601)
        out, want = ours(ids.to(CUDA), offsets.to(CUDA), scores=scores.to(CUDA)), ref(ids, offsets, scores=scores)
        grad = torch.randn(want.shape, generator=gen)
        out.backward(grad.to(CUDA))
        want.backward(grad)
    written = torch.cat([universe[:50], universe[:1]])
    rows = torch.randn(51, 8, generator=gen)
    ours.write(written.to(CUDA), rows.to(CUDA))
    ref.write(written, rows)
    assert ref.store.history.evicted > 0
    seen = torch.sort(ref.store.keys()).values
    assert torch.equal(torch.sort(ours.store.keys()).values.cpu(), seen)
    assert torch.equal(ours.store.read_ids(seen.to(CUDA), RowPart.META).cpu(), ref.store.read_ids(seen, RowPart.META))
    assert torch.equal(ours.store.read_ids(universe[:50].to(CUDA)).cpu(), torch.cat([rows[50:], rows[1:50]]))


# (optimizer, cache policy, rules): each optimizer under each policy; admission with a trainable
# default row and a row budget (evictions inside lookups) under both.
CACHE_CASES = [(o, c, False) for o in ("exact_rowwise_adagrad", "exact_sgd", "adam") for c in ("lru", "lfu")] + [
    ("exact_rowwise_adagrad", "lru", True), ("adam", "lfu", True)]


@pytest.mark.skipif(CUDA.type != "cuda", reason="fbgemm's managed-caching TBE runs on CUDA only")
@pytest.mark.parametrize("optimizer, policy, rules", CACHE_CASES)
def test_kernel_with_a_device_cache_trains_like_the_gpu_store(optimizer, policy, rules):
    """Rows in host memory under a GPU cache of 512 rows (issue 34) against every row in GPU
    memory, both on CUDA: outputs, rows and headers through growth, batches of more distinct rows
    than the cache holds, evictions (slots reused), embedding writes, evaluation, a frozen snapshot
    read while training goes on, and the decoupled weight decay's row shrink; with ``rules``,
    count admission (a trainable default row for ids not admitted yet) and a row budget that
    evicts inside the lookups."""
    from torchrec_kvzch import AdmissionPolicy, EvictionPolicy
    from torchrec_kvzch.params import DeviceCache
    from torchrec_kvzch.table.snapshot import RowSnapshot

    gen = torch.Generator().manual_seed(2)
    decay = dict(weight_decay=0.01, weight_decay_mode="decouple") if optimizer != "exact_sgd" else {}
    if rules:
        decay.update(admission=AdmissionPolicy("count", min_count=2, default="trainable"),
                     eviction=EvictionPolicy("lru", max_rows=1500))
    base = dict(name="t", embedding_dim=16, num_embeddings=2**40, total_num_buckets=16, optimizer=optimizer,
                learning_rate=0.05, init_range=(-0.5, 0.5), **decay)
    cached = KVZCHTableParams(**base, device_cache=DeviceCache(rows=512, policy=policy))
    ours = TableTBE(cached, cached.bucket_range(0, 1), num_features=2, device=CUDA)
    ref = TableTBE(KVZCHTableParams(**base), cached.bucket_range(0, 1), num_features=2, device=CUDA)
    assert ours.store.row_cache is not None and ref.store.row_cache is None
    universe = torch.randint(0, 2**40, (4000,), generator=gen).unique()
    hot = torch.distributions.Exponential(torch.tensor(1 / 600.0))  # skewed: hits and misses
    tol = dict(rtol=1e-6, atol=1e-6)
    frozen = None
    for step in range(10):
        lengths = torch.randint(0, 8, (2 * 256,), generator=gen)
        n = int(lengths.sum())
        ids = universe[hot.sample((n,)).long().clamp(max=universe.numel() - 1)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        out, want = ours(ids.to(CUDA), offsets.to(CUDA)), ref(ids.to(CUDA), offsets.to(CUDA))
        torch.testing.assert_close(out, want, **tol)
        grad = torch.randn(want.shape, generator=gen).to(CUDA)
        out.backward(grad)
        want.backward(grad)
        if step == 3:  # evictions move rows between slots; new rows then reuse the freed ones
            victims = ref.store.keys()[: len(ref.store) // 3].clone()
            ours.store.evict(victims)
            ref.store.evict(victims)
        if step == 5:  # writes of cached, uncached and new rows
            written = torch.cat([universe[:40], universe[-10:]]).to(CUDA)
            rows = torch.randn(50, 16, generator=gen).to(CUDA)
            ours.write(written, rows)
            ref.write(written, rows)
        if step == 6:  # rows as of now, read after three more steps changed them
            frozen = [RowSnapshot(t.store) for t in (ours, ref)]
            for snap in frozen:
                snap.freeze()
        with torch.no_grad():
            torch.testing.assert_close(ours.eval()(ids.to(CUDA), offsets.to(CUDA)),
                                       ref.eval()(ids.to(CUDA), offsets.to(CUDA)), **tol)
        ours.train()
        ref.train()
    assert ours.store.capacity > 1024 and ours.store.history.evicted > 0
    seen = torch.sort(ref.store.keys()).values
    assert torch.equal(torch.sort(ours.store.keys()).values, seen)
    if rules:  # (the budget held, and some ids read the default row, trained alike)
        assert len(ours.store) <= 1500 and ours.store.admission.rejected > 0
        for name, value in ref.default_state().items():
            torch.testing.assert_close(ours.default_state()[name], value, **tol)
    for part in [RowPart.WEIGHT, RowPart.META] + ([RowPart.OPTIMIZER] if optimizer != "exact_sgd" else []):
        torch.testing.assert_close(ours.store.read_ids(seen, part), ref.store.read_ids(seen, part), **tol)
    for part in (RowPart.WEIGHT, RowPart.META):
        torch.testing.assert_close(*(snap.read(0, len(snap), part) for snap in frozen), rtol=1e-6, atol=1e-6)
    assert not torch.equal(frozen[0].read(0, len(frozen[0]), RowPart.WEIGHT),
                           ours.store.read_ids(frozen[0].ids, RowPart.WEIGHT))  # (trained since)
    ahead = ours(ids.to(CUDA), offsets.to(CUDA))  # a forward ahead of its backward: refused under a cache
    with pytest.raises(RuntimeError, match="semi-sync pipeline"):
        ours(ids.to(CUDA), offsets.to(CUDA))
    del ahead


@pytest.mark.skipif(CUDA.type != "cuda", reason="fbgemm's Adam runs on CUDA only")
@pytest.mark.parametrize("optimizer", ["adam", "partial_row_wise_adam"])
def test_adam_kernel_on_cuda_trains_like_fbgemms_dense_cuda_adam(optimizer):
    """Our Adam (its own update, the moments in the rows) against fbgemm's CUDA Adam holding the
    same rows densely: outputs, weights and both moments after several steps."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                        SplitTableBatchedEmbeddingBagsCodegen)

    gen = torch.Generator().manual_seed(1)
    p = KVZCHTableParams("t", 16, num_embeddings=2**62, total_num_buckets=64, optimizer=optimizer,
                         learning_rate=0.05, beta1=0.8, beta2=0.95, init_range=(-0.5, 0.5))
    ours = TableTBE(p, p.bucket_range(0, 1), device=CUDA)
    universe = torch.randint(0, 2**62, (500,), generator=gen).unique()
    dense = SplitTableBatchedEmbeddingBagsCodegen(
        [(universe.numel(), 16, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)], optimizer=EmbOptimType(optimizer),
        learning_rate=0.05, eps=p.eps, beta1=0.8, beta2=0.95, device=CUDA)
    with torch.no_grad():
        dense.split_embedding_weights()[0].copy_(ours.store.peek(universe.to(CUDA)))
    for _ in range(5):
        lengths = torch.randint(0, 6, (64,), generator=gen)
        local = torch.randint(0, universe.numel(), (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(CUDA)
        out, want = ours(universe[local].to(CUDA), offsets), dense(local.to(CUDA), offsets)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        grad = torch.randn(want.shape, generator=gen).to(CUDA)
        out.backward(grad)
        want.backward(grad)
    seen = torch.sort(ours.store.keys()).values
    rows = torch.searchsorted(universe.to(CUDA), seen)  # (universe is sorted: unique())
    torch.testing.assert_close(ours.store.read_ids(seen), dense.split_embedding_weights()[0][rows],
                               rtol=1e-4, atol=1e-5)
    m1, m2 = (t.view(universe.numel(), -1)[rows] for t in dense.split_optimizer_states()[0])
    columns = {name: (first, count) for name, first, count in p.optimizer.state_names(16)}
    kept = ours.store.read_ids(seen, RowPart.OPTIMIZER)
    for name, want_state in (("momentum1", m1), ("momentum2", m2)):  # (fbgemm's names too)
        first, count = columns[name]
        torch.testing.assert_close(kept[:, first:first + count], want_state.float(), rtol=1e-4, atol=1e-6)


# -- the id map ---------------------------------------------------------------------------------
def test_the_id_map_kernels_agree_with_the_torch_twin_at_scale():
    """Millions of ids in batches with repeats, new ids racing for the same entries, erasures
    and the rehashes they cause: the GPU kernels give the twin's slots, compactions and keys."""
    from torchrec_kvzch.table.id_map import IdMap

    gpu, twin = IdMap("auto", CUDA), IdMap("torch", "cpu")
    if CUDA.type == "cuda":
        assert gpu.backend.name == "triton"
    gen = torch.Generator().manual_seed(5)
    for step in range(12):
        ids = torch.randint(0, 2**22, (1 << 18,), generator=gen) * 2**30  # repeats, crowded homes
        assert torch.equal(gpu.find_or_insert(ids.to(CUDA)).cpu(), twin.find_or_insert(ids))
        if step % 3 == 2:
            gone = ids[torch.randperm(ids.numel(), generator=gen)[: ids.numel() // 2]]
            a, b = gpu.erase(gone.to(CUDA)), twin.erase(gone)
            assert torch.equal(a.src.cpu(), b.src) and torch.equal(a.dst.cpu(), b.dst)
    assert torch.equal(gpu.keys().cpu(), twin.keys())
    probe = torch.randint(0, 2**23, (1 << 18,), generator=gen) * 2**30
    assert torch.equal(gpu.find(probe.to(CUDA)).cpu(), twin.find(probe))


def test_the_touch_kernels_count_hot_rows_as_the_twin_at_scale():
    """Batches of a million skewed occurrences (a quarter of them on one row) over 100,000 rows,
    touched by thousands of blocks at once: headers as the twin's, bit for bit, and the scratch
    counters left zero. Two lanes electing themselves for one row would race on its header."""
    from torchrec_kvzch.table import layout
    from torchrec_kvzch.table.id_map import TritonBackend

    n, rows = (1 << 20, 100_000) if CUDA.type == "cuda" else (4096, 1000)  # (the CPU: Triton's interpreter)
    gen = torch.Generator().manual_seed(9)
    meta = layout.make_meta(torch.randint(0, 2**32, (rows,), generator=gen),
                            torch.randint(0, 1000, (rows,), generator=gen))
    gpu, got = TritonBackend(CUDA), meta.to(CUDA, copy=True)
    for clock in range(1, 4):
        slots = (torch.rand(n, generator=gen).pow(8) * rows).long()  # u^8: row 0 takes rows^(-1/8) of them
        layout.touch_meta(meta, slots, clock, native=False)
        gpu.touch(got, slots.to(CUDA), clock)
        assert torch.equal(got.cpu(), meta)
    assert not bool(gpu._counts.any())


# -- DMP ---------------------------------------------------------------------------------------
def test_dmp_on_a_cuda_rank_matches_torchrec_fused_tables_on_cuda():
    """test_sharding's comparison (KV-ZCH tables against stock TorchRec FUSED twins over the
    same rows) on one NCCL rank, for pooled, weighted, sequence and random cases."""
    cases = [BASE, dict(BASE, weighted=True), dict(BASE, pooling=None, buckets=6)] + random_cases(21, 3)
    run_ranks(1, sweep, cases, None, CUDA.type, backend=BACKEND, timeout=600)


# -- checkpoints between CUDA and CPU ------------------------------------------------------------
STEPS = 4


def cache_kw(device, cached):
    """A device cache of 8 rows a shard (issue 34), smaller than the batches' rows, where asked."""
    from torchrec_kvzch.params import DeviceCache

    return {"device_cache": DeviceCache(rows=8)} if cached and device != "cpu" else {}


def train_and_save(rank, world, device, root, asynchronous=False, cached=False):
    """STEPS steps on ``device``, then a save of step STEPS (async: two more steps train while
    it is written); the state saved, gathered."""
    model, dense = build(device=torch.device(device), dense_lr=0.0, **cache_kw(device, cached))
    for step in range(STEPS):
        train_step(model, dense, step, rank, world)
    saved = snapshot(model, dense, dist.group.WORLD)
    group = dist.new_group(backend="gloo")  # async saves run their collectives on their own group
    manager = CheckpointManager(root, process_group=group)
    manager.save(state_of(model, dense), STEPS, asynchronous=asynchronous)
    if asynchronous:
        for step in range(STEPS, STEPS + 2):
            train_step(model, dense, step, rank, world)
    manager.close()
    return saved


def load(rank, world, device, root, cached=False):
    """A model on ``device`` with rows of its own loads the checkpoint; its state, gathered."""
    model, dense = build(device=torch.device(device), dense_lr=0.0, **cache_kw(device, cached))
    train_step(model, dense, 99, rank, world)  # rows the load must replace
    state = state_of(model, dense)
    assert CheckpointManager(root).load(state) == STEPS
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    return snapshot(model, dense, dist.group.WORLD)


def same_rows(a, b):
    """Every KV-ZCH row with its header, bit for bit, and the dense weights."""
    assert a["rows"].keys() == b["rows"].keys()
    assert all(torch.equal(a["rows"][k], b["rows"][k]) for k in a["rows"])
    assert all(torch.equal(x, y) for x, y in zip(a["dense"], b["dense"]))


CACHED = [False, True] if CUDA.type == "cuda" else [False]  # (rows in host memory under a GPU cache)


@pytest.mark.parametrize("cached", CACHED)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_checkpoint_saved_on_cuda_loads_on_two_cpu_ranks_bit_for_bit(asynchronous, cached):
    with tempfile.TemporaryDirectory() as root:
        saved = run_ranks(1, train_and_save, CUDA.type, root, asynchronous, cached, backend=BACKEND, timeout=600)[0]
        loaded = run_ranks(2, load, "cpu", root, timeout=600)[0]
    same_rows(saved, loaded)


@pytest.mark.parametrize("cached", CACHED)
def test_a_checkpoint_saved_on_two_cpu_ranks_loads_on_cuda_bit_for_bit(cached):
    with tempfile.TemporaryDirectory() as root:
        saved = run_ranks(2, train_and_save, "cpu", root, timeout=600)[0]
        loaded = run_ranks(1, load, CUDA.type, root, cached, backend=BACKEND, timeout=600)[0]
    same_rows(saved, loaded)


# -- the training job ----------------------------------------------------------------------------
def test_the_job_trains_and_logs_on_a_cuda_rank(tmp_path):
    """The job's own reductions (step totals, counters) are CPU tensors: its default group
    pairs gloo with NCCL for them. Three steps, a log line and a checkpoint each, evaluations at
    steps 2 and 3."""
    from torchrec_kvzch.job.train import main

    run = tmp_path / "run"
    assert main(["--config", "quickstart", "--nproc", "1", "--device", CUDA.type, "--steps", "3",
                 "--global-batch-size", "256", "--log-every", "1", "--checkpoint-every", "1",
                 "--eval-every", "2", "--run-dir", str(run)]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if m["kind"] == "train"] == [1, 2, 3]
    assert [m["step"] for m in lines if m["kind"] == "eval"] == [2, 3]  # held-out AUC from a CUDA model
    assert json.loads((run / "summary.json").read_text())["checkpoint_step"] == 3


# -- serving (issue 31) ---------------------------------------------------------------------------
# On CUDA a served table maps ids with the id map's GPU kernels; rehearsed on the CPU, with the
# torch twin they stand on.
SERVED_MAP = "auto" if CUDA.type == "cuda" else "torch"


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_serving_a_table_on_cuda_reads_as_on_cpu(dtype, pooling):
    """Rows in GPU memory (padded to 16 bytes: dim 10 pads every dtype), grown past their
    first capacity, replaced and deleted, read as the CPU table's: ``weights`` bit for bit,
    fbgemm's CUDA lookups to the rounding of another summation order; default rows by id
    range; an id outside the table refused by name; a copy independent."""
    from torchrec_kvzch.serving import ServedTable
    gen = torch.Generator().manual_seed(3)
    dim, top = 10, 2**41
    kw = dict(default_rows=torch.randn(2, dim, generator=gen), default_starts=torch.tensor([0, 2**40]),
              id_range=(0, top), capacity=16)
    gpu = ServedTable("t", dim, dtype, pooling, device=CUDA, id_map=SERVED_MAP, **kw)
    cpu = ServedTable("t", dim, dtype, pooling, **kw)
    universe = torch.randint(0, top, (3000,), generator=gen).unique()
    for _ in range(4):
        ids = universe[torch.randperm(universe.numel(), generator=gen)[:1500]]
        rows = torch.randn(ids.numel(), dim, generator=gen)
        gpu.upsert(ids.to(CUDA), rows.to(CUDA))
        cpu.upsert(ids, rows)
        assert gpu.delete(ids[:200].to(CUDA)) == cpu.delete(ids[:200])
    assert len(gpu) == len(cpu) > 1000
    if CUDA.type == "cuda":
        assert gpu.rows.device.type == CUDA.type and gpu.id_map.backend.name == "triton" and gpu.row_bytes % 16 == 0
    query = torch.cat([universe[:500], torch.randint(0, top, (100,), generator=gen)])
    assert torch.equal(gpu.weights(query.to(CUDA)).cpu(), cpu.weights(query))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.sort(torch.randint(0, 601, (149,), generator=gen)).values,
                         torch.tensor([600])])
    weights = None if pooling == "none" else torch.rand(600, generator=gen)
    got = gpu.lookup(query.to(CUDA), offsets.to(CUDA), None if weights is None else weights.to(CUDA)).cpu()
    expected = cpu.lookup(query, offsets, weights)
    if dtype == "int8" and CUDA.type == "cuda":
        # fbgemm's CUDA int8 kernel dequantizes in half precision (hfma2): each value is within half
        # an fp16 ulp (<= |v| * 2**-11) of the CPU's fp32 decoding, and the bags pool those errors.
        slack = cpu.weights(query).abs() * 2**-11
        if pooling != "none":
            bags = torch.arange(offsets.numel() - 1).repeat_interleave(offsets.diff())
            slack = torch.zeros_like(expected).index_add_(0, bags, slack * weights.unsqueeze(1))
            if pooling == "mean":
                slack /= torch.zeros(len(expected)).index_add_(0, bags, weights).unsqueeze(1) + 1e-6
        assert ((got - expected).abs() <= slack * 1.001 + 1e-5).all()
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=rf"served table 't': id {top} \(position 1 of the batch\) is outside"):
        gpu.lookup(torch.tensor([5, top], device=CUDA), torch.tensor([0, 2], device=CUDA))
    twin = gpu.copy()
    twin.delete(query[:100].to(CUDA))
    assert torch.equal(gpu.weights(query.to(CUDA)).cpu(), cpu.weights(query))


def test_serving_initial_weights_on_cuda_are_the_cpu_ones():
    """``initial``: an id without a row reads its id-seeded initial weights, computed on the
    device bit for bit as the native op computes them on the CPU."""
    from torchrec_kvzch.serving import ServedTable
    gpu = ServedTable("t", 6, initial=(-0.1, 0.1, 7), device=CUDA, id_map=SERVED_MAP)
    cpu = ServedTable("t", 6, initial=(-0.1, 0.1, 7))
    for t in (gpu, cpu):
        t.upsert(torch.tensor([3, 9], device=t.device), torch.ones(2, 6, device=t.device))
    query, offsets = torch.tensor([3, 4, 9, 2**50, 11]), torch.tensor([0, 2, 5])
    assert torch.equal(gpu.weights(query.to(CUDA)).cpu(), cpu.weights(query))
    torch.testing.assert_close(gpu.lookup(query.to(CUDA), offsets.to(CUDA)).cpu(), cpu.lookup(query, offsets))


def test_serving_a_model_on_cuda_predicts_as_on_cpu_follows_a_delta_and_exports(tmp_path):
    """The test model trained on CPU ranks and saved as a chain of deltas, served on CUDA:
    predictions as the CPU replica's (ids without rows reading their initial weights); a
    follower on CUDA applies the next deltas; the CUDA program exported from it loads in a
    process that imports ``torchrec_kvzch.ops`` and no TorchRec, and predicts the same."""
    import dataclasses
    import subprocess
    import sys

    import test_resume
    from test_serving_checkpoint import probe_batch, train_phase
    from torchrec_kvzch.serving import Follower, ServingOptions, export_served, served_model

    kv = test_resume.table_params("ttl")
    options = ServingOptions(default="initial", kvzch={t.name: t for t in kv})
    on_cuda = dataclasses.replace(options, device=CUDA)
    probe = probe_batch(torch.tensor([1, 2, 3, 2**32 + 5]), torch.tensor([3, 4, 5, 6]), torch.tensor([5, 6, 7, 8]))
    run = str(tmp_path / "run")
    run_ranks(2, train_phase, run, 0, 4, probe)
    follower = Follower(lambda: test_resume.Net(kv), run, options=on_cuda)

    def agree(step):
        cpu, _ = served_model(test_resume.Net(kv), run, options=options)
        with torch.no_grad(), follower.serving() as version:
            assert version.step == step
            torch.testing.assert_close(version.model(probe.to(CUDA)).cpu(), cpu(probe), rtol=1e-5, atol=1e-6)

    agree(4)
    run_ranks(2, train_phase, run, 4, 8, probe)  # two more saves: deltas on the version served
    assert follower.poll() and follower.last_error is None
    agree(8)
    with follower.serving() as version:
        program = export_served(version.model, (probe.to(CUDA),))
        with torch.no_grad():
            want = version.model(probe.to(CUDA)).cpu()
    torch.export.save(program, tmp_path / "model.pt2")
    torch.save((probe.values(), probe.lengths(), want), tmp_path / "case.pt")
    script = f"""
import sys, torch
import torchrec_kvzch.ops
program = torch.export.load({str(tmp_path / 'model.pt2')!r}).module()
values, lengths, want = torch.load({str(tmp_path / 'case.pt')!r})
torch.testing.assert_close(program(values.to({str(CUDA)!r}), lengths.to({str(CUDA)!r})).cpu(), want)
assert not [m for m in sys.modules if m == "torchrec" or m.startswith("torchrec.")], "TorchRec was imported"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_serving_the_job_over_http_on_cuda_scores_as_trained(tmp_path):
    """``torchrec-kvzch-serve --device cuda`` over a run trained on CPU ranks: the fixed
    batch's scores as the trained model's (to the rounding of CUDA's other summation orders)."""
    import subprocess
    import sys

    from test_serve import fixed_batch, request
    from test_train import train

    run = tmp_path / "run"
    _, trained = train(run, "--steps", 4, "--checkpoint-every", 2, "--incremental-every", 1)
    proc = subprocess.Popen([sys.executable, "-m", "torchrec_kvzch.job.serve", "--checkpoints", str(run / "checkpoints"),
                             "--port", "0", "--device", str(CUDA)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, proc.stderr.read()[-3000:]
        code, reply = request(line.split()[-1] + "/predict", {"examples": fixed_batch()})
        assert code == 200 and reply["step"] == 4, reply
        torch.testing.assert_close(torch.tensor(reply["scores"]), torch.tensor(trained["probe_final"]),
                                   rtol=1e-5, atol=1e-6)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
