"""bench_serving's second half, run in a fresh process (one gloo rank): building a replica from
a checkpoint against loading it for training, and following a delta while requests run.

Build (``--rows-build``, 4M rows x 128 fp32, rowwise Adagrad, whole rows: bench_checkpoint's
table, saved by ``CheckpointManager``): ``served_model`` of the table (fp32) against
``CheckpointManager.load`` of the same checkpoint into a fresh model (a trainer resuming; the
model's construction not timed), alternating, each ``repeats`` times; ``build_vs_training_load_ratio`` is the ratio of the medians and
``build_peak_extra_mib`` the most RSS above the finished replica's during a build (sampled every
5 ms). ``max_abs_diff_fp32`` and ``max_abs_diff_int8``: the served model's outputs (fp32; int8)
against the trained model's on a batch of trained ids, and ``max_abs_diff_int8_bound`` the bound
int8 quantization implies there (per bag, the sum of its rows' ``error_bound``).

Follow (``--rows-follow``, 10M rows x 128): a full checkpoint served in int8 by a ``Follower``;
a thread issues lookups (batch 512 x pooling 20 of trained ids, one after the other, on one
torch thread, as each request thread of a replica would) throughout.
One training step then updates 1% of the rows and the checkpoint after it is saved as a delta;
``delta_visible_s_1pct_10m`` is the time from the save's return (committed) to the follower
serving that step (polling every 50 ms), ``p99_ms_steady`` the requests' p99 before the step
and ``p99_ms_during_swap`` that of the requests that overlapped the apply.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import threading
import time

import psutil
import torch
import torch.distributed as dist

from _common import percentiles
from bench_checkpoint import RssSampler, build

BATCH, POOLING = 512, 20


def _collection(tbe):
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_kvzch.torchrec import kvzch_embedding_bag_config

    def make():
        return EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(tbe.params, ["ids"])],
                                      device=torch.device("meta"))
    return make


def _batch(ids: torch.Tensor, gen: torch.Generator, batch: int = BATCH, pooling: int = POOLING):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values = ids[torch.randint(0, ids.numel(), (batch * pooling,), generator=gen)]
    return KeyedJaggedTensor(keys=["ids"], values=values, lengths=torch.full((batch,), pooling))


def build_vs_load(rows: int, dim: int, repeats: int, root: str) -> dict:
    from torchrec_kvzch import CheckpointManager
    from torchrec_kvzch.serving import ServingOptions, served_model
    from torchrec_kvzch.serving.table import error_bound
    from torchrec_kvzch.torchrec import kvzch_tables

    model, store = build(1, rows, dim, whole_row=True)
    (_, tbe), = kvzch_tables(model)
    make = _collection(tbe)
    manager = CheckpointManager(root)
    manager.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, 1)
    builds, loads, extra = [], [], []
    for rep in range(repeats):
        for kind in (("build", "load") if rep % 2 else ("load", "build")):
            gc.collect()
            if kind == "load":  # a trainer resuming: a fresh model, its rows loaded
                fresh, _ = build(1, rows, dim, whole_row=True, fill=False)
                state = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
                t0 = time.perf_counter()
                manager.load(state)
                loads.append(time.perf_counter() - t0)
                del state, fresh
                continue
            with RssSampler() as rss:
                t0 = time.perf_counter()
                served, _ = served_model(make(), root)
                builds.append(time.perf_counter() - t0)
            after = psutil.Process().memory_info().rss
            extra.append(max(0, max(r for _, r in rss.samples) - after) / 2**20)
            del served
    gen = torch.Generator().manual_seed(3)
    kjt = _batch(store.keys(), gen)
    model.eval()
    with torch.no_grad():
        trained = model(kjt).wait().values()
        diffs = {}
        for dtype in ("fp32", "int8"):
            served, _ = served_model(make(), root, options=ServingOptions(dtype=dtype))
            diffs[dtype] = float((served(kjt).values() - trained).abs().max())
            del served
        bound = error_bound(store.read_ids(kjt.values()), "int8").view(BATCH, POOLING).sum(1).max()
    model.train()
    del model, store
    return {"rows_build": rows, "build_s": statistics.median(builds), "training_load_s": statistics.median(loads),
            "build_vs_training_load_ratio": statistics.median(builds) / statistics.median(loads),
            "build_peak_extra_mib": max(extra), "build_s_runs": builds, "training_load_s_runs": loads,
            "max_abs_diff_fp32": diffs["fp32"], "max_abs_diff_int8": diffs["int8"],
            "max_abs_diff_int8_bound": float(bound)}


def follow(rows: int, dim: int, root: str) -> dict:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvzch import CheckpointManager
    from torchrec_kvzch.serving import Follower, ServingOptions
    from torchrec_kvzch.torchrec import kvzch_tables

    model, store = build(1, rows, dim, whole_row=True)
    (_, tbe), = kvzch_tables(model)
    manager = CheckpointManager(root, full_every=2)
    manager.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, 1)
    follower = Follower(_collection(tbe), root, options=ServingOptions(dtype="int8"), poll_s=0.05)
    keys = store.keys().clone()
    requests, stop = [], threading.Event()

    def serve():  # one request at a time, on one torch thread: as a replica's request threads run
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(4)
        batches = [_batch(keys, gen) for _ in range(64)]
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            with follower.serving() as version, torch.no_grad():
                version.model(batches[i % len(batches)])
            requests.append((t0, time.perf_counter()))
            i += 1

    client = threading.Thread(target=serve)
    client.start()
    time.sleep(3.0)  # the steady state
    steady_end = time.perf_counter()
    changed = keys[torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(5))[: rows // 100]]
    kjt = KeyedJaggedTensor(keys=["ids"], values=changed, lengths=torch.ones(changed.numel(), dtype=torch.long))
    model(kjt).wait().values().sum().backward()  # one step: 1% of the rows change
    manager.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, 2)
    committed = time.perf_counter()
    follower.start()
    while follower.current.step != 2:
        if follower.last_error:
            raise RuntimeError(follower.last_error)
        time.sleep(0.005)
    visible = time.perf_counter()
    time.sleep(0.5)
    stop.set()
    client.join()
    follower.stop()

    def p99(spans):
        return percentiles([(b - a) * 1e3 for a, b in spans], (0.99,))[0]

    steady = [(a, b) for a, b in requests if b <= steady_end]
    during = [(a, b) for a, b in requests if b >= committed and a <= visible]
    return {"rows_follow": rows, "delta_rows": int(changed.numel()), "delta_visible_s_1pct_10m": visible - committed,
            "p99_ms_steady": p99(steady), "p99_ms_during_swap": p99(during),
            "p99_during_swap_over_steady": p99(during) / p99(steady), "requests_steady": len(steady),
            "requests_during_swap": len(during)}


def run(rows_build: int, rows_follow: int, dim: int, repeats: int) -> dict:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{29600 + os.getpid() % 1000}", rank=0,
                            world_size=1)
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVZCH_BENCH_DIR")) as tmp:
            out = build_vs_load(rows_build, dim, repeats, os.path.join(tmp, "build"))
        gc.collect()
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVZCH_BENCH_DIR")) as tmp:
            out.update(follow(rows_follow, dim, os.path.join(tmp, "follow")))
        return out
    finally:
        dist.destroy_process_group()
