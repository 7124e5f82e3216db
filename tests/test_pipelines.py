"""TorchRec's own training pipelines over KV-ZCH tables: TorchRec's DLRMTrain (the job's model,
two KV-ZCH tables and an ordinary one) trained by a pipeline against a plain loop on the same
batches, comparing every loss, every KV-ZCH row with its header, and the dense weights.

* ``TrainPipelineSparseDist`` overlaps batch i+1's input all-to-all with batch i; nothing a step
  computes changes, so it must match the plain loop exactly (CPU on two gloo ranks, and CUDA).
* ``PrefetchTrainPipelineSparseDist`` (CUDA only) looks batch i+1 up and, with a device cache
  (issue 34) whose ``prefetch_pipeline`` is set, brings its rows into the cache, between batch
  i's forward and backward; nothing a step computes changes, so it matches the plain loop over
  the same cached tables.
* ``TrainPipelineSemiSync`` (CUDA only in TorchRec) also looks batch i+1's embeddings up before
  batch i's backward, from ``start_batch`` on: each such batch reads its rows one update stale,
  and its lookup may insert rows while batch i's fused update is still pending. Its reference
  is a plain loop that does the same: the lookup of the next batch before this one's backward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _cuda import BACKEND, DEVICE, requires_cuda
from _dist import run_ranks
from torchrec_kvzch.job import config_path
from torchrec_kvzch.job.data import SyntheticClickLog
from torchrec_kvzch.job.model import build_model
from torchrec_kvzch.params import DeviceCache
from torchrec_kvzch.torchrec import kvzch_tables
from torchrec_kvzch.torchrec.config import load_config

STEPS, GLOBAL_BATCH = 8, 512


def _model(device: torch.device, world_size: int, cached: bool = False):
    config = load_config(config_path("quickstart"))
    if cached:  # the KV-ZCH tables' rows in host memory under a GPU cache of 256 rows a shard, prefetched
        cache = DeviceCache(rows=256, prefetch_pipeline=True)
        config = dataclasses.replace(config, tables=tuple(
            dataclasses.replace(t, kvzch=dataclasses.replace(t.kvzch, device_cache=cache)) if t.kvzch else t
            for t in config.tables))
    torch.manual_seed(0)  # the same dense initialisation in every run
    model, optimizer, _, _ = build_model(config, device, GLOBAL_BATCH // world_size, dense_lr=0.05)
    return config, model, optimizer


def _state(model, losses) -> dict:
    """Losses, every local KV-ZCH row (raw bits, header included) and the dense weights."""
    rows = {}
    for name, tbe in kvzch_tables(model):
        ids = torch.sort(tbe.store.keys()).values
        rows[name] = (ids.cpu(), tbe.store.read_ids(ids, "row").view(torch.int32).cpu())
    dense = [p.detach().cpu() for p in model.module.model.dense_arch.parameters()]
    return {"losses": losses, "rows": rows, "dense": dense}


def train(rank: int, world_size: int, device_type: str, how: str, start_batch: int = 0, cached: bool = False) -> dict:
    """``how``: "plain", "plain-semi-sync" (the plain loop with semi-sync's early lookups from
    ``start_batch`` on), "sparse-dist", "prefetch" or "semi-sync" (TorchRec's pipelines).
    ``cached``: the KV-ZCH tables under device caches (CUDA)."""
    from torchrec.distributed.train_pipeline.train_pipelines import (
        PrefetchTrainPipelineSparseDist,
        TrainPipelineSemiSync,
        TrainPipelineSparseDist,
    )

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device(device_type)
    config, model, optimizer = _model(device, world_size, cached)
    data = SyntheticClickLog(config, GLOBAL_BATCH, seed=1)
    batches = [data.batch(step, rank, world_size) for step in range(STEPS)]
    losses = []
    if how.startswith("plain"):
        ebc = model.module.model.sparse_arch.embedding_bag_collection
        lookup, ahead = ebc.forward, []
        ebc.forward = lambda features: ahead.pop() if ahead else lookup(features)
        for i, batch in enumerate(batches):
            batch = batch.to(device)
            loss, _ = model(batch)
            if how == "plain-semi-sync" and i >= start_batch and i + 1 < STEPS:
                ahead.append(lookup(batches[i + 1].sparse_features.to(device)))  # before this update
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    else:
        pipeline = (TrainPipelineSparseDist(model, optimizer, device) if how == "sparse-dist" else
                    PrefetchTrainPipelineSparseDist(model, optimizer, device) if how == "prefetch" else
                    TrainPipelineSemiSync(model, optimizer, device, start_batch=start_batch))
        it = iter(batches)
        for _ in range(STEPS):
            losses.append(pipeline.progress(it)[0].item())
        with pytest.raises(StopIteration):
            pipeline.progress(it)
    return _state(model, losses)


def assert_same(got: dict, want: dict, exact: bool) -> None:
    check = (lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)) if exact else (
        lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6))
    check(torch.tensor(got["losses"]), torch.tensor(want["losses"]))
    assert got["rows"].keys() == want["rows"].keys()
    for name, (ids, rows) in want["rows"].items():
        assert torch.equal(got["rows"][name][0], ids), f"table {name}: other ids got rows"
        check(got["rows"][name][1].view(torch.float32)[:, 4:], rows.view(torch.float32)[:, 4:])
        assert torch.equal(got["rows"][name][1][:, :4], rows[:, :4]), f"table {name}: headers differ"
    for a, b in zip(got["dense"], want["dense"]):
        check(a, b)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=requires_cuda())])
def test_sparse_dist_pipeline_trains_like_a_plain_loop(pools, where):
    world, device = (2, "cpu") if where == "cpu" else (1, DEVICE.type)
    run = pools[world].run if where == "cpu" else lambda *a: run_ranks(world, *a, backend=BACKEND, timeout=600)
    want, got = run(train, device, "plain"), run(train, device, "sparse-dist")
    for rank in range(world):
        assert_same(got[rank], want[rank], exact=where == "cpu")


def test_the_semi_sync_reference_reads_rows_one_update_stale(pools):
    """The reference loop itself: from start_batch on its losses leave the plain loop's (each
    batch reads rows before the last update), before it they are the same."""
    plain = pools[2].run(train, "cpu", "plain")[0]
    stale = pools[2].run(train, "cpu", "plain-semi-sync", 3)[0]
    assert stale["losses"][:4] == plain["losses"][:4] and stale["losses"][4:] != plain["losses"][4:]


@requires_cuda()
@pytest.mark.skipif(DEVICE.type != "cuda", reason="TorchRec's semi-sync pipeline runs on CUDA only")
@pytest.mark.parametrize("start_batch", [0, 3])
def test_semi_sync_pipeline_trains_like_a_plain_loop_with_early_lookups(start_batch):
    want = run_ranks(1, train, "cuda", "plain-semi-sync", start_batch, backend="nccl", timeout=600)[0]
    got = run_ranks(1, train, "cuda", "semi-sync", start_batch, backend="nccl", timeout=600)[0]
    assert_same(got, want, exact=False)


@requires_cuda()
@pytest.mark.skipif(DEVICE.type != "cuda", reason="TorchRec's prefetch pipeline and device caches run on CUDA only")
def test_prefetch_pipeline_over_device_caches_trains_like_a_plain_loop():
    want = run_ranks(1, train, "cuda", "plain", 0, True, backend="nccl", timeout=600)[0]
    got = run_ranks(1, train, "cuda", "prefetch", 0, True, backend="nccl", timeout=600)[0]
    assert_same(got, want, exact=False)


def _prefetch_beside_torchrecs_kernels(rank: int, world_size: int, sequence: bool) -> dict:
    from test_sharding import BASE, build
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvzch.torchrec.lookups import _WithOurKernels

    case = dict(BASE, pooling=None) if sequence else BASE
    model = build(world_size, case, {}, twin=False)
    (lookup,) = [x for m in model.modules() for x in getattr(m, "_lookups", ()) if isinstance(x, _WithOurKernels)]
    lookup._need_prefetch = True  # (the sequence lookup's flag: set where a caching table shares it)
    kernels = [type(kernel).__name__ for kernel in lookup._emb_modules]
    theirs = []  # what TorchRec's own kernel is handed (its fbgemm prefetch needs CUDA)
    for kernel in lookup._emb_modules:
        if kernel.emb_module is not None:
            kernel.emb_module.prefetch = lambda indices, offsets, **_: theirs.append(indices.numel())
    tables = dict(kvzch_tables(model))
    for tbe in tables.values():
        tbe.prefetches = True  # (as under DeviceCache(prefetch_pipeline=True), without the cache)
    keys = [f for config in lookup.grouped_configs for f in config.feature_names()]
    lengths = torch.randint(0, 4, (len(keys) * 8,), generator=torch.Generator().manual_seed(0))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, torch.arange(int(lengths.sum())) % 37, lengths)
    lookup.prefetch(kjt)
    waiting = {name: len(tbe._prefetched) for name, tbe in tables.items()}
    lookup(kjt)  # the forward takes the prefetched slots
    plain = int(lengths.view(len(keys), -1)[keys.index("f_plain")].sum())
    return {"kernels": kernels, "waiting": waiting, "left": sum(len(t._prefetched) for t in tables.values()),
            "clocks": [t.store.clock for t in tables.values()], "theirs": theirs, "plain": plain}


@pytest.mark.parametrize("sequence", [False, True])
def test_torchrecs_prefetch_hands_our_kernels_their_batch_beside_its_own_kernels(pools, sequence):
    """A row-wise lookup holding our kernel and one of TorchRec's, under TorchRec's prefetch (as
    where one of its caching tables shares the lookup, which makes the sequence lookup prefetch
    every kernel it holds): ours are passed over by TorchRec's loop and look their batch up once."""
    got = pools[1].run(_prefetch_beside_torchrecs_kernels, sequence)[0]
    assert "KVZCHEmbeddingKernel" in got["kernels"] and len(got["kernels"]) > 1
    assert got["waiting"] == {"kv": 1, "kv2": 1} and got["left"] == 0 and got["clocks"] == [1, 1]
    assert got["theirs"] == ([got["plain"]] if sequence else [])  # (the pooled lookup skips kernels that need none)


