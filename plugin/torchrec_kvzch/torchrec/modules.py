"""TorchRec's CUSTOMIZED_KERNEL extension chain, subclassed for KV-ZCH tables.

sharder.shard() -> sharded EBC/EC -> row-wise sharding -> lookup (``lookups.py``) -> KVZCHEmbeddingKernel.

Every step is a subclass of a public TorchRec class overriding one factory method; tables on
other kernels (e.g. FUSED) in the same module go through the stock code unchanged. The
sharders also offer ROW_WISE on CPU, where TorchRec's stock sharders offer it only on CUDA
(its row-wise input distribution works on CPU with gloo).

Plans name KV-ZCH tables by TorchRec's virtual-table kernels (``dram_virtual_table``...). The
sharder moves them to ``STORE_KERNEL`` (TorchRec's ``customized_kernel``) before the sharded
module is built, each with its ``KVZCHTableParams``: TorchRec's own code for virtual tables
(state dicts of fbgemm's KV backends) then stays out of the way of ours.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.tensor_dict import maybe_td_to_kjt

from torchrec_kvzch.torchrec.admission_state import ADMISSION_ENTRIES, admission_load
from torchrec_kvzch.torchrec.materialised import materialised_load
from torchrec_kvzch.torchrec.state_dict import TABLE_ENTRIES, UPSTREAM_ONLY_ENTRIES, kv_view, table_entries
from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.params import KVZCHTableParams, RankBudget
from torchrec_kvzch.torchrec.declarations import (
    KVZCH_KERNEL, VIRTUAL_KERNELS, table_fused_params, table_own_fields, table_params)
from torchrec_kvzch.torchrec.device_cache import with_device_cache
from torchrec_kvzch.torchrec.embedding_kernel import BUDGET_KEY, FUSED_PARAMS_KEY
from torchrec_kvzch.torchrec.eviction_declarations import check_feature_score_module
from torchrec_kvzch.torchrec.in_backward import in_backward_params
from torchrec_kvzch.torchrec.lookups import STORE_KERNEL, KVZCHRwPooledSharding, KVZCHRwSequenceSharding
from torchrec_kvzch.torchrec.pretrained import sharded_with_rows, without_kvzch_weights
from torchrec_kvzch.torchrec.tables import kvzch_kernels, kvzch_tables
from torchrec_kvzch.torchrec.validation import BatchChecker
from torchrec_kvzch.table.rank_budget import SharedBudget
from torchrec_kvzch.table.tbe import WEIGHTED_MEAN_EPS
from torchrec_kvzch.table.layout import RowPart

ROW_WISE = ShardingType.ROW_WISE.value
# Shardings whose kernels pool MEAN as SUM (``pooling_type_to_pooling_mode``; grid shards look
# up as table-row-wise): the EBC divides their MEAN outputs after the output dist.
SUM_POOLED_MEAN = {ROW_WISE, ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value}


@dataclasses.dataclass
class KVZCHParameterSharding(ParameterSharding):
    """A table's placement plus the KV-ZCH options of its module's KV-ZCH tables. TorchRec merges
    ``get_additional_fused_params()`` into the fused params its kernel is built from, and groups
    tables with equal fused params into one kernel: giving every KV-ZCH table of a module the
    same tuple lets tables of different dims share one kernel."""

    kvzch: KVZCHTableParams | None = None
    kvzch_group: tuple[KVZCHTableParams, ...] = ()
    budget: SharedBudget | None = None  # the rank budget of the sharder that shards the module

    def get_additional_fused_params(self) -> dict[str, Any]:
        extra = {FUSED_PARAMS_KEY: self.kvzch_group or (self.kvzch,)}
        return {**extra, BUDGET_KEY: self.budget} if self.budget is not None else extra

    @classmethod
    def wrap(cls, sharding: ParameterSharding, params: KVZCHTableParams,
             group: tuple[KVZCHTableParams, ...] = (), budget: SharedBudget | None = None,
             **changes) -> "KVZCHParameterSharding":
        fields = {f.name: getattr(sharding, f.name) for f in dataclasses.fields(ParameterSharding)}
        return cls(**{**fields, **changes}, kvzch=params, kvzch_group=tuple(group), budget=budget)


def store_plan(configs, plan: dict[str, ParameterSharding], fused_params: dict | None,
               budget: SharedBudget | None = None, device: torch.device | None = None,
               in_backward: dict[str, dict] | None = None) -> dict[str, ParameterSharding]:
    """A module's plan with its KV-ZCH tables moved to ``STORE_KERNEL``, each carrying its parameters (from
    our planner, else its declarations, with the optimizer applied ``in_backward`` to its weight; on CUDA with
    TorchRec's cache declarations), the module's group of them and the rank ``budget``, which reach the
    kernel as fused params; other tables' entries unchanged."""
    in_backward = in_backward or {}
    check_feature_score_module(configs)  # (TorchRec's planner does not: its sharded module asserts it, nameless)
    by_name = {c.name: c for c in configs}
    chosen = {}
    for name, sharding in plan.items():
        kernel = sharding.compute_kernel
        if kernel not in VIRTUAL_KERNELS and kernel != STORE_KERNEL:
            if getattr(by_name.get(name), "use_virtual_table", False):  # (TorchRec's stock planner on CPU)
                raise ValueError(f"table '{name}' is declared use_virtual_table=True but planned on kernel "
                                 f"'{kernel}', as an ordinary table (TorchRec's planner does so on CPU); plan "
                                 "it with KVZCHShardingPlanner")
            continue
        explicit = sharding.kvzch if isinstance(sharding, KVZCHParameterSharding) else None
        if explicit is None and kernel == STORE_KERNEL:
            raise ValueError(f"table '{name}' is planned on {STORE_KERNEL} without KV-ZCH "
                             f"parameters; plan it on {KVZCH_KERNEL} (KVZCHShardingPlanner does)")
        fused, kv = table_fused_params(fused_params, sharding, in_backward.get(name)), sharding.key_value_params
        params = table_params(by_name[name], KVZCH_KERNEL if kernel == STORE_KERNEL else kernel, kv, fused, explicit,
                              own={**in_backward.get(name, {}), **table_own_fields(sharding)})
        cuda = device is not None and torch.device(device).type == "cuda"  # (host rows under a GPU cache)
        params = with_device_cache(params, fused, sharding.cache_params, kv, cuda)
        if sharding.sharding_type != ROW_WISE:
            raise ValueError(f"KV-ZCH table '{name}' is planned {sharding.sharding_type}; KV-ZCH "
                             f"tables are sharded row-wise by buckets (sharding_types=['{ROW_WISE}'])")
        chosen[name] = params
    group = tuple(chosen[n] for n in sorted(chosen))
    return {name: (KVZCHParameterSharding.wrap(s, chosen[name], group, budget, compute_kernel=STORE_KERNEL)
                   if name in chosen else s) for name, s in plan.items()}


