"""The fused updates a table runs itself, over the rows a batch touched (issue 33): Adam,
partial row-wise Adam, and row-wise Adagrad with L2 weight decay, which fbgemm's CPU TBE does
not have (its CUDA Adam keeps the moments as flat tensors of their own, apart from the rows);
and SGD and row-wise Adagrad with any weight decay on fp16 rows, which fbgemm's update would
round once more after the decay (``TableTBE._decay``), dropping a decay below half an fp16 step.

The math is fbgemm's (``codegen/genscript/optimizers.py``), applied once per distinct row of the
batch to ``g``, the row's gradient summed over its occurrences:

* Adam: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` (per element), then
  ``w -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd w)``;
* partial row-wise Adam: the same, with ``v`` one value per row fed ``mean(g^2)``;
* row-wise Adagrad: ``a += mean(g^2)``, ``w = c w - lr / (sqrt(a) + eps) g``;
* SGD: ``w = c w - lr g``.

Weight decay: ``decouple`` is the ``wd w`` term above (Adam) and ``c = 1 - lr wd`` (else 1);
``l2`` adds ``wd w`` to ``g`` before anything reads it (fbgemm's rule for row-wise Adagrad; for
Adam, torch.optim.Adam's; for SGD the same step as ``decouple``). fp32 rows of SGD and row-wise
Adagrad with ``decouple`` stay on fbgemm's update (``TableTBE._decay``).
``t`` is the table's clock at the batch's forward: the training steps it has seen, saved with
every checkpoint, as fbgemm counts its ``iter`` per forward.

State per row, fp32 after the weights as in upstream's whole rows: Adam ``[m (D) | v (D)]``,
partial row-wise Adam ``[v | m (D)]``, row-wise Adagrad ``[a]``. fp16 weights are updated in
fp32 and rounded back, stochastically when the table asks for it (bits drawn from the row's id,
column and step, so a rerun rounds alike). ``OwnUpdate`` is the autograd function whose backward
runs the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrec_kvzch.params import KVZCHTableParams, OptimizerKind, WeightDecayMode
from torchrec_kvzch.table.hashing import FIBONACCI, mix64
from torchrec_kvzch.table.native import native_status

_FP16_DROPPED = (1 << 13) - 1  # fp32 mantissa bits an fp16 does not keep
# The native op's numbers for the optimizers it runs.
_KINDS = {OptimizerKind.EXACT_ROWWISE_ADAGRAD: 0, OptimizerKind.ADAM: 1, OptimizerKind.PARTIAL_ROWWISE_ADAM: 2,
          OptimizerKind.EXACT_SGD: 3}


@dataclass(frozen=True)
class Hyper:
    """What one update needs besides the rows and their gradients."""

    kind: OptimizerKind
    lr: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float
    l2: bool  # weight_decay_mode l2 (else decouple, or no decay)
    stochastic_rounding: bool

    @classmethod
    def of(cls, params: KVZCHTableParams, lr: float, eps: float) -> "Hyper":
        return cls(params.optimizer, lr, eps, params.beta1, params.beta2, params.weight_decay,
                   params.weight_decay_mode is WeightDecayMode.L2, params.stochastic_rounding)


def lookup_gradients(grad: torch.Tensor, offsets: torch.Tensor, pooled: bool, mean: bool,
                     num_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``bags`` fp32 ``[P, D]``, ``source`` ``[N]``): id ``i`` of a lookup receives the output
    gradient ``bags[source[i]]`` (times its per-sample weight). Pooled outputs ``[B, F * D]``
    over the bags of ``offsets`` (feature-major): a row per bag, divided by the bag's length
    under ``mean``; else the output's own rows."""
    if not pooled:
        return grad.float().contiguous(), torch.arange(grad.shape[0], device=grad.device)
    dim = grad.shape[1] // num_features
    lengths = offsets[1:] - offsets[:-1]
    bags = grad.float().reshape(-1, num_features, dim).transpose(0, 1).reshape(-1, dim)
    if mean:
        bags = bags / lengths.clamp(min=1).unsqueeze(1)
    return bags.contiguous(), torch.repeat_interleave(torch.arange(lengths.numel(), device=grad.device), lengths)


def sample_weight_gradients(bags: torch.Tensor, source: torch.Tensor, weights: torch.Tensor,
                            slots: torch.Tensor) -> torch.Tensor:
    """The gradient of a lookup's per-sample weights: each id's row (before the update) dotted
    with the output gradient it receives."""
    return (bags[source] * weights[slots].float()).sum(dim=1)


