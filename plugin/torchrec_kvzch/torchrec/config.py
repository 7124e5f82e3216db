"""Sharding configs: YAML files declaring tables, which of them are KV-ZCH, and planner hints.

    optimizer:                    # the fused optimizer of every table
      type: exact_rowwise_adagrad
      learning_rate: 0.02
    tables:
      - name: user
        embedding_dim: 32
        features: [user_id]
        kvzch:                    # present: a KV-ZCH table on our kernel
          num_embeddings: 2^40
          total_num_buckets: 64
          expected_rows: 200000
      - name: category            # absent: an ordinary table (fbgemm's FUSED kernel)
        embedding_dim: 16
        num_embeddings: 1000
        features: [category]
        planner: {sharding_types: [table_wise]}
    rank_budget: {max_bytes: 2^30}  # optional: one memory budget over the KV-ZCH tables of a rank

``table_defaults`` (optional) holds keys every table takes unless it sets them itself; its
``kvzch`` block is merged key by key into each table's, and a table with ``kvzch: false`` is an
ordinary one. ``load_config(path)`` validates every key and value and raises ``ConfigError``
naming the file, the key and what is allowed, before anything is built. Integers may be written
``2^40``. Keys and value types come from the parameter dataclasses (``params.py``), and so do the
defaults: nothing here repeats them.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

from torchrec_kvzch.params.checks import RENAME_TABLE, finite, module_key_problem
from torchrec_kvzch.params.table import MAX_NUM_EMBEDDINGS
from torchrec_kvzch.params import (
    OPTIMIZER_DEFAULTS,
    AdmissionPolicy,
    DeviceCache,
    DiskStorage,
    EvictionPolicy,
    KVZCHTableParams,
    OptimizerKind,
    RankBudget,
)
from torchrec_kvzch.torchrec.declarations import VIRTUAL_KERNELS
from torchrec_kvzch.torchrec.planner import KVZCHConstraints, KVZCHShardingPlanner
from torchrec_kvzch.torchrec.modules import kvzch_sharders
from torchrec_kvzch.torchrec.tables import kvzch_embedding_bag_config, kvzch_embedding_config

__all__ = ["ConfigError", "ShardingConfig", "TableSpec", "load_config"]

_POOLINGS = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
_OPTIMIZER_KEYS = {"type", "learning_rate", "eps"}
_FLOAT = r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*"  # what YAML 1.1 leaves a string: 1e-3
_TABLE_KEYS = {"name", "embedding_dim", "features", "pooling", "num_embeddings", "kvzch", "planner"}
_KVZCH_KEYS = {f.name for f in fields(KVZCHTableParams)} - {"name", "embedding_dim", "defaulted"}
_RANK_BUDGET_KEYS = {f.name for f in fields(RankBudget)}
_PLANNER_KEYS = {"sharding_types", "compute_kernels", "pooling_factors", "num_poolings",
                 "batch_sizes", "min_partition", "enforce_hbm"}
_SHARDING_TYPES = [t.value for t in ShardingType]
_COMPUTE_KERNELS = [k.value for k in EmbeddingComputeKernel]


class ConfigError(ValueError):
    """A sharding config that cannot be used; the message names file, key and fix."""


@dataclass(frozen=True)
class TableSpec:
    name: str
    embedding_dim: int
    features: tuple[str, ...]
    pooling: PoolingType
    num_embeddings: int
    kvzch: KVZCHTableParams | None
    constraints: ParameterConstraints | None


@dataclass(frozen=True)
class ShardingConfig:
    path: Path
    optimizer: OptimizerKind
    learning_rate: float
    eps: float
    tables: tuple[TableSpec, ...]
    rank_budget: RankBudget | None = None

    @property
    def kvzch_tables(self) -> list[KVZCHTableParams]:
        return [t.kvzch for t in self.tables if t.kvzch is not None]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """Pooled table configs, for an EmbeddingBagCollection (build it on the meta device)."""
        return [kvzch_embedding_bag_config(t.kvzch, t.features, t.pooling) if t.kvzch else
                EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                   feature_names=list(t.features), pooling=t.pooling)
                for t in self.tables]

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """Sequence table configs, for an EmbeddingCollection."""
        return [kvzch_embedding_config(t.kvzch, t.features) if t.kvzch else
                EmbeddingConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                feature_names=list(t.features))
                for t in self.tables]

    def constraints(self) -> dict[str, ParameterConstraints]:
        """Planner constraints: ``KVZCHConstraints`` for KV-ZCH tables (with any planner hints),
        the given ``planner`` hints for the others."""
        out = {}
        for t in self.tables:
            if t.kvzch is not None:
                hints = vars(t.constraints) if t.constraints is not None else {}
                out[t.name] = KVZCHConstraints(**hints, kvzch=t.kvzch)
            elif t.constraints is not None:
                out[t.name] = t.constraints
        return out

    def sharders(self) -> list:
        """Sharders; the ordinary tables get the config's fused optimizer, the KV-ZCH tables of
        each rank share the config's ``rank_budget``."""
        return kvzch_sharders({"optimizer": self.optimizer.to_fbgemm(),
                               "learning_rate": self.learning_rate, "eps": self.eps}, self.rank_budget)

    def planner(self, topology: Topology, batch_size: int) -> KVZCHShardingPlanner:
        return KVZCHShardingPlanner(topology, batch_size, constraints=self.constraints())


