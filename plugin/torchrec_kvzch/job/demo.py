"""``make demo``: the quickstart end to end, with a check that resuming loses nothing.

1. train on 2 processes (async checkpoints along the way, a final one at the end);
2. resume from that checkpoint on 1 process and keep training;
3. compare the two runs' predictions on a fixed batch at the resume point (equal, bit for bit:
   the checkpoint carried every row, optimizer state and dense weight);
4. serve the final checkpoint (``torchrec-kvzch-serve`` on loopback), ask it for predictions of
   that fixed batch and compare them with the trained model's (fp32: equal);
5. print a summary and write ``results/demo.json`` and the run's plot (loss, held-out AUC,
   live rows).

Each phase is a separate ``python -m torchrec_kvzch.job.train`` invocation, as a user would run it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from torchrec_kvzch.job import cli
from torchrec_kvzch.job.data import SyntheticClickLog
from torchrec_kvzch.job.report import format_summary, plot_metrics, read_jsonl
from torchrec_kvzch.torchrec.config import load_config


def run_phase(run_dir: Path, summary: Path, nproc: int, steps: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torchrec_kvzch.job.train", "--nproc", str(nproc), "--steps", str(steps),
           "--run-dir", str(run_dir), "--summary", str(summary), *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(summary.read_text())


def probe_examples(config: str | None) -> list[dict]:
    """The trainer's fixed batch (``data.probe()``, the log as the demo's runs draw it) as the
    server's JSON examples."""
    args = cli.parse_args(["--config", config] if config else [])
    data = SyntheticClickLog(load_config(args.config), args.global_batch_size, args.seed, args.population,
                             args.zipf_alpha, args.new_id_fraction)
    batch = data.probe()
    ids = {f: jt.values().tolist() for f, jt in batch.sparse_features.to_dict().items()}
    return [{"dense": dense, "sparse": {f: [v[i]] for f, v in ids.items()}}
            for i, dense in enumerate(batch.dense_features.tolist())]


def served_predictions(run_dir: Path, config: str | None) -> tuple[dict, float]:
    """Start ``torchrec-kvzch-serve`` on the run's checkpoints, ask it to score the fixed batch,
    stop it; (its answer, seconds from start to the first answer)."""
    cmd = [sys.executable, "-m", "torchrec_kvzch.job.serve", "--checkpoints", str(run_dir / "checkpoints"),
           "--port", "0"]
    print("$", " ".join(cmd[1:]), flush=True)
    started = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # "serving step N of DIR on http://127.0.0.1:PORT"
        if "http://" not in line:
            raise RuntimeError(f"torchrec-kvzch-serve did not start (exit {server.wait()}): {line.strip()}")
        print(line.strip(), flush=True)
        url = line.split()[-1]
        body = json.dumps({"examples": probe_examples(config)}).encode()
        with urllib.request.urlopen(urllib.request.Request(url + "/predict", body), timeout=120) as reply:
            return json.loads(reply.read()), time.perf_counter() - started
    finally:
        server.terminate()
        server.wait()


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
    served, serve_s = served_predictions(run_dir, args.config)
    served_diff = max(abs(a - b) for a, b in zip(served["scores"], second["probe_final"]))
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "train"]
    plot = plot_metrics(run_dir, out.with_name(out.stem + "_loss.png"))
    result = {
        "resume_predictions_equal": second["resumed_from"] == first["end_step"] and before == after,
        "max_abs_prediction_diff": max_diff,
        "served_step": served["step"],
        "served_predictions_equal": served["step"] == second["end_step"] and served["scores"] == second["probe_final"],
        "served_max_abs_prediction_diff": served_diff,
        "served_first_answer_s": serve_s,
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
        "heldout_auc_ne": [(e["step"], e["auc"], e["ne"]) for e in first["eval"] + second["eval"]],
        "commands": ["make demo"],
    }
    out.write_text(json.dumps(result, indent=1))

    print("\n== phase 1 ==\n" + format_summary(first))
    print("\n== phase 2 ==\n" + format_summary(second))
    verdict = "equal" if result["resume_predictions_equal"] else f"DIFFERENT (max |diff| {max_diff:.3g})"
    served_verdict = "equal" if result["served_predictions_equal"] else f"DIFFERENT (max |diff| {served_diff:.3g})"
    print(f"\npredictions on {len(before)} fixed examples, saved model (2 processes) vs resumed model "
          f"(1 process): {verdict}\nserved (torchrec-kvzch-serve, step {served['step']}, fp32) vs trained: "
          f"{served_verdict}\nloss {result['loss_first']:.4f} -> {result['loss_at_resume']:.4f} "
          f"(step {first['end_step']}) -> {result['loss_last']:.4f} (step {second['end_step']})\n"
          f"wrote {out} and {plot}")
    return 0 if result["resume_predictions_equal"] and result["served_predictions_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