def apply(hyper: Hyper, weights: torch.Tensor, state: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
          bags: torch.Tensor, source: torch.Tensor, scale: torch.Tensor | None, step: int) -> None:
    """The update of a lookup's rows (``slots`` of ``weights`` and ``state``; ``keys``: each
    slot's id) from the gradient each id received (``lookup_gradients``, times ``scale``), at
    bias correction's ``step``: the native op on the CPU (the rows' gradients summed run by run
    of the sorted slots, each row updated at once), else the torch twin."""
    if weights.device.type == "cpu" and native_status():
        slots, order = torch.sort(slots)
        scale = scale[order].float().contiguous() if scale is not None else bags.new_empty(0)
        torch.ops.kvzch.own_update_(weights, state, bags, slots, source[order].contiguous(), scale, keys,
                                    _KINDS[hyper.kind], hyper.lr, hyper.eps, hyper.beta1, hyper.beta2,
                                    hyper.weight_decay, hyper.l2, hyper.stochastic_rounding, step)
        return
    per_id = bags[source] if scale is None else bags[source] * scale.float().unsqueeze(1)
    rows, inverse = torch.unique(slots, return_inverse=True)
    grads = per_id.new_zeros(rows.numel(), per_id.shape[1]).index_add_(0, inverse, per_id)
    update_rows(hyper, weights, state, rows, grads, step, keys[rows])


def update_rows(hyper: Hyper, weights: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                grads: torch.Tensor, step: int, ids: torch.Tensor) -> None:
    """The twin: ``hyper``'s update of the distinct ``rows`` of ``weights`` and ``state``
    (``[R, F]`` fp32), in place, given their summed ``grads``; ``ids``: the rows' ids."""
    w = weights[rows].float()
    s = state[rows]
    g = grads + hyper.weight_decay * w if hyper.l2 and hyper.weight_decay else grads
    dim = w.shape[1]
    kind = hyper.kind
    if kind in (OptimizerKind.EXACT_ROWWISE_ADAGRAD, OptimizerKind.EXACT_SGD):
        multiplier = hyper.lr
        if kind is OptimizerKind.EXACT_ROWWISE_ADAGRAD:
            s[:, 0] += g.square().mean(dim=1)
            multiplier = hyper.lr / (s[:, :1].sqrt() + hyper.eps)
        correction = 1.0 if hyper.l2 else 1.0 - hyper.lr * hyper.weight_decay
        w = correction * w - multiplier * g
    else:
        b1, b2 = hyper.beta1, hyper.beta2
        if kind is OptimizerKind.ADAM:
            m, v = s[:, :dim], s[:, dim:]
            v.mul_(b2).add_((1.0 - b2) * g.square())
        else:
            v, m = s[:, :1], s[:, 1:]
            v.mul_(b2).add_((1.0 - b2) * g.square().mean(dim=1, keepdim=True))
        m.mul_(b1).add_((1.0 - b1) * g)
        decay = 0.0 if hyper.l2 else hyper.weight_decay
        w -= hyper.lr * (m / (1.0 - b1 ** step) / ((v / (1.0 - b2 ** step)).sqrt() + hyper.eps) + decay * w)
    state[rows] = s
    weights[rows] = _round(w, weights.dtype, hyper.stochastic_rounding, ids, step)


def _round(w: torch.Tensor, dtype: torch.dtype, stochastic: bool, ids: torch.Tensor, step: int) -> torch.Tensor:
    """fp32 ``w`` in ``dtype``; into fp16 stochastically with ``stochastic``: the 13 mantissa bits
    fp16 drops get a random addend, then are cut, so a value rounds up with the probability of
    its distance from the lower neighbour (exact in fp16's normal range)."""
    if dtype != torch.float16 or not stochastic:
        return w.to(dtype)
    column = torch.arange(w.shape[1], device=w.device)
    salt = (step * FIBONACCI) % 2**64  # (as an int64: the step's own stream of draws)
    salt -= 2**64 if salt >= 2**63 else 0
    draws = mix64(mix64(ids.long() + salt).unsqueeze(1) + column) & _FP16_DROPPED
    bits = w.contiguous().view(torch.int32)
    finite = torch.isfinite(w)
    bits = torch.where(finite, (bits + draws.int()) & ~_FP16_DROPPED, bits)
    return bits.view(torch.float32).to(dtype)


class OwnUpdate(torch.autograd.Function):
    """A training lookup (of ``table``, a ``TableTBE``) whose backward is the table's own update:
    the forward is fbgemm's lookup alone; the backward sums the gradient per distinct row and
    updates the rows in place (``TableTBE.own_update``, then ``apply``), at the clock of the
    forward (bias correction's step). Its output hangs on ``anchor`` so that autograd calls the
    backward."""

    @staticmethod
    def forward(ctx, anchor, table, tbe, slots, offsets, per_sample_weights):
        ctx.table, ctx.tbe, ctx.step = table, tbe, table.store.clock
        ctx.lookup = (slots, offsets, per_sample_weights)
        return tbe(slots, offsets, per_sample_weights)

    @staticmethod
    def backward(ctx, grad):
        weight_grads = ctx.table.own_update(ctx.tbe, grad, *ctx.lookup, ctx.step)
        return None, None, None, None, None, weight_grads if ctx.needs_input_grad[5] else None
