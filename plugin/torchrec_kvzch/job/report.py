"""What a run leaves in its run directory besides checkpoints: ``metrics.jsonl`` (a line per log
step and per evaluation, over every run), ``runs.jsonl`` (each run's summary, one line per run,
never overwritten), the latest run's summary (``--summary``), and ``metrics.png`` (loss, AUC and
live rows over the steps of every run, a line where each run started)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torchrec_kvzch


def versions() -> dict[str, str]:
    """The stack the run used."""
    stack = {name: v or "not installed" for name, v in torchrec_kvzch.installed_versions().items()}
    return {"torchrec_kvzch": torchrec_kvzch.__version__, **stack}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def record_run(run_dir: Path, summary_path: Path, summary: dict) -> None:
    """Keep ``summary`` (rank 0): appended to ``runs.jsonl``, drawn with the runs before it,
    written to ``summary_path`` with the plot's path."""
    with (run_dir / "runs.jsonl").open("a") as f:
        f.write(json.dumps(summary) + "\n")
    plot = plot_metrics(run_dir, run_dir / "metrics.png")
    summary["plot"] = str(plot) if plot else None
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=1))


def plot_metrics(run_dir: Path, out: Path) -> Path | None:
    """Training loss, held-out AUC and live rows against the step, over every run of
    ``run_dir``, with a dashed line where each resumed run started. None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        warnings.warn("matplotlib is not installed: no metrics.png (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [m for m in metrics if m.get("kind", "train") == "train"]
    evals = [m for m in metrics if m.get("kind") == "eval"]
    fig, (loss, auc, rows) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for world in sorted({m["world_size"] for m in train}):
        label = f"{world} process{'es' if world > 1 else ''}"
        points = [m for m in train if m["world_size"] == world]
        loss.plot([m["step"] for m in points], [m["loss"] for m in points], ".-", label=label)
        rows.plot([m["step"] for m in points], [sum(m["live_rows"].values()) for m in points], ".-", label=label)
        e = [m for m in evals if m["world_size"] == world]
        auc.plot([m["step"] for m in e], [m["auc"] for m in e], "o-", label=label)
    for run in read_jsonl(run_dir / "runs.jsonl"):
        if run.get("resumed_from") is not None:
            for ax in (loss, auc, rows):
                ax.axvline(run["resumed_from"], color="grey", linestyle="--", linewidth=0.8)
    loss.set(ylabel="training loss (window mean)", title=f"{run_dir.name}: dashed lines = resumed runs")
    auc.set(ylabel="held-out AUC")
    rows.set(ylabel="live KV-ZCH rows", xlabel="step")
    for ax in (loss, auc, rows):
        ax.grid(alpha=0.3)
    loss.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def format_summary(s: dict) -> str:
    lines = [f"trained steps {s['start_step']} -> {s['end_step']} on {s['world_size']} rank(s)"
             + (f", resumed from step {s['resumed_from']} (load {s['load_s']:.2f} s)" if s["resumed_from"] is not None else "")]
    if s.get("train_examples_per_s"):
        lines.append(f"  throughput    {s['train_examples_per_s']:,.0f} examples/s, last loss {s['loss_last']:.4f}")
    if s.get("eval"):
        last = s["eval"][-1]
        lines.append(f"  held-out      AUC {last['auc']:.4f}, NE {last['ne']:.4f} at step {last['step']} "
                     f"({last['examples']:,} examples)")
    for table, rows in s["rows_per_rank"].items():
        lines.append(f"  rows {table:<8} {' + '.join(f'{r:,}' for r in rows)} (per rank)")
    for key, per_table in s.get("totals", {}).items():
        lines.append(f"  {key:<13} " + ", ".join(f"{t} {v:,}" for t, v in per_table.items()) + " (since the tables were created)")
    for c in s["checkpoints"]:
        lines.append(f"  checkpoint    step {c['step']}: training blocked {c['blocking_s']:.2f} s")
    if "checkpoint_bytes" in s:
        chain, sizes = s["checkpoint_chain"], s["checkpoint_chain_bytes"]
        deltas = (f", a delta of step {chain[-2]}; its chain {' + '.join(f'{b / 2**20:,.1f}' for b in sizes)} MiB"
                  if len(chain) > 1 else "")
        lines.append(f"  latest        step {s['checkpoint_step']}, {sizes[-1] / 2**20:,.1f} MiB{deltas}")
    lines.append(f"  peak RSS      {', '.join(f'{r:,.0f}' for r in s['peak_rss_mib'])} MiB (per rank)")
    if s.get("plot"):
        lines.append(f"  plot          {s['plot']}")
    return "\n".join(lines)
