"""Training-step speed of the KV-ZCH kernel on a GPU against fbgemm's CUDA TBE on a dense table.

    python benchmarks/bench_gpu.py --json docs/benchmarks/gpu.json --plot docs/benchmarks/gpu.png
    torchrun --nproc_per_node N benchmarks/bench_gpu.py --dmp --json results/bench_gpu_dmp.json

One process: for 1M and 10M live rows x 128 fp32 (rowwise Adagrad), batches of 65,536 and 8,192
x pooling 20, uniform and Zipf(1.05) ids, our kernel's training step (forward, backward, fused
update) against fbgemm's CUDA TBE holding the same rows densely, alternating step by step
(``bench_lookup.compare``, synchronised around each step). Ratios are throughputs, ours /
TBE's, as ``ratio_<rows>_b<batch>_<dist>``. What bounds ours: ``map_ms_<case>``, the store's
``find_or_insert`` with its header touch alone on the same batches, and ``find_ms_<case>``, its
lookup alone. The id map's own rates on
the GPU: ``find`` and ``find_or_insert`` (20% new ids) in keys/s, batches of 2^20 ids, at the
load factor the 10M-key map runs at.

``--host-cache`` (issue 34): a table of ``--host-rows`` rows held in host memory under a GPU
cache of 10% and 50% of them (``DeviceCache``), Zipf(1.05) batches of 65,536 x 20, against
fbgemm's TBE with the whole table in GPU memory: ``ratio_host_<percent>_zipf`` (target 0.5 at
50%), and ``hit_rate_host_<percent>_zipf``, the share of a step's distinct rows found cached
before its lookup. For reference, fbgemm's own managed-caching TBE over the same rows with the
same cache (``ratio_fbgemm_cache_<percent>_zipf``); with ``--profile``, torch.profiler's tables of
ours and of it at 50% (lru): what ours adds to fbgemm's caching. And at 50% (lru) ours again with
the id map's probe left unread by the host (``unsynced_ms_host_50_zipf``,
``ratio_unsynced_host_50_zipf``): what a lookup without that sync could gain at most (its batches
hold known ids only, so the probe's counters, checked at the end, change nothing).

``--larger-than-gpu`` (issue 34): a table whose rows take 1.1 times the GPU memory the run may use,
in host memory under a GPU cache of 10% of them, trains: ``larger_rows``, ``larger_host_bytes``,
the step's ``larger_step_ms`` (and ``larger_build_s``, inserting the rows), the GPU memory the run
may use (``larger_gpu_left_bytes``), what torch's allocator peaked at (``larger_gpu_peak_bytes``)
and what the device had in use at the end (``larger_gpu_used_bytes``, from the driver: rows that
moved to the GPU would show there). Where the host cannot hold 1.1 times the whole GPU (the H200
machine: 128 GiB of host memory, 141 GB of GPU memory), the rows fill what the host can spare, at
least an H100's 80 GB, and the run first holds back the rest of the GPU
(``larger_gpu_ballast_bytes``), so the table is still larger than the GPU memory left to it.

``--dmp`` (under torchrun, NCCL, one GPU per rank): ``bench_lookup``'s DMP comparison, a KV-ZCH
table against an ordinary FUSED table of the same rows, with a global batch of ``--batch``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench_lookup import batches, build, compare, dmp_comparison, kvzch_table
from torchrec_kvzch.params import DeviceCache
from torchrec_kvzch.table.id_map import IdMap

TARGET = 0.7
HOST_TARGET = 0.5  # ratio_host_50_zipf (issue 34; NVIDIA dynamicemb publishes 0.3-0.5 with host caching)
CACHE_PERCENTS = (10, 50)
H100_BYTES = 80 * 10**9  # --larger-than-gpu: at least this much in host memory (issue 34's bar)
HOST_MARGIN = 1.25  # --larger-than-gpu: host memory per byte of rows
DISTS = ("uniform", "zipf")


def tag(rows: int) -> str:
    return f"{rows // 10**6}m" if rows % 10**6 == 0 else str(rows)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_ms(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median time of ``fn()`` in ms, synchronised around each call."""
    times = []
    for rep in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if rep >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def map_ms(tbe, universe, batch: int, pooling: int, dist: str, reps: int) -> tuple[float, float]:
    """The store's find_or_insert + header touch alone, and its lookup alone (``find``), on
    batches like the step's; the touch costs about their difference."""
    ids = [universe[local.to(universe.device)]
           for local in batches(universe.numel(), batch, pooling, dist, reps + 2, seed=9)]
    it, again = iter(ids), iter(ids)
    return (device_ms(lambda: tbe.store.find_or_insert(next(it)), universe.device, reps),
            device_ms(lambda: tbe.store.find(next(again)), universe.device, reps))


