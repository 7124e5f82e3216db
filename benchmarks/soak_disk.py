"""Soak: a table larger than this machine's memory grows by training over a disk tier,
checkpoints and resumes (issue 32; docs/disk.md). Not in ``make bench``: it writes about 50 GB.

    python benchmarks/soak_disk.py --json docs/benchmarks/soak_disk.json --doc docs/disk.md   # and its .png
    python benchmarks/soak_disk.py --json /tmp/soak.json --rows 2000000 --cache-mib 256   # a quick check

One table (128 fp32 with rowwise Adagrad, 532 bytes a row) over a disk tier with a ``--cache-mib``
(4 GiB) DRAM cache grows to ``--rows`` (49M: 25.7 GB, more than the machine's 25.3) in one
process: each training step (forward, backward, fused update) looks up a batch of 8192 x 20 ids,
60% never seen before, 35% drawn log-uniformly from the rows so far (the oldest the hottest) and
5% uniformly (most of them on disk). The process then saves the table with DCP and ends (its
tier's file goes with it). A second process loads the checkpoint into a new table over a new
tier (checksums verified, the same rows back) and trains ``--resume-steps`` more steps. Both
sample their RSS all along: ``peak_rss_over_cache_budget_<phase>`` is a phase's peak RSS less the
fixed overhead (the process before the table, the tier's index and the cache's id map, as in
``bench_disk.py``; while saving, also the save's index of the rows, ``SNAPSHOT_BYTES`` a row:
their ids, DRAM slots and tier positions in id order), over the cache budget; ``table_gb``, ``memory_gb``, the phases' seconds and
the disk's bytes are in the JSON, the RSS and rows over time in the PNG. ``--doc PAGE``
rewrites the text between the page's ``soak-disk`` markers from the JSON (``--from-json``: only
that, from an earlier run's JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from _common import fixed_mmap_threshold, print_targets
from _docs import replace_between
from bench_checkpoint import RssSampler
from bench_disk import SNAPSHOT_BYTES, dcp_load, dcp_save, table
from torchrec_kvzch.table.layout import RowLayout

HERE = Path(__file__).resolve().parent
MARKERS = ("<!-- soak-disk:start -->", "<!-- soak-disk:end -->")
TARGET_RSS = 1.1
BATCH, POOLING = 8192, 20
FRESH, HOT = 0.60, 0.35  # of a batch's ids: never seen; log-uniform over the rows so far (the rest: uniform)
SPREAD = 0x5DEECE66D  # odd: k -> k * SPREAD mod 2^40 is one-to-one, so the k-th new id is new


def ids_of(k: torch.Tensor) -> torch.Tensor:
    """The id of the ``k``-th row inserted: spread over 2^40, every bucket alike."""
    return (k * SPREAD) & (2**40 - 1)


def batch(inserted: int, most: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """A step's ids (new ones while the table has fewer than ``most`` rows), and the rows
    inserted after it."""
    n = BATCH * POOLING
    fresh = min(n if inserted == 0 else int(n * FRESH), max(0, most - inserted))
    hot = (n - fresh) * HOT / (1 - FRESH) if inserted else 0
    new = torch.arange(inserted, inserted + fresh)
    old = [torch.empty(0, dtype=torch.long)]
    if inserted:
        old.append((inserted ** torch.rand(int(hot), generator=gen, dtype=torch.float64)).long() - 1)
        old.append(torch.randint(0, inserted, (n - fresh - int(hot),), generator=gen))
    k = torch.cat([new, *old])
    return ids_of(k[torch.randperm(n, generator=gen)]), inserted + fresh


def step(tbe, ids: torch.Tensor) -> None:
    y = tbe(ids, torch.arange(0, ids.numel() + 1, POOLING))
    y.backward(torch.ones_like(y))


def trace_point(trace: list, t0: float, tbe, phase: str) -> None:
    store = tbe.store
    trace.append({"t": time.perf_counter() - t0, "phase": phase, "rss_mib": psutil.Process().memory_info().rss / 2**20,
                  "rows": len(store) + len(store.cache), **store.cache.counters})


def overhead(tbe, base_rss: int) -> dict:
    store = tbe.store
    return {"base_rss_mib": base_rss / 2**20, "tier_index_mib": store.cache.tier.nbytes / 2**20,
            "id_map_mib": store.id_map.nbytes / 2**20}


def grow(args) -> dict:
    """The first process: grow the table by training, then save it."""
    gen = torch.Generator().manual_seed(0)
    base_rss, trace, out = psutil.Process().memory_info().rss, [], {}
    with RssSampler(0.2) as rss:
        t0 = rss._t0
        tbe = table(args, "tier")
        inserted, steps = 0, 0
        with tqdm(total=args.rows, desc="grow", unit="row", unit_scale=True) as bar:
            while inserted < args.rows:
                ids, after = batch(inserted, args.rows, gen)
                step(tbe, ids)
                bar.update(after - inserted)
                inserted, steps = after, steps + 1
                if steps % 10 == 0:
                    trace_point(trace, t0, tbe, "grow")
        store = tbe.store
        rows = len(store) + len(store.cache)
        out.update(grow_s=time.perf_counter() - t0, grow_steps=steps, rows=rows, disk_rows=len(store.cache),
                   disk_file_gib=store.cache.tier.disk_bytes / 2**30, **overhead(tbe, base_rss),
                   grow_peak_rss_mib=max(r for _, r in rss.samples) / 2**20,
                   grow_counters=store.cache.counters)
        trace_point(trace, t0, tbe, "grow")
        out["save_s"] = dcp_save(tbe, args.dir / "ckpt")
        trace_point(trace, t0, tbe, "save")
        out["checkpoint_gib"] = sum(f.stat().st_size for f in (args.dir / "ckpt").iterdir()) / 2**30
        store.cache.close()
    out.update(save_peak_rss_mib=max(r for t, r in rss.samples if t >= trace[-2]["t"]) / 2**20, trace=trace)
    return out


def resume(args) -> dict:
    """The second process: load the checkpoint into a new tier, then train on."""
    gen = torch.Generator().manual_seed(1)
    base_rss, trace, out = psutil.Process().memory_info().rss, [], {}
    with RssSampler(0.2) as rss:
        t0 = rss._t0
        tbe = table(args, "tier-resumed")
        out["load_s"] = dcp_load(tbe, args.dir / "ckpt", args.saved_rows)
        trace_point(trace, t0, tbe, "load")
        out["load_peak_rss_mib"] = max(r for _, r in rss.samples) / 2**20
        inserted = args.saved_rows
        for _ in tqdm(range(args.resume_steps), desc="resume"):
            ids, inserted = batch(inserted, inserted + BATCH * POOLING, gen)
            step(tbe, ids)
            trace_point(trace, t0, tbe, "train")
        store = tbe.store
        out.update(overhead(tbe, base_rss), rows_after=len(store) + len(store.cache),
                   resume_peak_rss_mib=max(r for t, r in rss.samples if t >= trace[0]["t"]) / 2**20)
        store.cache.close()
    out["trace"] = trace
    return out


def in_fresh_process(args, phase: str, **extra) -> dict:
    cmd = [sys.executable, __file__, "--json", "-", "--phase", phase, "--rows", str(args.rows),
           "--cache-mib", str(args.cache_mib), "--dir", str(args.dir), "--resume-steps", str(args.resume_steps),
           *[a for k, v in extra.items() for a in (f"--{k.replace('_', '-')}", str(v))]]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"the {phase} process failed ({done.returncode}); its output is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    offset = 0.0
    for name in ("grow", "resume"):
        trace = results[name]["trace"]
        t = [offset + p["t"] / 60 for p in trace]
        left.plot(t, [p["rss_mib"] / 1024 for p in trace], label=f"RSS ({name} process)")
        right.plot(t, [p["rows"] / 1e6 for p in trace], label=f"rows ({name} process)")
        offset = t[-1]
        budget = (results["cache_mib"] + results[name]["fixed_mib"]) / 1024
        left.axhline(budget, color="red", ls="--", lw=1)
    left.axhline(results["memory_gb"] * 1e9 / 2**30, color="k", lw=1, label="the machine's memory")
    left.set(xlabel="minutes", ylabel="GiB", title=f"RSS; dashed: fixed overhead + {results['cache_mib']} MiB cache",
             ylim=(0, None))
    left.legend(fontsize=8)
    right.axhline(results["rows"] / 1e6, color="k", lw=1, ls=":")
    right.set(xlabel="minutes", ylabel="rows (M)", title=f"table: {results['table_gb']:.1f} GB")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def doc_text(results: dict, png: str) -> str:
    """The run's figures for a page (``--doc``)."""
    g, r = results["grow"], results["resume"]
    lines = [f"One run, {results['date']}, {results['cpus']} CPUs, load average {results['load_average'][0]:.2f} "
             f"before it (`benchmarks/soak_disk.py`): {g['rows']:,} rows of {results['table_gb'] / g['rows'] * 1e9:.0f} "
             f"bytes, {results['table_gb']:.1f} GB, on a machine of {results['memory_gb']:.1f} GB, under a "
             f"{results['cache_mib']} MiB cache.", "",
             "| phase | seconds | peak RSS (MiB) | fixed overhead (MiB) | (peak - fixed) / cache |", "|---|---|---|---|---|"]
    for label, key, part, seconds in (("grow by training", "grow", g, g["grow_s"]), ("save (DCP)", "save", g, g["save_s"]),
                                      ("load (a new process, a new tier)", "load", r, r["load_s"]),
                                      (f"train {results['resume_steps']} steps on", "resume", r, None)):
        fixed = f"{part['fixed_mib']:,.0f}" + (f" + {results['snapshot_index_mib']:,.0f}" if key == "save" else "")
        lines.append(f"| {label} | {'' if seconds is None else f'{seconds:.0f}'} | {part[f'{key}_peak_rss_mib']:,.0f} | "
                     f"{fixed} | {results[f'peak_rss_over_cache_budget_{key}']:.2f} |")
    lines += ["", f"{g['grow_steps']} steps grew it; the tier's file reached {g['disk_file_gib']:.1f} GiB and the "
              f"checkpoint {g['checkpoint_gib']:.1f} GiB. The fixed overhead is the process before the table, the "
              f"tier's index and the cache's id map; while saving, also the save's index of the rows "
              f"({SNAPSHOT_BYTES} bytes a row: ids, DRAM slots, tier positions).", "", f"![RSS and rows over the soak]({png})"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="the PNG (default: the JSON's path with .png)")
    parser.add_argument("--rows", type=int, default=49_000_000)
    parser.add_argument("--cache-mib", type=int, default=4096)
    parser.add_argument("--resume-steps", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=HERE.parent / ".disk_soak", help="a directory on local disk")
    parser.add_argument("--doc", type=Path, help="a page with soak-disk markers to put the figures in")
    parser.add_argument("--from-json", action="store_true", help="only rewrite --doc from --json")
    parser.add_argument("--phase", choices=["grow", "resume"], help=argparse.SUPPRESS)
    parser.add_argument("--saved-rows", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dim, args.worker, args.policy = 128, "disk", "lru"  # (what bench_disk.table reads)
    png = args.plot or args.json.with_suffix(".png")
    if args.from_json:
        replace_between(args.doc, MARKERS, doc_text(json.loads(args.json.read_text()),
                                                    os.path.relpath(png, args.doc.parent)))
        return
    if args.phase:
        fixed_mmap_threshold()
        print(json.dumps(grow(args) if args.phase == "grow" else resume(args)))
        return
    row_bytes = RowLayout.for_table(__import__("bench_disk").params(args)).stored_bytes
    results: dict = {"date": datetime.date.today().isoformat(), "rows": args.rows, "cache_mib": args.cache_mib,
                     "resume_steps": args.resume_steps, "table_gb": args.rows * row_bytes / 1e9,
                     "memory_gb": psutil.virtual_memory().total / 1e9, "batch": BATCH, "pooling": POOLING,
                     "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
                     "disk_free_gb_before": shutil.disk_usage(args.dir.parent).free / 1e9}
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        results["grow"] = in_fresh_process(args, "grow")
        results["resume"] = in_fresh_process(args, "resume", saved_rows=results["grow"]["rows"])
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    results["snapshot_index_mib"] = results["grow"]["rows"] * SNAPSHOT_BYTES / 2**20
    for name, peaks in (("grow", ("grow", "save")), ("resume", ("load", "resume"))):
        part = results[name]
        part["fixed_mib"] = part["base_rss_mib"] + part["tier_index_mib"] + part["id_map_mib"]
        for phase in peaks:
            fixed = part["fixed_mib"] + (results["snapshot_index_mib"] if phase == "save" else 0)
            results[f"peak_rss_over_cache_budget_{phase}"] = (part[f"{phase}_peak_rss_mib"] - fixed) / args.cache_mib
    results["targets"] = {f"peak_rss_over_cache_budget_{p} <= {TARGET_RSS}": results[f"peak_rss_over_cache_budget_{p}"] <= TARGET_RSS
                          for p in ("grow", "save", "load", "resume")}
    results["targets"]["table_gb > memory_gb"] = results["table_gb"] > results["memory_gb"]
    results["load_average_end"] = list(os.getloadavg())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, png)
    if args.doc:
        replace_between(args.doc, MARKERS, doc_text(results, os.path.relpath(png, args.doc.parent)))
    g, r = results["grow"], results["resume"]
    print(f"\n{g['rows']:,} rows ({results['table_gb']:.1f} GB; memory {results['memory_gb']:.1f} GB), "
          f"cache {args.cache_mib} MiB: grown in {g['grow_s'] / 60:.1f} min ({g['grow_steps']} steps), saved in "
          f"{g['save_s']:.0f} s ({g['checkpoint_gib']:.1f} GiB), loaded in {r['load_s']:.0f} s")
    for p in ("grow", "save", "load", "resume"):
        print(f"  {p:7s} peak RSS over the cache budget (fixed overhead apart): "
              f"{results[f'peak_rss_over_cache_budget_{p}']:.2f}")
    print_targets(results["targets"])
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
