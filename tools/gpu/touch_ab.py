"""Which count the header touch keeps (issue 34's `lru` gap): the store's, where a block sorts its
slots and adds a run of one row in one atomic, against one atomic per occurrence, relaxed, and
fenced as the count was before 38e3595. Device time of the touch alone (CUDA events, median),
batches of 65,536 x 20 over 10M rows, uniform and Zipf(1.05) slots as bench_gpu draws them; the
headers of every variant must agree. A one-off: delete it once a GPU run has decided.

    python tools/gpu/touch_ab.py --json OUT/gpu_touch.json     (check.sh: the "touch" stage)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--json", type=Path, required=True)
parser.add_argument("--rows", type=int, default=10_000_000)
parser.add_argument("--batch", type=int, default=65_536 * 20, help="occurrences per touch")
parser.add_argument("--reps", type=int, default=30)
parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: Triton's interpreter, to "
                    "rehearse the script")
args = parser.parse_args()
if args.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # (before Triton is imported)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_lookup import zipf_ranks  # noqa: E402
from torchrec_kvzch.table import gpu_kernels  # noqa: E402
from torchrec_kvzch.table.layout import make_meta  # noqa: E402


@triton.jit
def _per_occurrence(slots, counts, leads, n, RELAXED: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = off < n
    slot = tl.load(slots + off, mask=live, other=0)
    if RELAXED:
        seen = tl.atomic_add(counts + slot, 1, mask=live, sem="relaxed")
    else:
        seen = tl.atomic_add(counts + slot, 1, mask=live)
    tl.store(leads + off, seen, mask=live)


def per_occurrence(relaxed: bool):
    def count(slots, counts):
        leads = torch.empty(slots.numel(), dtype=torch.int32, device=slots.device)
        _per_occurrence[(gpu_kernels._blocks(slots.numel()),)](slots, counts, leads, slots.numel(), RELAXED=relaxed,
                                                                  BLOCK=gpu_kernels.BLOCK)
        return leads
    return count


def device_ms(fn, reps: int) -> float:
    if args.device == "cpu":  # (the interpreter: plumbing, no timing)
        fn()
        return 0.0
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


device = torch.device(args.device)
gen = torch.Generator().manual_seed(7)
variants = {"sorted": gpu_kernels.count, "relaxed": per_occurrence(True), "fenced": per_occurrence(False)}
results: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                 "rows": args.rows, "occurrences": args.batch}
for dist in ("uniform", "zipf"):
    draw = zipf_ranks(args.rows, args.batch, 1.05, gen) if dist == "zipf" else torch.randint(0, args.rows, (args.batch,),
                                                                                            generator=gen)
    slots = draw.to(device)
    results[f"distinct_{dist}"] = int(torch.unique(draw).numel())
    headers = {}
    for name, count in variants.items():
        meta = make_meta(0, 0).repeat(args.rows).to(device)
        counts = torch.zeros(args.rows, dtype=torch.int32, device=device)
        gpu_kernels.count = count  # (touch() looks its count up here)
        try:
            results[f"touch_ms_{name}_{dist}"] = device_ms(lambda: gpu_kernels.touch(meta, slots, 1, counts), args.reps)
            headers[name] = meta.cpu()
        finally:
            gpu_kernels.count = variants["sorted"]
    assert all(torch.equal(h, headers["sorted"]) for h in headers.values()), f"the variants' headers differ ({dist})"
args.json.parent.mkdir(parents=True, exist_ok=True)
args.json.write_text(json.dumps(results, indent=2))
print(json.dumps(results, indent=2))
