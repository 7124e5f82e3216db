"""Training over a disk tier against the same table in DRAM (issue 32; docs/disk.md).

    python benchmarks/bench_disk.py --json results/bench_disk.json          # and results/bench_disk.png
    python benchmarks/bench_disk.py --json /tmp/disk.json --rows 1000000 --cache-mib 128 --steps 5 --zipf-warmup 5   # a quick check

One table of ``--rows`` (16M) ids drawn from 2^40, 128 fp32 with rowwise Adagrad (8.5 GB of rows),
filled with the same rows (their id-seeded initial weights) in two fresh processes, one after
the other: in DRAM, and over a disk tier (``--dir``) with a ``--cache-mib`` (2 GiB) DRAM cache.
Each trains ``--zipf-warmup`` (100: the cache's rows are then the batches' own, not the fill's)
then ``--steps`` steps (forward, backward and the fused update) of batch 8192 x pooling 20 of
Zipf(1.05) ids, then ``--warmup`` and ``--steps`` of uniform ones (``bench_lookup``'s batches:
the same in both), each step timed on its own. ``disk_over_dram_<dist>``: the DRAM table's median step
time over the disk tier's (throughput, disk / DRAM). The tier reads and writes with ``O_DIRECT``
(``o_direct``: true), so its rows never sit in the page cache: the timed steps read the disk,
and the memory the tier takes is the process's RSS.

After training, each of the two saves its table with DCP (our writer and planner, one rank),
drops the saved files from the page cache, lets the table go and loads the checkpoint into a new
one of the same kind (over a fresh tier): ``save_vs_dram_ratio`` and ``load_vs_dram_ratio`` are
the disk tier's seconds over DRAM's. A third process trains over a disk tier whose cache keeps
the most often used rows (``DiskStorage(policy="lfu")``; the default, and the keys without a
suffix, keep the most recent): the same keys with ``_lfu``.

Keys: ``disk_over_dram_zipf`` (target >= 0.5), ``disk_over_dram_uniform``, ``hit_rate_<dist>``
(of the timed batches' existing rows, the share found in DRAM), ``write_amplification_<dist>``
(bytes the tier wrote per timed step over the bytes of the rows the step changed, its distinct
ids' whole rows), ``rows_read_per_s_<dist>`` (the disk's rate: rows brought in over the seconds their reads
took), ``read_bound_<dist>`` (the DRAM step over the disk tier's median read time per step: the
most ``disk_over_dram_<dist>`` could be were everything but the reads free),
``save_vs_dram_ratio``, ``load_vs_dram_ratio``, ``peak_rss_over_cache_budget``
(target <= 1.1: the disk-tier process's peak RSS while training less its fixed overhead, over
the cache budget; ``peak_rss_over_cache_budget_checkpoint`` the same over the save and the load,
less also the save's index of the rows, ``snapshot_index_mib``)
with the fixed overhead stated apart: ``fixed_overhead_mib``
(the process with its ids and batches before the table, plus the tier's index and the cache's
id map, whose size grows with the rows, not the cache), ``*_step_ms_<dist>`` the medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from _common import fixed_mmap_threshold, print_targets
from bench_checkpoint import RssSampler
from bench_lookup import batches
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.params import DiskStorage
from torchrec_kvzch.table.initializer import fill_uniform_by_id
from torchrec_kvzch.table.layout import RowLayout, make_meta
from torchrec_kvzch.table.tbe import TableTBE

HERE = Path(__file__).resolve().parent
DISTS = ("zipf", "uniform")
TARGET_RATIO, TARGET_RSS = 0.5, 1.1
SNAPSHOT_BYTES = 24  # a save's index of a disk-tier table's rows, per row: ids, DRAM slots, tier positions
FILL_ROWS = 1 << 14  # rows written at a time when the table is filled (their temporaries count in the peak RSS)


def params(args, storage: DiskStorage | None = None) -> KVZCHTableParams:
    return KVZCHTableParams("bench", args.dim, num_embeddings=2**40, total_num_buckets=1024, learning_rate=0.01,
                            **({"storage": storage} if storage is not None else {}))


def fill(tbe: TableTBE, universe: torch.Tensor, progress) -> None:
    """Every id of ``universe`` gets its row (its id-seeded initial weights), as whole rows."""
    store, p = tbe.store, tbe.store.params
    layout = store.layout
    for ids in universe.split(FILL_ROWS):
        weights = torch.empty(ids.numel(), p.embedding_dim)
        fill_uniform_by_id(weights, ids, *p.init_range, p.init_seed)
        rows = layout.pack(ids, make_meta(0, 0, used=True).expand(ids.numel()), weights.to(layout.dtype),
                           torch.zeros(ids.numel(), layout.optimizer_floats))
        store.write_rows(rows)
        progress.update(ids.numel())


def table(args, tier: str) -> TableTBE:
    """The table, empty, with room for ``--rows`` rows: in DRAM, or over a disk tier at ``tier``."""
    storage = (DiskStorage(args.dir / tier, cache_bytes=args.cache_mib << 20, policy=args.policy)
               if args.worker == "disk" else None)
    p = params(args, storage)
    return TableTBE(p, p.bucket_range(0, 1), initial_rows=args.rows)


def one_rank() -> None:
    """A process group of this process alone: DCP and the state dict's entries need one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def table_state(tbe: TableTBE) -> dict:
    """The table's DCP state dict (model and optimizer entries), as a model's would hold it."""
    from torchrec_kvzch.torchrec.state_dict import table_entries

    one_rank()
    model, optimizer = table_entries(iter([("bench", tbe)]), "", None)
    return {"model": model, "optim": optimizer}


