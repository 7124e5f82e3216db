"""docs/gpu.md's figures from one GPU run of ``tools/gpu/check.sh``, never retyped.

    python tools/gpu/report.py RUN      # RUN: the folder check.sh wrote (its OUT)

Training (a run with ``gpu.json``): copies the run's ``gpu.json``, ``gpu.png``, ``gpu_dmp.json``,
``gpu_profile.txt`` and ``job.json`` (as ``gpu_job.json``) into ``docs/benchmarks/``, writes
``docs/benchmarks/gpu_run.json`` (when, which commit, on which GPU, and the tests each JUnit
file counted) and rewrites the table between the ``gpu:table`` markers of ``docs/gpu.md``.
Serving (a run with ``gpu_serving.json``): the same for ``gpu_serving.json`` / ``.png`` and
``serving.xml``, into ``gpu_serving_run.json`` and between the ``gpu:serving`` markers.
Host cache (a run with ``gpu_host.json``, issue 34): the same for it (and its profile,
``gpu_host_profile.txt``) and the kernel tests, into ``gpu_host_run.json`` and between the
``gpu:host`` markers; a table larger than the GPU (``gpu_larger.json``) between the
``gpu:larger`` markers; the touch's comparison (``gpu_touch.json``) between ``gpu:touch``.
Tests (a run with JUnit files): each file's counts, with the run's date, commit and GPU, replace
that file's entry in ``docs/benchmarks/gpu_tests.json``, and the ``gpu:tests`` markers list the
latest GPU result of every group. A run of some stages (``KVZCH_CHECK_STAGES``) renews the parts
it has, and leaves the others; a rehearsal's (``KVZCH_CHECK_REHEARSE=1``) is refused.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks"
PAGE = ROOT / "docs" / "gpu.md"
MARKERS = ("<!-- gpu:table:start -->", "<!-- gpu:table:end -->")
SERVING_MARKERS = ("<!-- gpu:serving:start -->", "<!-- gpu:serving:end -->")
HOST_MARKERS = ("<!-- gpu:host:start -->", "<!-- gpu:host:end -->")
LARGER_MARKERS = ("<!-- gpu:larger:start -->", "<!-- gpu:larger:end -->")
TOUCH_MARKERS = ("<!-- gpu:touch:start -->", "<!-- gpu:touch:end -->")
TESTS_MARKERS = ("<!-- gpu:tests:start -->", "<!-- gpu:tests:end -->")
REHEARSAL = "the CPU (a rehearsal)"
HOST_TARGET = 0.5  # ratio_host_50_zipf (issue 34)
SERVING_TESTS = "serving"  # (its JUnit file's stem: the serving part's, not the training part's)
COPIES = {"gpu.json": "gpu.json", "gpu.png": "gpu.png", "gpu_dmp.json": "gpu_dmp.json", "job.json": "gpu_job.json",
          "gpu_profile.txt": "gpu_profile.txt"}
TARGET, TARGET_BATCH = 0.7, 65_536


def tests(run: Path, serving: bool = False) -> dict:
    """Per JUnit file of the training part (``serving``: of the serving part): tests, failures,
    errors, skipped."""
    out = {}
    for path in sorted(p for p in run.glob("*.xml") if (p.stem == SERVING_TESTS) == serving):
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        out[path.stem] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return out


def run_record(run: Path, serving: bool = False, bench_file: str = "gpu.json") -> dict:
    date, commit = _when(run)
    bench = json.loads((run / ("gpu_serving.json" if serving else bench_file)).read_text())
    return {"date": date, "commit": commit, "device": bench["device"], "tests": tests(run, serving)}


def _when(run: Path) -> tuple[str, str]:
    first = (run / "gpu.log").read_text().splitlines()[0]  # "== GPU check <date>, <commit>"
    return re.match(r"== GPU check (\S+), (\S+)", first).groups()


def gpu_name(log: str) -> str:
    """The GPU a run's log names (the line under nvidia-smi's CSV header), or the CPU of a rehearsal."""
    lines = log.splitlines()
    for header, row in zip(lines, lines[1:]):
        if header.startswith("name, memory.total"):
            return row.split(",")[0].strip()
    return REHEARSAL


def latest_tests(latest: dict, run: Path) -> dict:
    """``latest`` (JUnit file -> counts and run) with this run's files replacing their entries."""
    date, commit = _when(run)
    device = gpu_name((run / "gpu.log").read_text())
    found = {**tests(run), **tests(run, serving=True)}
    return {**latest, **{name: {**t, "date": date, "commit": commit, "device": device} for name, t in found.items()}}