def profile(tbe, baseline, universe, batch: int, pooling: int, dist: str, path: Path,
            baseline_name: str = "fbgemm TBE") -> None:
    """torch.profiler's table of ours and the baseline's (TBE's) training steps on one case: which
    kernels and host calls (syncs, copies, launches) the gap is made of."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = universe.device
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    offsets = torch.arange(0, batch * pooling + 1, pooling, dtype=torch.long, device=device)
    tables = []
    for name, module, global_ids in (("ours", tbe, True), (baseline_name, baseline, False)):
        steps = [local.to(device) for local in batches(universe.numel(), batch, pooling, dist, 8, seed=5)]
        steps = [universe[local] if global_ids else local for local in steps]
        for inputs in steps[:3]:  # warm up
            module(inputs, offsets).sum().backward()
        sync(device)
        with torch_profile(activities=activities) as prof:
            for inputs in steps[3:]:
                module(inputs, offsets).sum().backward()
            sync(device)
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        tables.append(f"## {name}: 5 training steps, batch {batch}, {dist}\n"
                      + prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(tables) + "\n")


def id_map_rates(universe: torch.Tensor, reps: int) -> dict:
    """find and find_or_insert (20% new ids) on a map holding ``universe``, in keys/s."""
    m = IdMap("auto", universe.device)
    for chunk in universe.split(1 << 22):
        m.find_or_insert(chunk)
    gen = torch.Generator().manual_seed(11)
    n = 1 << 20

    def present():
        return universe[torch.randint(0, universe.numel(), (n,), generator=gen).to(universe.device)]

    def mixed():
        fresh = torch.randint(2**41, 2**42, (n // 5,), generator=gen).to(universe.device)
        return torch.cat([present()[: n - n // 5], fresh])

    finds = iter([present() for _ in range(reps + 2)])
    inserts = iter([mixed() for _ in range(reps + 2)])
    find = device_ms(lambda: m.find(next(finds)), universe.device, reps)
    insert = device_ms(lambda: m.find_or_insert(next(inserts)), universe.device, reps)
    return {"map_keys": len(m), "map_load_factor": len(m) / m.capacity, "map_backend": m.backend.name,
            "find_keys_per_s": n / find * 1e3, "find_or_insert_keys_per_s": n / insert * 1e3}


def versions(device: torch.device) -> dict:
    import platform

    import fbgemm_gpu
    import torchrec

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "fbgemm_gpu": fbgemm_gpu.__version__,
            "torchrec": torchrec.__version__}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted(k[len("ratio_"):] for k in results if k.startswith("ratio_"))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(range(len(cases)), [results[f"ratio_{c}"] for c in cases], color="tab:blue")
    ax.axhline(TARGET, color="k", ls="--", lw=1, label=f"target {TARGET}")
    ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right")
    ax.set_ylabel("throughput / fbgemm CUDA TBE")
    ax.set_title(f"KV-ZCH training step on {results['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def single_gpu(args, device: torch.device) -> dict:
    results: dict = {**versions(device), "dim": args.dim, "pooling": args.pooling}
    for rows in args.rows:
        tbe, baseline, universe = build(rows, args.dim, seed=0, device=device)
        for batch in args.batches:
            for dist in tqdm(DISTS, desc=f"bench_gpu {tag(rows)} batch {batch}"):
                case = f"{tag(rows)}_b{batch}_{dist}"
                r = compare(tbe, baseline, universe, batch, args.pooling, dist, args.steps, args.warmup)
                results.update({f"ours_ms_{case}": r["ours_ms"], f"tbe_ms_{case}": r["tbe_ms"],
                                f"ratio_{case}": r["ratio"]})
                results[f"map_ms_{case}"], results[f"find_ms_{case}"] = map_ms(
                    tbe, universe, batch, args.pooling, dist, args.steps)
                if args.profile and (rows, batch, dist) == (args.rows[0], args.batches[0], DISTS[0]):
                    profile(tbe, baseline, universe, batch, args.pooling, dist, args.profile)
        if rows == args.rows[-1]:
            results.update(id_map_rates(universe, args.steps))
        del tbe, baseline, universe
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ratios = {k: v for k, v in results.items() if k.startswith("ratio_")}
    results["targets"] = {f"{k} >= {TARGET}": v >= TARGET for k, v in ratios.items()}
    return results


def hit_rate(tbe, universe, batch: int, pooling: int, reps: int) -> float:
    """The share of a training step's distinct rows found in the device cache before its lookup."""
    device = universe.device
    offsets = torch.arange(0, batch * pooling + 1, pooling, dtype=torch.long, device=device)
    hits = total = 0
    for local in batches(universe.numel(), batch, pooling, "zipf", reps, seed=13):
        ids = universe[local.to(device)]
        slots = torch.unique(tbe.store.find(ids))
        hits += int((tbe.store.row_cache.locations(slots[slots >= 0]) >= 0).sum())
        total += slots.numel()
        out = tbe(ids, offsets)
        out.backward(torch.ones_like(out))
    return hits / total


