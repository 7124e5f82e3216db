"""Planning time for 100 tables: our planner on KV-ZCH tables against TorchRec's on FUSED tables.

    python benchmarks/bench_planner.py --json results/bench_planner.json

Both plan an EmbeddingBagCollection of 100 tables (dims cycling 32..256) for 8 CPU ranks,
batch 512, with ``plan()`` (no process group needed). Ours: ``KVZCHShardingPlanner`` with our
sharders, every table KV-ZCH over 2^40 ids (1M expected rows each). Baseline: TorchRec's
``EmbeddingShardingPlanner`` with its default sharders and 100 ordinary tables of 1M rows (the
FUSED kernel). A mixed case plans 50 of each with our planner. Median of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from pathlib import Path

import torch
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from _common import print_targets
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.torchrec import KVZCHConstraints, KVZCHShardingPlanner, kvzch_embedding_bag_config, kvzch_sharders

DIMS = (32, 64, 128, 256)


def tables(n: int, kvzch: int):
    """``kvzch`` KV-ZCH tables (and their constraints) followed by ``n - kvzch`` ordinary ones."""
    configs, constraints = [], {}
    for i in range(n):
        dim, name = DIMS[i % len(DIMS)], f"t{i}"
        if i < kvzch:
            params = KVZCHTableParams(name, dim, expected_rows=1_000_000, total_num_buckets=1024)
            configs.append(kvzch_embedding_bag_config(params, [f"f{i}"]))
            constraints[name] = KVZCHConstraints(kvzch=params)
        else:
            configs.append(EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=1_000_000,
                                              feature_names=[f"f{i}"]))
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta")), constraints


def time_plan(make_planner, module, sharders, reps: int) -> tuple[float, object]:
    times, plan = [], None
    for _ in range(reps):
        planner = make_planner()
        t0 = time.perf_counter()
        plan = planner.plan(module, sharders)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), plan


def plot(results: dict, tables: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"fused_only_torchrec": f"TorchRec planner\n{tables} FUSED tables",
              "kvzch_ours": f"our planner\n{tables} KV-ZCH tables",
              "mixed_ours": f"our planner\n{tables // 2} + {tables - tables // 2} mixed"}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([labels[k] for k in labels], [results[k]["seconds"] for k in labels],
                  color=["tab:orange", "tab:blue", "tab:green"])
    ax.bar_label(bars, fmt="%.2f s")
    ax.set(ylabel="plan() time (s, median)", title="sharding-plan time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--tables", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    topology = Topology(world_size=args.world_size, compute_device="cpu", local_world_size=args.world_size)
    batch = 512
    results = {}
    for case, kv in (("fused_only_torchrec", 0), ("kvzch_ours", args.tables), ("mixed_ours", args.tables // 2)):
        module, constraints = tables(args.tables, kv)
        if kv == 0:
            seconds, plan = time_plan(lambda: EmbeddingShardingPlanner(topology, batch_size=batch),
                                      module, get_default_sharders(), args.reps)
        else:
            seconds, plan = time_plan(lambda: KVZCHShardingPlanner(topology, batch, constraints=constraints),
                                      module, kvzch_sharders(), args.reps)
        kernels = sorted({ps.compute_kernel for m in plan.plan.values() for ps in m.values()})
        results[case] = {"seconds": seconds, "kernels": kernels}
        print(f"{case:<22} {seconds:7.2f} s  kernels: {', '.join(kernels)}")
    ratio = results["kvzch_ours"]["seconds"] / results["fused_only_torchrec"]["seconds"]
    out = {"tables": args.tables, "world_size": args.world_size, "batch_size": batch, "reps": args.reps,
           **results, "kvzch_over_fused_time_ratio": ratio,
           "targets": {"kvzch_over_fused_time_ratio <= 2": ratio <= 2.0}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    plot(results, args.tables, args.json.with_suffix(".png"))
    print(f"ours / TorchRec FUSED-only: {ratio:.2f}")
    print_targets(out["targets"])


if __name__ == "__main__":
    main()
