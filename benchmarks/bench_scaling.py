"""How a rank's KV-ZCH table scales with its live rows: step time and bytes per row, 1M -> 10M.

    python benchmarks/bench_scaling.py --json results/bench_scaling.json

For each size the table is filled the way training fills it (inserts in batches, the store
growing as it goes, no up-front reservation), then one training step (forward + backward +
fused rowwise Adagrad, batch 8192, pooling 20) is timed against fbgemm's TBE on a dense table
holding the same rows, alternating step by step, with uniform and Zipf(1.05) ids over the live
rows. Bytes per row count everything the store holds (row arrays with their growth slack, the
slot -> id array, the hash table) against the dense table's weight + momentum.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from tqdm import tqdm

from _common import print_targets, same_huge_pages_for_the_baseline
from bench_lookup import compare
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.kernel import KVZCHTableKernel


def filled(rows: int, dim: int, seed: int = 0):
    """Our kernel and a dense TBE holding the same ``rows`` rows (ids from 2^40)."""
    params = KVZCHTableParams("scaling", dim, num_embeddings=2**40, total_num_buckets=1024, learning_rate=0.01)
    kernel = KVZCHTableKernel(params, params.bucket_range(0, 1))
    gen = torch.Generator().manual_seed(seed)
    universe = torch.randint(0, 2**40, (int(rows * 1.01),), generator=gen).unique()[:rows]
    universe = universe[torch.randperm(universe.numel(), generator=gen)]
    for chunk in universe.split(163_840):  # as training inserts: a batch at a time
        kernel.store.find_or_insert(chunk, touch=False)
    baseline = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=params.optimizer.to_fbgemm(), learning_rate=params.learning_rate, eps=params.eps)
    with torch.no_grad():
        baseline.weights_host.copy_(kernel.store.read_ids(universe).view(-1))
    return kernel, baseline, universe


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
    args = parser.parse_args()
    same_huge_pages_for_the_baseline()
    results = []
    for rows in tqdm([int(s) for s in args.sizes.split(",")], desc="sizes"):
        kernel, baseline, universe = filled(rows, args.dim)
        entry = {"rows": rows, "bytes_per_row": kernel.store.nbytes / rows,
                 "dense_bytes_per_row": args.dim * 4 + 4}
        for dist in ("uniform", "zipf"):
            entry[dist] = compare(kernel, baseline, universe, args.batch, args.pooling, dist, args.steps, warmup=2)
        results.append(entry)
        del kernel, baseline, universe
    first, last = results[0], results[-1]
    out = {"dim": args.dim, "batch": args.batch, "pooling": args.pooling, "sizes": results,
           "uniform_ratio_at_largest": last["uniform"]["ratio"],
           "step_time_growth_uniform": last["uniform"]["ours_ms"] / first["uniform"]["ours_ms"],
           "tbe_step_time_growth_uniform": last["uniform"]["tbe_ms"] / first["uniform"]["tbe_ms"],
           "bytes_per_row_at_largest": last["bytes_per_row"]}
    out["targets"] = {
        "throughput at the largest size >= 0.8 x TBE (uniform ids)": out["uniform_ratio_at_largest"] >= 0.8,
        "step time grows no faster than TBE's (within 25%)":
            out["step_time_growth_uniform"] <= 1.25 * out["tbe_step_time_growth_uniform"],
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
    print_targets(out["targets"])


if __name__ == "__main__":
    main()
