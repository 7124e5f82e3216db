"""Planning KV-ZCH tables with TorchRec's own sharding planner.

A table is a KV-ZCH table when its config says ``use_virtual_table=True`` (TorchRec's own
declaration), when its constraints name a virtual-table kernel (``dram_virtual_table``,
``ssd_virtual_table``, ``dram_ssd_virtual_table``), or when its constraints are
``KVZCHConstraints``: with ``kvzch=KVZCHTableParams(...)``, our explicit way, or with only the
fields TorchRec has no place for (``expected_rows=``, ``eviction=``, ``admission=``...), merged
into the TorchRec declaration. ``KVZCHShardingPlanner`` is TorchRec's
``EmbeddingShardingPlanner`` with these additions:

* constraints: KV-ZCH tables are pinned to ROW_WISE on their virtual-table kernel, and their
  parameters are read from every declaration (``declarations.table_params``) before planning,
  so a field we cannot honour fails here;
* estimators: a bandwidth entry for the virtual-table kernels on CPU (TorchRec prices them only
  on CUDA), and, for tables declared with ``KVZCHConstraints``, a storage estimator that counts
  the memory of each shard's *expected* rows (``KVZCHTableParams.expected_rows``) with the
  store's growth slack and hash table, where TorchRec counts only its caches - so a plan that
  cannot fit fails with the planner's normal error;
* the plan it returns carries each KV-ZCH table's parameters (``KVZCHParameterSharding``),
  which is how they reach the kernel. TorchRec's stock planner can plan the same tables on
  CUDA (it prices virtual-table kernels there); our sharders then read the parameters from the
  declarations themselves;
* ``collective_plan`` checks the declarations on every rank before its broadcast, and raises a
  planning error of rank 0 on every rank (TorchRec's leaves the others to fail on a closed
  connection);
* TorchRec's default storage reservation, without its notices about dense tensors of
  unmaterialised modules (docs/torchrec.md, "Warnings").
"""

from __future__ import annotations

import logging
import pickle
import warnings
from dataclasses import dataclass, fields, replace

import torch.distributed as dist
from torch import nn
from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
from torchrec.distributed.comm import get_local_size, get_topology_domain_multiple
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import BATCH_SIZE, DDR_MEM_BW
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import ShardingOption, Storage
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.distributed.utils import get_device_type
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_kvzch.params import (
    AdmissionPolicy, BucketRange, EvictionPolicy, KVZCHTableParams, OptimizerKind, WeightDecayMode)
from torchrec_kvzch.torchrec.declarations import (
    EXTRA_FIELDS, KVZCH_KERNEL, VIRTUAL_KERNELS, table_fused_params, table_own_fields, table_params)
from torchrec_kvzch.torchrec.device_cache import with_device_cache
from torchrec_kvzch.torchrec.eviction_declarations import check_feature_score_module
from torchrec_kvzch.torchrec.in_backward import in_backward_params
from torchrec_kvzch.torchrec.modules import ROW_WISE, KVZCHParameterSharding, kvzch_sharders
from torchrec_kvzch.table.disk_tier import estimated_tier_bytes
from torchrec_kvzch.table.eviction import shard_budget
from torchrec_kvzch.table.layout import RowLayout
from torchrec_kvzch.table.row_cache import estimated_split
from torchrec_kvzch.table.row_store import RowStore

# TorchRec's Storage counts disk bytes from 1.8 on; 1.6 (the torch 2.11 stack) has no field for them.
_SSD = "ssd" in {f.name for f in fields(Storage)}


@dataclass
class KVZCHConstraints(ParameterConstraints):
    """TorchRec planner constraints of a KV-ZCH table, plus any usual constraint (pooling
    factors, batch sizes...); sharding type and kernel are set by the planner. Either every
    parameter (``kvzch=KVZCHTableParams(...)``), or, for a table declared the TorchRec way, only
    what TorchRec has no per-table field for (the fields below ``kvzch``; None: not given)."""

    kvzch: KVZCHTableParams | None = None
    eviction: EvictionPolicy | None = None
    admission: AdmissionPolicy | None = None
    expected_rows: int | None = None
    checkpoint_chunk_rows: int | None = None
    init_seed: int | None = None
    optimizer: OptimizerKind | str | None = None
    learning_rate: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    weight_decay_mode: WeightDecayMode | str | None = None
    beta1: float | None = None
    beta2: float | None = None

    def extras(self) -> dict:
        """The ``KVZCHTableParams`` fields given beside the TorchRec declaration."""
        return {f: getattr(self, f) for f in EXTRA_FIELDS if getattr(self, f) is not None}


