"""Training-step speed of the KV-ZCH kernel against fbgemm's TBE on a dense table.

    python benchmarks/bench_lookup.py --json results/bench_lookup.json

One table with 1M live rows x 128 fp32, rowwise Adagrad, batch 8192, pooling 20. The KV-ZCH
kernel holds the rows of 1M ids drawn from 2^40; fbgemm's TBE holds the same rows densely and
sees each id's row index. Both run the same batches (forward + backward + fused update), with
uniform and Zipf(1.05) ids, alternating step by step after warm-up. Ratios are throughputs:
ours / baseline (1.0 = as fast as fbgemm on a dense table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from tqdm import tqdm

from _common import same_huge_pages_for_the_baseline, zipf_ranks
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.kernel import KVZCHTableKernel


def build(rows: int, dim: int, seed: int):
    params = KVZCHTableParams("bench", dim, num_embeddings=2**40, total_num_buckets=1024,
                              learning_rate=0.01)
    kernel = KVZCHTableKernel(params, params.bucket_range(0, 1), initial_rows=rows)
    gen = torch.Generator().manual_seed(seed)
    universe = torch.randint(0, 2**40, (int(rows * 1.01),), generator=gen).unique()[:rows]
    universe = universe[torch.randperm(universe.numel(), generator=gen)]
    kernel.store.find_or_insert(universe, touch=False)
    baseline = SplitTableBatchedEmbeddingBagsCodegen(
        [(universe.numel(), dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=params.optimizer.to_fbgemm(), learning_rate=params.learning_rate, eps=params.eps)
    with torch.no_grad():
        baseline.weights_host.copy_(kernel.store.read_ids(universe).view(-1))
    return kernel, baseline, universe


def batches(n_rows: int, batch: int, pooling: int, dist: str, count: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        if dist == "zipf":
            yield zipf_ranks(n_rows, batch * pooling, 1.05, gen)
        else:
            yield torch.randint(0, n_rows, (batch * pooling,), generator=gen)


def compare(kernel, baseline, universe, batch: int, pooling: int, dist: str, steps: int, warmup: int):
    offsets = torch.arange(0, batch * pooling + 1, pooling, dtype=torch.long)
    ours, base = [], []
    for i, local in enumerate(batches(universe.numel(), batch, pooling, dist, steps + warmup, seed=7)):
        ids = universe[local]  # global ids for our kernel, row indices for the baseline
        for module, inputs, times in ((kernel, ids, ours), (baseline, local, base)):
            t0 = time.perf_counter()
            out = module(inputs, offsets)
            out.backward(torch.ones_like(out))
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    ours_ms, base_ms = statistics.median(ours), statistics.median(base)
    return {"ours_ms": ours_ms, "tbe_ms": base_ms, "ratio": base_ms / ours_ms}


def main() -> None:
    same_huge_pages_for_the_baseline()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    kernel, baseline, universe = build(args.rows, args.dim, seed=0)
    results: dict = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "pooling": args.pooling,
                     "threads": torch.get_num_threads()}
    for dist in tqdm(("uniform", "zipf"), desc="bench_lookup"):
        r = compare(kernel, baseline, universe, args.batch, args.pooling, dist, args.steps, args.warmup)
        results.update({f"{k}_{dist}": v for k, v in r.items()})
    results["targets"] = {"ratio_uniform >= 0.80": results["ratio_uniform"] >= 0.80,
                          "ratio_zipf >= 0.85": results["ratio_zipf"] >= 0.85}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\ntraining step, {args.rows:,} live rows x {args.dim}, batch {args.batch}, pooling {args.pooling}")
    for dist in ("uniform", "zipf"):
        print(f"  {dist:8s} ours {results[f'ours_ms_{dist}']:7.1f} ms   fbgemm TBE {results[f'tbe_ms_{dist}']:7.1f} ms"
              f"   throughput ratio {results[f'ratio_{dist}']:.3f}")
    for name, ok in results["targets"].items():
        print(f"  [{'ok' if ok else 'MISS'}] {name}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