def latest_table(latest: dict) -> str:
    lines = ["The latest GPU run of each group of tests (`tools/gpu/check.sh`, `docs/benchmarks/gpu_tests.json`):", "",
             "| tests | passed | failed | run |", "|---|---|---|---|"]
    for name, t in sorted(latest.items()):
        lines.append(f"| {name} | {_counts(t)} | {t['date']}, {t['commit']}, {t['device']} |")
    return "\n".join(lines)


def touch_line(run: Path, bench: dict) -> str:
    """``tools/gpu/touch_ab.py``'s comparison of the header touch's counts, in one sentence."""
    date, commit = _when(run)
    ms = {name: " / ".join(f"{bench[f'touch_ms_{name}_{d}']:.3f}" for d in ("uniform", "zipf"))
          for name in ("sorted", "relaxed", "fenced")}
    return (f"One run, {date}, commit {commit}, on one {bench['device']}: the header touch alone of "
            f"{bench['occurrences']:,} occurrences over {bench['rows']:,} rows, ms uniform / Zipf(1.05) "
            f"({bench['distinct_uniform']:,} / {bench['distinct_zipf']:,} distinct rows): runs counted once a block "
            f"(sorted) {ms['sorted']}, one relaxed atomic per occurrence {ms['relaxed']}, one fenced atomic per "
            f"occurrence (the count before 38e3595) {ms['fenced']} (`tools/gpu/touch_ab.py`, "
            "`docs/benchmarks/gpu_touch.json`).")


def test_rows(record: dict) -> list[str]:
    lines = ["| tests | passed | failed |", "|---|---|---|"]
    for name, t in record["tests"].items():
        lines.append(f"| {name} | {_counts(t)} |")
    return lines


def _counts(t: dict) -> str:
    """A JUnit file's counts as table cells: passed of all, failed."""
    return f"{t['tests'] - t['failures'] - t['errors'] - t['skipped']} of {t['tests']} | {t['failures'] + t['errors']}"


def table(record: dict, bench: dict, dmp: dict, job: dict) -> str:
    versions = ", ".join(f"{k} {bench[k]}" for k in ("torch", "cuda", "fbgemm_gpu", "torchrec"))
    lines = [f"One run of `tools/gpu/check.sh`, {record['date']}, commit {record['commit']}, on one "
             f"{record['device']} ({versions}); id map backend `{bench['map_backend']}`.", "",
             *test_rows(record)]
    lines += ["", f"Training step against fbgemm's CUDA TBE ({bench['dim']} fp32, pooling {bench['pooling']}; "
              f"target: `ratio_*_b{TARGET_BATCH}_*` >= {TARGET}):", "",
              "| case | ours ms | TBE ms | ratio | find_or_insert + touch ms | find ms |", "|---|---|---|---|---|---|"]
    for key in (k for k in bench if k.startswith("ratio_")):
        case = key[len("ratio_"):]
        short = bench[key] < TARGET and f"_b{TARGET_BATCH}_" in key
        lines.append(f"| `{case}` | {bench[f'ours_ms_{case}']:.2f} | {bench[f'tbe_ms_{case}']:.2f} | "
                     f"{'**' if short else ''}{bench[key]:.3f}{'**' if short else ''} | "
                     f"{bench[f'map_ms_{case}']:.2f} | {_ms(bench.get(f'find_ms_{case}'))} |")
    lines += ["", f"Id map on the GPU at load factor {bench['map_load_factor']:.2f} ({bench['map_keys']:,} keys): "
              f"`find` {bench['find_keys_per_s'] / 1e9:.2f} G keys/s, `find_or_insert` (20% new) "
              f"{bench['find_or_insert_keys_per_s'] / 1e9:.2f} G keys/s.", "",
              f"DMP on {dmp['ranks_dmp']} rank (global batch {dmp['global_batch_dmp']:,}): ours "
              f"{dmp['ours_ms_dmp']:.2f} ms, a FUSED table {dmp['tbe_ms_dmp']:.2f} ms, `ratio_dmp` {dmp['ratio_dmp']:.3f}.", "",
              f"The job (`quickstart`, NCCL): {job['trained_steps']} steps with a checkpoint at "
              f"{job['checkpoint_step']}; predictions after resuming from it "]
    resumes = [f"on the GPU {'equal' if r['equal'] else 'NOT equal'} (largest difference {r['probe_max_abs_diff']:.2g})"
               if name == "resumed" else
               f"on {r['world_size']} CPU processes {'equal' if r['equal'] else 'NOT equal'} (largest difference "
               f"{r['probe_max_abs_diff']:.2g}, tolerance {r['tolerance']:g})" for name, r in
               ((n, job[n]) for n in ("resumed", "resumed_cpu"))]
    lines[-1] += " and ".join(resumes) + "."
    return "\n".join(lines)