class KVZCHPerfConfig(EmbeddingPerfEstimatorConfig):
    """On CPU our kernel is bound by host memory like fbgemm's CPU TBE: price it at DDR
    bandwidth (TorchRec prices virtual-table kernels on CUDA only, and keeps its CUDA price)."""

    kernel_device_bandwidths = {("cpu", kernel): DDR_MEM_BW for kernel in VIRTUAL_KERNELS}


class KVZCHStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimate, with the shards of tables declared with ``KVZCHConstraints``
    replaced by the bytes their ``expected_rows`` take in a row store (host DRAM on CPU, device
    memory on CUDA), or their eviction budget where they have one. TorchRec's own declarations
    carry no row count: their shards keep TorchRec's estimate (the caches its ``KeyValueParams``
    size)."""

    def __init__(self, topology: Topology, constraints, tables: dict[str, KVZCHTableParams]) -> None:
        super().__init__(topology=topology, constraints=constraints)
        self._tables = tables
        self._on_cuda = topology.compute_device == "cuda"

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:
        super().estimate(sharding_options, sharder_data_map)
        for option in sharding_options:
            params = self._tables.get(option.name)
            if params is None or option.compute_kernel not in VIRTUAL_KERNELS:
                continue
            layout = RowLayout.for_table(params)
            for shard in option.shards:
                start, rows, size = shard.offset[0], shard.size[0], params.bucket_size
                buckets = BucketRange(start // size, (start + rows) // size, size)
                rows, extra, on_disk = params.expected_shard_rows(buckets), params.admission.sketch_bytes, 0
                _, cap = shard_budget(params, buckets, RowStore.estimated_bytes)  # (reserved up front: the most it holds)
                rows = rows if cap is None else cap
                if params.storage.enabled:  # the cache's rows (and the tier's index) in DRAM, the others on disk
                    cached = min(rows, params.storage.shard_bytes(buckets.num_buckets, params.total_num_buckets)
                                 // layout.stored_bytes)
                    index, on_disk = estimated_tier_bytes(rows - cached, layout.row_width * layout.itemsize)
                    rows, extra = cached, extra + index
                if self._on_cuda and params.device_cache.enabled:  # host rows under a GPU cache
                    cache_rows = params.device_cache.shard_rows(params.expected_rows, buckets.num_buckets,
                                                                params.total_num_buckets)
                    hbm, host = estimated_split(layout, rows, cache_rows)
                    shard.storage = Storage(hbm=hbm + extra, ddr=host)
                    continue
                nbytes = RowStore.estimated_bytes(layout, rows, reserved=cap is not None) + extra
                shard.storage = (Storage(hbm=nbytes, ddr=0) if self._on_cuda else
                                 Storage(hbm=0, ddr=nbytes, **({"ssd": on_disk} if _SSD and on_disk else {})))


_DENSE_NOTICE = "There is a known issue with TorchRec's dense tensor size calculation"


def _not_dense_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_DENSE_NOTICE)


class QuietStorageReservation(HeuristicalStorageReservation):
    """TorchRec's default reservation (a share of each device, the dense parameters six times,
    the input batches), without the notices TorchRec 1.8 gives on each use: a FutureWarning when
    built, a log line each plan. Both warn that the dense part is misjudged for modules whose
    dense tensors are not materialised (lazy modules, FSDP); a meta-built embedding module is
    not part of it. Pass another ``storage_reservation`` to the planner where that matters."""

    def __init__(self, percentage: float = 0.15, **kwargs) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "HeuristicalStorageReservation is known", FutureWarning)
            super().__init__(percentage, **kwargs)

    def reserve(self, *args, **kwargs):
        logger = logging.getLogger(HeuristicalStorageReservation.__module__)
        logger.addFilter(_not_dense_notice)
        try:
            return super().reserve(*args, **kwargs)
        finally:
            logger.removeFilter(_not_dense_notice)


@dataclass
class _Failed:
    """A planning error of rank 0, broadcast so that every rank raises it."""

    error: BaseException


class KVZCHShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner, which also plans KV-ZCH tables (see the module docstring)."""

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int | None = None,
        enumerator=None,
        storage_reservation=None,
        proposer=None,
        partitioner=None,
        performance_model=None,
        stats=None,
        constraints: dict[str, ParameterConstraints] | None = None,
        **kwargs,
    ) -> None:
        """TorchRec's arguments, in its order. The enumerator is ours (it carries the estimators
        that price KV-ZCH tables): another is refused rather than left without them."""
        if enumerator is not None:
            raise ValueError("KVZCHShardingPlanner builds its own enumerator (its estimators price "
                             "KV-ZCH tables); fix: leave enumerator out (constraints and topology "
                             "reach it), or plan with EmbeddingShardingPlanner and no KV-ZCH tables")
        if topology is None:  # as TorchRec's planner: this process group's world, this device type
            topology = Topology(local_world_size=get_local_size(), world_size=dist.get_world_size(),
                                compute_device=get_device_type(), pod_size=get_topology_domain_multiple())
        batch_size = BATCH_SIZE if batch_size is None else batch_size  # as TorchRec's planner
        kwargs.update(proposer=proposer, partitioner=partitioner, performance_model=performance_model,
                      stats=stats)
        # Our own copies: the planner narrows them, the caller's objects stay as given.
        self._constraints = {name: replace(c) for name, c in (constraints or {}).items()}
        self._kvzch: dict[str, KVZCHTableParams] = {}  # filled by plan()
        self._estimated: dict[str, KVZCHTableParams] = {}  # those with a row count, for the estimator
        perf = EmbeddingPerfEstimatorFactory.create_with_config(
            KVZCHPerfConfig(), topology=topology, constraints=self._constraints)
        storage = KVZCHStorageEstimator(topology, self._constraints, self._estimated)
        enumerator = EmbeddingEnumerator(topology, batch_size, self._constraints,
                                         estimator=[perf, storage])
        kwargs["storage_reservation"] = storage_reservation or QuietStorageReservation()
        super().__init__(topology=topology, batch_size=batch_size, enumerator=enumerator,
                         constraints=self._constraints, **kwargs)

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        self._kvzch.clear()
        self._kvzch.update(self._checked_tables(module, sharders))
        self._estimated.clear()
        self._estimated.update((n, p) for n, p in self._kvzch.items()
                               if isinstance(self._constraints[n], KVZCHConstraints))
        plan = super().plan(module, sharders)
        for module_plan in plan.plan.values():
            for name, sharding in module_plan.items():
                if name in self._kvzch and sharding.compute_kernel in VIRTUAL_KERNELS:
                    module_plan[name] = KVZCHParameterSharding.wrap(sharding, self._kvzch[name])
        return plan

    def collective_plan(self, module: nn.Module, sharders=None, pg: dist.ProcessGroup | None = None):
        """The plan of rank 0, on every rank of ``pg`` (WORLD if None), as TorchRec's. Every
        rank checks the KV-ZCH declarations first, so a bad one fails alike everywhere before
        any collective, and an error of rank 0's planning is raised on every rank."""
        sharders = sharders or kvzch_sharders()
        if pg is None and not dist.is_initialized():
            raise RuntimeError("collective_plan needs an initialised process group; on a single "
                               "process without one, call plan() instead")
        pg = pg if pg is not None else dist.group.WORLD
        self._checked_tables(module, sharders)
        outcome = invoke_on_rank_and_broadcast_result(pg, 0, self._plan_or_failure, module, sharders)
        if isinstance(outcome, _Failed):
            raise outcome.error
        return outcome

    def _plan_or_failure(self, module: nn.Module, sharders) -> ShardingPlan | _Failed:
        try:
            return self.plan(module, sharders)
        except Exception as error:  # noqa: BLE001 - re-raised on every rank
            try:
                pickle.dumps(error)
            except Exception:  # noqa: BLE001 - an error that cannot travel goes as its text
                error = RuntimeError(f"{type(error).__name__}: {error}")
            return _Failed(error)

    def _checked_tables(self, module: nn.Module, sharders) -> dict[str, KVZCHTableParams]:
        """``_declared_tables``, checked against the topology's world size: each rank must own
        a bucket of each table (TorchRec would refuse later, without the table's name)."""
        tables = self._declared_tables(module, sharders)
        for params in tables.values():
            params.check_world_size(self._topology.world_size)
        return tables

    def _declared_tables(self, module: nn.Module, sharders) -> dict[str, KVZCHTableParams]:
        """Every KV-ZCH table of the model with its parameters; pins their constraints (these
        are shared with the enumerator, so they apply to this plan)."""
        tables, declared, wrapped = {}, set(), _wrapped(module)
        for m in module.modules():
            if isinstance(m, EmbeddingBagCollection):
                configs = m.embedding_bag_configs()
            elif isinstance(m, EmbeddingCollection):
                configs = m.embedding_configs()
            else:
                continue
            check_feature_score_module(configs)
            fused = next((s.fused_params for s in sharders if isinstance(m, s.module_type)), None)
            backward = in_backward_params(m, "embedding_bags" if isinstance(m, EmbeddingBagCollection) else "embeddings")
            for config in configs:
                declared.add(config.name)
                constraints = self._constraints.get(config.name)
                kernel = _kvzch_kernel(config, constraints)
                if kernel is None:
                    continue
                if id(m) in wrapped:
                    raise ValueError(f"KV-ZCH table '{config.name}' is inside a {wrapped[id(m)]}; {_WRAPPED_WHY[wrapped[id(m)]]}")
                explicit = getattr(constraints, "kvzch", None)
                if explicit is not None and not isinstance(explicit, KVZCHTableParams):
                    raise ValueError(f"table '{config.name}': KVZCHConstraints.kvzch must be a "
                                     f"KVZCHTableParams, got {explicit!r}; fix: pass one, or leave "
                                     "it out and give only the extra fields")
                if explicit is not None and explicit.name != config.name:
                    raise ValueError(f"table '{config.name}': its KVZCHConstraints carry the "
                                     f"parameters of table '{explicit.name}'")
                extras = constraints.extras() if isinstance(constraints, KVZCHConstraints) else {}
                kv, own = getattr(constraints, "key_value_params", None), backward.get(config.name, {})
                table_fused = table_fused_params(fused, constraints, own)
                params = table_params(config, kernel, kv, table_fused, explicit, extras,
                                      {**own, **table_own_fields(constraints)})
                # (as the sharders will read them: TorchRec's cache declarations size a CUDA shard's cache)
                tables[config.name] = with_device_cache(params, table_fused, getattr(constraints, "cache_params", None),
                                                        kv, self._topology.compute_device == "cuda")
                self._constraints[config.name] = _pinned(config.name, constraints, kernel)
        missing = sorted(n for n, c in self._constraints.items()
                         if isinstance(c, KVZCHConstraints) and n not in declared)
        if missing:
            raise ValueError(f"KV-ZCH tables {missing} are not in the model; tables found: {sorted(declared)}")
        return tables


