"""TorchRec-facing kernels: what a row-wise lookup runs for a group of KV-ZCH tables.

TorchRec hands a kernel the group's features as a KeyedJaggedTensor whose ids are *local*:
row-wise input distribution subtracts the shard's first row. A KV-ZCH table is keyed by global
ids, so the kernel adds the shard's row offset back before the store sees them. The shard's
rows must be whole buckets; the bucket range is derived from the shard metadata and checked
against our own split.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig, ShardedEmbeddingTable
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import pooling_type_to_pooling_mode
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvzch.torchrec.state_dict import table_entries
from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.params import BucketRange, EvictionKind, KVZCHTableParams

FUSED_PARAMS_KEY = "kvzch_tables"  # fused-params entry carrying the tables' KVZCHTableParams
BUDGET_KEY = "kvzch_rank_budget"  # fused-params entry carrying the rank's SharedBudget, if any


def _score_source(params: KVZCHTableParams, table: ShardedEmbeddingTable, weighted: bool) -> dict[str, float] | bool:
    """Where a feature-score table's scores come from, as upstream collects them: a score per
    feature ({feature: score}: TorchRec's automatic collection) or the KJT's weights (True),
    which then never scale the lookup. False: the table keeps no scores."""
    policy = params.eviction
    if EvictionKind(policy.kind) is not EvictionKind.FEATURE_SCORE:
        return False
    if not policy.scores_from_weights:
        return {f: policy.feature_score(f, params.name) for f in table.feature_names}
    if weighted:
        raise ValueError(
            f"KV-ZCH table '{params.name}': its feature scores would be the KJT's weights, which in a "
            "weighted EmbeddingBagCollection are pooling weights too (upstream then drops the pooling); "
            "fix: give scores per feature (eviction.feature_scores, or TorchRec's "
            "enable_auto_feature_score_collection with feature_score_mapping), or use an unweighted module")
    return True


def _scores(source: dict[str, float] | bool, kjt: KeyedJaggedTensor) -> torch.Tensor | None:
    """The score of each id of ``kjt`` (see ``_score_source``), or None."""
    if source is True:
        weights = kjt.weights_or_none()
        return None if weights is None else weights.float()
    if not source:
        return None
    per_feature = torch.tensor([source[k] for k in kjt.keys()], dtype=torch.float32, device=kjt.values().device)
    return per_feature.repeat_interleave(torch.tensor(kjt.length_per_key(), device=per_feature.device))


def shard_bucket_range(params: KVZCHTableParams, table: ShardedEmbeddingTable,
                       pg: dist.ProcessGroup | None) -> BucketRange:
    """The buckets of this shard, from TorchRec's shard metadata, checked against our split."""
    offset = table.local_metadata.shard_offsets[0] if table.local_metadata else 0
    rows, size = table.local_rows, params.bucket_size
    if offset % size or rows % size:
        raise ValueError(
            f"KV-ZCH table '{params.name}': shard rows [{offset}, {offset + rows}) are not whole "
            f"buckets of {size} ids; declare the table with use_virtual_table=True and "
            f"total_num_buckets={params.total_num_buckets} (kvzch_embedding_bag_config does)"
        )
    got = BucketRange(offset // size, (offset + rows) // size, size)
    if pg is not None and dist.is_initialized():
        want = params.bucket_range(dist.get_rank(pg), dist.get_world_size(pg))
        if want != got:
            raise ValueError(f"KV-ZCH table '{params.name}': TorchRec placed buckets "
                             f"[{got.start}, {got.end}) on this rank, expected [{want.start}, {want.end})")
    return got


class KVZCHFusedOptimizer(FusedOptimizer):
    """The optimizer step runs inside backward (fbgemm's fused update); step() has nothing to do.
    Optimizer state lives in the row store; ``state`` holds views of it, refreshed by
    ``set_state`` whenever the model's state dict is taken (row counts change over time), and
    of the empty tables before that.

    Param groups carry ``lr`` and ``eps``, one group per set of tables declared with the same
    values (as TorchRec gives one fused optimizer per TBE, whose tables share them). Set by
    hand, by torch's LR schedulers or by TorchRec's warm-up, they reach the tables (``tbes``) at
    the next ``zero_grad()`` or ``step()``, where TorchRec's fused optimizers apply their lr, so
    that KV-ZCH and ordinary tables of a model change lr at the same update."""

    def __init__(self, params: dict[str, torch.Tensor], tables: dict[str, KVZCHTableParams], tbes) -> None:
        self._tbes = tbes  # {table: TableTBE}
        self._table_of = {id(p): key.split(".")[-2] for key, p in params.items()}  # "<t>.weight"
        groups: dict[tuple[float, float], list[torch.Tensor]] = {}
        for param in params.values():
            table = tables[self._table_of[id(param)]]
            groups.setdefault((table.learning_rate, table.eps), []).append(param)
        super().__init__(params, {}, [{"params": ps, "lr": lr, "eps": eps}
                                      for (lr, eps), ps in groups.items()])

    def hyper_parameters(self) -> dict[str, tuple[float, float]]:
        """``{table: (lr, eps)}`` as the param groups say now."""
        return {self._table_of[id(p)]: (g["lr"], g["eps"]) for g in self.param_groups for p in g["params"]}

    def set_state(self, by_table: dict[str, dict]) -> None:
        """Point each table's state at fresh views: ``{table: {state name: tensor}}``."""
        for param in self.params.values():
            table_state = by_table.get(self._table_of[id(param)])
            if table_state:
                self.state[param] = table_state

    def step(self, closure: Any = None) -> None:
        self._apply()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._apply()

    def _apply(self) -> None:
        for name, hyper in self.hyper_parameters().items():
            self._tbes[name].set_hyper_parameters(*hyper)


class KVZCHEmbeddingKernel(BaseEmbedding, FusedOptimizerModule):
    """All KV-ZCH tables of one group on this rank; pooled (EBC) or sequence (EC) output."""

    # No fbgemm module of TorchRec's kind: TorchRec's prefetch loop, which reads each kernel's
    # ``emb_module`` where a caching table shares the lookup, passes over this one (lookups.py
    # prefetches it).
    emb_module = None

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                 device: torch.device | None, sharding_type: ShardingType | None,
                 pooled: bool) -> None:
        """Pooled kernels pool as TorchRec's own would for ``sharding_type``: under row-wise
        sharding MEAN runs as SUM here and TorchRec divides after the reduce-scatter."""
        BaseEmbedding.__init__(self)
        self._config = config
        self._pg = pg
        self._pooled = pooled
        device = device or torch.device("cpu")
        fused = config.fused_params or {}
        by_name = {p.name: p for p in fused.get(FUSED_PARAMS_KEY, ())}
        self.tables = nn.ModuleDict()
        self._row_offsets: list[int] = []
        self._features_per_table: list[int] = []
        self._score_sources: list[dict[str, float] | bool] = []  # per table, see _score_source
        # TorchRec hands weights to every kernel of a weighted module only; a KJT may carry
        # others (e.g. feature scores), which must never scale a lookup.
        self._weighted = pooled and config.is_weighted
        for table in config.embedding_tables:
            params = by_name.get(table.name)
            if params is None:
                raise ValueError(
                    f"table '{table.name}' is planned with the KV-ZCH kernel but carries no "
                    "KVZCHTableParams; shard it with kvzch_sharders()"
                )
            if (params.embedding_dim, params.num_embeddings) != (table.local_cols, table.num_embeddings):
                raise ValueError(
                    f"KV-ZCH table '{table.name}': the model declares {table.num_embeddings} x "
                    f"{table.local_cols} but its KVZCHTableParams say {params.num_embeddings} x "
                    f"{params.embedding_dim}; make them agree"
                )
            buckets = shard_bucket_range(params, table, pg)
            pooling = (pooling_type_to_pooling_mode(config.pooling, sharding_type) if pooled
                       else PoolingMode.NONE)
            self.tables[table.name] = TableTBE(
                params, buckets, table.num_features(), pooling, device,
                initial_rows=params.expected_shard_rows(buckets), budget=fused.get(BUDGET_KEY))
            self._row_offsets.append(buckets.id_start)
            self._features_per_table.append(table.num_features())
            self._score_sources.append(_score_source(params, table, self._weighted))
        self._optim = KVZCHFusedOptimizer(
            {f"{name}.weight": torch.empty(0) for name in self.tables},
            {name: tbe.params for name, tbe in self.tables.items()}, self.tables)
        # Views of the empty tables until the model's first state dict: an optimizer state dict
        # taken before it then holds entries a save refuses as another moment's, instead of
        # none, which would save as a model checkpointed without its optimizer.
        self._optim.set_state(table_entries(self.tables.items(), "", pg, empty=True)[1])
        if config.enable_embedding_update:  # an embedding cache, written by DMP.write (writes.py)
            for tbe in self.tables.values():
                tbe.embedding_cache = True

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    def forward(self, features: KeyedJaggedTensor, **vbe: Any) -> torch.Tensor:
        if features.variable_stride_per_key() or vbe:
            raise NotImplementedError(
                "KV-ZCH tables do not support variable batch sizes per feature (VBE) yet")
        outs = []
        for name, tbe, kjt, ids, source in self._per_table(features):
            outs.append(tbe(ids, kjt.offsets(), kjt.weights_or_none() if self._weighted else None,
                            _scores(source, kjt)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1 if self._pooled else 0)

    def prefetch(self, features: KeyedJaggedTensor, forward_stream: torch.cuda.Stream | None = None) -> None:
        """TorchRec's prefetch pipeline (``lookups.py``): each table's lookup of the next batch now,
        between this batch's forward and backward (``TableTBE.prefetch``)."""
        for _, tbe, kjt, ids, source in self._per_table(features):
            tbe.prefetch(ids, kjt.offsets(), _scores(source, kjt), forward_stream)

    def update(self, embeddings: KeyedJaggedTensor) -> None:
        """TorchRec's embedding write, after its write distribution: the KJT's (local) ids, each
        with its row in ``weights()`` ``[n, D]``, become the rows of this rank's stores."""
        for _, tbe, kjt, ids, _ in self._per_table(embeddings):
            tbe.write(ids, kjt.weights())

    def _per_table(self, features: KeyedJaggedTensor):
        """Per table: (name, its ``TableTBE``, its part of ``features``, their global ids, its score source)."""
        parts = features.split(self._features_per_table) if len(self.tables) > 1 else [features]
        for (name, tbe), kjt, offset, source in zip(self.tables.items(), parts, self._row_offsets, self._score_sources):
            yield name, tbe, kjt, kjt.values().long() + offset, source

    # -- what TorchRec's sharded modules call on a kernel ------------------------------------
    # The rows live in the store, not in parameters: nothing is exposed as a parameter or
    # buffer (checkpoints go through state-dict hooks over KV tensors).
    def named_parameters_by_table(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from ()

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from ()

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from ()

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        return {} if destination is None else destination

    def flush(self) -> None:
        pass

    def get_named_split_embedding_weights_snapshot(self, prefix: str = "") -> Iterator[tuple]:
        """What TorchRec's KV-ZCH kernels return: per table ``(name, weight, weight_id, bucket,
        metadata)`` (``name`` after ``prefix.``), ShardedTensors over one snapshot of its rows,
        exactly the table's state-dict entries (``metadata``: the header words, None with whole
        rows, which carry them). The weight's local shards are ``PartiallyMaterializedTensor`` s
        over our ``KVTensor`` (``get_weights_by_ids``, ``wrapped.set_weights_and_ids``,
        ``wrapped.set_range``). A collective on the kernel's process group, like a state dict."""
        entries, _ = table_entries(self.tables.items(), "", self._pg)
        for name in self.tables:
            yield (f"{prefix}.{name}" if prefix else name, entries[f"{name}.weight"], entries[f"{name}.weight_id"],
                   entries[f"{name}.bucket"], entries.get(f"{name}.metaheader"))

    def purge(self) -> None:
        pass

