"""Optimizers applied in backward (``apply_optimizer_in_backward``) to the weights of KV-ZCH tables.

TorchRec reads the optimizer class and kwargs attached to a table's weight as fused params of
that table alone, over the sharders' and under the table's own constraints (its sharded
modules' ``embeddingbag.py``: the class mapped to fbgemm's optimizer type, ``lr`` renamed
``learning_rate``). The planner and the sharders read them here, so that a KV-ZCH table trains
with the optimizer declared for it, or is refused naming what cannot be honoured.
"""

from __future__ import annotations

from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

# The kwargs fbgemm's TBE takes; TorchRec hands the others to it as they are, which it refuses.
_TAKEN = ("lr", "learning_rate", "eps", "weight_decay", "weight_decay_mode", "beta1", "beta2",
          "stochastic_rounding", "optimizer")


def in_backward_params(module, tables_attr: str) -> dict[str, dict]:
    """``{table: fused params}`` of the tables of ``module`` (``tables_attr``: an EBC's
    ``embedding_bags``, an EC's ``embeddings``) whose weight has an optimizer applied in backward."""
    out = {}
    for name, table in getattr(module, tables_attr, {}).items():
        weight = getattr(table, "weight", None)
        classes, kwargs = getattr(weight, "_optimizer_classes", None), getattr(weight, "_optimizer_kwargs", [{}])
        if classes:
            out[name] = _fused(name, classes, kwargs)
    return out


def _fused(table: str, classes: list, kwargs: list) -> dict:
    def fail(problem: str, fix: str):
        raise ValueError(f"KV-ZCH table '{table}': {problem}; fix: {fix}")

    if len(classes) != 1 or len(kwargs) != 1:
        fail(f"{len(classes)} optimizers are applied in backward to its weight", "apply one (TorchRec takes one)")
    cls, params = classes[0], dict(kwargs[0])
    unknown = sorted(set(params) - set(_TAKEN))
    if unknown:
        fail(f"the optimizer applied in backward to its weight ({cls.__name__}) sets {unknown}, which fbgemm's "
             "embedding kernels (TorchRec's and ours) do not take",
             f"drop them from apply_optimizer_in_backward's kwargs; the kernels take {list(_TAKEN[:-1])}")
    if "optimizer" not in params:
        try:
            params["optimizer"] = optimizer_type_to_emb_opt_type(cls)
        except ValueError:
            fail(f"the optimizer applied in backward to its weight, {cls.__module__}.{cls.__name__}, has no "
                 "embedding-kernel counterpart in TorchRec", "apply torch.optim.SGD, torchrec.optim.RowWiseAdagrad, "
                 "torch.optim.Adam or torchrec.optim.PartialRowWiseAdam, or declare it in fused params")
    if "lr" in params:
        params["learning_rate"] = params.pop("lr")
    return params
