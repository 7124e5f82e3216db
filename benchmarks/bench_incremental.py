"""Incremental checkpoints: delta size and save time against full checkpoints, and the restore
of a chain against the load of one full checkpoint.

    python benchmarks/bench_incremental.py --json results/bench_incremental.json

One KV-ZCH table of ``--rows`` rows x ``--dim`` fp32 with rowwise Adagrad (whole rows, the
table of ``bench_checkpoint.py``) in one process, saved by ``CheckpointManager``. After a full
checkpoint, for each fraction f of 1%, 10% and 50%: training steps over f of the live rows
(their weights, optimizer state and headers change), then a delta of the checkpoint before,
then a full checkpoint of the same state (each the next one's base), ``--repeats`` times.
Written per fraction, each the median of the rounds: ``delta_size_ratio_<f>`` (delta bytes /
full bytes) and ``delta_save_ratio_<f>`` (the time of ``CheckpointManager.save``, delta / full;
the disk is synced before each save). The state dict both are saved from is taken before
either and timed apart (``state_dict_s``: it sorts the shard's ids, whatever is saved);
``delta_blocking_ratio_<f>`` counts it in both.

Restore: ten rounds of 1% of the rows trained and 0.1% evicted, each saved as a delta, then a
full checkpoint of the same state (another folder). ``restore_chain10_vs_full``: the time of
``CheckpointManager.load`` of the last delta (checking all 11 links, then loading the full one
and applying the ten deltas) / that of the full checkpoint, each into the live model, checksums
verified, the median ratio of ``--repeats`` rounds, each going first in turn, after a round
that warms up; after each load every row is compared with the trained one, bit for bit. A PNG
beside the JSON shows both.

On the synthetic click log: the training job (quickstart, 2 processes, batches of 4,096) saves
a checkpoint every ``--job-every`` steps, deltas after the first. ``job_changed_rows_fraction``
is the median share of the live rows a delta holds (the rows the log touched or created in that
many steps; the rest of a Zipf log's rows stay as they were), with the deltas' bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _common import write_results
from bench_checkpoint import build
from torchrec_kvzch.job.report import read_jsonl

FRACTIONS = {"1pct": 0.01, "10pct": 0.10, "50pct": 0.50}
BATCH = 1 << 16  # ids per training step


def train_on(model, store, fraction: float, gen: torch.Generator) -> None:
    """Training steps over ``fraction`` of the live rows, each once."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = store.keys()
    ids = keys[torch.randperm(keys.numel(), generator=gen)[: int(fraction * keys.numel())]]
    for start in range(0, ids.numel(), BATCH):
        part = ids[start:start + BATCH]
        kjt = KeyedJaggedTensor(keys=["ids"], values=part, lengths=torch.ones(part.numel(), dtype=torch.long))
        model(kjt).wait().values().sum().backward()


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed_save(model, manager, step: int, incremental: bool) -> dict:
    os.sync()  # the writes of the saves before reach the disk first: each save starts alike
    t0 = time.perf_counter()
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    state_dict_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    manager.save(state, step, incremental=incremental)
    save_s = time.perf_counter() - t0
    assert len(manager.chain(step)) > 1 or not incremental, "a delta was asked for"
    return {"state_dict_s": state_dict_s, "save_s": save_s, "bytes": folder_bytes(manager.path(step))}


def timed_load(model, manager) -> float:
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    t0 = time.perf_counter()
    manager.load(state)
    return time.perf_counter() - t0


def all_rows(store) -> torch.Tensor:
    """Every row in id order, as raw bits (a header read as floats can be a NaN)."""
    ids = torch.sort(store.keys()).values
    return store.read_ids(ids, "row").view(torch.int32)


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(FRACTIONS)
    x = range(len(names))
    left.bar([i - 0.2 for i in x], [out[f"delta_size_ratio_{n}"] for n in names], 0.4, label="bytes")
    left.bar([i + 0.2 for i in x], [out[f"delta_save_ratio_{n}"] for n in names], 0.4, label="save time")
    left.set(xticks=list(x), xticklabels=[n.replace("pct", "%") for n in names], xlabel="rows trained since the base",
             ylabel="delta / full checkpoint", title="a delta against a full checkpoint")
    left.legend()
    right.bar(["full checkpoint", "full + 10 deltas"], [out["restore_full_s"], out["restore_chain10_s"]])
    right.set(ylabel="seconds (load, checksums verified)", title="restore")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def job_run(tmp: Path, every: int, saves: int) -> dict:
    """The job on the synthetic log, a checkpoint every ``every`` steps (deltas after the
    first): the share of the live rows each delta holds, and its bytes."""
    from torch.distributed.checkpoint import FileSystemReader

    from torchrec_kvzch.checkpoint.record import saved_record

    run = tmp / "job"
    subprocess.run([sys.executable, "-m", "torchrec_kvzch.job.train", "--config", "quickstart", "--nproc", "2",
                    "--steps", str(every * saves), "--checkpoint-every", "0", "--incremental-every", str(every),
                    "--keep", str(saves), "--log-every", str(every), "--run-dir", str(run)], check=True)
    summary = json.loads((run / "summary.json").read_text())
    live = {m["step"]: sum(m["live_rows"].values()) for m in read_jsonl(run / "metrics.jsonl") if m["kind"] == "train"}
    chain, sizes = summary["checkpoint_chain"], summary["checkpoint_chain_bytes"]
    assert len(chain) == saves, chain
    fractions = []
    for step in chain[1:]:
        tables, _ = saved_record(FileSystemReader(run / "checkpoints" / f"step-{step:08d}").read_metadata().planner_data)
        fractions.append(sum(sum(t.rows) for t in tables.values()) / live[step])
    return {"job_checkpoint_every_steps": every, "job_full_bytes": sizes[0], "job_delta_bytes": sizes[1:],
            "job_changed_rows_fractions": fractions, "job_changed_rows_fraction": statistics.median(fractions)}


