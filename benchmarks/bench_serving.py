"""Served KV-ZCH lookups against TorchRec's quantized EmbeddingBagCollection: speed, latency, memory.

    python benchmarks/bench_serving.py --json results/bench_serving.json     # and results/bench_serving.png
    python benchmarks/bench_serving.py --json /tmp/serving.json --rows 100000 --rows-memory 200000 \\
        --steps 50 --reps 200                                     # a quick check of the script
    python benchmarks/bench_serving.py --json OUT/gpu_serving.json --device cuda --lookups-only   # GPU

``--device cuda`` runs the lookups (throughput and latency, below) with both tables in GPU
memory, each call timed to the end of its GPU work (``torch.cuda.synchronize``);
``--lookups-only`` leaves out the memory, replica and update parts (CPU-side work), as the GPU
check does (``tools/gpu/check.sh``, into ``docs/benchmarks/gpu_serving.json``).

Throughput (``qps_ratio_<dtype>``, int8 and fp16): one table of ``--rows`` (1M) rows x 128,
random normal weights, held twice with the same rows. Ours: a ``ServedTable`` of that dtype
holding the row of id ``universe[i]`` (ids drawn from [0, 2^63 - 1)) for dense row i, looked up
with ``ServedTable.lookup(global ids, offsets)``. TorchRec's: the quantized
``torchrec.quant.embedding_modules.EmbeddingBagCollection`` made by ``from_float`` from a float
``EmbeddingBagCollection`` holding the rows (qconfig weight dtype qint8 or float16, fp32 out),
called on a ``KeyedJaggedTensor`` of the row indices (one feature, lengths and offsets built
beforehand): the whole module (KJT permute and split, its TBE's bounds check, fbgemm's
``int_nbit_split_embedding_codegen_lookup_function``). Both quantize with fbgemm's
``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``, so their rows are the same bytes (checked
once, ``check_rows_identical_<dtype>``, over the bytes before the padding to 16 bytes that
TorchRec's rows have, and ours on CUDA)
and their outputs on one batch are compared (``check_max_abs_diff_<dtype>``; where the rows
differed, each output against its own decoded rows pooled instead, and ``check_note_<dtype>``
says so). Batches of 512 bags x pooling 20 (offsets ``arange * 20``), Zipf(1.05) ranks over the
rows (``bench_lookup.batches``; rank k is dense row k, so the hot rows lead both tables),
alternating ours and TorchRec's call by call after warm-up (which goes first alternates too),
in one process; ``ours_ms_<dtype>`` and ``torchrec_ms_<dtype>`` are the medians and the ratio
is ``torchrec_ms / ours_ms`` (throughput, ours / TorchRec's). Where the time goes, timed in a
second interleaved pass on the same batches: ``slots_ms_<dtype>`` (``ServedTable.slots``, the
id -> row step alone) and ``torchrec_tbe_ms_<dtype>`` (TorchRec's TBE module alone, without the
KJT handling: about what fbgemm's op costs ours).

Latency (``p50_ms_<dtype>_b<batch>``, ``p99_ms_<dtype>_b<batch>``): single ``ServedTable.lookup``
calls on the same 1M rows for fp32, fp16 and int8, batches of 1, 64 and 512 bags x pooling 20,
Zipf ids, ``--reps`` calls each (a quarter of that for 512), each call timed on its own.

Memory, in a fresh process each (glibc's mmap threshold fixed, so RSS is what is in use): an
int8 ``ServedTable`` of ``--rows-memory`` (10M) rows x 128 filled by ``upsert`` of chunks of 1M
random distinct ids with random weights, ``served_bytes_per_row_over_raw_int8_10m`` =
``table.nbytes / (rows * (128 + 4))`` (the raw quantized row: D bytes and an fp16 scale and
bias), ``served_rss_bytes_per_row_over_raw_int8_10m`` the process's RSS growth over the same;
grown with no reservation, and ``..._reserved`` with ``capacity=rows`` given up front.

Replicas and live updates, in a fresh process (``_serving_updates.py`` says how):
``build_vs_training_load_ratio`` and ``build_peak_extra_mib`` (a replica built from a 4M-row
checkpoint against a trainer loading it), ``max_abs_diff_fp32`` / ``max_abs_diff_int8`` (with
``max_abs_diff_int8_bound``) against the trained model's outputs, ``delta_visible_s_1pct_10m``
and ``p99_ms_during_swap`` over ``p99_ms_steady`` (a follower of a 10M-row table taking a delta
of 1% of its rows while requests run).

Timings use torch's intra-op threads (``--threads``; default torch's, one per core). A batch of
512 bags is over the ops' parallel grain, so each parallel region waits for all the threads:
where another process holds a core, a region costs a scheduler slice (about 8 ms on 2 cores),
and a lookup of ours has two (the id probe and fbgemm's op) to TorchRec's one. The load average
at the start and the end (``load_average``, ``load_average_end``) is recorded; a run beside
other work measures that, not the lookups.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from _common import fixed_mmap_threshold, percentiles, print_targets, same_huge_pages_for_the_baseline, zipf_ranks
from bench_lookup import batches
from torchrec_kvzch.serving import ServedTable, decode
from torchrec_kvzch.serving.table import row_bytes

TARGET_QPS = 0.8
TARGET_BYTES = 1.3
QPS_DTYPES = ("int8", "fp16")
LATENCY_DTYPES = ("fp32", "fp16", "int8")
LATENCY_BATCHES = (1, 64, 512)
QCONFIG_DTYPES = {"int8": torch.qint8, "fp16": torch.float16, "fp32": torch.float32}
ZIPF = 1.05
ID_SPACE = 2**63 - 1


# -- the two tables ------------------------------------------------------------------------------
def float_ebc(rows: int, dim: int, seed: int, device: torch.device):
    """TorchRec's float EmbeddingBagCollection of one table (feature "f") with random normal rows
    (drawn on the CPU: the same rows on every device)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows,
                                                            feature_names=["f"])], device=device)
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.copy_(torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)))
    return ebc


