"""Served twins of TorchRec's embedding modules: the same ``KeyedJaggedTensor`` in and the same
outputs (a ``KeyedTensor`` of pooled features, or a ``JaggedTensor`` per sequence feature) as
``EmbeddingBagCollection`` / ``EmbeddingCollection``, from served tables, so the dense model
on top runs unchanged. Every table is a ``ServedTable``: a KV-ZCH table's rows by id, an
ordinary table's rows by index (its ids ``[0, num_embeddings)`` all present), both through
fbgemm's inference op, as TorchRec's quantized modules serve ordinary tables."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from torchrec_kvzch.serving.table import ServedTable


class ServedModule(nn.Module):
    """Tables and the features each one serves, in the order the trained module had them;
    ``saved_as``: each table's entry in the checkpoint it came from (``{table: fqn}``)."""

    def __init__(self, tables: list[ServedTable], features: list[list[str]], saved_as: dict[str, str]) -> None:
        super().__init__()
        if len(tables) != len(features):
            raise ValueError(f"{len(tables)} served tables for {len(features)} feature lists")
        self.saved_as = dict(saved_as)
        self.tables = {t.name: t for t in tables}
        self.feature_tables = [(f, t) for t, names in zip(tables, features) for f in names]
        self.feature_names = [f for f, _ in self.feature_tables]

    def replace(self, table: ServedTable) -> None:
        """Serve ``table`` in place of the one of its name (on a model nothing serves now)."""
        old = self.tables[table.name]
        if (old.dim, old.pooling) != (table.dim, table.pooling):
            raise ValueError(f"served table '{table.name}': a replacement of dim {table.dim} and pooling "
                             f"{table.pooling} for one of dim {old.dim} and pooling {old.pooling}")
        self.tables = {**self.tables, table.name: table}
        self.feature_tables = [(f, table if t.name == table.name else t) for f, t in self.feature_tables]

    def _features(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        keys = features.keys()
        unknown = sorted(set(keys) - set(self.feature_names))
        missing = [f for f in self.feature_names if f not in keys]
        if unknown or missing:
            raise ValueError(f"{type(self).__name__}: the batch has "
                             + "; ".join(p for p in (unknown and f"unknown features {unknown}",
                                                     missing and f"no feature {missing}") if p)
                             + f"; this module serves {self.feature_names}")
        return features.to_dict()


class ServedEmbeddingBagCollection(ServedModule):
    """Pooled features, as ``EmbeddingBagCollection``; ``is_weighted``: per-sample weights of
    the batch scale the rows (TorchRec's weighted EBC)."""

    def __init__(self, tables: list[ServedTable], features: list[list[str]], saved_as: dict[str, str],
                 is_weighted: bool = False) -> None:
        super().__init__(tables, features, saved_as)
        self.is_weighted = is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        by_feature = self._features(features)
        if self.is_weighted and features.weights_or_none() is None:  # (TorchRec's weighted EBC refuses it too)
            raise ValueError(f"{type(self).__name__}: the module is weighted (is_weighted=True) and the batch has "
                             "no weights; pass a KeyedJaggedTensor with weights, one per id")
        pooled = []
        for name, table in self.feature_tables:
            jt = by_feature[name]
            weights = jt.weights_or_none() if self.is_weighted else None
            pooled.append(table.lookup(jt.values(), jt.offsets(), weights))
        return KeyedTensor(keys=self.feature_names, length_per_key=[t.dim for _, t in self.feature_tables],
                           values=torch.cat(pooled, dim=1))


class ServedEmbeddingCollection(ServedModule):
    """A ``JaggedTensor`` of rows per sequence feature, as ``EmbeddingCollection``."""

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        by_feature = self._features(features)
        out = {}
        for name, table in self.feature_tables:
            jt = by_feature[name]
            out[name] = JaggedTensor(values=table.lookup(jt.values(), jt.offsets()), lengths=jt.lengths(),
                                     offsets=jt.offsets())
        return out
