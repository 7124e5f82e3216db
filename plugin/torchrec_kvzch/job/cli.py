"""The training job's command line: its options, and the checks that refuse a bad one before
any process starts (``train.py`` runs the job)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from datetime import timedelta
from pathlib import Path

import torch

from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.job import config_path, shipped_config_names
from torchrec_kvzch.job.data import CRITEO_HEAD_LINES, SEEDS, criteo_line_problem
from torchrec_kvzch.params import AdmissionPolicy
from torchrec_kvzch.torchrec.config import ShardingConfig, load_config

DESCRIPTION = "Train a DLRM with KV-ZCH tables on N processes, checkpoint, resume."


class UsageError(ValueError):
    """A bad command line: ``train.main`` prints it as ``error: ...`` and exits with status 2,
    as argparse does, before any process starts."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrec-kvzch-train", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="quickstart",
                   help=f"sharding config: a YAML path, or the name of a shipped one ({', '.join(shipped_config_names())})")
    p.add_argument("--nproc", type=int, default=2, help="processes to launch (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=300, help="train until this global step")
    p.add_argument("--global-batch-size", type=int, default=4096, help="examples per step over all ranks")
    p.add_argument("--run-dir", default=None, help="checkpoints, metrics and summary (default runs/<config>)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--async-checkpoint", action="store_true", help="save in the background while training goes on")
    p.add_argument("--incremental-every", type=int, default=0, metavar="K",
                   help="also save a delta (the rows changed since the checkpoint before) every K steps "
                        "between the full checkpoints of --checkpoint-every (0: no deltas)")
    p.add_argument("--keep", type=int, default=2,
                   help="restorable checkpoints to keep (with the checkpoints their deltas build on)")
    p.add_argument("--resume", default="auto", help="'auto' (latest complete checkpoint, if any), 'none', or a step")
    p.add_argument("--criteo", nargs="+", metavar="TSV", help="train on Criteo TSV files instead of the synthetic log")
    p.add_argument("--population", type=int, default=100_000, help="synthetic: Zipf population per feature")
    p.add_argument("--zipf-alpha", type=float, default=1.05, help="synthetic: id skew")
    p.add_argument("--new-id-fraction", type=float, default=0.02, help="synthetic: share of never-seen ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense-lr", type=float, default=0.05, help="Adagrad learning rate of the dense layers")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress and metrics updates")
    p.add_argument("--eval-every", type=int, default=100,
                   help="steps between evaluations (AUC, NE) on the held-out slice of the log, and one at "
                        "the end (0: none)")
    p.add_argument("--eval-batches", type=int, default=2, help="global batches in the held-out slice")
    p.add_argument("--pipeline", choices=["sparse-dist", "none"], default="sparse-dist",
                   help="TorchRec's TrainPipelineSparseDist (the next batch's ids are distributed while "
                        "this one trains), or a plain loop; both compute the same")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sharding plan and the memory it plans per rank, then stop")
    p.add_argument("--timeout-s", type=float, default=300.0, help="collectives give up after this long")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: a GPU per process when this machine has enough of them, else the CPU")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)")
    p.add_argument("--summary", default=None,
                   help="this run's summary JSON (default <run-dir>/summary.json; every run's summary is "
                        "also appended to <run-dir>/runs.jsonl)")
    p.add_argument("--admission", default=None, metavar="KIND:VALUE[:DEFAULT]",
                   help="admission for every KV-ZCH table, over the config's: count:MIN_COUNT or "
                        "probability:P, then zeros (default) or trainable for ids not admitted yet")
    p.add_argument("--crash-drill", default=None, metavar="RANK:STEP[:save]",
                   help="kill RANK with SIGKILL at STEP (':save': in the middle of that step's checkpoint); "
                        "for rehearsing failures")
    args = p.parse_args(argv)
    args.config = config_path(args.config)
    args.run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    args.summary = Path(args.summary or args.run_dir / "summary.json")
    return args


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Refuse a bad command line before any process starts (config errors name file and key)."""
    if world_size < 1:
        raise UsageError(f"--nproc {world_size}: launch at least 1 process")
    config = job_config(args)
    dims = {t.embedding_dim for t in config.tables}
    if len(dims) != 1:
        raise UsageError(f"{args.config}: DLRM needs one embedding_dim for all tables, got "
                         + ", ".join(f"{t.name}={t.embedding_dim}" for t in config.tables))
    for table in config.kvzch_tables:  # (the planner checks it too, on every rank: this is sooner)
        table.check_world_size(world_size)
    if args.global_batch_size % world_size:
        raise UsageError(f"--global-batch-size {args.global_batch_size} is not divisible by the world size "
                         f"{world_size}; use a multiple of {world_size}")
    for name in ("steps", "global_batch_size", "log_every", "keep", "eval_batches"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("checkpoint_every", "incremental_every", "eval_every"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
    if args.incremental_every and args.checkpoint_every % args.incremental_every:
        raise UsageError(f"--checkpoint-every {args.checkpoint_every} is not a multiple of --incremental-every "
                         f"{args.incremental_every}: full checkpoints fall on delta steps; use a multiple")
    if args.resume not in ("auto", "none") and not args.resume.isdigit():
        raise UsageError(f"--resume {args.resume!r}: use 'auto', 'none' or a step number")
    if args.crash_drill is not None:  # (a drill that cannot fire would rehearse nothing)
        rank, step, save = parse_crash_drill(args.crash_drill)
        if rank >= world_size:
            raise UsageError(f"--crash-drill {args.crash_drill!r}: rank {rank} does not exist in a run of "
                             f"{world_size} rank(s); use a rank below {world_size}")
        if step > args.steps or (step == args.steps and not save):
            raise UsageError(f"--crash-drill {args.crash_drill!r}: step {step} is never "
                             f"{'saved' if save else 'trained'} by a run to --steps {args.steps}; use an earlier step")
        start = (0 if args.resume == "none" else int(args.resume) if args.resume.isdigit()
                 else CheckpointManager(args.run_dir / "checkpoints").latest() or 0)
        if step <= start:
            raise UsageError(f"--crash-drill {args.crash_drill!r}: this run resumes at step {start}, so step "
                             f"{step} never comes; use a later step, or --resume none")
    if not 0 <= args.new_id_fraction < 1:
        raise UsageError(f"--new-id-fraction {args.new_id_fraction}: must be in [0, 1)")
    check_numbers(args)
    missing = [p for p in args.criteo or () if not Path(p).is_file()]
    if missing:
        raise UsageError(f"--criteo: no such file {', '.join(missing)}; give the paths of Criteo TSV files")
    for tsv in args.criteo or ():  # (the first lines only: a whole day of Criteo is many GB)
        if problem := criteo_line_problem(Path(tsv), CRITEO_HEAD_LINES):
            raise UsageError(problem)
    if args.run_dir.exists() and not args.run_dir.is_dir():
        raise UsageError(f"--run-dir {args.run_dir} is a file; give a folder (it holds the run's checkpoints)")
    args.device = job_device(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    cached = [t.name for t in config.kvzch_tables if t.device_cache.enabled]
    if cached and args.device == "cpu":
        raise UsageError(f"{args.config}: KV-ZCH table(s) {', '.join(cached)} set device_cache, a GPU cache over rows "
                         "in host memory, and this run is on the CPU, whose rows are in host memory already; use "
                         "--device cuda (a GPU per process) or drop device_cache")


def check_numbers(args: argparse.Namespace) -> None:
    """The numeric options the checks above leave: out of range, each fails only inside a
    worker, or (NaN, infinity) is taken without a word and trains on something else."""
    if args.threads < 0:
        raise UsageError(f"--threads {args.threads}: use a positive count, or 0 for the cores over the local ranks")
    if not 0 < args.timeout_s <= timedelta.max.total_seconds():
        raise UsageError(f"--timeout-s {args.timeout_s}: use a positive, finite number of seconds")
    if not 0 <= args.dense_lr < math.inf:
        raise UsageError(f"--dense-lr {args.dense_lr}: use a finite learning rate >= 0")
    if args.population < 1:
        raise UsageError(f"--population {args.population}: use at least 1 id per feature")
    if not 1 < args.zipf_alpha < math.inf:  # (written so that NaN fails it)
        raise UsageError(f"--zipf-alpha {args.zipf_alpha}: use a finite exponent above 1 (the synthetic log's "
                         "Zipf draw divides by alpha - 1)")
    if not 0 <= args.seed < SEEDS:
        raise UsageError(f"--seed {args.seed}: use a seed in [0, {SEEDS})")


def job_device(device: str, local_ranks: int) -> str:
    """'cpu' or 'cuda' for every rank: each rank on this machine needs a GPU of its own, so
    'auto' takes the GPUs only when there are enough, and 'cuda' without enough is refused."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < local_ranks:
        fix = f"--nproc {gpus} or fewer, or --device cpu" if gpus else "--device cpu"
        raise UsageError(f"--device cuda: {local_ranks} process(es) on this machine need one GPU each and it has "
                         f"{gpus}; use {fix}")
    return "cuda" if device == "cuda" or (device == "auto" and gpus >= local_ranks > 0) else "cpu"