def quant_ebc(ebc, dtype: str):
    """TorchRec's quantized EmbeddingBagCollection of ``ebc``'s rows in ``dtype``, fp32 out."""
    from torch.ao.quantization import PlaceholderObserver, QConfig
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    ebc.qconfig = QConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
                          weight=PlaceholderObserver.with_args(dtype=QCONFIG_DTYPES[dtype]))
    return QuantEmbeddingBagCollection.from_float(ebc)


def global_ids(rows: int, seed: int) -> torch.Tensor:
    """``rows`` distinct random ids from [0, 2^63 - 1), in random order."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ID_SPACE, (int(rows * 1.01) + 16,), generator=gen).unique()[:rows]
    return ids[torch.randperm(ids.numel(), generator=gen)]


def served(weights: torch.Tensor, universe: torch.Tensor, dtype: str) -> ServedTable:
    """A served table in which id ``universe[i]`` holds row ``weights[i]`` (on their device)."""
    table = ServedTable("bench", weights.shape[1], dtype=dtype, pooling="sum", capacity=universe.numel(),
                        device=weights.device)
    for at in torch.arange(universe.numel()).split(1 << 20):
        table.upsert(universe[at], weights[at])
    return table


def tbe_rows(qebc) -> torch.Tensor:
    """The rows of TorchRec's quantized table as its TBE holds them, ``[scale | bias | D bytes]``
    for int8 (its TBE hands the pair and the values apart; its padding to 16 bytes left out)."""
    values, scale_bias = qebc._emb_modules[0].split_embedding_weights()[0]
    return values if scale_bias is None else torch.cat([scale_bias, values], dim=1)


def check(table: ServedTable, qebc, universe: torch.Tensor, local: torch.Tensor, offsets: torch.Tensor,
          kjt) -> dict:
    """Whether both tables hold the same bytes, and how far apart their outputs on one batch are."""
    width = row_bytes(table.dim, table.dtype)  # (without the padding to 16 bytes on CUDA)
    ours_rows = table.rows[table.slots(universe)][:, :width]
    theirs = tbe_rows(qebc)[:, :width]
    identical = bool(torch.equal(ours_rows, theirs))
    ours, base = table.lookup(universe[local], offsets), qebc(kjt).values()
    tag = table.dtype
    if identical:
        return {f"check_rows_identical_{tag}": True, f"check_max_abs_diff_{tag}": (ours - base).abs().max().item()}
    # Different quantizers: each output against its own rows decoded and pooled.
    bags = torch.arange(offsets.numel() - 1, device=offsets.device).repeat_interleave(offsets.diff())
    diff = 0.0
    for out, rows in ((ours, ours_rows), (base, theirs)):
        reference = torch.zeros_like(out).index_add_(0, bags, decode(rows[local], tag))
        diff = max(diff, (out - reference).abs().max().item())
    return {f"check_rows_identical_{tag}": False, f"check_max_abs_diff_{tag}": diff,
            f"check_note_{tag}": "the two quantizers' rows differ: each output is compared with its "
                                 "own decoded rows, pooled"}


# -- timing --------------------------------------------------------------------------------------
def clock(device: torch.device) -> float:
    """``perf_counter`` once the device's queued work is done (CUDA: synchronize)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def compare(table: ServedTable, qebc, inputs: list, offsets: torch.Tensor, warmup: int) -> dict:
    """Ours and TorchRec's lookups alternating call by call (which goes first alternates too),
    then the pieces (id -> row mapping, TorchRec's TBE alone) interleaved on the same batches."""
    ours, base = [], []
    dev = table.device
    for i, (local, ids, kjt) in enumerate(inputs):
        pair = ((lambda: table.lookup(ids, offsets), ours), (lambda: qebc(kjt).values(), base))
        for fn, times in pair if i % 2 else pair[::-1]:
            t0 = clock(dev)
            fn()
            if i >= warmup:
                times.append((clock(dev) - t0) * 1e3)
    tbe = qebc._emb_modules[0]
    slots_t, tbe_t = [], []
    for i, (local, ids, _) in enumerate(inputs):
        for fn, times in ((lambda: table.slots(ids), slots_t), (lambda: tbe.forward(local, offsets), tbe_t)):
            t0 = clock(dev)
            fn()
            if i >= warmup:
                times.append((clock(dev) - t0) * 1e3)
    ours_ms, base_ms = statistics.median(ours), statistics.median(base)
    tag = table.dtype
    return {f"ours_ms_{tag}": ours_ms, f"torchrec_ms_{tag}": base_ms, f"qps_ratio_{tag}": base_ms / ours_ms,
            f"slots_ms_{tag}": statistics.median(slots_t), f"torchrec_tbe_ms_{tag}": statistics.median(tbe_t)}