@contextlib.contextmanager
def probes_unsynced():
    """The id map's GPU probe with its counters left on the device, as if every batch were found
    whole (no new id, no bad one): the lookup's host sync gone, for batches of known ids only.
    The counters are read once at the end: a batch with a new or bad id voids the figures."""
    from torchrec_kvzch.table import gpu_kernels

    real, counters = gpu_kernels.probe, []

    def unsynced(table, ids, lo, hi):
        pos, slots, stats = gpu_kernels.launch_probe(table, ids, lo, hi)
        counters.append(stats)
        return pos, slots, -1, 0

    gpu_kernels.probe = unsynced
    try:
        yield
    finally:
        gpu_kernels.probe = real
    if counters and bool(torch.stack(counters).any()):
        raise SystemExit("bench_gpu: a batch timed without the probe's sync had new or bad ids; its figures are void")


def host_cache(args, device: torch.device) -> dict:
    """Issue 34's training steps: the table in host memory under a GPU cache, against fbgemm's TBE
    with the whole table in GPU memory; fbgemm's own managed-caching TBE for reference."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                        SplitTableBatchedEmbeddingBagsCodegen)

    rows, batch = args.host_rows, args.batches[0]
    results: dict = {**versions(device), "dim": args.dim, "pooling": args.pooling, "host_rows": rows, "batch": batch}
    _, baseline, universe = build(rows, args.dim, seed=0, device=device)
    dense = torch.arange(rows, device=device)  # (fbgemm's tables take the rows' indices)
    cases = [(percent, "lru") for percent in CACHE_PERCENTS] + [(50, "lfu")]
    for percent, policy in tqdm(cases, desc="bench_gpu host cache"):
        cache_rows = rows * percent // 100
        tbe = kvzch_table(universe, args.dim, device_cache=DeviceCache(rows=cache_rows, policy=policy))
        case = f"host_{percent}_zipf" + ("" if policy == "lru" else f"_{policy}")
        r = compare(tbe, baseline, universe, batch, args.pooling, "zipf", args.steps, args.warmup)
        results.update({f"ours_ms_{case}": r["ours_ms"], f"tbe_ms_{case}": r["tbe_ms"], f"ratio_{case}": r["ratio"],
                        f"cache_rows_{case}": cache_rows,
                        f"hit_rate_{case}": hit_rate(tbe, universe, batch, args.pooling, 5)})
        if (percent, policy) == (50, "lru"):  # the most a lookup without the probe's sync could gain
            with probes_unsynced():
                r = compare(tbe, baseline, universe, batch, args.pooling, "zipf", args.steps, args.warmup)
            results.update({"unsynced_ms_host_50_zipf": r["ours_ms"], "ratio_unsynced_host_50_zipf": r["ratio"]})
        for mapped in (False, True) if (percent, policy) == (50, "lru") else (False,):
            cached = SplitTableBatchedEmbeddingBagsCodegen(
                [(rows, args.dim, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)],
                cache_load_factor=percent / 100, cache_algorithm=CacheAlgorithm[policy.upper()],
                uvm_host_mapped=mapped, optimizer=baseline.optimizer, learning_rate=0.01, device=device)
            r = compare(cached, baseline, dense, batch, args.pooling, "zipf", args.steps, args.warmup)
            key = case.replace("host_", "fbgemm_cache_") + ("_host_mapped" if mapped else "")
            results.update({f"{key}_ms": r["ours_ms"], f"ratio_{key}": r["ratio"]})
            if args.profile and (percent, policy, mapped) == (50, "lru", False):  # what ours adds to fbgemm's cache
                profile(tbe, cached, universe, batch, args.pooling, "zipf", args.profile, "fbgemm managed-caching TBE")
            del cached
        del tbe
        torch.cuda.empty_cache()
    results["targets"] = {f"{key} >= {HOST_TARGET}": results[key] >= HOST_TARGET
                          for key in ("ratio_host_50_zipf", "ratio_host_50_zipf_lfu")}
    return results


def larger_plan(gpu_bytes: int, host_bytes: int, row_bytes: int) -> tuple[int, int]:
    """(rows, GPU bytes to hold back) for ``--larger-than-gpu``: rows of 1.1 times the GPU, or,
    where the host cannot hold that, of what it can spare (at least an H100's 80 GB) with the GPU
    held back to 1/1.1 of them. The host keeps a quarter over the rows for the rest of the process."""
    rows = int(1.1 * gpu_bytes) // row_bytes
    spare = int(host_bytes / HOST_MARGIN) // row_bytes
    if rows <= spare:
        return rows, 0
    if spare * row_bytes <= H100_BYTES:
        raise SystemExit(f"bench_gpu --larger-than-gpu: {host_bytes / 2**30:.0f} GiB of host memory available "
                         f"cannot hold more than an H100's {H100_BYTES / 1e9:.0f} GB of rows with room to spare; run "
                         "it on a machine with more host memory")
    return spare, gpu_bytes - int(spare * row_bytes / 1.1)


def larger_than_gpu(args, device: torch.device) -> dict:
    """Issue 34: a table larger than the GPU memory the run may use trains, its rows in host memory."""
    gpu = torch.cuda.get_device_properties(device).total_memory
    meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    rows, held = larger_plan(gpu, int(meminfo["MemAvailable"].split()[0]) * 1024, args.dim * 4)
    ballast = torch.empty(held, dtype=torch.uint8, device=device)  # (cudaMalloc: the memory is taken now)
    print(f"--larger-than-gpu: {rows:,} rows ({rows * args.dim * 4 / 2**30:.1f} GiB), {held / 2**30:.1f} GiB of "
          f"the GPU's {gpu / 2**30:.1f} GiB held back", flush=True)
    t0 = time.perf_counter()
    ids = torch.arange(rows, device=device) * 7 + 1  # (distinct ids, spread over the table's id space)
    tbe = kvzch_table(ids, args.dim, device_cache=DeviceCache(rows=rows // 10))
    del ids
    sync(device)
    built = time.perf_counter() - t0
    print(f"--larger-than-gpu: built in {built:.0f} s", flush=True)
    gen = torch.Generator(device=device).manual_seed(3)
    batch, pooling = args.batches[0], args.pooling
    offsets = torch.arange(0, batch * pooling + 1, pooling, dtype=torch.long, device=device)
    torch.cuda.reset_peak_memory_stats(device)

    def step():  # skewed ids: u^4 of uniform u puts most draws on a small share of the rows
        u = torch.rand(batch * pooling, generator=gen, device=device)
        out = tbe((u.pow(4) * (rows - 1)).long() * 7 + 1, offsets)
        out.backward(torch.ones_like(out))

    ms = device_ms(step, device, args.steps, args.warmup)
    free, total = torch.cuda.mem_get_info(device)
    return {**versions(device), "dim": args.dim, "batch": batch, "pooling": pooling, "larger_rows": rows,
            "larger_host_bytes": tbe.store.weights.numel() * tbe.store.weights.element_size(),
            "gpu_bytes": gpu, "larger_gpu_ballast_bytes": ballast.numel(), "larger_gpu_left_bytes": gpu - held,
            "larger_build_s": built, "larger_step_ms": ms,
            "larger_gpu_peak_bytes": torch.cuda.max_memory_allocated(device) - held,
            "larger_gpu_used_bytes": total - free - held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--profile", type=Path, help="torch.profiler tables of the first case (--host-cache: "
                        "of the 50%% lru cache against fbgemm's managed-caching TBE)")
    parser.add_argument("--dmp", action="store_true", help="the DMP comparison, under torchrun")
    parser.add_argument("--host-cache", action="store_true", help="a table in host memory under a GPU cache")
    parser.add_argument("--host-rows", type=int, default=10_000_000)
    parser.add_argument("--larger-than-gpu", action="store_true", help="a table larger than the GPU's memory")
    parser.add_argument("--rows", nargs="+", type=int, default=[1_000_000, 10_000_000])
    parser.add_argument("--batches", nargs="+", type=int, default=[65_536, 8_192])
    parser.add_argument("--batch", type=int, default=65_536, help="--dmp: the global batch")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    # A run on the CPU checks the script (small --rows), not the GPU: bench_lookup measures CPUs.
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device; on CPU, bench_lookup compares with fbgemm's CPU TBE")
    if args.dmp:
        result = dmp_comparison(args, device.type)
        if result is None:  # not rank 0
            return
        results = {**versions(device), **{f"{k}_dmp": v for k, v in result.items()}}
    elif args.host_cache or args.larger_than_gpu:
        if device.type != "cuda":
            raise SystemExit("--host-cache needs a CUDA device: fbgemm's managed-caching TBE runs on CUDA only")
        results = host_cache(args, device) if args.host_cache else larger_than_gpu(args, device)
    else:
        results = single_gpu(args, device)
        if args.plot:
            plot(results, args.plot)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    for key, value in results.items():
        if key.startswith(("ratio_", "ours_ms", "tbe_ms", "find", "hit_rate", "larger_")):
            print(f"  {key:32s} {value:,.3f}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
