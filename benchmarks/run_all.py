"""Every benchmark, one after the other, and a table of their targets.

    .venv/bin/python benchmarks/run_all.py            # or: make bench
    .venv/bin/python benchmarks/run_all.py --only scaling planner

Each benchmark runs as its own process (they measure memory and re-exec for huge pages) and
writes ``results/<name>.json`` (and a PNG where a plot helps); this script then writes
``results/summary.json`` with every target and whether it was met, and the wall time of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = {  # name -> (script, its JSON, arguments); the order runs the quick ones first
    "store": ("bench_store.py", "bench_store.json", []),
    "planner": ("bench_planner.py", "bench_planner.json", []),
    "lookup": ("bench_lookup.py", "bench_lookup.json", []),
    "scaling": ("bench_scaling.py", "bench_scaling.json", []),
    "checkpoint": ("bench_checkpoint.py", "bench_checkpoint.json", []),
    "soak_eviction": ("soak_eviction.py", "soak_eviction.json", []),
    "soak_rank_budget": ("soak_eviction.py", "soak_rank_budget.json", ["--scope", "rank"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run just these")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    summary, failed = {}, []
    for name in args.only or BENCHMARKS:
        script, json_name, extra = BENCHMARKS[name]
        out = args.results / json_name
        print(f"\n== {name} ==", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, str(HERE / script), "--json", str(out), *extra])
        entry = {"json": str(out), "seconds": time.perf_counter() - t0, "exit_code": done.returncode}
        if done.returncode == 0:
            entry["targets"] = json.loads(out.read_text()).get("targets", {})
        else:
            failed.append(name)
        summary[name] = entry
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n| benchmark | target | met |\n|---|---|---|")
    for name, entry in summary.items():
        if entry["exit_code"]:
            print(f"| {name} | (failed, exit code {entry['exit_code']}) | |")
        for target, ok in entry.get("targets", {}).items():
            print(f"| {name} | {target} | {'yes' if ok else '**no**'} |")
    print(f"\nwrote {args.results / 'summary.json'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