_WRAPPED_WHY = {
    "FeatureProcessedEmbeddingBagCollection": "KV-ZCH tables are sharded row-wise, where TorchRec passes per-sample "
    "weights no gradient, so its feature processor's weights would never train; fix: give that feature an ordinary "
    "table, or compute the weights outside the model (a weighted EmbeddingBagCollection)",
    "ManagedCollisionEmbeddingBagCollection": "a KV-ZCH table gives every id a row of its own (zero-collision), and "
    "the managed-collision module would remap ids on each rank apart; fix: drop it and look the raw ids up",
}
_WRAPPED_WHY["ManagedCollisionEmbeddingCollection"] = _WRAPPED_WHY["ManagedCollisionEmbeddingBagCollection"]


def _wrapped(module: nn.Module) -> dict[int, str]:
    """The embedding modules inside TorchRec's feature-processed or managed-collision modules (by
    ``id``), with the wrapper's class name."""
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    return {id(c): type(m).__name__ for m in module.modules()
            if isinstance(m, (FeatureProcessedEmbeddingBagCollection, BaseManagedCollisionEmbeddingCollection))
            for c in m.modules() if c is not m}


def _kvzch_kernel(config, constraints: ParameterConstraints | None) -> str | None:
    """The virtual-table kernel a table is declared on, or None for an ordinary table."""
    kernels = getattr(constraints, "compute_kernels", None)
    virtual = [k for k in kernels or () if k in VIRTUAL_KERNELS]
    if not (virtual or config.use_virtual_table or isinstance(constraints, KVZCHConstraints)):
        return None
    if kernels and not virtual:
        raise ValueError(f"KV-ZCH table '{config.name}': constraint compute_kernels={kernels} has no "
                         f"virtual-table kernel; a table declared with use_virtual_table=True (or "
                         f"KVZCHConstraints) is planned on one of {list(VIRTUAL_KERNELS)}")
    return virtual[0] if virtual else KVZCH_KERNEL


def _pinned(name: str, constraints: ParameterConstraints | None, kernel: str) -> ParameterConstraints:
    """The table's constraints restricted to ROW_WISE on ``kernel``."""
    constraints = constraints if constraints is not None else ParameterConstraints()
    current = constraints.sharding_types
    if current is not None and ROW_WISE not in current:
        raise ValueError(f"KV-ZCH table '{name}': constraint sharding_types={current} excludes "
                         f"'{ROW_WISE}', the only sharding of KV-ZCH tables (by buckets)")
    constraints.sharding_types, constraints.compute_kernels = [ROW_WISE], [kernel]
    return constraints
