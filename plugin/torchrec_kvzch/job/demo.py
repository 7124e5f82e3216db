"""``make demo``: the quickstart end to end, with a check that resuming loses nothing.

1. train on 2 processes (async checkpoints along the way, a final one at the end);
2. resume from that checkpoint on 1 process and keep training;
3. compare the two runs' predictions on a fixed batch at the resume point (equal, bit for bit:
   the checkpoint carried every row, optimizer state and dense weight);
4. print a summary and write ``results/demo.json`` and a loss-curve PNG.

Each phase is a separate ``python -m torchrec_kvzch.job.train`` invocation, as a user would run it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from torchrec_kvzch.job.train import format_summary


def run_phase(run_dir: Path, summary: Path, nproc: int, steps: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torchrec_kvzch.job.train", "--nproc", str(nproc), "--steps", str(steps),
           "--run-dir", str(run_dir), "--summary", str(summary), *extra]
    print("$", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(summary.read_text())


def plot_loss(metrics: list[dict], resume_step: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for world in sorted({m["world_size"] for m in metrics}):
        points = [(m["step"], m["loss"]) for m in metrics if m["world_size"] == world]
        ax.plot(*zip(*points), marker=".", label=f"{world} process{'es' if world > 1 else ''}")
    ax.axvline(resume_step, color="grey", linestyle="--", label=f"checkpoint / resume (step {resume_step})")
    ax.set(xlabel="step", ylabel="training loss (BCE, window mean)", title="quickstart: train, checkpoint, resume")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="sharding config (default: the quickstart)")
    p.add_argument("--steps", type=int, default=300, help="steps of the 2-process phase")
    p.add_argument("--resumed-steps", type=int, default=100, help="steps of the 1-process phase")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--json", default="results/demo.json")
    args = p.parse_args(argv)
    run_dir, out = Path(args.run_dir), Path(args.json)
    shutil.rmtree(run_dir, ignore_errors=True)  # every demo starts from nothing
    out.parent.mkdir(parents=True, exist_ok=True)
    common = ["--config", args.config] if args.config else []

    first = run_phase(run_dir, run_dir / "summary-2proc.json", 2, args.steps,
                      common + ["--checkpoint-every", str(max(1, args.steps // 3)), "--async-checkpoint"])
    second = run_phase(run_dir, run_dir / "summary-1proc.json", 1, args.steps + args.resumed_steps,
                       common + ["--checkpoint-every", "0"])

    before, after = first["probe_final"], second["probe_after_resume"]
    max_diff = max(abs(a - b) for a, b in zip(before, after))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plot = out.with_name(out.stem + "_loss.png")
    plot_loss(metrics, second["resumed_from"], plot)
    result = {
        "resume_predictions_equal": second["resumed_from"] == first["end_step"] and before == after,
        "max_abs_prediction_diff": max_diff,
        "probe_examples": len(before),
        "train_examples_per_s": first["train_examples_per_s"],
        "train_examples_per_s_resumed_1proc": second["train_examples_per_s"],
        "checkpoint_bytes": first["checkpoint_bytes"],
        "checkpoint_step": first["checkpoint_step"],
        "save_blocking_s": [c["blocking_s"] for c in first["checkpoints"]],
        "load_s": second["load_s"],
        "rows_per_rank_2proc": first["rows_per_rank"],
        "rows_per_rank_1proc": second["rows_per_rank"],
        "peak_rss_mib_2proc": first["peak_rss_mib"],
        "peak_rss_mib_1proc": second["peak_rss_mib"],
        "loss_first": metrics[0]["loss"],
        "loss_at_resume": first["loss_last"],
        "loss_last": second["loss_last"],
        "loss_curve": [(m["step"], m["loss"], m["world_size"]) for m in metrics],
        "loss_plot": str(plot),
        "commands": ["make demo"],
    }
    out.write_text(json.dumps(result, indent=1))

    print("\n== phase 1 ==\n" + format_summary(first), file=sys.stderr)
    print("\n== phase 2 ==\n" + format_summary(second), file=sys.stderr)
    verdict = "equal" if result["resume_predictions_equal"] else f"DIFFERENT (max |diff| {max_diff:.3g})"
    print(f"\npredictions on {len(before)} fixed examples, saved model (2 processes) vs resumed model "
          f"(1 process): {verdict}\nloss {result['loss_first']:.4f} -> {result['loss_at_resume']:.4f} "
          f"(step {first['end_step']}) -> {result['loss_last']:.4f} (step {second['end_step']})\n"
          f"wrote {out} and {plot}", file=sys.stderr)
    return 0 if result["resume_predictions_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