@pytest.mark.parametrize("optimizer", ["exact_rowwise_adagrad", "adam"])
def test_a_table_looked_up_between_forward_and_backward_trains_as_in_a_plain_loop(optimizer):
    """What the prefetch pipeline does to a KV-ZCH table under a device cache with prefetch_pipeline
    (``TableTBE.prefetch``; here forced on a CPU table, without the cache fill): batch i+1's lookup
    between batch i's forward and backward, its forward then taking those slots. Outputs, rows and
    headers are the plain loop's, bit for bit; a forward of other ids, or an evaluation while a
    prefetched batch waits, is refused; a table without the cache looks up in its forward."""
    from torchrec_kvzch import KVZCHTableParams
    from torchrec_kvzch.table.tbe import TableTBE

    p = KVZCHTableParams("t", 8, num_embeddings=2**30, total_num_buckets=8, optimizer=optimizer, learning_rate=0.05)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 3000, (64,), generator=gen) for _ in range(6)]
    grads = [torch.randn(16, 8, generator=gen) for _ in batches]
    offsets = torch.arange(0, 65, 4)
    plain, ahead = (TableTBE(p, p.bucket_range(0, 1), initial_rows=4000) for _ in range(2))
    plain.prefetch(batches[0], offsets)
    assert not plain.prefetches and not plain._prefetched and plain.store.clock == 0
    ahead.prefetches = True
    want = []
    for ids, grad in zip(batches, grads):
        out = plain(ids, offsets)
        out.backward(grad)
        want.append(out.detach())
    ahead.prefetch(batches[0], offsets)
    for i, (ids, grad) in enumerate(zip(batches, grads)):
        out = ahead(ids, offsets)
        if i + 1 < len(batches):
            ahead.prefetch(batches[i + 1], offsets)  # before this batch's update
        out.backward(grad)
        assert torch.equal(out.detach(), want[i])
    keys = torch.sort(plain.store.keys()).values
    assert torch.equal(torch.sort(ahead.store.keys()).values, keys)
    rows = [t.store.read_ids(keys, "row").view(torch.int32) for t in (ahead, plain)]
    assert torch.equal(*rows)
    ahead.prefetch(batches[0], offsets)
    with pytest.raises(RuntimeError, match="other ids than the batch prefetched"):
        ahead(batches[1], offsets)
    ahead.prefetch(batches[0], offsets)
    with pytest.raises(RuntimeError, match="while a prefetched training batch waits"), torch.no_grad():
        ahead(batches[0], offsets)
