"""The main job: train a DLRM with KV-ZCH tables on N processes, checkpoint, resume.

    python -m torchrec_kvzch.job.train --config quickstart --nproc 2 --steps 300
    torchrun --nproc_per_node 2 -m torchrec_kvzch.job.train --config quickstart

Data flows one way: YAML config -> TorchRec planner with our sharders -> DistributedModelParallel
around TorchRec's DLRM -> steps on a click log (``data.py``) -> ``CheckpointManager`` every K
steps. On start the job resumes from the latest complete checkpoint in ``--run-dir``, at
whatever world size it now has; the data is indexed by global step, so the loss curve continues.

Without torchrun the job launches its own workers through torchrun's launcher API
(``elastic_launch``), so in both cases a rank that dies makes the launcher stop the others and
report which rank failed and how, instead of leaving them blocked in a collective.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from tqdm import tqdm

from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.job.cli import check_args, job_config, parse_args, parse_crash_drill
from torchrec_kvzch.job.data import DENSE_FEATURES, CriteoClickLog, SyntheticClickLog
from torchrec_kvzch.torchrec import kvzch_tables

# -- the model ---------------------------------------------------------------------------------
def build_model(config, device: torch.device, batch_per_rank: int, dense_lr: float):
    """TorchRec's DLRM over the config's tables, planned and sharded; returns (model, optimizer, plan)."""
    dim = config.tables[0].embedding_dim
    ebc = EmbeddingBagCollection(tables=config.embedding_bag_configs(), device=torch.device("meta"))
    dlrm = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_FEATURES,
                          dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 32, 1], dense_device=device))
    world_size = dist.get_world_size()
    topology = Topology(world_size=world_size, compute_device=device.type,
                        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    sharders = config.sharders()
    plan = config.planner(topology, batch_per_rank).collective_plan(dlrm, sharders, dist.group.WORLD)
    model = DistributedModelParallel(dlrm, device=device, plan=plan, sharders=sharders,
                                     env=ShardingEnv.from_process_group(dist.group.WORLD))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=dense_lr))
    return model, CombinedOptimizer([model.fused_optimizer, dense]), plan


def predict(model, batch) -> torch.Tensor:
    """Click probabilities on ``batch``; every rank passes the same batch."""
    with torch.no_grad():
        _, (_, logits, _) = model(batch.to(model.device))
    return torch.sigmoid(logits).cpu()


def live_rows(model) -> dict[str, int]:
    return {name: len(tbe.store) for name, tbe in kvzch_tables(model)}


def store_counters(model) -> dict[str, list[int]]:
    """Per counter (``RowStore.counters``: rows, inserted, evicted, bytes), its value for each
    local KV-ZCH table shard, in table order."""
    counters = [tbe.store.counters for _, tbe in kvzch_tables(model)]
    keys = ("rows", "inserted", "evicted", "bytes") + (("admitted", "rejected") if "admitted" in counters[0] else ())
    return {key: [c.get(key, 0) for c in counters] for key in keys}


def process_group_backend(device: torch.device) -> str:
    """The default group's backend: NCCL for the model's CUDA tensors, and gloo beside it for
    the CPU tensors the job reduces itself (step totals, summaries): NCCL has no CPU path."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


# -- the worker --------------------------------------------------------------------------------
class PeerLost(RuntimeError):
    """A collective failed: another rank died or stalled."""