def latencies(table: ServedTable, universe: torch.Tensor, batch: int, pooling: int, reps: int,
              warmup: int = 20) -> dict:
    """p50 and p99 of single lookups of ``batch`` bags of Zipf ids, each call timed on its own."""
    n = batch * pooling
    gen = torch.Generator().manual_seed(100 + batch)
    dev = table.device
    ids = universe[zipf_ranks(universe.numel(), (warmup + reps) * n, ZIPF, gen).to(dev)].split(n)
    offsets = torch.arange(0, n + 1, pooling, device=dev)
    times = []
    for i, chunk in enumerate(ids):
        t0 = clock(dev)
        table.lookup(chunk, offsets)
        if i >= warmup:
            times.append((clock(dev) - t0) * 1e3)
    p50, p99 = percentiles(times, (0.5, 0.99))
    tag = f"{table.dtype}_b{batch}"
    return {f"p50_ms_{tag}": p50, f"p99_ms_{tag}": p99}


# -- memory --------------------------------------------------------------------------------------
def memory_worker(rows: int, dim: int, reserve: bool, chunk: int = 1 << 20) -> dict:
    """An int8 served table of ``rows`` random ids, filled by upserts of ``chunk`` ids: its
    ``nbytes`` and the process's RSS growth, per row and over the raw quantized row."""
    gen = torch.Generator().manual_seed(1)
    ids = global_ids(rows, seed=1)  # (made before the first RSS reading: the benchmark's, not the table's)
    process = psutil.Process()  # (RSS as the other benchmarks read it)
    before = process.memory_info().rss
    table = ServedTable("memory", dim, dtype="int8", capacity=rows if reserve else 0)
    for part in ids.split(chunk):
        table.upsert(part, torch.randn(part.numel(), dim, generator=gen))
    grown = process.memory_info().rss - before
    raw = rows * (dim + 4)
    assert len(table) == rows
    return {"rows": rows, "nbytes": table.nbytes, "rss_growth": grown,
            "nbytes_over_raw": table.nbytes / raw, "rss_over_raw": grown / raw}


