"""One rank of the training job: resume, train through TorchRec's ``TrainPipelineSparseDist``,
log, evaluate, checkpoint, summarise. ``train.py`` launches it."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from tqdm import tqdm

from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.job.cli import job_config, parse_crash_drill
from torchrec_kvzch.job.data import CriteoClickLog, SyntheticClickLog
from torchrec_kvzch.job.evaluation import evaluate
from torchrec_kvzch.job.model import build_model, live_rows, predict, process_group_backend, store_counters
from torchrec_kvzch.job.report import format_summary, record_run, versions
from torchrec_kvzch.torchrec import kvzch_tables


def init_process_group(backend: str, timeout: timedelta) -> None:
    """``dist.init_process_group`` on keys of this launch attempt's own.

    torchrun keeps one TCPStore for all the attempts of a run (``--max-restarts``; its static
    and c10d rendezvous alike), and process groups write their gloo addresses there under the
    same keys in every attempt. A restarted group read the dead attempt's addresses: a rank
    connected to a closed port ("Connection refused"), or both ranks waited for the other to
    connect, forever. Under torchelastic the keys go under the restart count instead."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:  # started without torchelastic: nothing reuses the store
        dist.init_process_group(backend, timeout=timeout)
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"torchrec_kvzch/attempt_{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


class PeerLost(RuntimeError):
    """A collective failed: another rank died or stalled."""


def resume_advice(run_dir: Path) -> str:
    """What a rerun of the same command does after a crash or an interruption."""
    root = run_dir / "checkpoints"
    steps = CheckpointManager(root).steps()
    if not steps:
        return f"no complete checkpoint under {root} yet: a rerun of the same command starts afresh"
    return f"complete checkpoints: {steps} under {root}; rerun the same command to resume from the latest"


