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
@pytest.mark.parametrize("optimizer", ["exact_rowwise_adagrad", "exact_sgd"])
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


# -- DMP ---------------------------------------------------------------------------------------
def test_dmp_on_a_cuda_rank_matches_torchrec_fused_tables_on_cuda():
    """test_sharding's comparison (KV-ZCH tables against stock TorchRec FUSED twins over the
    same rows) on one NCCL rank, for pooled, weighted, sequence and random cases."""
    cases = [BASE, dict(BASE, weighted=True), dict(BASE, pooling=None, buckets=6)] + random_cases(21, 3)
    run_ranks(1, sweep, cases, None, CUDA.type, backend=BACKEND, timeout=600)


# -- checkpoints between CUDA and CPU ------------------------------------------------------------
STEPS = 4


def train_and_save(rank, world, device, root, asynchronous=False):
    """STEPS steps on ``device``, then a save of step STEPS (async: two more steps train while
    it is written); the state saved, gathered."""
    model, dense = build(device=torch.device(device), dense_lr=0.0)
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


def load(rank, world, device, root):
    """A model on ``device`` with rows of its own loads the checkpoint; its state, gathered."""
    model, dense = build(device=torch.device(device), dense_lr=0.0)
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


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_checkpoint_saved_on_cuda_loads_on_two_cpu_ranks_bit_for_bit(asynchronous):
    with tempfile.TemporaryDirectory() as root:
        saved = run_ranks(1, train_and_save, CUDA.type, root, asynchronous, backend=BACKEND, timeout=600)[0]
        loaded = run_ranks(2, load, "cpu", root, timeout=600)[0]
    same_rows(saved, loaded)


def test_a_checkpoint_saved_on_two_cpu_ranks_loads_on_cuda_bit_for_bit():
    with tempfile.TemporaryDirectory() as root:
        saved = run_ranks(2, train_and_save, "cpu", root, timeout=600)[0]
        loaded = run_ranks(1, load, CUDA.type, root, backend=BACKEND, timeout=600)[0]
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
