"""Id-map and row-store speed and memory, side by side with a Python dict and one fbgemm TBE step.

    python benchmarks/bench_store.py --json results/bench_store.json [--plot results/bench_store.png]

For maps holding 1M and 10M keys (ids drawn from 2^50), times ``find_or_insert`` of batches of
163,840 ids of which 20% are new, for the native op, the pure-torch twin and a Python dict, in one
run; reports bytes per key; and times one fbgemm CPU TBE training step (1M x 128 fp32, batch
8192, pooling 20, rowwise Adagrad) for scale, in turn with the native op on the 10M map, so that
their ratio compares the two under the same conditions; that comparison runs in ``--processes``
fresh processes (default 5) and ``native_over_tbe_10m`` is the median of their ratios (see
``_common.in_fresh_processes``). All times are medians after warm-up, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from _common import (in_fresh_processes, interleaved_median_ms, median_ms, print_targets,
                     same_huge_pages_for_the_baseline)
from torchrec_kvzch import KVZCHTableParams, RowStore
from torchrec_kvzch.table.id_map import IdMap

ID_SPACE = 2**50
BATCH = 8192 * 20
NEW_FRACTION = 0.2


class BatchSource:
    """Batches of 163,840 ids: 80% drawn from the keys present, 20% fresh."""

    def __init__(self, present: torch.Tensor, seed: int) -> None:
        self.present = present
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self) -> torch.Tensor:
        n_new = int(BATCH * NEW_FRACTION)
        old = self.present[torch.randint(0, self.present.numel(), (BATCH - n_new,), generator=self.gen)]
        new = torch.randint(0, ID_SPACE, (n_new,), generator=self.gen)
        return torch.cat([old, new])[torch.randperm(BATCH, generator=self.gen)]

    def take(self, n: int):
        """An iterator over ``n`` batches made up front, so timings exclude id generation."""
        return iter([self() for _ in range(n)])


def filled_map(keys: torch.Tensor, backend: str) -> IdMap:
    m = IdMap(backend)
    for chunk in keys.split(1 << 20):
        m.find_or_insert(chunk)
    return m


def bench_maps(n_keys: int, reps: int, with_dict: bool, beside=None, torch_twin: bool = True) -> dict:
    """Times per map; ``beside``: a baseline step timed in turn with the native op (then only
    the two times are returned)."""
    keys = torch.unique(torch.randint(0, ID_SPACE, (int(n_keys * 1.01),)))[:n_keys]
    keys = keys[torch.randperm(keys.numel())]
    native = filled_map(keys, "native")
    out = {} if beside is not None else {"bytes_per_key": native.nbytes / len(native)}
    maps = [("native", native)]
    if torch_twin:  # on a copy of the native table: both backends share one state format
        twin = IdMap("torch")
        twin.table = native.table.clone()
        twin.slot_keys, twin.size, twin._occupied = native.slot_keys.clone(), native.size, native._occupied
        maps.append(("torch", twin))
    for name, m in maps:
        batches = BatchSource(keys, seed=1).take(reps + 2)
        step = lambda m=m, b=batches: m.find_or_insert(next(b))  # noqa: E731
        if name == "native" and beside is not None:
            out["native_ms"], out["beside_ms"] = interleaved_median_ms([step, beside], reps)
        else:
            out[f"{name}_ms"] = median_ms(step, reps)
    if with_dict:
        table = dict(zip(keys.tolist(), range(n_keys)))
        dict_reps = max(3, reps // 3)
        batches = BatchSource(keys, seed=1).take(dict_reps + 1)

        def dict_find_or_insert():
            ids = next(batches).tolist()
            slots = []
            for i in ids:  # the per-id Python loop is the baseline being measured
                s = table.get(i)
                if s is None:
                    s = table[i] = len(table)
                slots.append(s)
            return torch.tensor(slots)

        out["dict_ms"] = median_ms(dict_find_or_insert, dict_reps, warmup=1)
        del table
    return out


def bench_store_insert(n_rows: int, dim: int, reps: int) -> float:
    """Store-level find_or_insert (map + id-seeded init of new 128-dim rows + header touch)."""
    params = KVZCHTableParams("bench", dim, num_embeddings=ID_SPACE, total_num_buckets=1024)
    store = RowStore(params)
    keys = torch.randint(0, ID_SPACE, (n_rows,))
    for chunk in keys.split(1 << 18):
        store.find_or_insert(chunk)
    batches = BatchSource(store.keys().clone(), seed=2).take(reps + 2)
    return median_ms(lambda: store.find_or_insert(next(batches)), reps)


def tbe_step(rows: int, dim: int, batch: int, pooling: int):
    """One fbgemm CPU TBE training step (forward, backward, fused rowwise Adagrad), as a callable."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
    )
    gen = torch.Generator().manual_seed(3)
    offsets = torch.arange(0, batch * pooling + 1, pooling, dtype=torch.long)

    def step():
        indices = torch.randint(0, rows, (batch * pooling,), generator=gen)
        out = tbe(indices, offsets)
        out.backward(torch.ones_like(out))

    return step


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["native", "torch", "dict"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.35
    for i, size in enumerate(("1m", "10m")):
        values = [results.get(f"{n}_ms_{size}", 0.0) for n in names]
        bars = ax.bar([x + i * width for x in range(3)], values, width, label=f"{size.upper()} keys")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.axhline(results["tbe_step_ms"], color="k", ls="--", lw=1,
               label=f"fbgemm TBE train step ({results['tbe_step_ms']:.0f} ms)")
    ax.set_xticks([x + width / 2 for x in range(3)], ["native op", "torch twin", "Python dict"])
    ax.set_yscale("log")
    ax.set_ylabel("ms per batch of 163,840 ids (20% new)")
    ax.set_title("id -> slot find_or_insert, median after warm-up")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    same_huge_pages_for_the_baseline()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--plot", type=Path, help="PNG bar chart (default: next to --json)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sizes", default="1000000,10000000",
                        help="map sizes; the first two are reported as _1m and _10m")
    parser.add_argument("--processes", type=int, default=5,
                        help="fresh processes timing the 10M-key map beside a TBE step; "
                             "native_over_tbe_10m is the median of their ratios")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # one such process's JSON
    args = parser.parse_args()
    torch.manual_seed(0)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.one:  # the map beside fbgemm's step, in this process
        r = bench_maps(sizes[1], args.reps, False, tbe_step(1_000_000, 128, 8192, 20), torch_twin=False)
        args.one.write_text(json.dumps({"native_over_tbe_10m": r["native_ms"] / r["beside_ms"],
                                        "tbe_step_ms": r["beside_ms"]}))
        return
    results: dict = {"batch_ids": BATCH, "new_fraction": NEW_FRACTION, "threads": torch.get_num_threads(),
                     "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    steps = tqdm(total=len(sizes) + 1, desc="bench_store", unit="stage")
    for size, tag in zip(sizes, ("1m", "10m")):
        for key, value in bench_maps(size, args.reps, True).items():
            results[f"{key}_{tag}"] = value
        steps.update()
    results["store_insert_ms_1m_d128"] = bench_store_insert(sizes[0], 128, args.reps)
    steps.update()
    steps.close()
    results.update(in_fresh_processes(__file__, ["--json", str(args.json), "--reps", str(args.reps),
                                                 "--sizes", args.sizes],
                                      args.processes))

    r = results
    r["dict_over_native_10m"] = r["dict_ms_10m"] / r["native_ms_10m"]
    r["torch_over_native_10m"] = r["torch_ms_10m"] / r["native_ms_10m"]
    r["targets"] = {
        "native_over_tbe_10m <= 0.10": r["native_over_tbe_10m"] <= 0.10,
        "dict_over_native_10m >= 10": r["dict_over_native_10m"] >= 10,
        "bytes_per_key_10m <= 64": r["bytes_per_key_10m"] <= 64,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    plot_path = args.plot or args.json.with_suffix(".png")
    plot(results, plot_path)

    print(f"\nfind_or_insert, batch of {BATCH:,} ids ({NEW_FRACTION:.0%} new), median ms:")
    print(f"{'keys':>6} {'native':>8} {'torch':>8} {'dict':>8} {'bytes/key':>10}")
    for tag in ("1m", "10m"):
        print(f"{tag.upper():>6} {r[f'native_ms_{tag}']:8.2f} {r[f'torch_ms_{tag}']:8.2f} "
              f"{r[f'dict_ms_{tag}']:8.1f} {r[f'bytes_per_key_{tag}']:10.1f}")
    print(f"store find_or_insert incl. init of new 128-d rows (1M rows): {r['store_insert_ms_1m_d128']:.2f} ms")
    print(f"fbgemm TBE training step (1M x 128, batch 8192, pooling 20): {r['tbe_step_ms']:.1f} ms")
    print_targets(r["targets"])
    print(f"wrote {args.json} and {plot_path}")


if __name__ == "__main__":
    main()