def load_config(path: str | Path) -> ShardingConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such sharding config") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return _Parser(path).config(raw)


class _Parser:
    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> None:
        raise ConfigError(f"{self.path}: {where}: {problem}")

    def mapping(self, value: Any, where: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
        if not isinstance(value, dict):
            self.fail(where or "top level", f"expected a mapping with keys from {sorted(allowed)}, got {value!r}")
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                self.fail(f"{where}.{key}" if where else str(key),
                          (f"unknown key; did you mean '{close[0]}'? " if close else "unknown key; ")
                          + f"allowed: {', '.join(sorted(allowed))}")
        for key in sorted(required - value.keys()):
            self.fail(where or "top level", f"missing required key '{key}'")
        return value

    def integer(self, value: Any, where: str) -> int:
        if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*\^\s*\d+\s*", value):
            base, exp = (int(v) for v in value.split("^"))
            return base**exp
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(where, f"expected an integer (or 'a^b'), got {value!r}")
        return value

    def positive(self, value: Any, where: str) -> int:
        number = self.integer(value, where)
        if number < 1:
            self.fail(where, f"expected a positive integer, got {number}")
        return number

    def rate(self, value: Any, where: str) -> float:
        """A learning rate or epsilon: a positive finite number (the ordinary tables take it as
        it is, the KV-ZCH ones as their default). YAML reads ``1e-3`` as a string: taken too."""
        number = float(value) if isinstance(value, str) and re.fullmatch(_FLOAT, value) else value
        if not finite(number) or number <= 0:
            self.fail(where, f"expected a positive number, got {value!r}")
        return float(number)

    def choice(self, value: Any, where: str, allowed) -> Any:
        if value not in allowed:
            close = difflib.get_close_matches(str(value), list(map(str, allowed)), n=1)
            self.fail(where, f"{value!r} is not allowed; " + (f"did you mean '{close[0]}'? " if close else "")
                      + f"use one of {', '.join(map(str, allowed))}")
        return value

    def config(self, raw: Any) -> ShardingConfig:
        top = self.mapping(raw, "", {"optimizer", "tables", "table_defaults", "description", "rank_budget"},
                           {"tables"})
        opt = self.mapping(top.get("optimizer", {}), "optimizer", _OPTIMIZER_KEYS)
        kind = self.optimizer_kind(opt.get("type", OPTIMIZER_DEFAULTS["optimizer"]), "optimizer.type")
        lr = self.rate(opt.get("learning_rate", OPTIMIZER_DEFAULTS["learning_rate"]), "optimizer.learning_rate")
        eps = self.rate(opt.get("eps", OPTIMIZER_DEFAULTS["eps"]), "optimizer.eps")
        if not isinstance(top["tables"], list) or not top["tables"]:
            self.fail("tables", "expected a non-empty list of tables")
        defaults = self.mapping(top.get("table_defaults") or {}, "table_defaults", _TABLE_KEYS - {"name"})
        tables = [self.table(self.merged(defaults, t), f"tables[{i}]", kind, lr, eps)
                  for i, t in enumerate(top["tables"])]
        ordinary = [t.name for t in tables if t.kvzch is None]
        if ordinary and kind.adam:
            self.fail("optimizer.type", f"{kind.value} would also train the ordinary tables {ordinary}, which "
                      "fbgemm's CPU TBE cannot (it has no Adam); set it in the KV-ZCH tables' kvzch blocks")
        seen_tables, seen_features = set(), {}
        for t in tables:
            if t.name in seen_tables:
                self.fail(f"tables ({t.name})", "duplicate table name")
            seen_tables.add(t.name)
            for f in t.features:
                if f in seen_features:
                    self.fail(f"tables ({t.name}).features", f"feature '{f}' already feeds table "
                              f"'{seen_features[f]}'; each feature feeds one table")
                seen_features[f] = t.name
        budget = self.rank_budget(top["rank_budget"]) if top.get("rank_budget") is not None else None
        if budget is not None and not any(t.kvzch for t in tables):
            self.fail("rank_budget", "no table is KV-ZCH (has a 'kvzch' block); remove rank_budget")
        return ShardingConfig(self.path, kind, float(lr), float(eps), tuple(tables), budget)

    @staticmethod
    def merged(defaults: dict, table: Any) -> Any:
        """``table`` over ``defaults`` (its ``kvzch`` block over theirs; ``kvzch: false`` drops it)."""
        if not isinstance(table, dict):
            return table
        out = {**defaults, **table}
        if isinstance(defaults.get("kvzch"), dict) and isinstance(table.get("kvzch"), dict):
            out["kvzch"] = {**defaults["kvzch"], **table["kvzch"]}
        if out.get("kvzch") is False:
            del out["kvzch"]
        return out

    def typed(self, cls, raw: dict, where: str) -> dict:
        """``raw``'s values as ``cls``'s fields are typed: integer fields take ``a^b``, tuple
        fields YAML lists (the dataclass then validates them)."""
        hints = typing.get_type_hints(cls)
        out = dict(raw)
        for key, value in raw.items():
            hint = hints[key]
            kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            if value is not None and int in kinds and float not in kinds:
                out[key] = self.integer(value, f"{where}.{key}")
            elif isinstance(value, str) and float in kinds and re.fullmatch(_FLOAT, value):
                out[key] = float(value)  # (YAML reads 1e-3 as a string)
            elif isinstance(value, list) and any(typing.get_origin(k) is tuple for k in kinds):
                out[key] = tuple(value)
        return out

    def rank_budget(self, raw: Any) -> RankBudget:
        b = self.typed(RankBudget, self.mapping(raw, "rank_budget", _RANK_BUDGET_KEYS), "rank_budget")
        try:
            return RankBudget(**b)
        except ValueError as e:
            self.fail("rank_budget", str(e).removeprefix("rank budget: "))

    def optimizer_kind(self, value: Any, where: str) -> OptimizerKind:
        try:
            return OptimizerKind.parse(value)
        except ValueError:
            self.fail(where, OptimizerKind.refusal(value))

    def table(self, raw: Any, where: str, kind: OptimizerKind, lr: float, eps: float) -> TableSpec:
        if isinstance(raw, dict) and "name" in raw:
            where = f"{where} ({raw['name']})"
        t = self.mapping(raw, where, _TABLE_KEYS, {"name", "embedding_dim", "features"})
        name = t["name"]
        if not isinstance(name, str) or not name.strip():
            self.fail(f"{where}.name", f"expected a non-empty string (quote one YAML reads otherwise), got {name!r}")
        if problem := module_key_problem(name):
            self.fail(f"{where}.name", f"{problem}; {RENAME_TABLE}")
        features = t["features"]
        if not isinstance(features, list) or not features or not all(isinstance(f, str) for f in features):
            self.fail(f"{where}.features", f"expected a non-empty list of feature names, got {features!r}")
        pooling = _POOLINGS[self.choice(str(t.get("pooling", "sum")).lower(), f"{where}.pooling", list(_POOLINGS))]
        dim = self.positive(t["embedding_dim"], f"{where}.embedding_dim")
        hints = self.constraints(t.get("planner"), f"{where}.planner", len(features), "kvzch" in t)
        if dim % 4 and ("kvzch" in t or (hints.sharding_types if hints else None) != [ShardingType.DATA_PARALLEL.value]):
            self.fail(f"{where}.embedding_dim", f"{dim} is not a multiple of 4, which fbgemm's TBE kernels need "
                      f"(KV-ZCH tables', and TorchRec's for every table not sharded data_parallel alone); "
                      f"use {dim + -dim % 4}, the next multiple")
        kvzch = None
        if "kvzch" in t:
            if "num_embeddings" in t:
                self.fail(f"{where}.num_embeddings", "a KV-ZCH table sets num_embeddings inside 'kvzch' "
                          "(for an ordinary table under a table_defaults kvzch block, set kvzch: false)")
            kvzch = self.kvzch(t["kvzch"], f"{where}.kvzch", name, dim, kind, lr, eps)
            num_embeddings = kvzch.num_embeddings
        elif "num_embeddings" not in t:
            self.fail(where, "missing required key 'num_embeddings' (or a 'kvzch' block)")
        else:
            num_embeddings = self.positive(t["num_embeddings"], f"{where}.num_embeddings")
            if num_embeddings > MAX_NUM_EMBEDDINGS:
                self.fail(f"{where}.num_embeddings", f"{num_embeddings} ids do not fit int64; at most 2^63 - 1")
        return TableSpec(name, dim, tuple(features), pooling, num_embeddings, kvzch, hints)

    def kvzch(self, raw: Any, where: str, name: str, dim: int, kind, lr, eps) -> KVZCHTableParams:
        kv = self.typed(KVZCHTableParams, self.mapping(raw if raw is not None else {}, where, _KVZCH_KEYS),
                        where)
        kv["optimizer"] = self.optimizer_kind(kv.get("optimizer", kind), f"{where}.optimizer")
        kv.setdefault("learning_rate", lr)
        kv.setdefault("eps", eps)
        for key, cls in (("eviction", EvictionPolicy), ("admission", AdmissionPolicy), ("storage", DiskStorage),
                         ("device_cache", DeviceCache)):
            if key in kv:
                block = self.mapping(kv[key], f"{where}.{key}", {f.name for f in fields(cls)})
                kv[key] = cls(**self.typed(cls, block, f"{where}.{key}"))
        try:
            return KVZCHTableParams(name=name, embedding_dim=dim, **kv)
        except (TypeError, ValueError) as e:
            self.fail(where, str(e))

    def constraints(self, raw: Any, where: str, features: int, kvzch: bool) -> ParameterConstraints | None:
        """The table's planner hints; ``kvzch``: whether it is a KV-ZCH table, which is sharded
        row-wise on a virtual-table kernel, as an ordinary table is not."""
        if raw is None:
            return None
        c = dict(self.mapping(raw, where, _PLANNER_KEYS))
        for key, allowed in (("sharding_types", _SHARDING_TYPES), ("compute_kernels", _COMPUTE_KERNELS)):
            for i, value in enumerate(self.listed(c, key, where)):
                self.choice(value, f"{where}.{key}[{i}]", allowed)
        kernels = self.listed(c, "compute_kernels", where)
        if kvzch and c.get("sharding_types") and ShardingType.ROW_WISE.value not in c["sharding_types"]:
            self.fail(f"{where}.sharding_types", f"a KV-ZCH table is sharded row_wise (by buckets), not "
                      f"{c['sharding_types']}; add row_wise or drop the key")
        if kvzch and any(k not in VIRTUAL_KERNELS for k in kernels):
            self.fail(f"{where}.compute_kernels", f"a KV-ZCH table runs on a virtual-table kernel "
                      f"({', '.join(VIRTUAL_KERNELS)}), not {[k for k in kernels if k not in VIRTUAL_KERNELS]}; "
                      "drop the others, or the table's kvzch block to make it ordinary")
        if not kvzch and any(k in VIRTUAL_KERNELS for k in kernels):
            self.fail(f"{where}.compute_kernels", f"{[k for k in kernels if k in VIRTUAL_KERNELS]} serve "
                      "KV-ZCH tables; give this table a kvzch block to make it one, or drop them")
        for key, kind in (("pooling_factors", "number"), ("num_poolings", "number"), ("batch_sizes", "integer")):
            values = self.listed(c, key, where)
            for i, value in enumerate(values):
                types = int if kind == "integer" else (int, float)
                if isinstance(value, bool) or not isinstance(value, types) or value <= 0:
                    self.fail(f"{where}.{key}[{i}]", f"expected a positive {kind}, got {value!r}")
            if values and len(values) != features:  # (TorchRec's: one per feature)
                self.fail(f"{where}.{key}", f"expected one value per feature ({features}), got {len(values)}")
        if "min_partition" in c:
            c["min_partition"] = self.positive(c["min_partition"], f"{where}.min_partition")
        if not isinstance(c.get("enforce_hbm", False), bool):
            self.fail(f"{where}.enforce_hbm", f"expected true or false, got {c['enforce_hbm']!r}")
        return ParameterConstraints(**c)

    def listed(self, block: dict, key: str, where: str) -> list:
        """``block[key]``, a YAML list (a lone value is refused: it would be iterated, a string
        character by character), or [] where the key is absent."""
        value = block.get(key, [])
        if not isinstance(value, list):
            self.fail(f"{where}.{key}", f"expected a list, got {value!r}; write [{value}]")
        return value
