"""How a rank's KV-ZCH table scales with its live rows: step time and bytes per row, 1M -> 10M.

    python benchmarks/bench_scaling.py --json results/bench_scaling.json

For each size the table is filled the way training fills it (inserts in batches, the store
growing as it goes, no up-front reservation), then one training step (forward + backward +
fused rowwise Adagrad, batch 8192, pooling 20) is timed against fbgemm's TBE on a dense table
holding the same rows, alternating step by step, with uniform and Zipf(1.05) ids over the live
rows. Bytes per row count everything the store holds (row arrays with their growth slack, the
slot -> id array, the hash table) against the dense table's weight + momentum.

Memory as the OS sees it: in a fresh process each, a table is grown to 10M rows by training
steps whose ids are all new (no reservation), and another with its rows reserved up front; the
process's RSS growth per live row is divided by the whole-row bytes (header + weight + optimizer
state, what a checkpoint holds per row): ``bytes_per_row_over_raw_10m`` and ``..._reserved``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import psutil

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from tqdm import tqdm

from _common import fixed_mmap_threshold, print_targets, same_huge_pages_for_the_baseline
from bench_lookup import compare
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.table.tbe import TableTBE


def filled(rows: int, dim: int, seed: int = 0):
    """Our kernel and a dense TBE holding the same ``rows`` rows (ids from 2^40)."""
    params = KVZCHTableParams("scaling", dim, num_embeddings=2**40, total_num_buckets=1024, learning_rate=0.01)
    tbe = TableTBE(params, params.bucket_range(0, 1))
    gen = torch.Generator().manual_seed(seed)
    universe = torch.randint(0, 2**40, (int(rows * 1.01),), generator=gen).unique()[:rows]
    universe = universe[torch.randperm(universe.numel(), generator=gen)]
    for chunk in universe.split(163_840):  # as training inserts: a batch at a time
        tbe.store.find_or_insert(chunk, touch=False)
    baseline = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=params.optimizer.to_fbgemm(), learning_rate=params.learning_rate, eps=params.eps)
    with torch.no_grad():
        baseline.weights_host.copy_(tbe.store.read_ids(universe).view(-1))
    return tbe, baseline, universe


def rss_worker(rows: int, dim: int, batch: int, pooling: int, reserve: bool) -> dict:
    """Grow one table to ``rows`` rows by training steps of new ids; RSS growth per live row."""
    from torchrec_kvzch.table.layout import RowLayout

    params = KVZCHTableParams("rss", dim, num_embeddings=2**40, total_num_buckets=1024, learning_rate=0.01)
    process = psutil.Process()
    before = process.memory_info().rss
    tbe = TableTBE(params, params.bucket_range(0, 1), initial_rows=rows if reserve else 0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2**40, (int(rows * 1.01),), generator=gen).unique()[:rows]
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    extra = ids.numel() * ids.element_size()  # the id list itself is the benchmark's, not the store's
    for chunk in ids.split(batch * pooling):
        offsets = torch.arange(0, chunk.numel() + 1, pooling)
        offsets[-1] = chunk.numel()
        out = tbe(chunk, offsets)
        out.backward(torch.ones_like(out))
    del out
    grown = process.memory_info().rss - before - extra
    raw = RowLayout.for_table(params).row_width * RowLayout.for_table(params).itemsize
    return {"rows": len(tbe.store), "rss_bytes_per_row": grown / len(tbe.store),
            "whole_row_bytes": raw, "ratio": grown / len(tbe.store) / raw}


def rss_in_fresh_process(args, reserve: bool) -> dict:
    cmd = [sys.executable, __file__, "--json", "-", "--rss-worker", "reserved" if reserve else "grown",
           "--dim", str(args.dim), "--batch", str(args.batch), "--pooling", str(args.pooling),
           "--rss-rows", str(args.rss_rows)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r["rows"] / 1e6 for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for dist, style in (("uniform", "-"), ("zipf", "--")):
        left.plot(rows, [r[dist]["ours_ms"] for r in results], style, marker="o", label=f"KV-ZCH, {dist}")
        left.plot(rows, [r[dist]["tbe_ms"] for r in results], style, marker="s", label=f"fbgemm TBE, {dist}")
    left.set(xlabel="live rows per rank (M)", ylabel="training step (ms)", title="step time")
    left.legend(fontsize=8)
    right.plot(rows, [r["bytes_per_row"] for r in results], marker="o", label="KV-ZCH store (all of it)")
    right.plot(rows, [r["dense_bytes_per_row"] for r in results], marker="s", label="dense TBE (weight + momentum)")
    right.set(xlabel="live rows per rank (M)", ylabel="bytes per row", title="memory", ylim=(0, None))
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--sizes", default="1000000,2000000,5000000,10000000")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rss-rows", type=int, default=10_000_000)
    parser.add_argument("--rss-worker", choices=["grown", "reserved"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_worker:
        fixed_mmap_threshold()  # freed temporaries go back to the OS: RSS is what is in use
        print(json.dumps(rss_worker(args.rss_rows, args.dim, args.batch, args.pooling,
                                    args.rss_worker == "reserved")))
        return
    same_huge_pages_for_the_baseline()
    memory = {kind: rss_in_fresh_process(args, kind == "reserved") for kind in ("grown", "reserved")}
    results = []
    for rows in tqdm([int(s) for s in args.sizes.split(",")], desc="sizes"):
        tbe, baseline, universe = filled(rows, args.dim)
        entry = {"rows": rows, "bytes_per_row": tbe.store.nbytes / rows,
                 "dense_bytes_per_row": args.dim * 4 + 4}
        for dist in ("uniform", "zipf"):
            entry[dist] = compare(tbe, baseline, universe, args.batch, args.pooling, dist, args.steps, warmup=2)
        results.append(entry)
        del tbe, baseline, universe
    first, last = results[0], results[-1]
    out = {"dim": args.dim, "batch": args.batch, "pooling": args.pooling, "sizes": results,
           "uniform_ratio_at_largest": last["uniform"]["ratio"],
           "step_time_growth_uniform": last["uniform"]["ours_ms"] / first["uniform"]["ours_ms"],
           "tbe_step_time_growth_uniform": last["uniform"]["tbe_ms"] / first["uniform"]["tbe_ms"],
           "bytes_per_row_at_largest": last["bytes_per_row"], "rss": memory,
           "bytes_per_row_over_raw_10m": memory["grown"]["ratio"],
           "bytes_per_row_over_raw_10m_reserved": memory["reserved"]["ratio"]}
    out["targets"] = {
        "uniform_ratio_at_largest >= 0.8": out["uniform_ratio_at_largest"] >= 0.8,
        "step_time_growth_uniform <= 1.25 x TBE's":
            out["step_time_growth_uniform"] <= 1.25 * out["tbe_step_time_growth_uniform"],
        "bytes_per_row_over_raw_10m <= 1.15": out["bytes_per_row_over_raw_10m"] <= 1.15,
        "bytes_per_row_over_raw_10m_reserved <= 1.15": out["bytes_per_row_over_raw_10m_reserved"] <= 1.15,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    plot(results, args.json.with_suffix(".png"))
    print(f"{'rows':>11} {'ours uni':>9} {'tbe uni':>8} {'ratio':>6} {'ours zipf':>10} {'tbe zipf':>9} "
          f"{'ratio':>6} {'B/row':>6} {'dense':>6}")
    for r in results:
        u, z = r["uniform"], r["zipf"]
        print(f"{r['rows']:>11,} {u['ours_ms']:>9.1f} {u['tbe_ms']:>8.1f} {u['ratio']:>6.2f} {z['ours_ms']:>10.1f} "
              f"{z['tbe_ms']:>9.1f} {z['ratio']:>6.2f} {r['bytes_per_row']:>6.1f} {r['dense_bytes_per_row']:>6}")
    for kind, m in memory.items():
        print(f"RSS per live row at {m['rows']:,} rows, {kind}: {m['rss_bytes_per_row']:.1f} B "
              f"= {m['ratio']:.3f} x the whole row ({m['whole_row_bytes']} B)")
    print_targets(out["targets"])


if __name__ == "__main__":
    main()