def parse_admission(text: str) -> AdmissionPolicy:
    """``--admission``: ``count:N`` or ``probability:P``, optionally ``:zeros`` / ``:trainable``."""
    parts = text.split(":")
    try:
        kind, value = parts[0], parts[1]
        number = {"count": int, "probability": float}[kind](value)
        policy = AdmissionPolicy(kind, **{"count": {"min_count": number},
                                          "probability": {"probability": number}}[kind],
                                 **({"default": parts[2]} if len(parts) == 3 else {}))
        if len(parts) > 3:
            raise ValueError("too many fields")
        return policy.validate("--admission")
    except (IndexError, KeyError, ValueError) as e:
        raise UsageError(f"--admission {text!r}: expected count:N or probability:P, then optionally "
                         f":zeros or :trainable ({e})") from None


def job_config(args: argparse.Namespace) -> ShardingConfig:
    """The sharding config, with ``--admission`` (if given: its rule, keeping the config's sketch
    size) for every KV-ZCH table, and each relative disk-tier path (``storage.path``) under the
    run directory: the run's own."""
    config = load_config(args.config)
    policy = None if args.admission is None else parse_admission(args.admission)

    def adjusted(kv):
        if policy is not None:  # (the rule the flag names; the config's sketch size stays)
            sketch = {k: getattr(kv.admission, k) for k in ("sketch_width", "sketch_depth")}
            kv = dataclasses.replace(kv, admission=dataclasses.replace(policy, **sketch).validate(kv.name))
        if kv.storage.enabled and not Path(kv.storage.path).is_absolute():
            kv = dataclasses.replace(kv, storage=dataclasses.replace(kv.storage, path=str(args.run_dir / kv.storage.path)))
        return kv

    tables = tuple(dataclasses.replace(t, kvzch=adjusted(t.kvzch)) if t.kvzch else t for t in config.tables)
    return dataclasses.replace(config, tables=tables)


def parse_crash_drill(text: str) -> tuple[int, int, bool]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(x.isdigit() for x in parts[:2]) or parts[2:] not in ([], ["save"]):
        raise UsageError(f"--crash-drill {text!r}: expected RANK:STEP or RANK:STEP:save")
    return int(parts[0]), int(parts[1]), parts[2:] == ["save"]
