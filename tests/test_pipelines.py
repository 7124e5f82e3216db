"""TorchRec's own training pipelines over KV-ZCH tables: TorchRec's DLRMTrain (the job's model,
two KV-ZCH tables and an ordinary one) trained by a pipeline against a plain loop on the same
batches, comparing every loss, every KV-ZCH row with its header, and the dense weights.

* ``TrainPipelineSparseDist`` overlaps batch i+1's input all-to-all with batch i; nothing a step
  computes changes, so it must match the plain loop exactly (CPU on two gloo ranks, and CUDA).
* ``TrainPipelineSemiSync`` (CUDA only in TorchRec) also looks batch i+1's embeddings up before
  batch i's backward, from ``start_batch`` on: each such batch reads its rows one update stale,
  and its lookup may insert rows while batch i's fused update is still pending. Its reference
  is a plain loop that does the same: the lookup of the next batch before this one's backward.
"""

from __future__ import annotations

import pytest
import torch

from _cuda import BACKEND, DEVICE, requires_cuda
from _dist import run_ranks
from torchrec_kvzch.job import config_path
from torchrec_kvzch.job.data import SyntheticClickLog
from torchrec_kvzch.job.model import build_model
from torchrec_kvzch.torchrec import kvzch_tables
from torchrec_kvzch.torchrec.config import load_config

STEPS, GLOBAL_BATCH = 8, 512


def _model(device: torch.device, world_size: int):
    config = load_config(config_path("quickstart"))
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


def train(rank: int, world_size: int, device_type: str, how: str, start_batch: int = 0) -> dict:
    """``how``: "plain", "plain-semi-sync" (the plain loop with semi-sync's early lookups from
    ``start_batch`` on), "sparse-dist" or "semi-sync" (TorchRec's pipelines)."""
    from torchrec.distributed.train_pipeline.train_pipelines import (
        TrainPipelineSemiSync,
        TrainPipelineSparseDist,
    )

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device(device_type)
    config, model, optimizer = _model(device, world_size)
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
def test_sparse_dist_pipeline_trains_like_a_plain_loop(where):
    world, device, backend = (2, "cpu", "gloo") if where == "cpu" else (1, DEVICE.type, BACKEND)
    want = run_ranks(world, train, device, "plain", backend=backend, timeout=600)
    got = run_ranks(world, train, device, "sparse-dist", backend=backend, timeout=600)
    for rank in range(world):
        assert_same(got[rank], want[rank], exact=where == "cpu")


def test_the_semi_sync_reference_reads_rows_one_update_stale():
    """The reference loop itself: from start_batch on its losses leave the plain loop's (each
    batch reads rows before the last update), before it they are the same."""
    plain = run_ranks(2, train, "cpu", "plain", timeout=600)[0]
    stale = run_ranks(2, train, "cpu", "plain-semi-sync", 3, timeout=600)[0]
    assert stale["losses"][:4] == plain["losses"][:4] and stale["losses"][4:] != plain["losses"][4:]


@requires_cuda()
@pytest.mark.skipif(DEVICE.type != "cuda", reason="TorchRec's semi-sync pipeline runs on CUDA only")
@pytest.mark.parametrize("start_batch", [0, 3])
def test_semi_sync_pipeline_trains_like_a_plain_loop_with_early_lookups(start_batch):
    want = run_ranks(1, train, "cuda", "plain-semi-sync", start_batch, backend="nccl", timeout=600)[0]
    got = run_ranks(1, train, "cuda", "semi-sync", start_batch, backend="nccl", timeout=600)[0]
    assert_same(got, want, exact=False)