# -- sharded modules ---------------------------------------------------------------------------
class _KVZCHModuleMixin:
    """What TorchRec's sharded modules need changed for tables whose rows live in a store."""

    _configs_attr: str  # the instance attribute listing the module's table configs
    _tables_prefix: str  # where tables sit in the state dict ("embedding_bags." / "embeddings.")
    _built = False  # until TorchRec's __init__, which copies the unsharded module's state, is over

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._built = True
        # TorchRec leaves CUSTOMIZED_KERNEL tables out of its state dict; ours add them.
        self._register_state_dict_hook(_add_kvzch_entries)
        self._register_load_state_dict_pre_hook(_take_kvzch_entries, with_module=True)
        self.register_load_state_dict_post_hook(_load_kvzch_entries)
        scored = {t for t, ps in self.module_sharding_plan.items()  # (their KJT weights are scores: >= 0)
                  if getattr(ps, "kvzch", None) is not None and ps.kvzch.eviction.scores_from_weights}
        kvzch = {t for t, ps in self.module_sharding_plan.items() if getattr(ps, "kvzch", None) is not None}
        self._check_batch = BatchChecker(getattr(self, self._configs_attr), scored, kvzch)

    def input_dist(self, ctx, features, *args, **kwargs):
        # A store makes rows of whatever ids arrive: refuse a bad batch before it is routed.
        if isinstance(features, KeyedJaggedTensor):
            self._check_batch(features)
        return super().input_dist(ctx, features, *args, **kwargs)

    def _kvzch_tables(self) -> set[str]:
        return {t for t, ps in self.module_sharding_plan.items() if ps.compute_kernel == STORE_KERNEL}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if not self._built:  # TorchRec's __init__, copying the unsharded module
            keys = {f"{self._tables_prefix}{t}.weight" for t in self._kvzch_tables()}
            state_dict = without_kvzch_weights(state_dict, keys)
        self._kvzch_strict = strict  # (torch hands its hooks strict=True whatever the caller asked)
        try:
            return super().load_state_dict(state_dict, strict, assign)
        finally:
            del self._kvzch_strict

    def reset_parameters(self) -> None:
        # Stock reset re-initialises every table's dense weight; ours have none (the store
        # creates rows id-seeded on first use). Run it over the other tables only.
        configs = getattr(self, self._configs_attr)
        kvzch = self._kvzch_tables()
        setattr(self, self._configs_attr, [c for c in configs if c.name not in kvzch])
        try:
            super().reset_parameters()
        finally:
            setattr(self, self._configs_attr, configs)