def close(tbe: TableTBE) -> None:
    """Let a disk tier's file go (a DRAM table has none)."""
    if tbe.store.cache is not None:
        tbe.store.cache.close()


def dcp_save(tbe: TableTBE, path: Path) -> float:
    """Save with DCP (our writer and planner); then drop the files from the page cache, so a
    load reads the disk. Returns the seconds the save took."""
    import torch.distributed.checkpoint as dcp

    from torchrec_kvzch import KVZCHFileSystemWriter, KVZCHSavePlanner

    shutil.rmtree(path, ignore_errors=True)
    state = table_state(tbe)
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=KVZCHFileSystemWriter(str(path), thread_count=2), planner=KVZCHSavePlanner())
    seconds = time.perf_counter() - t0
    for f in path.iterdir():  # (written and synced by the writer)
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return seconds


def dcp_load(tbe: TableTBE, path: Path, rows: int) -> float:
    """Load ``path`` into ``tbe`` (checksums verified), which must then hold ``rows`` rows.
    Returns the seconds the load took."""
    import torch.distributed.checkpoint as dcp

    from torchrec_kvzch import KVZCHLoadPlanner

    state = table_state(tbe)
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=str(path), planner=KVZCHLoadPlanner(checkpoint_id=str(path)))
    seconds = time.perf_counter() - t0
    store = tbe.store
    held = len(store) + (len(store.cache) if store.cache is not None else 0)
    if held != rows:
        raise RuntimeError(f"the load of {path} brought back {held} rows of {rows}")
    return seconds


def warmup(args, dist: str) -> int:
    """Untimed steps before a distribution's timed ones."""
    return args.zipf_warmup if dist == "zipf" else args.warmup


def train(args, tbe: TableTBE, steps: dict) -> dict:
    """Each distribution's steps, each timed; with a tier, its hit rate and write amplification."""
    store, cache, out = tbe.store, tbe.store.cache, {}
    offsets = torch.arange(0, args.batch * args.pooling + 1, args.pooling)
    row_bytes = store.layout.row_width * store.layout.itemsize
    for dist in DISTS:
        times, reads, changed, written, hits, misses = [], [], 0, 0, 0, 0
        for i, ids in enumerate(steps[dist]):
            before = cache.counters if cache is not None else None
            read_s = cache.tier.read_seconds if cache is not None else 0.0
            t0 = time.perf_counter()
            y = tbe(ids, offsets)
            y.backward(torch.ones_like(y))
            elapsed = time.perf_counter() - t0
            if i < warmup(args, dist):
                continue
            times.append(elapsed * 1e3)
            if cache is not None:
                after = cache.counters
                reads.append((cache.tier.read_seconds - read_s) * 1e3)
                written += after["disk_bytes_written"] - before["disk_bytes_written"]
                hits += after["cache_hits"] - before["cache_hits"]
                misses += after["cache_misses"] - before["cache_misses"]
                changed += torch.unique(ids).numel() * row_bytes
        out[f"step_ms_{dist}"] = statistics.median(times)
        if cache is not None:
            out[f"hit_rate_{dist}"] = hits / max(1, hits + misses)
            out[f"read_ms_{dist}"] = statistics.median(reads)
            out[f"rows_read_per_s_{dist}"] = misses / max(1e-9, sum(reads) / 1e3)
            out[f"write_amplification_{dist}"] = written / max(1, changed)
    if cache is not None:
        out.update(disk_rows=len(cache), dram_rows=len(store), cache_rows=cache.max_rows,
                   tier_index_mib=cache.tier.nbytes / 2**20, id_map_mib=store.id_map.nbytes / 2**20,
                   disk_file_gib=cache.tier.disk_bytes / 2**30, disk_bytes_read=cache.tier.bytes_read,
                   disk_bytes_written=cache.tier.bytes_written)
    return out