def updates_in_fresh_process(args) -> dict:
    """``_serving_updates.run``: replicas built from checkpoints, and a follower (one gloo rank)."""
    cmd = [sys.executable, __file__, "--json", "-", "--updates-worker", "--dim", str(args.dim),
           "--rows-build", str(args.rows_build), "--rows-follow", str(args.rows_follow),
           "--build-repeats", str(args.build_repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the updates worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def memory_in_fresh_process(args, reserve: bool) -> dict:
    cmd = [sys.executable, __file__, "--json", "-", "--memory-worker", "reserved" if reserve else "grown",
           "--dim", str(args.dim), "--rows-memory", str(args.rows_memory)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


# -- report --------------------------------------------------------------------------------------
def versions(device: torch.device) -> dict:
    import fbgemm_gpu
    import torchrec

    return {"torch": torch.__version__, "fbgemm_gpu": fbgemm_gpu.__version__, "torchrec": torchrec.__version__,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1, 2]})
    left.bar(range(len(QPS_DTYPES)), [results[f"qps_ratio_{d}"] for d in QPS_DTYPES], color="tab:blue")
    left.axhline(TARGET_QPS, color="k", ls="--", lw=1, label=f"target {TARGET_QPS}")
    left.set_xticks(range(len(QPS_DTYPES)), QPS_DTYPES)
    left.set(ylabel="throughput / TorchRec quant EBC",
             title=f"lookups, batch {results['batch']} x {results['pooling']}")
    left.legend(fontsize=8)
    width = 0.8 / len(LATENCY_DTYPES)
    for k, dtype in enumerate(LATENCY_DTYPES):
        xs = [i + (k - (len(LATENCY_DTYPES) - 1) / 2) * width for i in range(len(LATENCY_BATCHES))]
        right.bar(xs, [results[f"p99_ms_{dtype}_b{b}"] for b in LATENCY_BATCHES], width, label=f"{dtype} p99")
        right.scatter(xs, [results[f"p50_ms_{dtype}_b{b}"] for b in LATENCY_BATCHES], color="k", marker="_",
                      s=80, zorder=3, label="p50" if k == 0 else None)
    right.set_xticks(range(len(LATENCY_BATCHES)), [f"batch {b}" for b in LATENCY_BATCHES])
    right.set_yscale("log")
    right.set(ylabel="ServedTable.lookup latency (ms)", title=f"{results['rows']:,} rows x {results['dim']}, "
                                                               f"pooling {results['pooling']}, Zipf({ZIPF})")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="the PNG (default: the JSON's path with .png)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--steps", type=int, default=500, help="timed calls of each, throughput")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2000,
                        help="timed calls per latency case (a quarter of that for batch 512)")
    parser.add_argument("--rows-memory", type=int, default=10_000_000, help="rows of the memory table")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--rows-build", type=int, default=4_000_000, help="rows of the checkpoint a replica is built from")
    parser.add_argument("--rows-follow", type=int, default=10_000_000, help="rows of the table a follower serves")
    parser.add_argument("--build-repeats", type=int, default=3, help="builds and training loads, alternating")
    parser.add_argument("--device", default="cpu", help="where the lookups run: cpu or cuda")
    parser.add_argument("--lookups-only", action="store_true", help="only throughput and latency (no memory, "
                                                                    "replica or update parts)")
    parser.add_argument("--memory-worker", choices=["grown", "reserved"], help=argparse.SUPPRESS)
    parser.add_argument("--updates-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.updates_worker:
        from _serving_updates import run

        print(json.dumps(run(args.rows_build, args.rows_follow, args.dim, args.build_repeats)))
        return
    if args.memory_worker:
        fixed_mmap_threshold()  # freed temporaries go back to the OS: RSS is what is in use
        print(json.dumps(memory_worker(args.rows_memory, args.dim, args.memory_worker == "reserved")))
        return
    same_huge_pages_for_the_baseline()
    if args.threads:
        torch.set_num_threads(args.threads)
    from torchrec import KeyedJaggedTensor

    device = torch.device(args.device)
    results: dict = {**versions(device), "rows": args.rows, "dim": args.dim, "batch": args.batch,
                     "pooling": args.pooling, "zipf_alpha": ZIPF, "steps": args.steps, "reps": args.reps}
    progress = tqdm(total=(0 if args.lookups_only else 3) + len(LATENCY_DTYPES), desc="bench_serving", unit="stage")
    memory = {}
    if not args.lookups_only:
        results.update(updates_in_fresh_process(args), rows_memory=args.rows_memory)
        progress.update(1)
        memory = {kind: memory_in_fresh_process(args, kind == "reserved") for kind in ("grown", "reserved")}
        progress.update(2)
        results.update({"served_bytes_per_row_over_raw_int8_10m": memory["grown"]["nbytes_over_raw"],
                        "served_rss_bytes_per_row_over_raw_int8_10m": memory["grown"]["rss_over_raw"],
                        "served_bytes_per_row_over_raw_int8_10m_reserved": memory["reserved"]["nbytes_over_raw"],
                        "served_rss_bytes_per_row_over_raw_int8_10m_reserved": memory["reserved"]["rss_over_raw"],
                        "memory": memory})

    ebc = float_ebc(args.rows, args.dim, seed=0, device=device)
    weights = ebc.embedding_bags["t"].weight.detach()
    universe = global_ids(args.rows, seed=0).to(device)
    offsets = torch.arange(0, args.batch * args.pooling + 1, args.pooling, device=device)
    lengths = torch.full((args.batch,), args.pooling, device=device)
    inputs = [(local, universe[local], KeyedJaggedTensor(keys=["f"], values=local, lengths=lengths, offsets=offsets))
              for local in (b.to(device) for b in batches(args.rows, args.batch, args.pooling, "zipf",
                                                          args.warmup + args.steps, seed=7))]
    for dtype in ("int8", "fp16", "fp32"):
        table = served(weights, universe, dtype)
        if dtype in QPS_DTYPES:
            qebc = quant_ebc(ebc, dtype)
            results.update(check(table, qebc, universe, inputs[0][0], offsets, inputs[0][2]))
            results.update(compare(table, qebc, inputs, offsets, args.warmup))
            del qebc
        for batch in LATENCY_BATCHES:
            reps = args.reps if batch < 512 else max(1, args.reps // 4)
            results.update(latencies(table, universe, batch, args.pooling, reps))
        del table
        progress.update(1)
    progress.close()

    results["load_average_end"] = list(os.getloadavg())
    results["targets"] = {f"qps_ratio_{d} >= {TARGET_QPS}": results[f"qps_ratio_{d}"] >= TARGET_QPS for d in QPS_DTYPES}
    if not args.lookups_only:
        results["targets"].update(targets_beyond_lookups(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.plot or args.json.with_suffix(".png"))
    print(f"\nserved lookups on {results['device']}, {args.rows:,} rows x {args.dim}, batch {args.batch} x pooling "
          f"{args.pooling}, Zipf({ZIPF}); load average {results['load_average'][0]:.2f} on {results['cpus']} CPUs")
    for d in QPS_DTYPES:
        r = {key[: -len(d) - 1]: value for key, value in results.items() if key.endswith(f"_{d}")}
        print(f"  {d:5s} ours {r['ours_ms']:7.3f} ms   TorchRec quant EBC {r['torchrec_ms']:7.3f} ms   "
              f"throughput ratio {r['qps_ratio']:.3f}   (slots {r['slots_ms']:.3f} ms, TorchRec's TBE alone "
              f"{r['torchrec_tbe_ms']:.3f} ms; max |diff| {r['check_max_abs_diff']:.2g})")
    for d in LATENCY_DTYPES:
        print(f"  {d:5s} " + "   ".join(f"b{b}: p50 {results[f'p50_ms_{d}_b{b}']:.3f} "
                                        f"p99 {results[f'p99_ms_{d}_b{b}']:.3f} ms" for b in LATENCY_BATCHES))
    if not args.lookups_only:
        print_beyond_lookups(results, memory)
    print_targets(results["targets"])
    print(f"wrote {args.json}")


def targets_beyond_lookups(results: dict) -> dict:
    return {
        f"served_bytes_per_row_over_raw_int8_10m <= {TARGET_BYTES}":
            results["served_bytes_per_row_over_raw_int8_10m"] <= TARGET_BYTES,
        "build_vs_training_load_ratio <= 1.0": results["build_vs_training_load_ratio"] <= 1.0,
        "build_peak_extra_mib <= 256": results["build_peak_extra_mib"] <= 256,
        "delta_visible_s_1pct_10m <= 2": results["delta_visible_s_1pct_10m"] <= 2,
        "p99_ms_during_swap / p99_ms_steady <= 2": results["p99_during_swap_over_steady"] <= 2,
        "max_abs_diff_fp32 == 0": results["max_abs_diff_fp32"] == 0,
        "max_abs_diff_int8 <= max_abs_diff_int8_bound": results["max_abs_diff_int8"] <= results["max_abs_diff_int8_bound"],
    }


def print_beyond_lookups(results: dict, memory: dict) -> None:
    print(f"  replica built from {results['rows_build']:,} rows: {results['build_s']:.2f} s vs training load "
          f"{results['training_load_s']:.2f} s (ratio {results['build_vs_training_load_ratio']:.3f}), "
          f"peak extra {results['build_peak_extra_mib']:.0f} MiB; max |diff| fp32 {results['max_abs_diff_fp32']:.3g}, "
          f"int8 {results['max_abs_diff_int8']:.3g} (bound {results['max_abs_diff_int8_bound']:.3g})")
    print(f"  delta of {results['delta_rows']:,} of {results['rows_follow']:,} rows visible after "
          f"{results['delta_visible_s_1pct_10m']:.2f} s; p99 {results['p99_ms_steady']:.3f} ms steady, "
          f"{results['p99_ms_during_swap']:.3f} ms during the swap")
    for kind, m in memory.items():
        print(f"  memory, {m['rows']:,} int8 rows, {kind}: nbytes {m['nbytes_over_raw']:.3f} x raw, "
              f"RSS growth {m['rss_over_raw']:.3f} x raw")


if __name__ == "__main__":
    main()