def profile_line(text: str, case: str) -> str:
    """One sentence from ``gpu_profile.txt`` (bench_gpu profiles its first ``case``): device and
    host time per step, ours and TBE's."""
    sections = [part for part in text.split("## ") if part.strip()]
    per_step = []
    for part in sections:
        title = part.splitlines()[0]
        steps = int(re.search(r"(\d+) training steps", title).group(1))
        cpu = float(re.search(r"Self CPU time total: ([\d.]+)ms", part).group(1)) / steps
        gpu = float(re.search(r"Self CUDA time total: ([\d.]+)ms", part).group(1)) / steps
        per_step.append((cpu, gpu))
    (ours_cpu, ours_gpu), (tbe_cpu, tbe_gpu) = per_step
    return (f"Under torch's profiler (`gpu_profile.txt`, case `{case}`) "
            f"a step keeps the GPU busy {ours_gpu:.2f} ms for ours and {tbe_gpu:.2f} ms for TBE "
            f"(kernels alone: a ratio of {tbe_gpu / ours_gpu:.2f}); the host spends {ours_cpu:.2f} ms "
            f"and {tbe_cpu:.2f} ms on it (profiled, so slower than unprofiled).")


def serving_table(record: dict, bench: dict) -> str:
    """The serving part: its tests, and served lookups against TorchRec's quantized EBC."""
    versions = ", ".join(f"{k} {bench[k]}" for k in ("torch", "fbgemm_gpu", "torchrec"))
    lines = [f"One run of `tools/gpu/check.sh`, {record['date']}, commit {record['commit']}, on one "
             f"{record['device']} ({versions}).", "", *test_rows(record), "",
             f"Served lookups, both tables in GPU memory ({bench['rows']:,} rows x {bench['dim']}, batch "
             f"{bench['batch']} x pooling {bench['pooling']}, Zipf({bench['zipf_alpha']})), against TorchRec's "
             "quantized EBC on the same GPU (`benchmarks/bench_serving.py --device cuda --lookups-only`, "
             "`docs/benchmarks/gpu_serving.json`; each call timed to the end of its GPU work):", "",
             "| dtype | ours ms | TorchRec ms | `qps_ratio` | ours: id -> row ms | TorchRec's TBE alone ms |",
             "|---|---|---|---|---|---|"]
    for d in ("int8", "fp16"):
        lines.append(f"| {d} | {bench[f'ours_ms_{d}']:.3f} | {bench[f'torchrec_ms_{d}']:.3f} | "
                     f"{bench[f'qps_ratio_{d}']:.3f} | {bench[f'slots_ms_{d}']:.3f} | {bench[f'torchrec_tbe_ms_{d}']:.3f} |")
    batches = sorted({int(k.rsplit("_b", 1)[1]) for k in bench if k.startswith("p99_ms_")})
    lines += ["", "Latency of one `ServedTable.lookup`, p50 / p99 ms:", "",
              "| dtype | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    for d in ("fp32", "fp16", "int8"):
        lines.append(f"| {d} | " + " | ".join(f"{bench[f'p50_ms_{d}_b{b}']:.3f} / {bench[f'p99_ms_{d}_b{b}']:.3f}"
                                              for b in batches) + " |")
    return "\n".join(lines)


def host_table(record: dict, bench: dict) -> str:
    """The host-cache part: the kernel tests (the device cache's among them) and the training
    steps of a table in host memory under a GPU cache."""
    versions = ", ".join(f"{k} {bench[k]}" for k in ("torch", "cuda", "fbgemm_gpu", "torchrec"))
    lines = [f"One run, {record['date']}, commit {record['commit']}, on one {record['device']} ({versions}).", "",
             *test_rows(record), "",
             f"Training step of a table of {bench['host_rows']:,} rows x {bench['dim']} fp32 (row-wise Adagrad) in "
             f"host memory under a GPU cache, against fbgemm's TBE with the table in GPU memory (Zipf(1.05), batch "
             f"{bench['batch']:,} x pooling {bench['pooling']}; `benchmarks/bench_gpu.py --host-cache`, "
             f"`docs/benchmarks/gpu_host.json`; issue 34's target: `ratio_host_50_zipf` >= {HOST_TARGET}):", "",
             "| cache | policy | ours ms | TBE ms | ratio | hit rate | fbgemm's managed-caching TBE, ratio |",
             "|---|---|---|---|---|---|---|"]
    for key in (k for k in bench if k.startswith("ratio_host_")):
        case = key[len("ratio_"):]
        percent, policy = case.split("_")[1], case.split("_zipf")[1].lstrip("_") or "lru"
        short = percent == "50" and bench[key] < HOST_TARGET
        reference = bench[f"ratio_{case.replace('host_', 'fbgemm_cache_')}"]
        lines.append(f"| {percent}% | {policy} | {bench[f'ours_ms_{case}']:.2f} | {bench[f'tbe_ms_{case}']:.2f} | "
                     f"{'**' if short else ''}{bench[key]:.3f}{'**' if short else ''} | {bench[f'hit_rate_{case}']:.3f} | "
                     f"{reference:.3f} |")
    unsynced = bench.get("ratio_unsynced_host_50_zipf")
    if unsynced is not None:
        lines += ["", f"Ours at 50% (lru) with the id map's probe left unread by the host (batches of known ids "
                      f"only): {bench['unsynced_ms_host_50_zipf']:.2f} ms, ratio {unsynced:.3f}; the most a lookup "
                      "without that host sync could gain."]
    mapped = bench.get("ratio_fbgemm_cache_50_zipf_host_mapped")
    if mapped is not None:
        lines += ["", f"fbgemm's cache over pinned host memory (`uvm_host_mapped`) instead of managed memory: "
                      f"ratio {mapped:.3f} at 50% (lru)."]
    return "\n".join(lines)


def larger_line(record: dict, bench: dict) -> str:
    """The table larger than the GPU: that it trained, and what it took."""
    gib = 2**30
    host, left, held = bench["larger_host_bytes"], bench["larger_gpu_left_bytes"], bench["larger_gpu_ballast_bytes"]
    room = (f"the GPU's {left / gib:.1f} GiB" if not held else
            f"the {left / gib:.1f} GiB of GPU memory left to it: this machine's host memory cannot hold 1.1 times "
            f"the GPU's {bench['gpu_bytes'] / gib:.1f} GiB, so the run first held {held / gib:.1f} GiB of it back")
    return (f"One run, {record['date']}, commit {record['commit']}, on one {record['device']}: a table of "
            f"{bench['larger_rows']:,} rows x {bench['dim']} fp32 ({host / gib:.1f} GiB of weights in host memory, "
            f"{host / left:.2f} times {room}) under a GPU cache of a tenth of its rows trained at "
            f"{bench['larger_step_ms']:.1f} ms a step (batch {bench['batch']:,} x pooling {bench['pooling']}, skewed "
            f"ids; inserting the rows took {bench['larger_build_s']:.0f} s). "
            f"{'Besides what was held back, t' if held else 'T'}orch's allocator peaked at "
            f"{bench['larger_gpu_peak_bytes'] / gib:.1f} GiB and the device had "
            f"{bench['larger_gpu_used_bytes'] / gib:.1f} GiB in use at the end (`bench_gpu.py --larger-than-gpu`, "
            "`docs/benchmarks/gpu_larger.json`).")


def _ms(value) -> str:
    return "" if value is None else f"{value:.2f}"


def _rewrite(markers: tuple[str, str], text: str) -> None:
    page = PAGE.read_text()
    start, end = (page.index(m) for m in markers)
    PAGE.write_text(page[: start + len(markers[0])] + "\n" + text + "\n" + page[end:])
    print(text)


def main() -> int:
    run = Path(sys.argv[1])
    if gpu_name((run / "gpu.log").read_text()) == REHEARSAL:
        print(f"{run}: a rehearsal on the CPU (KVZCH_CHECK_REHEARSE=1); its figures are not a GPU's, nothing recorded")
        return 1
    DOCS.mkdir(parents=True, exist_ok=True)
    if (run / "gpu.json").exists():
        for source, target in COPIES.items():
            shutil.copyfile(run / source, DOCS / target)
        record = run_record(run)
        (DOCS / "gpu_run.json").write_text(json.dumps(record, indent=1) + "\n")
        load = {name: json.loads((DOCS / name).read_text()) for name in ("gpu.json", "gpu_dmp.json", "gpu_job.json")}
        text = table(record, load["gpu.json"], load["gpu_dmp.json"], load["gpu_job.json"])
        if (DOCS / "gpu_profile.txt").exists():
            text += "\n\n" + profile_line((DOCS / "gpu_profile.txt").read_text(),
                                         next(k for k in load["gpu.json"] if k.startswith("ratio_"))[len("ratio_"):])
        _rewrite(MARKERS, text)
    if (run / "gpu_serving.json").exists():
        for name in ("gpu_serving.json", "gpu_serving.png"):
            shutil.copyfile(run / name, DOCS / name)
        record = run_record(run, serving=True)
        (DOCS / "gpu_serving_run.json").write_text(json.dumps(record, indent=1) + "\n")
        _rewrite(SERVING_MARKERS, serving_table(record, json.loads((run / "gpu_serving.json").read_text())))
    if (run / "gpu_larger.json").exists():
        shutil.copyfile(run / "gpu_larger.json", DOCS / "gpu_larger.json")
        record = run_record(run, bench_file="gpu_larger.json")
        _rewrite(LARGER_MARKERS, larger_line(record, json.loads((run / "gpu_larger.json").read_text())))
    if (run / "gpu_touch.json").exists():
        shutil.copyfile(run / "gpu_touch.json", DOCS / "gpu_touch.json")
        _rewrite(TOUCH_MARKERS, touch_line(run, json.loads((run / "gpu_touch.json").read_text())))
    if any(run.glob("*.xml")):
        record = DOCS / "gpu_tests.json"
        latest = latest_tests(json.loads(record.read_text()) if record.exists() else {}, run)
        record.write_text(json.dumps(latest, indent=1) + "\n")
        _rewrite(TESTS_MARKERS, latest_table(latest))
    if (run / "gpu_host.json").exists():
        for name in ("gpu_host.json", "gpu_host_profile.txt"):
            if (run / name).exists():
                shutil.copyfile(run / name, DOCS / name)
            else:  # (an older run's profile would not match these figures)
                (DOCS / name).unlink(missing_ok=True)
        record = run_record(run, bench_file="gpu_host.json")
        (DOCS / "gpu_host_run.json").write_text(json.dumps(record, indent=1) + "\n")
        _rewrite(HOST_MARKERS, host_table(record, json.loads((run / "gpu_host.json").read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