def worker(args) -> dict:
    """One process: the ids and batches, then the table (in DRAM, or over a disk tier) filled,
    trained, saved and loaded."""
    gen = torch.Generator().manual_seed(0)
    universe = torch.randint(0, 2**40, (int(args.rows * 1.01) + 16,), generator=gen).unique()[: args.rows]
    universe = universe[torch.randperm(universe.numel(), generator=gen)]
    steps = {dist: [universe[local] for local in batches(args.rows, args.batch, args.pooling, dist,
                                                         warmup(args, dist) + args.steps, seed=7)] for dist in DISTS}
    gc.collect()
    base_rss = psutil.Process().memory_info().rss  # the benchmark's data: not the table's
    with RssSampler(0.05) as rss:
        tbe = table(args, "tier")
        with tqdm(total=args.rows, desc=f"fill ({args.worker})", unit="row", unit_scale=True, leave=False) as bar:
            fill(tbe, universe, bar)
        out = train(args, tbe, steps)
        trained = time.perf_counter() - rss._t0
        if not args.no_checkpoint:  # saved, dropped, loaded into a new table of its kind
            path = args.dir / f"ckpt-{args.worker}"
            out["save_s"] = dcp_save(tbe, path)
            close(tbe)
            del tbe
            gc.collect()
            tbe = table(args, "tier-load")
            out["load_s"] = dcp_load(tbe, path, args.rows)
            shutil.rmtree(path)
        close(tbe)
    out.update(base_rss_mib=base_rss / 2**20, train_peak_rss_mib=max(r for t, r in rss.samples if t <= trained) / 2**20,
               checkpoint_peak_rss_mib=max([r for t, r in rss.samples if t > trained], default=0) / 2**20)
    return out