class KVZCHShardedEmbeddingBagCollection(_KVZCHModuleMixin, ShardedEmbeddingBagCollection):
    _configs_attr = "_embedding_bag_configs"
    _tables_prefix = "embedding_bags."

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        configs = self._embedding_bag_configs
        sharding = {c.name: self.module_sharding_plan[c.name].sharding_type for c in configs}
        # output key -> the feature whose bag lengths divide it (see input_dist)
        self._mean_divided: dict[str, str] = {
            name: feature
            for config, names in zip(configs, get_embedding_names_by_table(configs))
            if config.pooling == PoolingType.MEAN and sharding[config.name] in SUM_POOLED_MEAN
            for name, feature in zip(names, config.feature_names)}
        self._has_mean_pooling_callback = bool(self._mean_divided)
        # fbgemm's CPU MEAN kernels ("MEAN pooling will not work with indice_weights") divide
        # a weighted bag by L in the forward but not in the gradient: no divisor can fix that.
        if self._is_weighted and getattr(self._device, "type", "cpu") == "cpu":
            for config in configs:
                if (config.pooling == PoolingType.MEAN
                        and sharding[config.name] not in SUM_POOLED_MEAN):
                    raise ValueError(
                        f"table '{config.name}': MEAN pooling with per-sample weights is wrong "
                        f"under {sharding[config.name]} sharding on CPU (fbgemm's CPU MEAN kernel "
                        "leaves the 1/L out of the gradient); shard it row-wise, where it is "
                        "pooled as SUM and divided after the reduce-scatter, or pool SUM")

    def input_dist(self, ctx, features, *args, **kwargs):
        """Replaces the divisor TorchRec's ``input_dist`` leaves in ``ctx``
        (``_create_mean_pooling_divisor``). Once any row-wise table pools MEAN, TorchRec divides
        every output by its feature's bag lengths (sums of weights if weighted) except row-wise
        SUM features: table-wise SUM outputs came back as sum/L, table-wise MEAN ones (pooled
        MEAN by their own kernel) as sum/L^2, the 1 of a row-wise SUM feature went only to the
        feature's first output, whichever table that was, and grid MEAN tables (pooled as SUM
        too) did not count. Ours is per output, for MEAN tables of ``SUM_POOLED_MEAN``
        shardings: the bag length, at least 1 (an empty bag stays 0), or in a weighted module
        TorchRec's sum of the bag's weights + 1e-6 (a weighted MEAN is sum(w * row) / sum(w),
        where fbgemm's table-wise kernels divide by L); else 1. Variable batch sizes are
        expanded by the inverse indices, as TorchRec does. What no divisor fixes, weighted MEAN
        on fbgemm's CPU MEAN kernels, ``__init__`` refuses."""
        if not self._has_mean_pooling_callback:
            return super().input_dist(ctx, features, *args, **kwargs)
        features = maybe_td_to_kjt(features)
        awaitable = super().input_dist(ctx, features, *args, **kwargs)
        ctx.divisor = self._mean_divisor(features)
        return awaitable

    def _mean_divisor(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """[batch, output columns], laid out as TorchRec's pooled output."""
        lengths = features.lengths()
        weights = features.weights_or_none() if self._is_weighted else None
        if weights is not None:  # (TorchRec's eps; an empty bag divides by 1 below, and stays 0)
            sums = torch.ops.fbgemm.segment_sum_csr(1, features.offsets().int(), weights.float())
            lengths = torch.where(lengths > 0, sums + WEIGHTED_MEAN_EPS, 1.0)
        position = {key: i for i, key in enumerate(features.keys())}
        divided = set(self._mean_divided.values())
        if features.variable_stride_per_key():
            inverse_keys, inverse = features.inverse_indices()
            starts = list(itertools.accumulate(features.stride_per_key(), initial=0))
            bags = {f: lengths[starts[position[f]] + inverse[inverse_keys.index(f)]]
                    for f in divided}
        else:
            per_key = lengths.reshape(len(position), features.stride())
            bags = {f: per_key[position[f]] for f in divided}
        one = lengths.new_ones(())
        rows = [bags[self._mean_divided[name]] if name in self._mean_divided else one
                for name in self._embedding_names]
        divisor = torch.stack(torch.broadcast_tensors(*rows), dim=1).to(torch.float32)
        if weights is None:
            divisor = divisor.clamp_min(1)
        return divisor.repeat_interleave(self._dim_per_key, dim=1,
                                         output_size=sum(self._embedding_dims))

    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos, env, device=None,
                                      permute_embeddings=False, qcomm_codecs_registry=None):
        if sharding_infos[0].param_sharding.sharding_type != ROW_WISE:
            return super().create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry)
        if device is not None and device.type == "meta":
            replace_placement_with_meta_device(sharding_infos)
        return KVZCHRwPooledSharding(sharding_infos, env, device,
                                     qcomm_codecs_registry=qcomm_codecs_registry)


