"""Helpers shared by the benchmarks: timing, huge pages for the baseline, id distributions."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch


def percentiles(values: list[float], qs: tuple[float, ...]) -> list[float]:
    """The ``qs`` quantiles of ``values`` (linear interpolation, as ``torch.quantile``); NaN
    for none. One definition for every benchmark's p50 and p99."""
    if not values:
        return [float("nan")] * len(qs)
    q = torch.tensor(values, dtype=torch.float64).quantile(torch.tensor(qs, dtype=torch.float64))
    return q.tolist()


def median_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in ms, after ``warmup`` untimed calls."""
    return interleaved_median_ms([fn], reps, warmup)[0]


def interleaved_median_ms(fns, reps: int, warmup: int = 2) -> list[float]:
    """Median wall time in ms of each of ``fns``, called in turn, so that a ratio of two of them
    compares calls made under the same machine conditions (memory speed on a shared host drifts
    by 10-20% over minutes)."""
    times = [[] for _ in fns]
    for rep in range(warmup + reps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            if rep >= warmup:
                out.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def in_fresh_processes(script: str, args: list[str], n: int) -> dict:
    """Runs ``script --one <json> *args`` in ``n`` fresh processes, one after the other, and
    returns the median of each figure they report, and each figure's values as ``<key>_runs``.
    On a VM, how fast a process's memory is can differ by 15% from one process to the next, and
    our random reads suffer from slow memory more than TBE's row reads: one process is one draw,
    so a ratio is the median of several (as pyperf spreads a benchmark over worker processes)."""
    import json
    import tempfile
    from pathlib import Path

    from tqdm import tqdm

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in tqdm(range(n), desc=f"{Path(script).stem}: fresh processes"):
            out = Path(tmp) / f"{i}.json"
            subprocess.run([sys.executable, script, "--one", str(out), *args], check=True)
            runs.append(json.loads(out.read_text()))
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return {**medians, **{f"{key}_runs": [run[key] for run in runs] for key in runs[0]}}


def same_huge_pages_for_the_baseline() -> None:
    """Our store madvises its arrays to huge pages; give fbgemm's TBE weights the same by setting
    torch's switch, which torch reads at its first allocation, hence the re-exec."""
    if os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Re-exec with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``), unless one is set.
    By default glibc raises the threshold (up to 32 MiB) whenever a large block is freed, after
    which per-step temporaries of that size come from the heap and, freed, stay in the process:
    RSS then measures the allocator's history, not the memory in use."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(nbytes))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def zipf_ranks(n: int, size: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """``size`` draws of ranks in ``[0, n)`` with P(rank k) proportional to 1 / (k + 1)^alpha."""
    weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-alpha)
    return torch.multinomial(weights, size, replacement=True, generator=gen)


def torchrun(script: str, nproc: int, args: list[str]) -> None:
    """Run ``script`` on ``nproc`` local ranks (gloo), each with its share of the cores."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(29500 + os.getpid() % 1000),
           script, *args]
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS=threads))


def print_targets(targets: dict[str, bool]) -> None:
    for name, ok in targets.items():
        print(f"  [{'ok' if ok else 'MISS'}] {name}")


def write_results(out: dict, path) -> None:
    """``out`` (figures and their ``targets``) as JSON at ``path``, then shown."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "targets"}, indent=1))
    print_targets(out["targets"])