class Trainer:
    """One rank of the job: builds everything in ``__init__``, then ``run()`` resumes, trains to
    ``--steps`` with checkpoints, and returns the run summary (rank 0 also writes it)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend(device), timeout=timedelta(seconds=args.timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
        self.drill = parse_crash_drill(args.crash_drill) if args.crash_drill else None

        config = job_config(args)
        self.per_rank = args.global_batch_size // self.world_size
        self.data = (CriteoClickLog(config, args.criteo, args.run_dir / "criteo_cache", args.global_batch_size)
                     if args.criteo else
                     SyntheticClickLog(config, args.global_batch_size, args.seed, args.population,
                                       args.zipf_alpha, args.new_id_fraction))
        torch.manual_seed(args.seed)  # the same dense initialisation on every rank
        self.model, self.optimizer, plan = build_model(config, device, self.per_rank, args.dense_lr)
        if self.rank == 0:
            print(plan, file=sys.stderr)
        # Async saves run their collectives on a thread: they get a group of their own.
        checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout_s))
        # With deltas, the job says which save is full (every --checkpoint-every steps).
        full_every = max(2, args.checkpoint_every // args.incremental_every) if args.incremental_every else 1
        self.checkpoints = CheckpointManager(args.run_dir / "checkpoints", keep=args.keep,
                                             process_group=checkpoint_group, full_every=full_every)
        self.step = self.start = 0
        self.train_s, self.losses = 0.0, []
        self.summary: dict = {"config": str(args.config), "world_size": self.world_size,
                              "global_batch_size": args.global_batch_size,
                              "data": "criteo" if args.criteo else "synthetic",
                              "resumed_from": None, "load_s": None, "checkpoints": []}

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
                           f"{str(e).splitlines()[0] if str(e) else ''}); another rank died or stalled. "
                           f"Complete checkpoints: {self.checkpoints.steps()} under {self.checkpoints.root}; "
                           f"rerun the same command to resume from the latest.") from e
        finally:
            self.bar.close()
            if self.metrics:
                self.metrics.close()
        return self.finish()

    def resume(self) -> None:
        if self.args.resume == "none":
            return
        t0 = time.perf_counter()
        state = self.state()
        try:
            loaded = self.checkpoints.load(state, None if self.args.resume == "auto" else int(self.args.resume))
        except CheckpointException as e:  # a BaseException: make it an error the launcher reports
            raise RuntimeError(f"cannot resume from {self.checkpoints.root} with {self.args.config}: "
                               f"{e}") from None
        if loaded is None:
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.step = self.start = loaded
        self.summary.update(resumed_from=loaded, load_s=time.perf_counter() - t0,
                            probe_after_resume=predict(self.model, self.data.probe()).tolist())

    def train(self) -> None:
        args = self.args
        self.window = [0.0, 0, time.perf_counter()]  # loss sum, examples, start
        while self.step < args.steps:
            if self.drill and self.drill[:2] == (self.rank, self.step) and not self.drill[2]:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            batch = self.data.batch(self.step, self.rank, self.world_size)
            loss, _ = self.model(batch.to(self.model.device, non_blocking=True))
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
        record = {"step": self.step, "loss": totals[0].item() / totals[1].item(), "world_size": self.world_size,
                  "examples_per_s": totals[1].item() / (time.perf_counter() - t0),
                  **{("live_rows" if key == "rows" else key): dict(zip(tables, values))
                     for key, values in zip(counters, per_table)}}
        self.losses.append(record["loss"])
        total = {key: sum(values) for key, values in zip(counters, per_table)}
        postfix = {"loss": f"{record['loss']:.4f}", "ex_s": f"{record['examples_per_s']:,.0f}",
                   "rows": f"{total['rows']:,}", "ins": f"{total['inserted']:,}",
                   "evict": f"{total['evicted']:,}", "MiB": f"{total['bytes'] / 2**20:,.0f}"}
        if "admitted" in total:
            postfix.update(adm=f"{total['admitted']:,}", rej=f"{total['rejected']:,}")
        self.bar.set_postfix(postfix, refresh=False)
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        self.window = [0.0, 0, time.perf_counter()]

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
        summary.update(start_step=self.start, end_step=self.step,
                       loss_last=self.losses[-1] if self.losses else None,
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
            self.args.summary.parent.mkdir(parents=True, exist_ok=True)
            self.args.summary.write_text(json.dumps(summary, indent=1))
            print(format_summary(summary), file=sys.stderr)
        dist.destroy_process_group()
        return summary


def _collective_failure(e: RuntimeError) -> bool:
    """Gloo reports a dead peer as a plain RuntimeError from its transport; NCCL and timeouts as
    DistError. Anything else is not a peer problem and propagates unchanged."""
    return isinstance(e, dist.DistError) or re.search(
        r"gloo|nccl|connection (reset|closed)|timed out|timeout", str(e), re.IGNORECASE) is not None


def quiet() -> None:
    """Hide upstream deprecation chatter so the progress bar and real errors stay readable."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|torchrec)\.")
    for name in ("torchrec.distributed.planner", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)


@record  # a worker's traceback reaches the launcher's failure report
def _worker(args: argparse.Namespace) -> dict:
    quiet()
    return Trainer(args).run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_args(args, int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    if under_torchrun:
        _worker(args)
        return 0

    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=f"kvzch-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.5, start_method="spawn")
    try:
        elastic_launch(launch, _worker)(args)
    except ChildFailedError as e:
        failures = "; ".join(f"rank {r}: {_describe(f)}" for r, f in sorted(e.failures.items()))
        print(f"\ntraining failed ({failures}). Complete checkpoints stay under {args.run_dir / 'checkpoints'}; "
              f"rerun the same command to resume from the latest.", file=sys.stderr)
        return 1
    return 0


def _describe(failure) -> str:
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"killed by {signal.Signals(-failure.exitcode).name}"
    message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
    return f"exit code {failure.exitcode}: {message.strip().splitlines()[-1] if message else 'see the log above'}"


def format_summary(s: dict) -> str:
    lines = [f"trained steps {s['start_step']} -> {s['end_step']} on {s['world_size']} rank(s)"
             + (f", resumed from step {s['resumed_from']} (load {s['load_s']:.2f} s)" if s["resumed_from"] is not None else "")]
    if s.get("train_examples_per_s"):
        lines.append(f"  throughput    {s['train_examples_per_s']:,.0f} examples/s, last loss {s['loss_last']:.4f}")
    for table, rows in s["rows_per_rank"].items():
        lines.append(f"  rows {table:<8} {' + '.join(f'{r:,}' for r in rows)} (per rank)")
    for c in s["checkpoints"]:
        lines.append(f"  checkpoint    step {c['step']}: training blocked {c['blocking_s']:.2f} s")
    if "checkpoint_bytes" in s:
        chain, sizes = s["checkpoint_chain"], s["checkpoint_chain_bytes"]
        deltas = (f", a delta of step {chain[-2]}; its chain {' + '.join(f'{b / 2**20:,.1f}' for b in sizes)} MiB"
                  if len(chain) > 1 else "")
        lines.append(f"  latest        step {s['checkpoint_step']}, {sizes[-1] / 2**20:,.1f} MiB{deltas}")
    lines.append(f"  peak RSS      {', '.join(f'{r:,.0f}' for r in s['peak_rss_mib'])} MiB (per rank)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