class KVZCHShardedEmbeddingCollection(_KVZCHModuleMixin, ShardedEmbeddingCollection):
    _configs_attr = "_embedding_configs"
    _tables_prefix = "embeddings."

    @classmethod
    def create_embedding_sharding(cls, sharding_type, sharding_infos, env, device=None,
                                  qcomm_codecs_registry=None):
        if sharding_type != ROW_WISE:
            return super().create_embedding_sharding(sharding_type, sharding_infos, env, device,
                                                     qcomm_codecs_registry)
        return KVZCHRwSequenceSharding(sharding_infos=sharding_infos, env=env, device=device,
                                       qcomm_codecs_registry=qcomm_codecs_registry)


def _add_kvzch_entries(module, destination, prefix, local_metadata):
    entries, optimizer_state = table_entries(kvzch_tables(module), prefix + module._tables_prefix,
                                             module._env.process_group)
    destination.update(entries)
    # The fused optimizer's state (what its state_dict() returns) follows the same snapshot.
    for kernel in kvzch_kernels(module):
        kernel.fused_optimizer.set_state(optimizer_state)
    return destination


def _take_kvzch_entries(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs) -> None:
    """Removes our tables' entries before TorchRec's own checks, and upstream TorchRec's
    ``{table}.metadata`` (its only entry we lack; any other unknown key is left for TorchRec's
    strict check to report); a table without its ``weight`` entry is reported missing. Entries
    that are this model's own views (a state dict loaded in place by DCP) need nothing more.
    Others are rows to load, at the same world size (``torch.load``, upstream's materialised state
    dict, another model's, read chunk by chunk; upstream skips virtual-table weights in this path,
    we load them, since the rows are at hand): every table's are checked here, before torch copies
    anything (``materialised.py``), and ``_load_kvzch_entries`` loads them."""
    loads = []
    for name, tbe in kvzch_tables(module):
        base = f"{prefix}{module._tables_prefix}{name}."
        entries = {k: state_dict.pop(base + k) for k in TABLE_ENTRIES + UPSTREAM_ONLY_ENTRIES
                   if base + k in state_dict}
        admission = {k: state_dict.pop(base + k) for k in ADMISSION_ENTRIES if base + k in state_dict}
        if "weight" not in entries:
            missing_keys.append(base + "weight")
            continue
        view = kv_view(entries["weight"])
        if view is None or view.store is not tbe.store:
            part = RowPart.ROW if tbe.params.backend_return_whole_row else RowPart.WEIGHT
            loads += [materialised_load(KVTensor(tbe.store, part), entries), admission_load(tbe, admission)]
    module._kvzch_loads = (loads, prefix, error_msgs)