class Trainer:
    """One rank of the job: builds everything in ``__init__``, then ``run()`` resumes, trains to
    ``--steps`` with checkpoints and evaluations, and returns the run summary (rank 0 also
    keeps it in the run directory)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        use_cuda = args.device == "cuda"  # (check_args resolved 'auto')
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        init_process_group(process_group_backend(self.device), timedelta(seconds=args.timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
        # A drill fires in the first attempt only: a run that torchrun restarts must come back.
        first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
        self.drill = parse_crash_drill(args.crash_drill) if args.crash_drill and first_attempt else None

        self.config = job_config(args)
        self.per_rank = args.global_batch_size // self.world_size
        self.data = (CriteoClickLog(self.config, args.criteo, args.run_dir / "criteo_cache", args.global_batch_size,
                                    heldout_batches=args.eval_batches if args.eval_every else 0)
                     if args.criteo else
                     SyntheticClickLog(self.config, args.global_batch_size, args.seed, args.population,
                                       args.zipf_alpha, args.new_id_fraction))
        torch.manual_seed(args.seed)  # the same dense initialisation on every rank
        self.model, self.optimizer, plan, memory = build_model(self.config, self.device, self.per_rank, args.dense_lr)
        self.say(f"{plan}\n{memory.format()}")
        # Async saves run their collectives on a thread: they get a group of their own.
        checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout_s))
        # With deltas, the job says which save is full (every --checkpoint-every steps).
        full_every = max(2, args.checkpoint_every // args.incremental_every) if args.incremental_every else 1
        self.checkpoints = CheckpointManager(args.run_dir / "checkpoints", keep=args.keep,
                                             process_group=checkpoint_group, full_every=full_every)
        self.step = self.start = 0
        self.train_s, self.losses, self.counters, self.postfix = 0.0, [], {}, {}
        self.summary: dict = {"config": str(args.config), "config_yaml": args.config.read_text(),
                              "versions": versions(), "world_size": self.world_size,
                              "global_batch_size": args.global_batch_size, "pipeline": args.pipeline,
                              "data": "criteo" if args.criteo else "synthetic", "started_at": time.time(),
                              "resumed_from": None, "load_s": None, "checkpoints": [], "eval": []}

    def say(self, text: str) -> None:
        """A line for the user, from rank 0 (on stdout; the progress bar is on stderr)."""
        if self.rank == 0:
            tqdm.write(text, file=sys.stdout)

    def state(self) -> dict:
        """A fresh state dict (KV-ZCH entries are snapshots of the rows at this call)."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def run(self) -> dict:
        self.resume()
        self.metrics = (self.args.run_dir / "metrics.jsonl").open("a") if self.rank == 0 else None
        self.bar = tqdm(total=self.args.steps, initial=self.step, disable=self.rank != 0, unit="step",
                        mininterval=1.0, desc=f"train x{self.world_size}", dynamic_ncols=True)
        try:
            self.train()
        except RuntimeError as e:
            if not _collective_failure(e):
                raise
            raise PeerLost(f"rank {self.rank}: a collective failed at step {self.step} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); another rank died or stalled; "
                           f"{resume_advice(self.args.run_dir)}.") from e
        finally:
            self.bar.close()
            if self.metrics:
                self.metrics.close()
        return self.finish()

    def resume(self) -> None:
        """Load the checkpoint ``--resume`` names; then retire any later one, another run's."""
        self._resume()
        later, aside = self.checkpoints.retire_after(self.start)
        if later:
            self.say(f"checkpoints {later} are later than this run's start (step {self.start}): moved to "
                     f"{aside}, so that this run's own checkpoints are the ones a rerun resumes from")

    def _resume(self) -> None:
        if self.args.resume == "none":
            self.say(f"--resume none: starting fresh under {self.checkpoints.root}")
            return
        step = None if self.args.resume == "auto" else int(self.args.resume)
        if step is None and self.checkpoints.latest() is None:
            self.say(f"no checkpoint under {self.checkpoints.root}: starting fresh")
            return
        t0 = time.perf_counter()
        state = self.state()
        loaded = self.checkpoints.load(state, step)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.step = self.start = loaded
        self.summary.update(resumed_from=loaded, load_s=time.perf_counter() - t0,
                            probe_after_resume=predict(self.model, self.data.probe()).tolist())
        self.say(f"resumed from {self.checkpoints.path(loaded)} (step {loaded}) in {self.summary['load_s']:.2f} s")

    def train(self) -> None:
        """TorchRec's ``TrainPipelineSparseDist`` (``--pipeline sparse-dist``): batch i+1's ids
        are distributed while batch i trains. It computes what the plain loop computes
        (``--pipeline none``), bit for bit."""
        args = self.args
        batches = (self.data.batch(step, self.rank, self.world_size) for step in range(self.step, args.steps))
        pipeline = (TrainPipelineSparseDist(self.model, self.optimizer, self.device)
                    if args.pipeline == "sparse-dist" else None)
        self.detach = pipeline.detach if pipeline else (lambda: None)  # before a forward of our own
        self.window = [0.0, 0, time.perf_counter()]  # loss sum, examples, start
        while self.step < args.steps:
            if self.drill and self.drill[:2] == (self.rank, self.step) and not self.drill[2]:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            if pipeline is not None:
                loss = pipeline.progress(batches)[0]  # zero_grad, forward, backward, step
            else:
                loss, _ = self.model(next(batches).to(self.device, non_blocking=True))
                loss.backward()  # the tables' fused optimizer updates their rows here
                self.optimizer.step()
                self.optimizer.zero_grad()
            self.step += 1
            self.train_s += time.perf_counter() - t0
            self.window[0] += loss.detach().item() * self.per_rank
            self.window[1] += self.per_rank
            self.bar.update(1)
            if self.step % args.log_every == 0 or self.step == args.steps:
                self.log()
            if args.eval_every and (self.step % args.eval_every == 0 or self.step == args.steps):
                self.evaluate()
            if self.step == args.steps or any(k and self.step % k == 0
                                              for k in (args.checkpoint_every, args.incremental_every)):
                self.save()
        t0 = time.perf_counter()
        self.checkpoints.close()  # an async save still being written
        if self.summary["checkpoints"]:
            self.summary["checkpoints"][-1]["blocking_s"] += time.perf_counter() - t0

    def log(self) -> None:
        """Loss and throughput of the window since the last log, and the stores' counters, over all ranks."""
        loss_sum, examples, t0 = self.window
        tables = [name for name, _ in kvzch_tables(self.model)]
        counters = store_counters(self.model)
        totals = torch.tensor([loss_sum, examples, *(v for values in counters.values() for v in values)],
                              dtype=torch.float64)
        dist.all_reduce(totals)  # every rank holds a shard of every table: sums are table totals
        per_table = totals[2:].view(len(counters), len(tables)).long().tolist()
        self.counters = {("live_rows" if key == "rows" else key): dict(zip(tables, values))
                         for key, values in zip(counters, per_table)}
        record = {"kind": "train", "step": self.step, "loss": totals[0].item() / totals[1].item(),
                  "world_size": self.world_size, "examples_per_s": totals[1].item() / (time.perf_counter() - t0),
                  **self.counters}
        self.losses.append((self.step, record["loss"]))
        total = {key: sum(values) for key, values in zip(counters, per_table)}
        self.postfix.update(loss=f"{record['loss']:.4f}", ex_s=f"{record['examples_per_s']:,.0f}",
                            rows=f"{total['rows']:,}", ins=f"{total['inserted']:,}",
                            evict=f"{total['evicted']:,}", MiB=f"{total['bytes'] / 2**20:,.0f}")
        if "admitted" in total:
            self.postfix.update(adm=f"{total['admitted']:,}", rej=f"{total['rejected']:,}")
        if "cache_hits" in total:  # a disk tier: the share of existing rows found in DRAM, disk I/O
            hits, misses = self.counters["cache_hits"], self.counters["cache_misses"]
            record["cache_hit_rate"] = {t: hits[t] / max(1, hits[t] + misses[t]) for t in tables}
            self.postfix.update(hit=f"{total['cache_hits'] / max(1, total['cache_hits'] + total['cache_misses']):.3f}",
                                disk_rd_MiB=f"{total['disk_bytes_read'] / 2**20:,.0f}",
                                disk_wr_MiB=f"{total['disk_bytes_written'] / 2**20:,.0f}")
        self.bar.set_postfix(self.postfix, refresh=False)
        self.write_metrics(record)
        self.window = [0.0, 0, time.perf_counter()]

    def evaluate(self) -> None:
        """AUC and NE on the held-out slice (``evaluation.py``); not counted as training time."""
        t0 = time.perf_counter()
        self.detach()
        result = {"step": self.step, **evaluate(self.model, self.data, self.args.eval_batches,
                                                 self.rank, self.world_size)}
        self.summary["eval"].append(result)
        self.write_metrics({"kind": "eval", "world_size": self.world_size, **result})
        self.postfix["auc"] = f"{result['auc']:.4f}"
        self.bar.set_postfix(self.postfix, refresh=False)
        self.window[2] += time.perf_counter() - t0

    def write_metrics(self, record: dict) -> None:
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def save(self) -> None:
        dying = self.drill is not None and self.drill == (self.rank, self.step, True)
        t0 = time.perf_counter()
        every = self.args.checkpoint_every
        delta = bool(self.args.incremental_every) and not (every and self.step % every == 0)
        self.checkpoints.save(self.state(), self.step, asynchronous=self.args.async_checkpoint or dying,
                              incremental=delta if self.args.incremental_every else None)
        if dying:  # staged, the background write under way: the worst moment to die
            os.kill(os.getpid(), signal.SIGKILL)
        blocked = time.perf_counter() - t0
        self.summary["checkpoints"].append({"step": self.step, "blocking_s": blocked})
        self.window[2] += blocked  # saving is not training throughput

    def finish(self) -> dict:
        summary, world_size = self.summary, self.world_size
        self.detach()
        summary.update(start_step=self.start, end_step=self.step, loss_curve=self.losses,
                       loss_last=self.losses[-1][1] if self.losses else None,
                       totals={k: v for k, v in self.counters.items() if k not in ("live_rows", "bytes")},
                       probe_final=predict(self.model, self.data.probe()).tolist())
        gathered = [None] * world_size
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        dist.all_gather_object(gathered, {"rows": live_rows(self.model), "rss": rss_mib, "train_s": self.train_s})
        summary["rows_per_rank"] = {t: [g["rows"][t] for g in gathered] for t in gathered[0]["rows"]}
        summary["peak_rss_mib"] = [g["rss"] for g in gathered]
        slowest = max(g["train_s"] for g in gathered)  # ranks train in lockstep: the slowest sets the pace
        trained = (self.step - self.start) * self.args.global_batch_size
        summary["train_examples_per_s"] = trained / slowest if slowest else None
        latest = self.checkpoints.latest()
        if latest is not None:
            summary["checkpoint_step"] = latest
            summary["checkpoint_chain"] = self.checkpoints.chain(latest)  # [full, deltas...]
            summary["checkpoint_chain_bytes"] = [sum(f.stat().st_size for f in self.checkpoints.path(s).rglob("*")
                                                     if f.is_file()) for s in summary["checkpoint_chain"]]
            summary["checkpoint_bytes"] = summary["checkpoint_chain_bytes"][-1]
        if self.rank == 0:
            record_run(self.args.run_dir, self.args.summary, summary)
            self.say(format_summary(summary))
        dist.destroy_process_group()
        return summary


def _collective_failure(e: RuntimeError) -> bool:
    """Gloo reports a dead peer as a plain RuntimeError from its transport; NCCL and timeouts as
    DistError. Anything else is not a peer problem and propagates unchanged."""
    return isinstance(e, dist.DistError) or re.search(
        r"gloo|nccl|connection (reset|closed)|timed out|timeout", str(e), re.IGNORECASE) is not None