def in_fresh_process(args, mode: str, policy: str = "lru", checkpoint: bool = True) -> dict:
    cmd = [sys.executable, __file__, "--json", "-", "--worker", mode, "--rows", str(args.rows), "--dim", str(args.dim),
           "--batch", str(args.batch), "--pooling", str(args.pooling), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--zipf-warmup", str(args.zipf_warmup), "--cache-mib", str(args.cache_mib), "--dir", str(args.dir),
           "--policy", policy, *([] if checkpoint else ["--no-checkpoint"])]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"the {mode} worker failed ({done.returncode}); its output is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.8))
    x, width = range(len(DISTS)), 0.38
    for i, (suffix, label) in enumerate((("", "lru cache"), ("_lfu", "lfu cache"))):
        at = [p + (i - 0.5) * width for p in x]
        left.bar(at, [results[f"disk_over_dram_{d}{suffix}"] for d in DISTS], width, label=label)
        middle.bar(at, [results[f"hit_rate_{d}{suffix}"] for d in DISTS], width, label=label)
    left.axhline(TARGET_RATIO, color="k", ls="--", lw=1, label=f"target {TARGET_RATIO} (zipf)")
    left.set(xticks=list(x), xticklabels=DISTS, ylabel="training steps/s, disk tier / DRAM",
             title=f"{results['rows'] / 1e6:g}M rows, {results['cache_mib']} MiB cache")
    middle.set(xticks=list(x), xticklabels=DISTS, ylabel="cache hit rate", ylim=(0, 1),
               title=f"batch {results['batch']} x {results['pooling']}")
    for axes in (left, middle):
        axes.legend(fontsize=8)
    ops = ("save", "load")
    for i, (name, label) in enumerate((("dram", "DRAM"), ("disk", "disk tier"))):
        right.bar([p + (i - 0.5) * width for p in range(len(ops))], [results[name][f"{op}_s"] for op in ops], width,
                  label=label)
    right.set(xticks=list(range(len(ops))), xticklabels=[f"DCP {op}" for op in ops], ylabel="seconds",
              title="checkpoint of the table")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="the PNG (default: the JSON's path with .png)")
    parser.add_argument("--rows", type=int, default=16_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--zipf-warmup", type=int, default=100)
    parser.add_argument("--cache-mib", type=int, default=2048)
    parser.add_argument("--dir", type=Path, default=HERE.parent / ".disk_bench", help="a directory on local disk")
    parser.add_argument("--worker", choices=["dram", "disk"], help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="lru", help=argparse.SUPPRESS)
    parser.add_argument("--no-checkpoint", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        fixed_mmap_threshold()  # freed temporaries go back to the OS: RSS is what is in use
        print(json.dumps(worker(args)))
        return
    layout = RowLayout.for_table(params(args))
    results: dict = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "pooling": args.pooling,
                     "steps": args.steps, "cache_mib": args.cache_mib, "o_direct": True, "cpus": os.cpu_count(),
                     "table_gib": args.rows * layout.stored_bytes / 2**30, "load_average": list(os.getloadavg())}
    dram = in_fresh_process(args, "dram")
    disk = in_fresh_process(args, "disk")
    lfu = in_fresh_process(args, "disk", policy="lfu", checkpoint=False)
    results.update(dram=dram, disk=disk, disk_lfu=lfu)  # each process's figures
    for dist in DISTS:
        for suffix, tier in (("", disk), ("_lfu", lfu)):
            results[f"disk_over_dram_{dist}{suffix}"] = dram[f"step_ms_{dist}"] / tier[f"step_ms_{dist}"]
            results[f"hit_rate_{dist}{suffix}"] = tier[f"hit_rate_{dist}"]
            results[f"write_amplification_{dist}{suffix}"] = tier[f"write_amplification_{dist}"]
        results[f"rows_read_per_s_{dist}"] = disk[f"rows_read_per_s_{dist}"]
        results[f"read_bound_{dist}"] = dram[f"step_ms_{dist}"] / max(disk[f"read_ms_{dist}"], dram[f"step_ms_{dist}"])
    for op in ("save", "load"):
        results[f"{op}_vs_dram_ratio"] = disk[f"{op}_s"] / dram[f"{op}_s"]
    fixed = disk["base_rss_mib"] + disk["tier_index_mib"] + disk["id_map_mib"]
    results["fixed_overhead_mib"] = fixed
    results["peak_rss_over_cache_budget"] = (disk["train_peak_rss_mib"] - fixed) / args.cache_mib
    results["snapshot_index_mib"] = args.rows * SNAPSHOT_BYTES / 2**20  # held by the save, as the index by training
    results["peak_rss_over_cache_budget_checkpoint"] = ((disk["checkpoint_peak_rss_mib"] - fixed - results["snapshot_index_mib"])
                                                        / args.cache_mib)
    results["load_average_end"] = list(os.getloadavg())
    results["targets"] = {f"disk_over_dram_zipf >= {TARGET_RATIO}": results["disk_over_dram_zipf"] >= TARGET_RATIO,
                          f"peak_rss_over_cache_budget <= {TARGET_RSS}":
                              results["peak_rss_over_cache_budget"] <= TARGET_RSS}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.plot or args.json.with_suffix(".png"))
    print(f"\n{args.rows:,} rows x {args.dim} ({results['table_gib']:.1f} GiB), cache {args.cache_mib} MiB, "
          f"batch {args.batch} x {args.pooling}")
    for dist in DISTS:
        print(f"  {dist:8s} DRAM {dram[f'step_ms_{dist}']:8.1f} ms  disk tier {disk[f'step_ms_{dist}']:8.1f} ms  "
              f"ratio {results[f'disk_over_dram_{dist}']:.3f}  hit rate {results[f'hit_rate_{dist}']:.3f}  "
              f"write amplification {results[f'write_amplification_{dist}']:.2f}; with an lfu cache: ratio "
              f"{results[f'disk_over_dram_{dist}_lfu']:.3f}, hit rate {results[f'hit_rate_{dist}_lfu']:.3f}")
        print(f"  {'':8s} reads {disk[f'read_ms_{dist}']:.1f} ms a step at {results[f'rows_read_per_s_{dist}']:,.0f} "
              f"rows/s: the ratio could reach {results[f'read_bound_{dist}']:.3f} were nothing else paid")
    print(f"  DCP save {disk['save_s']:.1f} s vs {dram['save_s']:.1f} s in DRAM ({results['save_vs_dram_ratio']:.2f}x), "
          f"load {disk['load_s']:.1f} s vs {dram['load_s']:.1f} s ({results['load_vs_dram_ratio']:.2f}x)")
    print(f"  peak RSS {disk['train_peak_rss_mib']:,.0f} MiB training, {disk['checkpoint_peak_rss_mib']:,.0f} MiB "
          f"saving and loading: fixed {fixed:,.0f} MiB + {results['peak_rss_over_cache_budget']:.2f}, "
          f"{results['peak_rss_over_cache_budget_checkpoint']:.2f} x the cache budget")
    print_targets(results["targets"])
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
