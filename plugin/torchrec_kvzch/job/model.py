"""The job's model: TorchRec's DLRM over the config's tables, planned by our planner and sharded
by ``DistributedModelParallel``; what the planner expects each rank to hold; what it predicts."""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import KernelConfig, Stats, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_kvzch.job.data import DENSE_FEATURES
from torchrec_kvzch.torchrec import KVZCHShardingPlanner, kvzch_tables
from torchrec_kvzch.torchrec.config import ShardingConfig


class PlannedMemory(Stats):
    """TorchRec's planner hands its chosen plan to its ``stats``: this one keeps what each
    rank is expected to hold (host and device bytes), in place of TorchRec's long log table."""

    def __init__(self) -> None:
        self.per_rank: dict[int, dict[str, int]] = {}
        self.per_table: dict[str, int] = {}

    def log(self, sharding_plan, topology, batch_size, storage_reservation, num_proposals, num_plans,
            run_time, best_plan, *args, **kwargs) -> None:
        per_rank: dict[int, dict[str, int]] = defaultdict(lambda: {"ddr": 0, "hbm": 0})
        per_table: dict[str, int] = defaultdict(int)
        for option in best_plan:
            for shard in option.shards:
                per_rank[shard.rank]["ddr"] += shard.storage.ddr
                per_rank[shard.rank]["hbm"] += shard.storage.hbm
                per_table[option.name] += shard.storage.ddr + shard.storage.hbm
        self.per_rank, self.per_table = dict(sorted(per_rank.items())), dict(per_table)

    def format(self) -> str:
        mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
        lines = ["planned memory per rank (the planner's estimate: expected rows of KV-ZCH tables, "
                 "every row of the others, with optimizer state)",
                 "  rank   host MiB   device MiB"]
        lines += [f"  {rank:>4} {mib(m['ddr']):>10} {mib(m['hbm']):>12}" for rank, m in self.per_rank.items()]
        lines += [f"  table {name}: {mib(b)} MiB" for name, b in self.per_table.items()]
        return "\n".join(lines)


def dlrm(config: ShardingConfig, device: torch.device) -> DLRMTrain:
    """The unsharded model: its tables on the meta device (never materialised: DMP builds the
    shards), its dense layers on ``device``."""
    dim = config.tables[0].embedding_dim
    ebc = EmbeddingBagCollection(tables=config.embedding_bag_configs(), device=torch.device("meta"))
    return DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_FEATURES,
                          dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 32, 1], dense_device=device))


def plan_model(config: ShardingConfig, model: DLRMTrain, device_type: str, world_size: int,
               batch_per_rank: int, group: dist.ProcessGroup | None = None) -> tuple[ShardingPlan, PlannedMemory]:
    """The sharding plan of ``model`` (collective when ``group`` is given: rank 0 plans, the
    others receive it), and the memory it plans per rank."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    topology = TopologyFactory.create_topology(TrainerConfig(world_size=world_size, local_world_size=local_world_size),
                                               kernel_config=KernelConfig(compute_device=device_type))
    memory = PlannedMemory()
    planner = KVZCHShardingPlanner(topology, batch_per_rank, constraints=config.constraints(), stats=[memory])
    sharders = config.sharders()
    plan = planner.collective_plan(model, sharders, group) if group is not None else planner.plan(model, sharders)
    return plan, memory


def build_model(config: ShardingConfig, device: torch.device, batch_per_rank: int, dense_lr: float):
    """The sharded DLRM; returns (model, optimizer, plan, planned memory). Collective."""
    unsharded = dlrm(config, device)
    plan, memory = plan_model(config, unsharded, device.type, dist.get_world_size(), batch_per_rank,
                              dist.group.WORLD)
    model = DistributedModelParallel(unsharded, device=device, plan=plan, sharders=config.sharders(),
                                     env=ShardingEnv.from_process_group(dist.group.WORLD))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=dense_lr))
    return model, CombinedOptimizer([model.fused_optimizer, dense]), plan, memory


def predict(model, batch) -> torch.Tensor:
    """Click probabilities on ``batch`` (no row is created or touched: evaluation forwards
    leave the tables as they are)."""
    with torch.no_grad():
        _, (_, logits, _) = model(batch.to(model.device))
    return torch.sigmoid(logits).cpu()


def live_rows(model) -> dict[str, int]:
    return {name: len(tbe.store) for name, tbe in kvzch_tables(model)}


COUNTERS = ("rows", "inserted", "evicted", "bytes", "admitted", "rejected", "disk_rows", "disk_bytes_read",
            "disk_bytes_written", "cache_hits", "cache_misses")
OPTIONAL = set(COUNTERS[4:])  # admission's and a disk tier's: kept where some table has them


def store_counters(model) -> dict[str, list[int]]:
    """Per counter (``RowStore.counters``), its value for each local KV-ZCH table shard, in
    table order; a table without admission (a disk tier) counts 0 for its counters, which are
    left out only when no table has admission (a disk tier)."""
    counters = [tbe.store.counters for _, tbe in kvzch_tables(model)]
    keys = [k for k in COUNTERS if k not in OPTIONAL or any(k in c for c in counters)]
    return {key: [c.get(key, 0) for c in counters] for key in keys}


def process_group_backend(device: torch.device) -> str:
    """The default group's backend: NCCL for the model's CUDA tensors, and gloo beside it for
    the CPU tensors the job reduces itself (step totals, summaries): NCCL has no CPU path."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
