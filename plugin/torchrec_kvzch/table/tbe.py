"""fbgemm's TBE bound to one KV-ZCH table shard's rows: ids -> store slots -> TBE over the rows.

fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` does the lookup, the backward and the fused
optimizer update. Instead of owning its weights it is bound, before every forward, to the row
store's arrays: its weights are ``store.weights`` and its optimizer state ``store.optimizer``,
and the ids it sees are the store's dense slots. So the update lands directly in the store,
with no gradient the size of the table and no copy of the rows. Under a device cache (rows in
host memory, ``row_cache.py``) the TBE is fbgemm's managed-caching one, bound to the store's
host rows and to the cache the store owns; evaluation then pools through a dense TBE of its own.

One hazard follows: the fused backward writes into the arrays the forward saw. If the store
reallocated or moved rows in between, those writes would go to a dropped buffer or the wrong
rows. So each training forward announces its update to the store (``expect_update``), which
then neither evicts nor grows until the update starts (``update_started``, from the output's
gradient hook, or when the output's graph is dropped without a backward); the store owns that
state, with its clock, eviction and budget. Forwards may run ahead of backwards (TorchRec's
semi-sync pipeline): each has its own pending update, and rows a later forward creates are
written in place beside them, which autograd must not take for a change of what an earlier
forward saved (the TBE sees the arrays through aliases with version counters of their own).
"""

from __future__ import annotations

import math

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn

from torchrec_kvzch.params import AdmissionDefault, BucketRange, CachePolicy, KVZCHTableParams, OptimizerKind
from torchrec_kvzch.table.rank_budget import SharedBudget
from torchrec_kvzch.table.pending import UpdateHook
from torchrec_kvzch.table.row_optimizers import Hyper, OwnUpdate, apply, lookup_gradients, sample_weight_gradients
from torchrec_kvzch.table.row_store import RowStore

_PRECISION = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}
# Row-wise sharding's weighted MEAN divides a bag's sum(w * row) by sum(w) + this (TorchRec's,
# ``_create_mean_pooling_divisor``); training's EBC and serving both divide so.
WEIGHTED_MEAN_EPS = 1e-6


