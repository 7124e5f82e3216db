"""Soak: a table shard under a memory budget, fed fresh ids step after step.

    python benchmarks/soak_eviction.py --json results/soak_eviction.json

One KV-ZCH table shard (64-d fp32, rowwise Adagrad) with an LRU byte budget trains through the
kernel (forward, backward, fused update) on batches where ``--fresh`` of the ids were never seen
before and the rest are Zipf-popular, far more ids than the budget holds. Every step records the
process RSS and the live rows. The target compares the RSS growth the store causes - the peak
RSS minus a baseline taken before the store exists - with the budget.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from _common import print_targets, zipf_ranks
from torchrec_kvzch import EvictionPolicy, KVZCHTableParams
from torchrec_kvzch.kernel import KVZCHTableKernel


def plot(trace: list[dict], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [t["step"] for t in trace]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(steps, [t["rss_growth"] / 2**20 for t in trace], label="RSS growth since before the store")
    left.axhline(budget / 2**20, color="red", linestyle="--", label="budget")
    left.set(xlabel="step", ylabel="MiB", title="memory", ylim=(0, None))
    left.legend(fontsize=8)
    right.plot(steps, [t["rows"] / 1e6 for t in trace], label="live rows")
    right.plot(steps, [t["inserted"] / 1e6 for t in trace], label="rows ever inserted")
    right.set(xlabel="step", ylabel="rows (M)", title="rows")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--fresh", type=float, default=0.5, help="share of never-seen ids per batch")
    parser.add_argument("--steps", type=int, default=800)
    args = parser.parse_args()
    process = psutil.Process()
    budget = args.budget_mib * 2**20
    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(args.batch + 1)
    params = KVZCHTableParams("soak", args.dim, num_embeddings=2**40, total_num_buckets=1024, learning_rate=0.01,
                              eviction=EvictionPolicy("lru", max_bytes=budget))
    # Warm the allocator and fbgemm on a throwaway table first, so the baseline holds them.
    warm = KVZCHTableKernel(KVZCHTableParams("warm", args.dim, num_embeddings=2**40, total_num_buckets=1024),
                            params.bucket_range(0, 1))
    warm(torch.arange(args.batch), offsets).sum().backward()
    del warm
    baseline = process.memory_info().rss
    kernel = KVZCHTableKernel(params, params.bucket_range(0, 1))
    popular = torch.randint(0, 2**40, (100_000,), generator=gen)
    trace, peak, t0 = [], 0, time.perf_counter()
    for step in tqdm(range(args.steps), desc="soak", mininterval=2):
        fresh = torch.rand(args.batch, generator=gen) < args.fresh
        ids = torch.where(fresh, torch.randint(0, 2**40, (args.batch,), generator=gen),
                          popular[zipf_ranks(popular.numel(), args.batch, 1.05, gen)])
        kernel(ids, offsets).sum().backward()
        rss = process.memory_info().rss
        peak = max(peak, rss)
        trace.append({"step": step, "rss_growth": rss - baseline, **kernel.store.counters})
    counters = kernel.store.counters
    out = {"budget_bytes": budget, "budget_rows": kernel.store.evictor.max_rows, "baseline_rss": baseline,
           "peak_rss": peak, "peak_rss_over_budget_ratio": (peak - baseline) / budget,
           "final_rss_over_budget_ratio": trace[-1]["rss_growth"] / budget,
           "steps": args.steps, "batch": args.batch, "fresh": args.fresh, "dim": args.dim,
           "seconds": time.perf_counter() - t0, "rows": counters["rows"], "inserted": counters["inserted"],
           "evicted": counters["evicted"], "trace": trace[:: max(1, args.steps // 200)]}
    out["targets"] = {"peak_rss_over_budget_ratio <= 1.10": out["peak_rss_over_budget_ratio"] <= 1.10}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    plot(trace, budget, args.json.with_suffix(".png"))
    print(f"budget {args.budget_mib} MiB = {out['budget_rows']:,} rows; {counters['inserted']:,} rows inserted, "
          f"{counters['evicted']:,} evicted, {counters['rows']:,} live; peak RSS growth "
          f"{(peak - baseline) / 2**20:,.0f} MiB = {out['peak_rss_over_budget_ratio']:.3f} x budget")
    print_targets(out["targets"])


if __name__ == "__main__":
    main()
