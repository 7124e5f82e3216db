"""Checkpoint speed and memory: DCP save and load of a >= 2 GiB KV-ZCH table.

    python benchmarks/bench_checkpoint.py --json results/bench_checkpoint.json

One KV-ZCH table of 4M rows x 128 fp32 with rowwise Adagrad (whole rows of 544 bytes, 2.2 GB),
in one process and in two (torchrun, gloo). For the whole-row path and the legacy path
(weights, ids and optimizer state apart) it measures the DCP save time, the load time and the
peak extra RSS while loading (RSS sampled every 5 ms; "extra" = peak minus the RSS once the
rows are loaded, i.e. the transient cost of loading), and beside them a raw sequential write
(tofile + fsync) and read of the same number of bytes. Our saves use ``KVZCHFileSystemWriter``
(DCP's FileSystemWriter, writing each file back to disk as it goes) with two writer threads. A
PNG shows RSS over time during the two loads (one process).

Stock DCP beside it, same run: ``dcp.save`` / ``dcp.load`` (FileSystemWriter / Reader, two
threads) of one plain tensor of the same bytes as a rank's whole rows - a plain tensor in one
process, each rank its half as a row-sharded DTensor in two - loaded into the existing tensor,
as into a model's parameters. ``load_vs_dcp_dense_ratio`` and ``save_vs_dcp_dense_ratio`` are
our whole-row time over DCP's (lower is better). The whole-row save and load, DCP's and the raw
write run one after the other ``--repeats`` times (default 6), each of the three going first in
turn: a write is slower once earlier ones have filled the page cache, and the first write of a
run was slower in every run when it followed the deletion of the last run's files without
waiting (now ``os.sync`` waits for that). Each time is the median over those runs (peak memory:
the largest) and each ratio the median of the runs' ratios, so that a burst of load elsewhere on
the machine skews one run, not the ratios. Every run's times are in
the JSON (``runs``), for the spread.

Async save (whole rows): the time from taking the state dict to ``dcp.async_save`` returning,
against the same for the synchronous save (``async_blocked_ratio``); training steps then run
while the checkpoint is written, and the rows they change are copied aside (``async_copied_mib``,
the most held at once).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import psutil
import torch

from _common import print_targets, torchrun


class RssSampler:
    """Samples this process's RSS every ``period`` seconds in a background thread."""

    def __init__(self, period: float = 0.005) -> None:
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._proc, self._t0 = psutil.Process(), time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._t0, self._proc.memory_info().rss))
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def build(world: int, rows_total: int, dim: int, whole_row: bool, chunk_rows: int | None = None, fill: bool = True):
    """The table's model (``rows_total`` rows over ``world`` ranks, written unless ``fill`` is
    False: then empty, sized for them) and this rank's store."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_kvzch import KVZCHTableParams
    from torchrec_kvzch.torchrec import (KVZCHConstraints, KVZCHShardingPlanner, kvzch_embedding_bag_config,
                                         kvzch_sharders, kvzch_tables)

    params = KVZCHTableParams("big", dim, num_embeddings=2**40, total_num_buckets=1024,
                              enable_optimizer_offloading=True, backend_return_whole_row=whole_row,
                              expected_rows=rows_total,
                              **({"checkpoint_chunk_rows": chunk_rows} if chunk_rows else {}))
    ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(params, ["ids"])], device=torch.device("meta"))
    planner = KVZCHShardingPlanner(Topology(world_size=world, compute_device="cpu", local_world_size=world),
                                   batch_size=1024, constraints={"big": KVZCHConstraints(kvzch=params)})
    plan = planner.collective_plan(ebc, kvzch_sharders(), dist.group.WORLD)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=kvzch_sharders(),
                                     env=ShardingEnv.from_process_group(dist.group.WORLD))
    (_, tbe), = kvzch_tables(model)
    store, r = tbe.store, tbe.store.bucket_range
    gen = torch.Generator().manual_seed(dist.get_rank())
    per_rank = rows_total // world if fill else 0
    for _ in range(0, per_rank, 1 << 20):  # rows with distinct weights and optimizer state
        slots = store.find_or_insert(torch.randint(r.id_start, r.id_end, (min(1 << 20, per_rank - len(store)),),
                                                   generator=gen), touch=False)
        store.optimizer[slots] = torch.rand(slots.numel(), store.optimizer.shape[1], generator=gen)
    return model, store


def timed_save_and_load(model, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec_kvzch import KVZCHFileSystemWriter, KVZCHLoadPlanner, KVZCHSavePlanner

    dist.barrier()
    t0 = time.perf_counter()
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    state_dict_s = time.perf_counter() - t0
    # Two writer threads: one materialises chunks while the other writes (see docs/checkpoints.md).
    dcp.save(state, storage_writer=KVZCHFileSystemWriter(path, thread_count=2), planner=KVZCHSavePlanner())
    dist.barrier()
    save_s = time.perf_counter() - t0 - state_dict_s
    del state
    gc.collect()
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dist.barrier()
    with RssSampler() as rss:
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=path, planner=KVZCHLoadPlanner(checkpoint_id=path))
        model.load_state_dict(state["model"])
        model.fused_optimizer.load_state_dict(state["optim"])
        dist.barrier()
        load_s = time.perf_counter() - t0
        time.sleep(0.05)
    after = psutil.Process().memory_info().rss
    peak = max(r for _, r in rss.samples)
    return {"save_s": save_s, "state_dict_s": state_dict_s, "load_s": load_s, "load_peak_extra_mib": max(0, peak - after) / 2**20,
            "rss_trace": [(t, r / 2**20) for t, r in rss.samples[:: max(1, len(rss.samples) // 400)]]}


def timed_async_save(model, store, path: str, checkpoint_group) -> dict:
    """async_save, then train until the checkpoint is written."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvzch.checkpoint.save_planner import KVZCHSavePlanner
    from torchrec_kvzch.checkpoint.staging import KVZCHAsyncStager
    from torchrec_kvzch.torchrec.state_dict import kv_view
    from torchrec_kvzch.checkpoint.writer import KVZCHFileSystemWriter

    gen = torch.Generator().manual_seed(dist.get_rank())
    ids, world = torch.sort(store.keys()).values, dist.get_world_size()

    def batch() -> KeyedJaggedTensor:  # 4096 ids per rank: half new rows, half old ones
        n = world * 4096
        values = torch.where(torch.rand(n, generator=gen) < 0.5, torch.randint(0, 2**40, (n,), generator=gen),
                             ids[torch.randint(0, ids.numel(), (n,), generator=gen)])
        return KeyedJaggedTensor(keys=["ids"], values=values, lengths=torch.full((world * 1024,), 4))

    stager = KVZCHAsyncStager()
    dist.barrier()
    t0 = time.perf_counter()
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    future = dcp.async_save(state, storage_writer=KVZCHFileSystemWriter(path, thread_count=2),
                            planner=KVZCHSavePlanner(), async_stager=stager,
                            process_group=checkpoint_group)
    blocked_s = time.perf_counter() - t0
    snapshot = next(kv_view(e).snapshot for e in state["model"].values() if kv_view(e) is not None)
    steps, copied = 0, 0
    while True:
        # Every rank trains the same number of steps (a step is collective): until the save is
        # done on all of them. Ranks deciding apart would leave one waiting in a step.
        done = torch.tensor([int(future.done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            break
        model(batch()).wait().values().sum().backward()
        steps += 1
        copied = max(copied, snapshot.copied_bytes)
    future.result()
    total_s = time.perf_counter() - t0
    stager.close()
    return {"async_blocked_s": blocked_s, "async_total_s": total_s, "async_train_steps": steps,
            "async_copied_mib": copied / 2**20}


def dense_tensor(nbytes: int):
    """A plain fp32 tensor of ``nbytes`` per rank, in rows of 544 bytes like the whole rows; in
    several processes, each rank's rows of a row-sharded DTensor."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.tensor([nbytes // 544])
    dist.all_reduce(rows, op=dist.ReduceOp.MIN)  # even shards (ranks' row counts differ a little)
    local = torch.empty(int(rows), 136).uniform_(generator=torch.Generator().manual_seed(rank))
    if world == 1:
        return local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, init_device_mesh("cpu", (world,)), [Shard(0)], run_check=False)


def timed_dcp_dense(tensor, path: str) -> dict:
    """Stock DCP saving ``tensor`` and loading it back in place (as into a model's parameters)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    dist.barrier()
    t0 = time.perf_counter()
    dcp.save({"dense": tensor}, storage_writer=FileSystemWriter(path, thread_count=2))
    dist.barrier()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dcp.load({"dense": tensor}, storage_reader=FileSystemReader(path))
    dist.barrier()
    load_s = time.perf_counter() - t0
    return {"save_s_dcp_dense": save_s, "load_s_dcp_dense": load_s}


def raw_write_and_read(path: str, data: np.ndarray) -> dict:
    """A sequential write + fsync of ``data``'s bytes, and a read of them back."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        data.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = np.fromfile(path, dtype=np.uint8)
    read_s = time.perf_counter() - t0
    assert back.nbytes == data.nbytes
    return {"raw_write_s": write_s, "raw_read_s": read_s}


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint_group = dist.new_group(backend="gloo")  # async saves' collectives run on a thread
    out: dict = {}
    for whole_row, tag in ((True, "whole_row"), (False, "legacy")):
        model, store = build(world, args.rows, args.dim, whole_row)
        nbytes = len(store) * store.layout.row_width * store.layout.itemsize
        path = f"{args.dir}/{tag}"
        if whole_row:  # ours, stock DCP's and the raw bytes side by side, a few times over
            dense, runs = dense_tensor(nbytes), []
            raw = np.random.default_rng(rank).integers(0, 255, nbytes, dtype=np.uint8)
            steps = [partial(timed_save_and_load, model), partial(timed_dcp_dense, dense),
                     partial(raw_write_and_read, data=raw)]
            for rep in range(args.repeats):
                paths = [f"{path}-{rep}", f"{args.dir}/dense-{rep}", f"{args.dir}/raw-{rank}.bin"]
                run, order = {}, list(zip(steps, paths))
                first = rep % len(order)  # each goes first in turn (see the module docstring)
                for step, where in order[first:] + order[:first]:
                    run.update(step(where))
                runs.append(run)
                dist.barrier()
                if rank == 0:  # the disk holds one run's files at a time
                    for old in (f"{path}-{rep}", f"{args.dir}/dense-{rep}"):
                        shutil.rmtree(old, ignore_errors=True)
                    os.sync()  # the deletions' writes, before the next run's first write
                dist.barrier()
            del dense, raw
            out["runs"] = [{k: v for k, v in run.items() if k != "rss_trace"} for run in runs]
            r = {key: (max if key.startswith("load_peak") else statistics.median)(run[key] for run in runs)
                 for key in ("state_dict_s", "load_peak_extra_mib")}
            r["rss_trace"] = runs[-1]["rss_trace"]
        else:
            r = timed_save_and_load(model, path)
        out.update({f"{k}_{tag}": v for k, v in r.items()})
        out[f"bytes_per_rank_{tag}"] = nbytes
        if whole_row:
            out.update(timed_async_save(model, store, f"{args.dir}/async", checkpoint_group))
        del model, store
        gc.collect()
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(args.worker).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def summarize(per_rank: list[dict], suffix: str) -> dict:
    """Slowest rank's times, largest rank's extra memory. The whole-row save and load and
    their baselines: each run's slowest rank, then the median over the runs; a ratio is the
    median of the runs' ratios, each of two times taken seconds apart."""
    worst = lambda key: max(r[key] for r in per_rank)  # noqa: E731
    runs = [{key: max(r["runs"][i][key] for r in per_rank) for key in per_rank[0]["runs"][i]}
            for i in range(len(per_rank[0]["runs"]))]
    median = lambda f: statistics.median(f(run) for run in runs)  # noqa: E731
    out = {}
    for key in ("save_s", "load_s"):
        out[f"{key}_whole_row{suffix}"] = median(lambda run: run[key])
        out[f"{key}_legacy{suffix}"] = worst(f"{key}_legacy")
    for tag in ("whole_row", "legacy"):
        out[f"load_peak_extra_mib_{tag}{suffix}"] = worst(f"load_peak_extra_mib_{tag}")
    for key in ("raw_write_s", "raw_read_s", "save_s_dcp_dense", "load_s_dcp_dense"):
        out[f"{key}{suffix}"] = median(lambda run: run[key])
    out[f"checkpoint_bytes{suffix}"] = sum(r["bytes_per_rank_whole_row"] for r in per_rank)
    # Same bytes, same machine: the save's throughput against a raw write.
    out[f"save_throughput_ratio_vs_raw{suffix}"] = median(lambda run: run["raw_write_s"] / run["save_s"])
    # Same bytes through stock DCP as one plain tensor: ours / theirs (lower is better).
    for op in ("save", "load"):
        out[f"{op}_vs_dcp_dense_ratio{suffix}"] = median(lambda run: run[f"{op}_s"] / run[f"{op}_s_dcp_dense"])
    out[f"runs{suffix}"] = runs
    # Time before training may go on: state dict + async_save's return, vs state dict + save.
    sync = worst("state_dict_s_whole_row") + out[f"save_s_whole_row{suffix}"]
    for key in ("async_blocked_s", "async_total_s", "async_copied_mib"):
        out[f"{key}{suffix}"] = worst(key)
    out[f"async_train_steps{suffix}"] = min(r["async_train_steps"] for r in per_rank)
    out[f"sync_save_s{suffix}"] = sync
    out[f"async_blocked_ratio{suffix}"] = out[f"async_blocked_s{suffix}"] / sync
    return out


def plot(traces: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, trace in traces.items():
        ax.plot([t for t, _ in trace], [r for _, r in trace], label=label)
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("RSS while loading a 2.2 GB KV-ZCH table (1 process)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dir", help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=6,
                        help="whole-row save and load, DCP's and the raw write: median of this many runs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    results: dict = {"rows": args.rows, "dim": args.dim}
    traces = {}
    for nproc, suffix in ((1, ""), (2, "_2proc")):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            out = Path(tmp) / "ranks.json"
            torchrun(__file__, nproc, ["--worker", str(out), "--json", str(args.json), "--dir", tmp,
                                       "--rows", str(args.rows), "--dim", str(args.dim),
                                       "--repeats", str(args.repeats)])
            per_rank = json.loads(out.read_text())
            shutil.rmtree(tmp, ignore_errors=True)
        results.update(summarize(per_rank, suffix))
        if nproc == 1:
            traces = {"whole rows, streamed": per_rank[0]["rss_trace_whole_row"],
                      "legacy (weights, ids, optimizer apart)": per_rank[0]["rss_trace_legacy"]}
    r = results
    r["targets"] = {
        "load_peak_extra_mib_whole_row <= 256": r["load_peak_extra_mib_whole_row"] <= 256,
        # Both layouts now stream through reused buffers (the legacy one once held 4x more).
        "load_peak_extra_mib_legacy <= 256": r["load_peak_extra_mib_legacy"] <= 256,
        "save_throughput_ratio_vs_raw >= 0.8": r["save_throughput_ratio_vs_raw"] >= 0.8,
        "async_blocked_ratio <= 0.15": r["async_blocked_ratio"] <= 0.15,
        **{f"{op}_vs_dcp_dense_ratio{suffix} <= 1.0": r[f"{op}_vs_dcp_dense_ratio{suffix}"] <= 1.0
           for op in ("load", "save") for suffix in ("", "_2proc")},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    plot(traces, args.json.with_suffix(".png"))
    gb = r["checkpoint_bytes"] / 1e9
    print(f"\nKV-ZCH table: {args.rows:,} rows x {args.dim} fp32 + rowwise Adagrad, {gb:.2f} GB of whole rows")
    for suffix, label in (("", "1 process"), ("_2proc", "2 processes")):
        print(f"  {label}: save {r[f'save_s_whole_row{suffix}']:.2f} s (raw write {r[f'raw_write_s{suffix}']:.2f} s), "
              f"load whole rows {r[f'load_s_whole_row{suffix}']:.2f} s / legacy {r[f'load_s_legacy{suffix}']:.2f} s "
              f"(raw read {r[f'raw_read_s{suffix}']:.2f} s); load peak extra RSS whole rows "
              f"{r[f'load_peak_extra_mib_whole_row{suffix}']:.0f} MiB / legacy {r[f'load_peak_extra_mib_legacy{suffix}']:.0f} MiB")
        print(f"    stock DCP, one plain tensor of the same bytes: save {r[f'save_s_dcp_dense{suffix}']:.2f} s, "
              f"load {r[f'load_s_dcp_dense{suffix}']:.2f} s; ours / DCP's: save "
              f"{r[f'save_vs_dcp_dense_ratio{suffix}']:.2f}, load {r[f'load_vs_dcp_dense_ratio{suffix}']:.2f}")
        print(f"    async save: training resumes after {r[f'async_blocked_s{suffix}']:.3f} s vs "
              f"{r[f'sync_save_s{suffix}']:.2f} s for a sync save (ratio {r[f'async_blocked_ratio{suffix}']:.3f}); "
              f"{r[f'async_train_steps{suffix}']} training steps ran during the save, copying "
              f"{r[f'async_copied_mib{suffix}']:.0f} MiB of rows aside")
    print_targets(r["targets"])
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
