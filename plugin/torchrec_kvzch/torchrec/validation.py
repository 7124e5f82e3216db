"""Checks on every batch a sharded module receives, before any of it reaches a table.

A KV-ZCH table creates a row for whatever id it is given, so a bad batch does not fail by itself:
negative or out-of-range ids would be routed to no rank or become rows, and lengths that
disagree with the values would shift ids between features. TorchRec checks a batch's structure
once, on the first batch, without naming features, and fixes the feature routing from that
batch's key order: a later batch with its keys in another order would send features to the
wrong tables, silently. ``BatchChecker`` runs in the sharded module's ``input_dist`` on every
batch, before the ids are routed and before any store changes, and raises ``ValueError`` naming
the feature, its table and the fix. It costs one min/max pass over the ids (more only to name an offender).
"""

from __future__ import annotations

import itertools

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class BatchChecker:
    def __init__(self, configs, scored: set[str] = frozenset(), kvzch: set[str] = frozenset()) -> None:
        """``configs``: the module's TorchRec table configs (name, num_embeddings, feature_names);
        ``scored``: the tables whose feature scores are the KJT's weights; ``kvzch``: the KV-ZCH
        tables (no variable batch size per feature yet)."""
        self.scored = {f for c in configs if c.name in scored for f in c.feature_names}
        self.fixed_stride = [f for c in configs if c.name in kvzch for f in c.feature_names]
        self.table_of = {f: c.name for c in configs for f in c.feature_names}
        self.rows_of = {f: c.num_embeddings for c in configs for f in c.feature_names}
        self.keys: list[str] | None = None  # the first batch's key order, which TorchRec routes by
        self.places: dict[str, int] = {}  # where this module's features sit in it

    def tables(self, features) -> list[str]:
        return sorted({self.table_of[f] for f in features if f in self.table_of})

    def _in_range(self, keys: list[str], values: torch.Tensor, per_key: list[int]) -> bool:
        """Whether every id is inside its table: one min/max pass over the ids (per run of features
        with the same table size); the offender is found only when one exists."""
        lo = 0
        for limit, run in itertools.groupby(zip(keys, per_key), key=lambda kn: self.rows_of.get(kn[0])):
            hi = lo + sum(n for _, n in run)
            if hi > lo and limit is not None:  # (None: a feature of another module, not ours to check)
                low, high = torch.aminmax(values[lo:hi])
                if int(low) < 0 or int(high) >= limit:
                    return False
            lo = hi
        return True

    def _check_scores(self, keys: list[str], weights: torch.Tensor, per_key: list[int]) -> None:
        """Feature scores must be >= 0 (fbgemm adds up ``|score|``): refused here, before any
        table of the batch looks its ids up."""
        lo = 0
        for key, n in zip(keys, per_key):
            bad = ~(weights[lo:lo + n] >= 0) if key in self.scored else None  # (NaN too)
            if bad is not None and bool(bad.any()):
                at = int(torch.nonzero(bad)[0])
                raise ValueError(f"feature '{key}' (table '{self.table_of[key]}') has feature score "
                                 f"{float(weights[lo + at])} at its id {at} (the KJT's weights are this "
                                 "table's scores); scores must be >= 0")
            lo += n

    def __call__(self, kjt: KeyedJaggedTensor) -> None:
        keys = kjt.keys()
        places = {k: i for i, k in enumerate(keys) if k in self.table_of}
        if self.keys is not None and places != self.places and places.keys() == self.places.keys():
            raise ValueError(f"the batch's features come in the order {keys}, the first batch's in "
                             f"{self.keys}; TorchRec routes features by the first batch's order (where each "
                             "sits in it), so keep one order for every batch")
        if kjt.variable_stride_per_key() and self.fixed_stride:
            raise ValueError(f"the batch has a batch size per feature (TorchRec's variable batch, VBE), which "
                             f"KV-ZCH tables {self.tables(self.fixed_stride)} (features {self.fixed_stride}) do not "
                             "take yet; give every feature the batch's size (lengths 0 where it has no ids)")
        missing = sorted(set(self.table_of) - set(keys))
        if missing:  # (features no table reads pass, as in TorchRec: a batch may feed several modules)
            others = [k for k in keys if k not in self.table_of]
            raise ValueError(f"features {missing} (tables {self.tables(missing)}) are missing from the "
                             "batch; pass them, with zero lengths if they have no ids"
                             + (f" (the batch's features {others} are read by no table here)" if others else ""))
        values = kjt.values()
        if values.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"the ids of features {keys} (tables {self.tables(keys)}) are "
                             f"{values.dtype}; ids must be int32 or int64")
        lengths = kjt.lengths()
        if not kjt.variable_stride_per_key() and lengths.numel() % len(keys):
            raise ValueError(f"the batch has {lengths.numel()} lengths for the {len(keys)} features "
                             f"{keys}; give each feature one length per example")
        if lengths.numel() and bool((lengths < 0).any()):
            raise ValueError(f"the batch of features {keys} has negative lengths")
        if int(lengths.sum()) != values.numel():
            raise ValueError(f"the lengths of features {keys} add up to {int(lengths.sum())}, but the "
                             f"batch has {values.numel()} ids; lengths and values must agree")
        weights = kjt.weights_or_none()
        if weights is not None and weights.numel() != values.numel():
            raise ValueError(f"the batch has {weights.numel()} weights for {values.numel()} ids of "
                             f"features {keys}; give one weight per id")
        if weights is not None and self.scored:
            self._check_scores(keys, weights, kjt.length_per_key())
        if values.numel() and not self._in_range(keys, values, kjt.length_per_key()):
            per_key = torch.tensor(kjt.length_per_key(), device=values.device)
            limits = torch.tensor([self.rows_of.get(k, -1) for k in keys], device=values.device)  # (-1: not ours)
            limit = limits.repeat_interleave(per_key, output_size=values.numel())
            bad = (limit >= 0) & ((values < 0) | (values.long() >= limit))
            first = int(torch.nonzero(bad)[0])
            key = keys[int(torch.searchsorted(per_key.cumsum(0), first, right=True))]
            raise ValueError(f"feature '{key}' (table '{self.table_of[key]}') has id "
                             f"{int(values[first])}, outside [0, {self.rows_of[key]}); hash or remap "
                             "ids into the table's num_embeddings")
        if self.keys is None:
            self.keys, self.places = keys, places