def main() -> None:
    from torchrec_kvzch import CheckpointManager

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--job-every", type=int, default=10, help="steps between the job's checkpoints")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model, store = build(1, args.rows, args.dim, True)
    out: dict = {"rows": args.rows, "dim": args.dim}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        manager = CheckpointManager(Path(tmp) / "chain", keep=1, full_every=1000)
        step = 1
        timed_save(model, manager, step, incremental=False)  # the first base
        for name, fraction in FRACTIONS.items():
            runs = []
            for _ in range(args.repeats):  # each round: train, a delta of the last full, a full
                train_on(model, store, fraction, gen)
                delta = timed_save(model, manager, step + 1, incremental=True)
                full = timed_save(model, manager, step + 2, incremental=False)
                step += 2
                runs.append((delta, full))
                print(f"{name}: delta {delta['bytes'] / 2**20:,.1f} MiB in {delta['save_s']:.3f} s, full "
                      f"{full['bytes'] / 2**20:,.1f} MiB in {full['save_s']:.3f} s (state dict "
                      f"{delta['state_dict_s']:.3f} s)", flush=True)
            median = lambda f: statistics.median(f(d, full) for d, full in runs)  # noqa: E731
            out[f"delta_bytes_{name}"] = median(lambda d, f: d["bytes"])
            out[f"full_bytes_{name}"] = median(lambda d, f: f["bytes"])
            out[f"delta_save_s_{name}"] = median(lambda d, f: d["save_s"])
            out[f"full_save_s_{name}"] = median(lambda d, f: f["save_s"])
            out[f"state_dict_s_{name}"] = median(lambda d, f: (d["state_dict_s"] + f["state_dict_s"]) / 2)
            out[f"delta_size_ratio_{name}"] = median(lambda d, f: d["bytes"] / f["bytes"])
            out[f"delta_save_ratio_{name}"] = median(lambda d, f: d["save_s"] / f["save_s"])
            out[f"delta_blocking_ratio_{name}"] = median(
                lambda d, f: (d["state_dict_s"] + d["save_s"]) / (f["state_dict_s"] + f["save_s"]))
        # The chain: ten deltas of 1% trained and 0.1% evicted each, on the last full checkpoint.
        evicted = 0
        for _ in range(10):
            train_on(model, store, 0.01, gen)
            doomed = torch.randperm(len(store), generator=gen)[: len(store) // 1000]
            store.evict(store.keys()[doomed].clone())
            evicted += doomed.numel()
            step += 1
            timed_save(model, manager, step, incremental=True)
        out["chain_length"] = len(manager.chain(step))
        out["chain_evicted_rows"] = evicted
        full_manager = CheckpointManager(Path(tmp) / "full", keep=1)
        timed_save(model, full_manager, step, incremental=False)
        expected = all_rows(store)
        chain_s, full_s = [], []
        runs = [("chain", manager, chain_s), ("full", full_manager, full_s)]
        for rep in range(args.repeats + 1):  # each goes first in turn; the first round warms up
            for which, source, times in runs if rep % 2 == 0 else runs[::-1]:
                times.append(timed_load(model, source))
                assert torch.equal(all_rows(store), expected), f"the {which} restore differs from the trained rows"
        chain_s, full_s = chain_s[1:], full_s[1:]
        out["restore_chain10_s_runs"], out["restore_full_s_runs"] = chain_s, full_s
        out["restore_chain10_s"], out["restore_full_s"] = statistics.median(chain_s), statistics.median(full_s)
        out["restore_chain10_vs_full"] = statistics.median(c / f for c, f in zip(chain_s, full_s))
        out["chain_bytes"] = sum(folder_bytes(manager.path(s)) for s in manager.chain(step))
        out["full_bytes"] = folder_bytes(full_manager.path(step))
        del model, store, expected
        out.update(job_run(Path(tmp), args.job_every, saves=6))
    out["targets"] = {
        "delta_size_ratio_1pct <= 0.03": out["delta_size_ratio_1pct"] <= 0.03,
        "delta_size_ratio_10pct <= 0.15": out["delta_size_ratio_10pct"] <= 0.15,
        "delta_save_ratio_1pct <= 0.1": out["delta_save_ratio_1pct"] <= 0.1,
        "restore_chain10_vs_full <= 1.5": out["restore_chain10_vs_full"] <= 1.5,
    }
    write_results(out, args.json)
    plot(out, args.json.with_suffix(".png"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
