"""Planning KV-ZCH tables with TorchRec's own sharding planner.

A table opts in through its planner constraints: ``KVZCHConstraints(kvzch=KVZCHTableParams(...))``
is a TorchRec ``ParameterConstraints`` carrying the table's KV-ZCH options.
``KVZCHShardingPlanner`` is TorchRec's ``EmbeddingShardingPlanner`` with three additions:

* constraints: KV-ZCH tables are pinned to ROW_WISE on our kernel; every other table is kept
  off it (TorchRec does not guard ``customized_kernel``, so it could otherwise pick it);
* estimators: a bandwidth entry for our kernel (TorchRec's perf estimator rejects unknown
  kernels), and a storage estimator that counts the memory of each shard's *expected* rows
  (``KVZCHTableParams.expected_rows``) with the store's growth slack and hash table, where
  TorchRec counts virtual tables as 0 - so a plan that cannot fit fails with the planner's
  normal error;
* the plan it returns carries each KV-ZCH table's parameters (``KVZCHParameterSharding``),
  which is how they reach the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import DDR_MEM_BW
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ShardingOption, Storage
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_kvzch.params import BucketRange, KVZCHTableParams
from torchrec_kvzch.sharding.modules import (
    KVZCH_KERNEL,
    ROW_WISE,
    KVZCHParameterSharding,
    kvzch_sharders,
)
from torchrec_kvzch.store.layout import RowLayout
from torchrec_kvzch.store.row_store import RowStore

OTHER_KERNELS = [k.value for k in EmbeddingComputeKernel if k.value != KVZCH_KERNEL]


@dataclass
class KVZCHConstraints(ParameterConstraints):
    """TorchRec planner constraints of a KV-ZCH table: its options, plus any usual constraint
    (pooling factors, batch sizes...). Sharding type and kernel are set by the planner."""

    kvzch: KVZCHTableParams | None = None


class KVZCHPerfConfig(EmbeddingPerfEstimatorConfig):
    """Our kernel is bound by host memory like fbgemm's CPU TBE: price it at DDR bandwidth."""

    kernel_device_bandwidths = {("cpu", KVZCH_KERNEL): DDR_MEM_BW, ("cuda", KVZCH_KERNEL): DDR_MEM_BW}


class KVZCHStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimate, with KV-ZCH shards replaced by the bytes their expected rows
    take in a row store (host DRAM on CPU, device memory on CUDA)."""

    def __init__(self, topology: Topology, constraints, tables: dict[str, KVZCHTableParams]) -> None:
        super().__init__(topology=topology, constraints=constraints)
        self._tables = tables
        self._on_cuda = topology.compute_device == "cuda"

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:
        super().estimate(sharding_options, sharder_data_map)
        for option in sharding_options:
            params = self._tables.get(option.name)
            if params is None or option.compute_kernel != KVZCH_KERNEL:
                continue
            layout = RowLayout.for_table(params)
            for shard in option.shards:
                start, rows, size = shard.offset[0], shard.size[0], params.bucket_size
                buckets = BucketRange(start // size, (start + rows) // size, size)
                nbytes = RowStore.estimated_bytes(layout, params.expected_shard_rows(buckets))
                shard.storage = Storage(hbm=nbytes, ddr=0) if self._on_cuda else Storage(hbm=0, ddr=nbytes)


class KVZCHShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner; tables whose constraints are ``KVZCHConstraints`` are KV-ZCH tables."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int | None = None,
        constraints: dict[str, ParameterConstraints] | None = None,
        **kwargs,
    ) -> None:
        # Our own copies: the planner narrows them, the caller's objects stay as given.
        self._constraints = {name: replace(c) for name, c in (constraints or {}).items()}
        self._kvzch = {name: _pinned(name, c) for name, c in self._constraints.items()
                       if isinstance(c, KVZCHConstraints)}
        perf = EmbeddingPerfEstimatorFactory.create_with_config(
            KVZCHPerfConfig(), topology=topology, constraints=self._constraints)
        storage = KVZCHStorageEstimator(topology, self._constraints, self._kvzch)
        enumerator = EmbeddingEnumerator(topology, batch_size, self._constraints,
                                         estimator=[perf, storage])
        super().__init__(topology=topology, batch_size=batch_size, enumerator=enumerator,
                         constraints=self._constraints, **kwargs)

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        self._check_tables(module)
        plan = super().plan(module, sharders)
        for module_plan in plan.plan.values():
            names = [n for n, s in module_plan.items() if n in self._kvzch and s.compute_kernel == KVZCH_KERNEL]
            group = tuple(self._kvzch[n] for n in sorted(names))
            for name in names:
                module_plan[name] = KVZCHParameterSharding.wrap(module_plan[name], self._kvzch[name], group)
        return plan

    def collective_plan(self, module: nn.Module, sharders=None, pg: dist.ProcessGroup | None = None):
        return super().collective_plan(module, sharders or kvzch_sharders(), pg)

    def _check_tables(self, module: nn.Module) -> None:
        """KV-ZCH tables must be declared as such in the model; other tables stay off our kernel
        (these constraints are shared with the enumerator, so they apply to this plan)."""
        declared = {}
        for m in module.modules():
            if isinstance(m, EmbeddingBagCollection):
                declared.update((c.name, c) for c in m.embedding_bag_configs())
            elif isinstance(m, EmbeddingCollection):
                declared.update((c.name, c) for c in m.embedding_configs())
        for name, params in self._kvzch.items():
            config = declared.get(name)
            if config is None:
                raise ValueError(f"KV-ZCH table '{name}' is not in the model; tables found: "
                                 f"{sorted(declared)}")
            if not config.use_virtual_table or config.total_num_buckets != params.total_num_buckets:
                raise ValueError(
                    f"KV-ZCH table '{name}' must be declared with use_virtual_table=True and "
                    f"total_num_buckets={params.total_num_buckets} so TorchRec splits it at bucket "
                    "boundaries; build its config with kvzch_embedding_bag_config / kvzch_embedding_config")
        for name in declared.keys() - self._kvzch.keys():
            given = self._constraints.get(name)
            if given is None:
                self._constraints[name] = ParameterConstraints(compute_kernels=OTHER_KERNELS)
            elif given.compute_kernels is None:
                given.compute_kernels = OTHER_KERNELS  # our copy
            elif KVZCH_KERNEL in given.compute_kernels:
                raise ValueError(f"table '{name}' is constrained to the KV-ZCH kernel but has no "
                                 "KV-ZCH options; give it KVZCHConstraints(kvzch=KVZCHTableParams(...))")


def _pinned(name: str, constraints: KVZCHConstraints) -> KVZCHTableParams:
    """Validates a KV-ZCH table's constraints and restricts them to ROW_WISE on our kernel."""
    params = constraints.kvzch
    if not isinstance(params, KVZCHTableParams):
        raise ValueError(f"table '{name}': KVZCHConstraints.kvzch must be a KVZCHTableParams, got {params!r}")
    if params.name != name:
        raise ValueError(f"table '{name}': its KVZCHConstraints carry the parameters of table '{params.name}'")
    for attr, value in (("sharding_types", ROW_WISE), ("compute_kernels", KVZCH_KERNEL)):
        current = getattr(constraints, attr)
        if current is not None and value not in current:
            raise ValueError(f"KV-ZCH table '{name}': constraint {attr}={current} excludes "
                             f"{value!r}, the only option for KV-ZCH tables")
        setattr(constraints, attr, [value])
    return params