class TableTBE(nn.Module):
    """Lookup + fused update for the features of one KV-ZCH table on one rank (``budget``: the
    rank budget its store shares, ``SharedBudget``).

    ``forward(ids, offsets, per_sample_weights)`` takes global ids in TBE's jagged layout
    (``offsets`` over features x batch, features of this table only) and returns pooled
    ``[B, F * D]`` (``pooling`` SUM or MEAN) or per-id ``[len(ids), D]`` rows (NONE).

    With admission (``params.admission``), ids the store has not admitted yet read the default
    row instead: zeros, or ``default``, a one-row TBE of its own trained by the same fused
    optimizer. Pooled outputs combine both parts as one bag would (MEAN over all of its ids).
    """

    def __init__(
        self,
        params: KVZCHTableParams,
        bucket_range: BucketRange,
        num_features: int = 1,
        pooling: PoolingMode = PoolingMode.SUM,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        initial_rows: int = 0,
        budget: SharedBudget | None = None,
    ) -> None:
        super().__init__()
        self.params = params
        self.device = torch.device(device)
        self.num_features = num_features
        on_cuda = self.device.type == "cuda"
        if params.embedding_dim % 4:
            raise ValueError(
                f"KV-ZCH table '{params.name}': embedding_dim {params.embedding_dim} is not a "
                "multiple of 4, which fbgemm's TBE kernels require; pad the dimension"
            )
        self.store = RowStore(params, bucket_range, self.device, backend, initial_rows, budget)
        location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
        # ``params.own_update`` (Adam, row-wise Adagrad with L2 decay, fp16 rows with a decay): the table's
        # own update (row_optimizers.py) in the backward of ``OwnUpdate``; fbgemm's TBE only looks up.
        self._own = params.own_update
        # Else weight decay: fbgemm's SGD has none and its CPU rowwise Adagrad drops it (measured:
        # tests/test_weight_decay.py), so the update hook shrinks the rows first (``_decay``).
        self._decays_itself = params.weight_decay > 0 and not self._own
        self._anchor = torch.zeros((), requires_grad=True)  # (what an own update's output hangs on)

        cache = self.store.row_cache

        def one_row_tbe(cached: bool = False) -> SplitTableBatchedEmbeddingBagsCodegen:
            # cached: fbgemm's managed-caching placement; its cache is the store's (row_cache.py)
            where = EmbeddingLocation.MANAGED_CACHING if cached else location
            algorithm = CacheAlgorithm.LFU if cached and cache.policy is CachePolicy.LFU else CacheAlgorithm.LRU
            return SplitTableBatchedEmbeddingBagsCodegen(
                [(1, params.embedding_dim, where, compute)],
                cache_sets=1 if cached else 0,
                cache_algorithm=algorithm,
                prefetch_pipeline=cached and cache.prefetch_pipeline,
                cache_precision=_PRECISION[params.dtype],
                feature_table_map=[0] * num_features,
                optimizer=(OptimizerKind.EXACT_SGD if self._own else params.optimizer).to_fbgemm(),
                learning_rate=params.learning_rate,
                eps=params.eps,
                pooling_mode=pooling,
                weights_precision=_PRECISION[params.dtype],
                stochastic_rounding=params.stochastic_rounding,
                output_dtype=SparseType.FP32,
                bounds_check_mode=BoundsCheckMode.NONE,  # slots come from the store, always in range
                device=self.device,
            )

        self.pooling = pooling
        self.tbe = one_row_tbe(cache is not None)  # its one placeholder row: the store's rows are bound in _bind()
        # Evaluation binds a batch's rows densely: with a device cache, to a TBE of its own.
        self._dense = self.tbe if cache is None else one_row_tbe()
        self.default: SplitTableBatchedEmbeddingBagsCodegen | None = None
        if params.admission.enabled and params.admission.default is AdmissionDefault.TRAINABLE:
            self.default = one_row_tbe()  # the shared row of ids not admitted yet, from zeros
            with torch.no_grad():
                self.default.split_embedding_weights()[0].zero_()
        # An own update's default row keeps its optimizer state here (fbgemm's TBE holds none).
        self._default_state = torch.zeros(1, self.store.layout.optimizer_floats, device=self.device)
        self._suffix = "dev" if on_cuda else "host"
        self._hyper = (params.learning_rate, params.eps)
        self._bound: torch.Tensor | None = None
        # TorchRec's enable_embedding_update: rows come from ``write``; a training lookup makes and
        # stamps rows as any other, but never trains them (upstream runs it without gradients).
        self.embedding_cache = False
        # Whether ``prefetch`` looks batches up ahead: under a device cache with ``prefetch_pipeline``
        # only (elsewhere it would gain little, and a lookup before a backward may not grow the store).
        self.prefetches = cache is not None and cache.prefetch_pipeline
        self._prefetched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, slots) of prefetched batches

    # -- forward ------------------------------------------------------------------------------
    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``scores``: per id, what a training lookup adds to a feature-score table's rows."""
        self._check_batch(ids, offsets, per_sample_weights)
        if not (self.training and torch.is_grad_enabled()):
            if self._prefetched:
                raise RuntimeError(f"KV-ZCH table '{self.params.name}': an evaluation lookup while a prefetched "
                                   "training batch waits for its forward; train it first")
            return self._evaluate(ids, offsets, per_sample_weights)
        if self.embedding_cache:  # (a training lookup, whose output trains nothing)
            with torch.no_grad():
                return self._train_lookup(ids, offsets, per_sample_weights, scores)
        return self._train_lookup(ids, offsets, per_sample_weights, scores)

    def _check_batch(self, ids, offsets, per_sample_weights) -> None:
        """Refuse a malformed batch before anything changes: fbgemm's TBE runs without bounds checks
        (the sharded modules check their batches before routing them). Offsets' values are checked
        where they are on the CPU: on a GPU that would cost a host sync per lookup."""
        n, bad = ids.numel(), None
        if offsets.dim() != 1 or offsets.numel() < 1:
            bad = f"offsets must be 1-D with one value at least, got shape {list(offsets.shape)}"
        elif per_sample_weights is not None and per_sample_weights.numel() != n:
            bad = f"{per_sample_weights.numel()} per-sample weights for {n} ids"
        elif offsets.device.type == "cpu" and (int(offsets[0]) != 0 or int(offsets[-1]) != n
                                               or bool((offsets[1:] < offsets[:-1]).any())):
            bad = f"offsets must rise from 0 to the number of ids, {n}; got {offsets.tolist()[:8]}..."
        if bad is not None:
            raise ValueError(f"KV-ZCH table '{self.params.name}': {bad}; fix: one weight per id, offsets from 0 up")

    def _train_lookup(self, ids, offsets, per_sample_weights, scores) -> torch.Tensor:
        if self.store.row_cache is not None and self.store.pending_update is not None:
            raise RuntimeError(f"KV-ZCH table '{self.params.name}': a training forward before the previous one's "
                               "backward (a semi-sync pipeline) under a device cache: its cache fill could drop rows "
                               "the pending update writes; run each backward first (TrainPipelineSparseDist)")
        if self._prefetched:  # (TorchRec's prefetch pipeline looked this batch up already: prefetch())
            seen, slots = self._prefetched.pop(0)
            if seen.shape != ids.shape or not torch.equal(seen, ids):
                raise RuntimeError(f"KV-ZCH table '{self.params.name}': a training forward of other ids than the batch "
                                   "prefetched for it; prefetch each batch once, in the order of the forwards")
        else:
            slots = self.store.lookup_for_update(ids, scores)
        self._bind()
        admitted = slots >= 0 if self.store.admission is not None else None
        default_used = not (admitted is None or bool(admitted.all()))
        if not default_used:
            out = self._lookup(self.tbe, slots, offsets.long(), per_sample_weights)
        else:
            out = self._with_default(slots, offsets.long(), per_sample_weights, admitted)
            slots = slots[admitted]
        if out.requires_grad:
            decay = (lambda: self._decay(slots, default_used)) if self._decays_itself else None
            out.register_hook(UpdateHook(self.store, self.store.expect_update(slots), decay))
        return out

    def prefetch(self, ids: torch.Tensor, offsets: torch.Tensor, scores: torch.Tensor | None = None,
                 forward_stream: torch.cuda.Stream | None = None) -> None:
        """TorchRec's prefetch pipeline, between a batch's forward and backward, for the next batch: its
        training lookup (clock step, admission, eviction, new rows) runs now, and its forward takes the
        slots, and fbgemm's TBE brings its rows into the device cache, locking them and the current
        batch's until each one's backward. Only where ``prefetches`` (a device cache with
        ``prefetch_pipeline``); evaluation batches look up in their forward."""
        if not (self.prefetches and self.training and torch.is_grad_enabled()) or self.embedding_cache:
            return
        self._check_batch(ids, offsets, None)
        if forward_stream is not None:  # (the store's id map and headers are not made for two streams at once)
            torch.cuda.current_stream().wait_stream(forward_stream)
        slots = self.store.lookup_for_update(ids, scores)
        self._bind()
        if forward_stream is not None:  # (made on the prefetch stream, read on the forward's)
            ids.record_stream(forward_stream)
            slots.record_stream(forward_stream)
        cached = self.store.row_cache is not None  # (always, but where a test forces prefetches on)
        if cached and (self.store.admission is None or bool((slots >= 0).all())):
            self.tbe.prefetch(slots, offsets.long(), forward_stream)  # (the forward's own indices; else it fills)
        self._prefetched.append((ids, slots))

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """TorchRec's embedding write: ``rows`` ``[n, D]`` become the weights of ``ids`` (rows created
        as needed; a repeated id takes its last row), stamped with the next step's clock so that
        deltas carry them. Refused between a forward and its backward, and for ids of other shards."""
        store = self.store
        if store.pending_update is not None:
            raise RuntimeError(f"KV-ZCH table '{self.params.name}': an embedding write cannot run between a "
                               "forward and its backward; write after the step")
        ids = ids.to(store.device).long()
        rows = torch.as_tensor(rows, device=store.device)
        if rows.dim() != 2 or rows.shape != (ids.numel(), self.params.embedding_dim):
            raise ValueError(f"KV-ZCH table '{self.params.name}': an embedding write needs one row of "
                             f"{self.params.embedding_dim} values per id, got {tuple(rows.shape)} for "
                             f"{ids.numel()} ids")
        unique, where = torch.unique(ids, return_inverse=True)
        last = torch.full_like(unique, -1).scatter_reduce_(0, where, torch.arange(ids.numel(), device=ids.device),
                                                          "amax")
        store.write_ids(unique, rows[last].to(store.weights.dtype), stamp=store.clock + 1)

    def _decay(self, slots: torch.Tensor, default_used: bool) -> None:
        """Decoupled weight decay, as the update starts: the rows it will write (and the default
        row, if the batch read it) shrink by ``lr * weight_decay``, then fbgemm's update
        subtracts its step, which does not depend on the weights - ``w * (1 - lr * wd) - step``
        (for SGD L2's step too)."""
        factor = 1.0 - self._hyper[0] * self.params.weight_decay
        with torch.no_grad():
            weights, cache = self.store.weights, self.store.row_cache
            rows = torch.unique(slots)
            if cache is not None:
                cache.scatter(rows, cache.gather(rows).float() * factor)
            else:
                weights[rows] = (weights[rows].float() * factor).to(weights.dtype)
            if default_used:
                self.default.split_embedding_weights()[0].data.mul_(factor)  # (.data: autograd saved it)

    def _with_default(self, slots, offsets, per_sample_weights, admitted) -> torch.Tensor:
        """The lookup of a batch part of whose ids read the default row (``admitted`` False):
        each part through its own TBE, on the same bags, then put together."""
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=slots.device), lengths)

        def part(mask: torch.Tensor):
            n = torch.bincount(bag[mask], minlength=lengths.numel())
            weights = per_sample_weights[mask] if per_sample_weights is not None else None
            return n, torch.cat([offsets[:1], offsets[0] + n.cumsum(0)]), weights

        n_in, off_in, w_in = part(admitted)
        n_out, off_out, w_out = part(~admitted)
        main = self._lookup(self.tbe, slots[admitted], off_in, w_in)
        other = (self._lookup(self.default, torch.zeros_like(slots[~admitted]), off_out, w_out)
                 if self.default is not None else None)
        if self.pooling == PoolingMode.NONE:
            rows = main.new_zeros(slots.numel(), main.shape[1])
            rows[admitted] = main
            if other is not None:
                rows[~admitted] = other
            return rows
        if self.pooling == PoolingMode.MEAN:  # each part's mean, weighted by its share of the bag
            total = (n_in + n_out).clamp(min=1).to(main.dtype)

            def scale(n: torch.Tensor) -> torch.Tensor:  # per bag -> the output's [B, F * D]
                share = (n / total).view(self.num_features, -1).t()
                return share.repeat_interleave(self.params.embedding_dim, dim=1)

            main = main * scale(n_in)
            other = other * scale(n_out) if other is not None else None
        return main + other if other is not None else main

    def _lookup(self, tbe, slots, offsets, per_sample_weights) -> torch.Tensor:
        """``tbe``'s training lookup: fbgemm's own autograd (its fused update), or ours."""
        if not self._own:
            return tbe(slots, offsets, per_sample_weights)
        return OwnUpdate.apply(self._anchor, self, tbe, slots, offsets, per_sample_weights)

    def own_update(self, tbe, grad: torch.Tensor, slots, offsets, per_sample_weights, step: int) -> torch.Tensor | None:
        """The own update of the rows ``tbe`` looked up (the store's, or the default row's) from
        the gradient of its output; returns the per-sample weights' gradient when they need one."""
        pooled, mean = self.pooling != PoolingMode.NONE, self.pooling == PoolingMode.MEAN
        bags, source = lookup_gradients(grad, offsets, pooled, mean, self.num_features)
        cache = self.store.row_cache if tbe is self.tbe else None
        if tbe is self.tbe:
            weights, state, keys = self.store.weights, self.store.optimizer, self.store.keys()
        else:  # (the default row: id -1 for its rounding draws)
            weights, state = tbe.split_embedding_weights()[0].data, self._default_state
            keys = torch.full((1,), -1, dtype=torch.long, device=self.device)
        with torch.no_grad():
            rows = None
            if cache is not None:  # the batch's rows through the device cache, updated as a block
                rows, slots = torch.unique(slots, return_inverse=True)
                weights, state, keys = cache.gather(rows), state[rows], keys[rows]
            weight_grads = None
            if per_sample_weights is not None and per_sample_weights.requires_grad:  # (before the update)
                weight_grads = sample_weight_gradients(bags, source, weights, slots)
            scale = per_sample_weights.detach() if per_sample_weights is not None else None
            apply(Hyper.of(self.params, *self._hyper), weights, state, keys, slots, bags, source, scale, step)
            if rows is not None:
                cache.scatter(rows, weights)
                self.store.optimizer[rows] = state
        return weight_grads

    def set_hyper_parameters(self, lr: float, eps: float) -> None:
        """The learning rate and eps of the next fused update (fbgemm reads them in backward)."""
        if (lr, eps) == self._hyper:
            return
        for name, value in (("lr", lr), ("eps", eps)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"KV-ZCH table '{self.params.name}': optimizer {name} must be a "
                                 f"finite number >= 0, got {value!r}")
        for tbe in (self.tbe, self.default):
            if tbe is not None and not self._own:
                tbe.update_hyper_parameters({"lr": float(lr), "eps": float(eps)})
        self._hyper = (lr, eps)

    def _evaluate(self, ids, offsets, per_sample_weights) -> torch.Tensor:
        """An evaluation lookup (``torch.no_grad()`` or ``model.eval()``) changes nothing: no
        rows are created, evicted or touched and the clock stays, so evaluating between
        training steps leaves training (and a resumed run) exactly as without it. An unseen id
        reads as the id-seeded weights its row would start with, or, with admission, as the
        default row. The same TBE pools the rows, bound for this call to just the batch's
        distinct rows, so outputs match training's."""
        unique, slots = torch.unique(ids, return_inverse=True)
        absent = None
        if self.store.admission is not None:  # ids without a row read the default row
            absent = (self.default.split_embedding_weights()[0][0] if self.default is not None
                      else torch.zeros(self.params.embedding_dim, dtype=self.params.dtype, device=self.device))
        rows = self.store.peek(unique, absent)
        if not rows.shape[0]:  # fbgemm takes empty CPU weights for device ones: one unused row
            rows = rows.new_zeros(1, rows.shape[1])
        self._set_tensor(self._dense, f"weights_{self._suffix}", rows.view(-1))
        self._set_geometry(self._dense, rows.shape[0])
        if self._dense is self.tbe:
            self._bound = None  # the next training forward binds the store again
        with torch.no_grad():
            return self._dense(slots, offsets.long(), per_sample_weights)

    def default_state(self) -> dict[str, torch.Tensor]:
        """The trainable default row as views: ``weight`` ``[1, D]`` and, for rowwise Adagrad,
        ``momentum1`` ``[1, 1]`` (empty without a trainable default row)."""
        if self.default is None:
            return {}
        out = {"weight": self.default.split_embedding_weights()[0]}
        if self._own:
            for name, start, width in self.params.optimizer.state_names(self.params.embedding_dim):
                out[name] = self._default_state[:, start:start + width]
        elif self.store.layout.optimizer_floats:
            out["momentum1"] = getattr(self.default, f"momentum1_{self._suffix}").detach().view(1, -1)
        return out

    def _bind(self) -> None:
        """Point fbgemm's TBE at the store's current arrays (cheap; re-done after growth), through
        ``.data`` aliases: a version counter apart from the store's, which bumps as rows are
        created or loaded (the store keeps the rows of pending updates in place itself)."""
        store, tbe = self.store, self.tbe
        if self._bound is store.weights:
            return
        placed = "uvm" if store.row_cache is not None else self._suffix  # (host memory under a device cache)
        self._set_tensor(tbe, f"weights_{placed}", store.weights.view(-1).data)
        if store.optimizer.shape[1] and not self._own:  # (row-wise: in device memory either way)
            self._set_tensor(tbe, f"momentum1_{self._suffix}", store.optimizer.view(-1).data)
        self._set_geometry(tbe, store.capacity)
        if store.row_cache is not None:
            store.row_cache.bind(tbe, self.num_features)
        self._bound = store.weights

    def _set_geometry(self, tbe, rows: int) -> None:
        # Per-feature hash offsets (one table: all 0) and the total, used to sort in backward.
        tbe.hash_size_cumsum = torch.tensor([0] * self.num_features + [rows], dtype=torch.long, device=self.device)
        tbe.total_hash_size_bits = int(math.log2(rows) + 1)
        tbe.rows_per_table = torch.tensor([rows], dtype=torch.long, device=self.device)

    @staticmethod
    def _set_tensor(tbe, name: str, tensor: torch.Tensor) -> None:
        current = getattr(tbe, name)
        if isinstance(current, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=current.requires_grad)
        setattr(tbe, name, tensor)
