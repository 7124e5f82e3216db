"""The job stage of check.sh: did the run resumed from the GPU's checkpoint predict as the GPU did?

    python tools/gpu/compare_job.py WORK OUT_JSON

WORK holds the summaries of the run that trained and saved (``trained.json``), of its resume on
the same device (``resumed.json``) and of its resume on 2 CPU processes (``resumed_cpu.json``).
Each resume's predictions right after the load (``probe_after_resume``) are compared with the
trained run's final ones: bit for bit on the same device; on the CPU to float rounding, as the
dense layers' matrix products sum in another order there. Exit 1 if any differ.
"""

import json
import sys
from pathlib import Path

import torch

CROSS_DEVICE_ATOL = 1e-5  # click probabilities in [0, 1]


def main() -> int:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    runs = {name: json.loads((work / f"{name}.json").read_text()) for name in ("trained", "resumed", "resumed_cpu")}
    final = torch.tensor(runs["trained"]["probe_final"])
    result = {"trained_steps": runs["trained"]["end_step"], "checkpoint_step": runs["trained"]["checkpoint_step"],
              "loss_last": runs["trained"]["loss_last"],
              "train_examples_per_s": runs["trained"]["train_examples_per_s"]}
    ok = True
    for name, atol in (("resumed", 0.0), ("resumed_cpu", CROSS_DEVICE_ATOL)):
        run = runs[name]
        diff = (torch.tensor(run["probe_after_resume"]) - final).abs().max().item()
        equal = run["resumed_from"] == result["checkpoint_step"] and diff <= atol
        result[name] = {"world_size": run["world_size"], "resumed_from": run["resumed_from"],
                        "load_s": run["load_s"], "end_step": run["end_step"], "loss_last": run["loss_last"],
                        "probe_max_abs_diff": diff, "tolerance": atol, "equal": equal}
        ok &= equal
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