def _load_kvzch_entries(module, incompatible_keys) -> None:
    """Load the rows ``_take_kvzch_entries`` checked, unless torch is about to refuse the load (a
    strict ``load_state_dict`` of this module with keys missing or unexpected, or errors): its
    ordinary parameters are copied by then, as torch copies them, but the KV-ZCH rows stay. The
    fused optimizer's state views are then rebuilt over the loaded rows, so that its
    ``load_state_dict`` writes the matching optimizer state into them (by each row's id when it
    comes from another model's views)."""
    loads, prefix, error_msgs = module.__dict__.pop("_kvzch_loads", ((), "", ()))
    strict = module.__dict__.get("_kvzch_strict", False)  # (unknown, loaded by a parent: torch's way)
    if not loads or error_msgs or (strict and (incompatible_keys.missing_keys or incompatible_keys.unexpected_keys)):
        return
    for load in loads:
        load()
    _add_kvzch_entries(module, {}, prefix, None)


# -- sharders ----------------------------------------------------------------------------------
class _KVZCHSharderMixin:
    _tables_attr: str  # where the unsharded module keeps its tables

    def __init__(self, *args, shared_budget: SharedBudget | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shared_budget = shared_budget

    def _build(self, module, params, build):
        """``build()``, with the rows of KV-ZCH tables materialised before sharding loaded
        into their stores (``pretrained.py``)."""
        names = [n for n, s in params.items() if s.compute_kernel == STORE_KERNEL]
        return sharded_with_rows(module, self._tables_attr, names, build)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        return types if ROW_WISE in types else [*types, ROW_WISE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """TorchRec's kernels, and row-wise its virtual-table ones on every device (TorchRec
        guards them: only a table constrained to one is planned on one)."""
        kernels = list(super().compute_kernels(sharding_type, compute_device_type))
        if sharding_type == ROW_WISE:
            kernels += [k for k in VIRTUAL_KERNELS if k not in kernels]
        return kernels


class KVZCHEmbeddingBagCollectionSharder(_KVZCHSharderMixin, EmbeddingBagCollectionSharder):
    """Shards EmbeddingBagCollections whose KV-ZCH tables use our kernel; other tables as usual."""

    _tables_attr = "embedding_bags"

    def shard(self, module, params, env, device=None, module_fqn=None):
        params = store_plan(module.embedding_bag_configs(), params, self.fused_params, self.shared_budget, device,
                            in_backward_params(module, self._tables_attr))
        return self._build(module, params, lambda: KVZCHShardedEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=params, env=env,
            fused_params=self.fused_params, device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite))

    @property
    def sharded_module_type(self):
        return KVZCHShardedEmbeddingBagCollection


class KVZCHEmbeddingCollectionSharder(_KVZCHSharderMixin, EmbeddingCollectionSharder):
    """Shards EmbeddingCollections whose KV-ZCH tables use our kernel; other tables as usual."""

    _tables_attr = "embeddings"

    def shard(self, module, params, env, device=None, module_fqn=None):
        params = store_plan(module.embedding_configs(), params, self.fused_params, self.shared_budget, device,
                            in_backward_params(module, self._tables_attr))
        return self._build(module, params, lambda: KVZCHShardedEmbeddingCollection(
            module, params, env, self.fused_params, device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup, module_fqn=module_fqn))

    @property
    def sharded_module_type(self):
        return KVZCHShardedEmbeddingCollection


def kvzch_sharders(fused_params: dict[str, Any] | None = None,
                   rank_budget: RankBudget | None = None) -> list:
    """Sharders for models mixing KV-ZCH and ordinary tables. ``fused_params`` configure every
    table, e.g. ``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}``;
    a KV-ZCH table's ``KVZCHTableParams`` fields that are set win over them (see
    ``declarations``), and a fused param the KV-ZCH kernel cannot honour is refused.
    ``rank_budget``: one memory budget shared by every KV-ZCH table shard these sharders
    create on this rank (``sharders[0].shared_budget`` reports its usage)."""
    shared = SharedBudget(rank_budget) if rank_budget is not None else None
    return [KVZCHEmbeddingBagCollectionSharder(fused_params=fused_params, shared_budget=shared),
            KVZCHEmbeddingCollectionSharder(fused_params=fused_params, shared_budget=shared)]
