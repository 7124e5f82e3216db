"""Soak: KV-ZCH table shards under a memory budget, fed fresh ids step after step.

    python benchmarks/soak_eviction.py --json results/soak_eviction.json
    python benchmarks/soak_eviction.py --scope rank --json results/soak_rank_budget.json

``--scope table``: one table shard (64-d fp32, rowwise Adagrad) with an LRU byte budget of its
own. ``--scope rank``: two table shards (64-d and 128-d) under one ``RankBudget`` of that many
bytes, whose traffic shifts halfway: table ``a`` gets most of the fresh ids in the first half,
``b`` in the second, so the budget has to move from one table to the other. Each step runs every
table's forward, then one backward (fused updates), as a training step does. Batches mix
``--fresh`` never-seen ids with Zipf-popular ones, far more ids than the budget holds. Every step
records the process RSS and the live rows. The target compares the RSS growth the stores cause -
the peak RSS minus a baseline taken before they exist - with the budget.

The run re-executes itself with glibc's mmap threshold fixed at 1 MiB (``_common.fixed_mmap_threshold``,
the setting docs/eviction.md recommends for jobs under a budget); ``--default-malloc`` keeps glibc's
moving threshold, under which freed temporaries of torch and fbgemm stay in the heap.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from _common import fixed_mmap_threshold, print_targets, zipf_ranks
from torchrec_kvzch import EvictionPolicy, KVZCHTableParams, RankBudget, SharedBudget
from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.table.eviction import budget_bytes


def plot(trace: list[dict], tables: list[str], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [t["step"] for t in trace]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(steps, [t["rss_growth"] / 2**20 for t in trace], label="RSS growth since before the stores")
    left.plot(steps, [t["counted_bytes"] / 2**20 for t in trace], label="counted by the budget", alpha=0.7)
    left.axhline(budget / 2**20, color="red", linestyle="--", label="budget")
    left.set(xlabel="step", ylabel="MiB", title="memory", ylim=(0, None))
    left.legend(fontsize=8)
    for name in tables:
        right.plot(steps, [t["tables"][name]["rows"] / 1e6 for t in trace], label=f"{name}: live rows")
    if len(tables) == 1:
        right.plot(steps, [t["tables"][tables[0]]["inserted"] / 1e6 for t in trace], label="rows ever inserted")
    right.set(xlabel="step", ylabel="rows (M)", title="rows")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--scope", choices=["table", "rank"], default="table")
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16384, help="ids per table and step")
    parser.add_argument("--fresh", type=float, default=0.5, help="share of never-seen ids per batch")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--default-malloc", action="store_true", help="keep glibc's moving mmap threshold")
    args = parser.parse_args()
    if not args.default_malloc:
        fixed_mmap_threshold()
    process = psutil.Process()
    budget = args.budget_mib * 2**20
    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(args.batch + 1)
    rank_scope = args.scope == "rank"
    dims = {"a": 64, "b": 128} if rank_scope else {"soak": 64}
    own = EvictionPolicy() if rank_scope else EvictionPolicy("lru", max_bytes=budget)
    params = [KVZCHTableParams(name, dim, num_embeddings=2**40, total_num_buckets=1024, learning_rate=0.01,
                               eviction=own) for name, dim in dims.items()]
    buckets = params[0].bucket_range(0, 1)
    # Warm the allocator and fbgemm on throwaway tables first, so the baseline holds them.
    for p in params:
        warm = TableTBE(KVZCHTableParams("warm", p.embedding_dim, num_embeddings=2**40,
                                                 total_num_buckets=1024), buckets)
        warm(torch.arange(args.batch), offsets).sum().backward()
        del warm
    baseline = process.memory_info().rss
    shared = SharedBudget(RankBudget(max_bytes=budget)) if rank_scope else None
    tbes = [TableTBE(p, buckets, budget=shared) for p in params]
    popular = torch.randint(0, 2**40, (100_000,), generator=gen)
    trace, peak, t0 = [], 0, time.perf_counter()
    for step in tqdm(range(args.steps), desc=f"soak ({args.scope})", mininterval=2):
        loss = 0
        for i, tbe in enumerate(tbes):
            fresh_share = args.fresh
            if rank_scope:  # a takes most fresh ids in the first half, b in the second
                fresh_share = 0.9 if (i == 0) == (step < args.steps // 2) else 0.1
            fresh = torch.rand(args.batch, generator=gen) < fresh_share
            ids = torch.where(fresh, torch.randint(0, 2**40, (args.batch,), generator=gen),
                              popular[zipf_ranks(popular.numel(), args.batch, 1.05, gen)])
            loss = loss + tbe(ids, offsets).sum()
        loss.backward()
        rss = process.memory_info().rss
        peak = max(peak, rss)
        trace.append({"step": step, "rss_growth": rss - baseline,
                      "counted_bytes": sum(budget_bytes(k.store, len(k.store)) for k in tbes),
                      "tables": {p.name: k.store.counters for p, k in zip(params, tbes)}})
    out = {"scope": args.scope, "budget_bytes": budget, "baseline_rss": baseline, "peak_rss": peak,
           "peak_rss_over_budget_ratio": (peak - baseline) / budget,
           "final_rss_over_budget_ratio": trace[-1]["rss_growth"] / budget,
           "steps": args.steps, "batch": args.batch, "fresh": args.fresh, "dims": dims,
           "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
           "seconds": time.perf_counter() - t0, "tables": trace[-1]["tables"],
           "trace": trace[:: max(1, args.steps // 200)]}
    if not rank_scope:
        out["budget_rows"] = tbes[0].store.evictor.max_rows
    out["targets"] = {"peak_rss_over_budget_ratio <= 1.10": out["peak_rss_over_budget_ratio"] <= 1.10}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    plot(trace, list(dims), budget, args.json.with_suffix(".png"))
    for name, c in out["tables"].items():
        print(f"{name}: {c['inserted']:,} rows inserted, {c['evicted']:,} evicted, {c['rows']:,} live")
    print(f"budget {args.budget_mib} MiB ({args.scope}); peak RSS growth {(peak - baseline) / 2**20:,.0f} MiB "
          f"= {out['peak_rss_over_budget_ratio']:.3f} x budget")
    print_targets(out["targets"])


if __name__ == "__main__":
    main()
