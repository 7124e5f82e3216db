"""Every benchmark, one after the other, and a table of their targets.

    .venv/bin/python benchmarks/run_all.py            # or: make bench
    .venv/bin/python benchmarks/run_all.py --only scaling planner

Each benchmark runs as its own process (they measure memory and re-exec for huge pages) and
writes ``results/<name>.json`` (and a PNG where a plot helps); this script then writes
``results/summary.json`` with every target, its measured value and whether it was met, the wall
time of each, and how quiet the machine was (load before the run, CPU steal during it). After
a whole run (not ``--only``) it regenerates the table in ``docs/benchmarks.md`` from it (between
the ``bench:table`` markers) and copies the run's JSON and plots to ``docs/benchmarks/``, so the figures
there are one dated run's, never retyped; ``--no-docs`` (old name ``--no-readme``) leaves both
alone. A target is named ``<JSON key> <comparison>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _docs import replace_between

HERE = Path(__file__).resolve().parent
BENCHMARKS = {  # name -> (script, its JSON, arguments); the order runs the quick ones first
    "store": ("bench_store.py", "bench_store.json", []),
    "planner": ("bench_planner.py", "bench_planner.json", []),
    "lookup": ("bench_lookup.py", "bench_lookup.json", []),
    "scaling": ("bench_scaling.py", "bench_scaling.json", []),
    "checkpoint": ("bench_checkpoint.py", "bench_checkpoint.json", []),
    "soak_eviction": ("soak_eviction.py", "soak_eviction.json", []),
    "soak_rank_budget": ("soak_eviction.py", "soak_rank_budget.json", ["--scope", "rank"]),
    "admission": ("bench_admission.py", "bench_admission.json", []),
    "incremental": ("bench_incremental.py", "bench_incremental.json", []),
    "serving": ("bench_serving.py", "bench_serving.json", []),
    "disk": ("bench_disk.py", "bench_disk.json", []),
}


PAGE = HERE.parent / "docs" / "benchmarks.md"  # the page holding the table, between the markers
DOCS = HERE.parent / "docs" / "benchmarks"  # the JSON of the run the table shows
MARKERS = ("<!-- bench:table:start -->", "<!-- bench:table:end -->")


def cpu_times() -> tuple[int, int]:
    """(all, steal) jiffies of the machine so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields), fields[7] if len(fields) > 7 else 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def measured(results: dict, target: str):
    """The value a target tests: its first word names a key of the benchmark's JSON."""
    value = results.get(target.split()[0])
    return value if isinstance(value, (int, float)) else None


def table(summary: dict) -> str:
    machine = summary["machine"]
    lines = [f"One `make bench` run, {machine['date']}, {machine['cpus']} CPUs ({machine['cpu']}); "
             f"load average {machine['load_before']:.2f} before it, CPU steal {machine['steal_pct']:.1f}% "
             f"during it; {machine['minutes']:.1f} minutes.", "",
             "| benchmark | target | measured | met |", "|---|---|---|---|"]
    for name, entry in summary["benchmarks"].items():
        if entry["exit_code"]:
            lines.append(f"| {name} | (failed, exit code {entry['exit_code']}) | | |")
        for target, ok in entry.get("targets", {}).items():
            value = entry.get("values", {}).get(target)
            shown = "" if value is None else f"{value:.3g}"
            lines.append(f"| {name} | `{target}` | {shown} | {'yes' if ok else '**no**'} |")
    return "\n".join(lines)


def update_docs(text: str, results: Path) -> None:
    """The table of docs/benchmarks.md, and in docs/benchmarks/ the run's JSON it was made from
    and its plots."""
    replace_between(PAGE, MARKERS, text)
    DOCS.mkdir(parents=True, exist_ok=True)
    for path in [*results.glob("*.json"), *results.glob("*.png")]:
        if not path.name.startswith("demo"):
            shutil.copyfile(path, DOCS / path.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run just these")
    parser.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true",
                        help="leave docs/benchmarks.md's table and docs/benchmarks/*.json alone "
                             "(--no-readme: the old name)")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    summary, failed = {}, []
    load_before, (all0, steal0), t_start = os.getloadavg()[0], cpu_times(), time.perf_counter()
    for name in args.only or BENCHMARKS:
        script, json_name, extra = BENCHMARKS[name]
        out = args.results / json_name
        print(f"\n== {name} ==", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, str(HERE / script), "--json", str(out), *extra])
        entry = {"json": str(out), "seconds": time.perf_counter() - t0, "exit_code": done.returncode}
        if done.returncode == 0:
            results = json.loads(out.read_text())
            entry["targets"] = results.get("targets", {})
            entry["values"] = {t: measured(results, t) for t in entry["targets"]}
        else:
            failed.append(name)
        summary[name] = entry
    all1, steal1 = cpu_times()
    machine = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
               "cpu": cpu_model(), "load_before": load_before,
               "steal_pct": 100 * (steal1 - steal0) / max(1, all1 - all0),
               "minutes": (time.perf_counter() - t_start) / 60}
    summary = {"machine": machine, "benchmarks": summary}
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1))
    text = table(summary)
    print("\n" + text)
    if not args.no_docs and not args.only:  # the docs show whole runs only
        update_docs(text, args.results)
    print(f"\nwrote {args.results / 'summary.json'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
