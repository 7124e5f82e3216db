"""Admission control: rows and checkpoint bytes saved, and what it costs the loss.

    python benchmarks/bench_admission.py --json results/bench_admission.json

The training job (``python -m torchrec_kvzch.job.train``, the quickstart config, 2 processes)
runs three times on the same synthetic click log, one where most ids are rare (a Zipf
population of ``--population`` ids and ``--new-id-fraction`` ids never seen again): without
admission, with ``--admission count:2`` and with ``count:5`` (both with a trainable default
row). Written: live rows, checkpoint bytes and the final loss of each (the mean of the last
logged window), ``rows_saved_fraction_min<K>`` (1 - rows with admission / rows without),
``final_loss_delta_min<K>`` (final loss with admission minus without, same steps), and a PNG of
the three loss curves.

The sketch's false admissions are measured apart, on ids each seen once (none may be admitted
at ``min_count`` 2), as many as one table shard of the run without admission saw
(``distinct_ids_per_shard``): ``false_admission_rate`` for the default sketch (4 x 2^20
counters), ``false_admission_rate_small_sketch`` for 4 x 2^16; and, for the sizing rule in
docs/admission.md, ``false_admission_rate_at_width`` with as many ids as the default sketch has
counters in a row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from _common import write_results
from torchrec_kvzch import AdmissionPolicy
from torchrec_kvzch.job.report import read_jsonl
from torchrec_kvzch.table.admission import Admission

RUNS = {"none": None, "min2": "count:2:trainable", "min5": "count:5:trainable"}


def train(run_dir: Path, admission: str | None, args) -> tuple[dict, list[dict]]:
    cmd = [sys.executable, "-m", "torchrec_kvzch.job.train", "--config", "quickstart", "--nproc", "2",
           "--steps", str(args.steps), "--global-batch-size", str(args.batch), "--checkpoint-every", "0",
           "--population", str(args.population), "--new-id-fraction", str(args.new_id_fraction),
           "--log-every", "10", "--run-dir", str(run_dir)]
    subprocess.run(cmd + (["--admission", admission] if admission else []), check=True)
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "train"]  # (not the evaluations)
    return json.loads((run_dir / "summary.json").read_text()), metrics


def false_admission_rate(distinct: int, width: int, batch: int = 65536) -> float:
    """Admitted ids among ``distinct`` ids each seen once, at min_count 2, batch by batch."""
    policy = AdmissionPolicy("count", min_count=2, sketch_width=width).validate("bench")
    admission = Admission(policy, seed=1, device=torch.device("cpu"))
    ids = torch.randperm(distinct, generator=torch.Generator().manual_seed(0)) * 7919 + 13
    for start in range(0, distinct, batch):
        part = ids[start:start + batch]
        admission.admit(part, torch.zeros(part.numel(), dtype=torch.bool))
    return admission.admitted / distinct


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, metrics in curves.items():
        ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics],
                label={"none": "no admission", "min2": "min_count 2", "min5": "min_count 5"}[name])
    ax.set(xlabel="step", ylabel="training loss (BCE, window mean)", title="admission: loss curves")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--population", type=int, default=2_000_000)
    parser.add_argument("--new-id-fraction", type=float, default=0.1)
    args = parser.parse_args()
    out: dict = {"steps": args.steps, "global_batch_size": args.batch, "population": args.population,
                 "new_id_fraction": args.new_id_fraction}
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, admission in RUNS.items():
            summary, metrics = train(Path(tmp) / name, admission, args)
            curves[name] = metrics
            out[f"rows_{name}"] = sum(sum(r) for r in summary["rows_per_rank"].values())
            out[f"checkpoint_bytes_{name}"] = summary.get("checkpoint_bytes")
            out[f"final_loss_{name}"] = metrics[-1]["loss"]
            if admission:
                out[f"admitted_{name}"] = sum(metrics[-1]["admitted"].values())
                out[f"rejected_{name}"] = sum(metrics[-1]["rejected"].values())
    for k in ("min2", "min5"):
        out[f"rows_saved_fraction_{k}"] = 1 - out[f"rows_{k}"] / out["rows_none"]
        out[f"checkpoint_bytes_ratio_{k}"] = out[f"checkpoint_bytes_{k}"] / out["checkpoint_bytes_none"]
        out[f"final_loss_delta_{k}"] = out[f"final_loss_{k}"] - out["final_loss_none"]
    shards = 2 * 2  # the quickstart's two KV-ZCH tables, on 2 ranks
    out["distinct_ids_per_shard"] = distinct = out["rows_none"] // shards
    out["false_admission_rate"] = false_admission_rate(distinct, 2**20)
    out["false_admission_rate_small_sketch"] = false_admission_rate(distinct, 2**16)
    out["false_admission_rate_at_width"] = false_admission_rate(2**20, 2**20)
    out["targets"] = {
        "rows_saved_fraction_min2 >= 0.3": out["rows_saved_fraction_min2"] >= 0.3,
        "final_loss_delta_min2 <= 0.01": out["final_loss_delta_min2"] <= 0.01,
        "false_admission_rate <= 0.01": out["false_admission_rate"] <= 0.01,
    }
    write_results(out, args.json)
    plot(curves, args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
