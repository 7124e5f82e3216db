"""The disk tier's storage engine, chosen by measurement (issue 32; docs/design.md, "The disk tier").

    apt-get install librocksdb-dev liblmdb-dev        # the candidates' libraries (Debian's)
    python benchmarks/bench_disk_engines.py --json docs/benchmarks/disk_engines.json --doc docs/design.md

Builds ``disk_engines/engines.cpp`` against RocksDB and LMDB and runs it once per engine, in a
fresh process each, on ``--rows`` rows of ``--row-bytes`` (532: 128 fp32 weights, a rowwise
Adagrad state and the metaheader, the issue's row) in ``--dir`` (default: beside this checkout,
on the disk the tier would use). The engines, as the tier would use them:

* ``rocksdb``: upstream's choice, linked (no WAL, direct reads and compaction I/O, a 32 MiB
  block cache, bloom filters, 4 KiB blocks, no compression: the rows are random floats);
* ``lmdb``: a B+tree read through its memory map (no sync, no read-ahead);
* ``slots``: a fixed-slot row file: a row lives at its slot (the id map's), whole rows per 4 KiB
  page, read and rewritten in place with ``O_DIRECT`` (no log, no compaction).

Phases (each engine): load every row in batches of ``--batch``; the files' cached pages
dropped (``posix_fadvise(DONTNEED)`` after a sync, LMDB's map closed first), so reads reach
the disk; ``--batches`` batches of ``--batch`` distinct ids read, uniform, then Zipf(1.05) over
the rows; the same number of batches of existing rows rewritten (a cache's write-back), until
flushes and compactions are done. JSON keys per engine: ``load_rows_per_s``,
``read_uniform_rows_per_s``, ``read_zipf_rows_per_s``, ``update_rows_per_s``,
``update_written_over_raw`` (bytes written to storage per byte of rows rewritten: the write
amplification), ``load_written_over_raw``, ``disk_over_raw`` (space per byte of rows).
``--doc PAGE`` rewrites the table between the page's ``disk-engines`` markers from the JSON
(``--from-json`` does only that, from an earlier run's JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _docs import replace_between

HERE = Path(__file__).resolve().parent
ENGINES = ("rocksdb", "lmdb", "slots")


def build(out: Path) -> Path:
    binary = out / "engines"
    subprocess.run(["g++", "-O2", "-std=c++17", "-fopenmp", str(HERE / "disk_engines" / "engines.cpp"), "-o",
                    str(binary), "-lrocksdb", "-llmdb"], check=True)
    return binary


MARKERS = ("<!-- disk-engines:start -->", "<!-- disk-engines:end -->")
COLUMNS = (("read_uniform_rows_per_s", "reads, uniform (rows/s)", "{:,.0f}"),
           ("read_zipf_rows_per_s", "reads, Zipf (rows/s)", "{:,.0f}"),
           ("update_rows_per_s", "rewrites (rows/s)", "{:,.0f}"),
           ("update_written_over_raw", "rewrite bytes written / row bytes", "{:.2f}"),
           ("load_rows_per_s", "load (rows/s)", "{:,.0f}"),
           ("load_written_over_raw", "load bytes written / row bytes", "{:.2f}"),
           ("disk_over_raw", "space / row bytes", "{:.2f}"))


def table(results: dict, date: str) -> str:
    lines = [f"`benchmarks/bench_disk_engines.py`, {date}: {results['rows']:,} rows of {results['row_bytes']} bytes, "
             f"batches of {results['batch']:,} distinct ids, on this machine's disk ({results['cpus']} CPUs, load "
             f"average {results['load_average'][0]:.2f} at the start); reads start with the files' pages dropped.", "",
             "| engine | I/O threads | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for run in results["runs"]:
        lines.append(f"| {run['engine']} | {run['threads']} | "
                     + " | ".join(fmt.format(run[key]) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--row-bytes", type=int, default=532)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--threads", type=int, nargs="+", default=[8, 32],
                        help="I/O threads (the queue depth a tier would keep)")
    parser.add_argument("--dir", type=Path, default=HERE.parent / ".disk_engines")
    parser.add_argument("--doc", type=Path, help="a page with disk-engines markers to put the table in")
    parser.add_argument("--from-json", action="store_true", help="only rewrite --doc from --json")
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(args.json.read_text())
        replace_between(args.doc, MARKERS, table(results, results["date"]))
        return
    results = {"date": time.strftime("%Y-%m-%d"), "rows": args.rows, "row_bytes": args.row_bytes, "batch": args.batch, "batches": args.batches,
               "cpus": os.cpu_count(), "load_average": list(os.getloadavg()), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for threads in args.threads:
            for engine in ENGINES:
                done = subprocess.run([str(binary), engine, str(args.dir / engine), str(args.rows), str(args.row_bytes),
                                       str(args.batch), str(args.batches), str(threads)],
                                      capture_output=True, text=True, check=True)
                run = json.loads(done.stdout.strip().splitlines()[-1])
                results["runs"].append(run)
                print(json.dumps(run))
                subprocess.run(["rm", "-rf", str(args.dir / engine)], check=True)
    results["load_average_end"] = list(os.getloadavg())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    if args.doc:
        replace_between(args.doc, MARKERS, table(results, results["date"]))


if __name__ == "__main__":
    main()
