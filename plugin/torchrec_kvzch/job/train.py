"""The main job: train a DLRM with KV-ZCH tables on N processes, checkpoint, resume.

    python -m torchrec_kvzch.job.train --config quickstart --nproc 2 --steps 300
    torchrun --nproc_per_node 2 -m torchrec_kvzch.job.train --config quickstart
    python -m torchrec_kvzch.job.train --config quickstart --nproc 8 --dry-run

Data flows one way: YAML config -> TorchRec planner with our sharders -> DistributedModelParallel
around TorchRec's DLRM (``model.py``) -> TorchRec's ``TrainPipelineSparseDist`` over a click log
(``data.py``), held-out AUC and NE every K steps (``evaluation.py``) -> ``CheckpointManager``
every K steps -> the run directory's metrics, summaries and plot (``report.py``). On start the
job resumes from the latest complete checkpoint in ``--run-dir``, at whatever world size it now
has; the data is indexed by global step, so the loss curve continues.

Without torchrun the job launches its own workers through torchrun's launcher API
(``elastic_launch``): a rank that dies makes the launcher stop the others. A failure is reported
once: an error that a rerun would repeat (a bad config, a mismatched checkpoint) as its message;
a crash (a rank killed, a peer lost) with the checkpoints to resume from. Each failing rank's
traceback is kept in ``<run-dir>/failures/``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from tqdm import tqdm

from torchrec_kvzch.job.cli import check_args, job_config, parse_args
from torchrec_kvzch.job.model import dlrm, plan_model
from torchrec_kvzch.job.trainer import PeerLost, Trainer, resume_advice


def quiet() -> None:
    """Hide upstream deprecation chatter so the progress bar and real errors stay readable."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|torchrec)\.")
    for name in ("torchrec.distributed.planner", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _worker(args: argparse.Namespace) -> dict:
    """One rank. An exception is written to ``<run-dir>/failures/rank-<r>.json`` (for the
    launcher's report) and the rank exits with status 1; under torchrun, which reports in its
    own way, the rank also prints its error as one line."""
    quiet()
    # tqdm's default lock is a multiprocessing semaphore, which a rank killed by a signal leaks:
    # the resource tracker then warns after our report. One rank draws, so a thread lock will do.
    tqdm.set_lock(threading.RLock())
    rank = int(os.environ.get("RANK", 0))
    record = args.run_dir / "failures" / f"rank-{rank}.json"
    record.unlink(missing_ok=True)
    try:
        return Trainer(args).run()
    except KeyboardInterrupt:  # Ctrl-C reaches every process, then our launcher passes it on:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one broke the exit with a traceback
        raise
    except Exception as e:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"rank": rank, "crash": isinstance(e, PeerLost),
                                      "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
        if not args.own_launcher:
            print(f"rank {rank}: {type(e).__name__}: {e}\n(traceback: {record})", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> int:
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        args = parse_args(argv)  # (a --config name that names no shipped config is refused here)
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
        check_args(args, world_size)
    except (ValueError, FileNotFoundError) as e:  # a config that cannot be used: its message says why
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(args, world_size) if int(os.environ.get("RANK", 0)) == 0 else 0
    # One job per run dir, locked by the job's one entry point: our launcher, or under torchrun
    # (a process per rank, on every node) rank 0 alone, which lives as long as the run.
    try:
        with run_dir_lock(args.run_dir) if int(os.environ.get("RANK", 0)) == 0 else nullcontext():
            return launch(args, under_torchrun)
    except RunDirBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (SignalException, KeyboardInterrupt) as e:  # Ctrl-C, or SIGTERM to our launcher
        # (on a line of its own: a killed rank 0 leaves its progress bar without one)
        signum = e.sigval if isinstance(e, SignalException) else signal.SIGINT
        if int(os.environ.get("RANK", 0)) == 0:  # (under torchrun, every rank gets it)
            print(f"\ninterrupted ({signal.Signals(signum).name}); {resume_advice(args.run_dir)}", file=sys.stderr)
        return 128 + signum  # as a shell reports a process its signal ended


def launch(args: argparse.Namespace, under_torchrun: bool) -> int:
    """Train: this process is the rank (under torchrun), or it launches ``--nproc`` of them."""
    args.run_dir.mkdir(parents=True, exist_ok=True)
    args.own_launcher = not under_torchrun
    if args.own_launcher:  # (the failures of an earlier launch, perhaps of more ranks)
        shutil.rmtree(args.run_dir / "failures", ignore_errors=True)
    if under_torchrun:
        _worker(args)
        return 0

    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=f"kvzch-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.5, start_method="spawn")
    try:
        with _launcher_quiet():  # it logs every failure with tracebacks; we report once, below
            elastic_launch(launch, _worker)(args)
    except ChildFailedError as e:
        print(failure_report(args.run_dir, e), file=sys.stderr)
        return 1
    return 0


class RunDirBusy(RuntimeError):
    """Another job holds the run dir: its checkpoints, metrics and failures would mix with ours."""


@contextmanager
def run_dir_lock(run_dir: Path):
    """Hold ``<run-dir>/LOCK`` (``flock``) while the run lasts; a second job on the run dir is
    refused, naming the holder, before it writes anything. The OS lets go of the lock when the
    holder ends, however it ends, so a crash leaves nothing to clean up."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "LOCK", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            for _ in range(20):  # (a holder that has just taken the lock writes its name next)
                lock.seek(0)
                holder = lock.read().strip()
                if holder:
                    break
                time.sleep(0.05)
            raise RunDirBusy(f"--run-dir {run_dir} is in use by {holder or 'another process'}, a job training "
                             "there; wait for it to end, or give this run another --run-dir") from None
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
        yield


def dry_run(args: argparse.Namespace, world_size: int) -> int:
    """Print the plan and the memory it expects per rank, without starting any process."""
    quiet()
    config = job_config(args)
    model = dlrm(config, torch.device("meta"))
    plan, memory = plan_model(config, model, args.device, world_size,
                              args.global_batch_size // world_size)
    print(f"{plan}\n{memory.format()}\n(dry run of {args.config} on {world_size} rank(s): nothing trained)")
    return 0


def failure_report(run_dir: Path, e: ChildFailedError) -> str:
    """One report for the whole failure: the errors ranks raised (each distinct one once), or,
    when it was a crash, who died and how to resume."""
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "failures").glob("rank-*.json"))]
    errors: dict[str, list[int]] = {}
    for r in records:
        if not r["crash"]:
            errors.setdefault(r["error"], []).append(r["rank"])
    if errors:  # a rerun would fail the same way: no advice to rerun
        return "\n".join(f"training failed on rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))}: {error}" for error, ranks in errors.items()) + \
            f"\n(tracebacks in {run_dir / 'failures'})"
    died = "; ".join(f"rank {r}: {_describe(f)}" for r, f in sorted(e.failures.items()))
    killed = any(f.exitcode is not None and f.exitcode < 0 for f in e.failures.values())
    lost = [r["error"] for r in records]  # (PeerLost: a collective failed, and where to resume from)
    if lost and not killed:  # no rank was killed (one stalled): the survivor's message says why
        return f"training failed ({died}): {lost[0]}"
    return f"training failed ({died}); {resume_advice(run_dir)}."


def _describe(failure) -> str:
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"killed by {signal.Signals(-failure.exitcode).name}"
    return f"exit code {failure.exitcode}"


@contextmanager
def _launcher_quiet():
    loggers = [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict)
               if n.startswith(("torch.distributed.elastic", "torch.multiprocessing"))]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
