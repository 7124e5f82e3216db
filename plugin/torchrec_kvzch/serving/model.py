"""The inference twin of a trained model, from its checkpoint directory.

``served_model(model, root)`` takes the unsharded model as the user builds it for training (its
embedding modules may be on the meta device), replaces each TorchRec ``EmbeddingBagCollection``
/ ``EmbeddingCollection`` with its served twin (``modules.py``: KV-ZCH tables from the
checkpoint's chain, ordinary tables from its last link) and loads every other parameter and
buffer (the dense model) from the checkpoint. Every table and dense entry is checked against
the checkpoint - present, the same shape, every byte read matching its checksum - and a
mismatch names the table or entry, the file and the fix. The model passed in is changed only
once everything is read.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_kvzch.checkpoint.integrity import verify_items
from torchrec_kvzch.params import KVZCHTableParams
from torchrec_kvzch.serving.build import DEFAULTS, build_table, find_table
from torchrec_kvzch.serving.modules import ServedEmbeddingBagCollection, ServedEmbeddingCollection
from torchrec_kvzch.serving.source import CheckpointSource, Link
from torchrec_kvzch.serving.table import SERVED_DTYPES, ServedTable

_POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean", PoolingType.NONE: "none"}


@dataclass(frozen=True)
class ServingOptions:
    """How tables are served. ``dtype``: one for all tables or ``{table: dtype}`` (the others
    fp32); ``buckets``: ``{KV-ZCH table: (start, end)}`` for a replica of those buckets (the
    others whole); ``default``: what an id without a row reads (``build.build_table``);
    ``kvzch``: the KV-ZCH tables' parameters as trained (``initial`` reads their initializer);
    ``device``: where the model serves, ``cpu`` or ``cuda`` (rows, id maps and the dense part
    in its memory; batches are moved to it)."""

    dtype: str | dict[str, str] = "fp32"
    buckets: dict[str, tuple[int, int]] | None = None
    default: str = "admission"
    kvzch: dict[str, KVZCHTableParams] | None = None
    device: str | torch.device = "cpu"

    def dtype_of(self, table: str) -> str:
        return self.dtype.get(table, "fp32") if isinstance(self.dtype, dict) else self.dtype

    def check(self, tables: set[str], kv_tables: set[str]) -> None:
        device = torch.device(self.device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"ServingOptions.device {str(device)!r}: fbgemm's inference op serves on cpu or cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"ServingOptions.device {str(device)!r}: torch sees no CUDA device here; serve on 'cpu'")
        dtypes = self.dtype if isinstance(self.dtype, dict) else {"*": self.dtype}
        for name, dtype in dtypes.items():
            if name != "*" and name not in tables:
                raise ValueError(f"ServingOptions.dtype names table '{name}', which the model does not have; "
                                 f"its tables: {sorted(tables)}")
            if dtype not in SERVED_DTYPES:
                raise ValueError(f"ServingOptions.dtype: {dtype!r} is not served; use one of {', '.join(SERVED_DTYPES)}")
        for name in self.buckets or {}:
            if name not in kv_tables:
                raise ValueError(f"ServingOptions.buckets names '{name}', which is not a KV-ZCH table of the "
                                 f"checkpoint; its KV-ZCH tables: {sorted(kv_tables)}")
        if self.default not in DEFAULTS:
            raise ValueError(f"ServingOptions.default {self.default!r} is unknown; use one of {', '.join(DEFAULTS)}")
        for name, params in (self.kvzch or {}).items():  # (parameters no table reads: a typo, or another model's)
            if name not in kv_tables & tables:
                raise ValueError(f"ServingOptions.kvzch names '{name}', which is not a KV-ZCH table of both the model "
                                 f"and the checkpoint; those: {sorted(kv_tables & tables)}")
            if getattr(params, "name", name) != name:
                raise ValueError(f"ServingOptions.kvzch['{name}'] holds the parameters of table '{params.name}'; "
                                 "key each table's parameters by its own name")
        missing = sorted((kv_tables & tables) - set(self.kvzch or {}))
        if self.default == "initial" and missing:
            raise ValueError(f"ServingOptions.default 'initial' reads each KV-ZCH table's initializer; "
                             f"ServingOptions.kvzch has no parameters for {missing}")


def served_model(model: nn.Module, root: str | os.PathLike, *, step: int | None = None, prefix: str = "model",
                 options: ServingOptions = ServingOptions()) -> tuple[nn.Module, int]:
    """``model`` with its embedding modules served and its dense part loaded from the
    checkpoint of ``step`` (default: the latest) under ``root``; returns (model, step).
    ``prefix``: the key the trained model's state dict was saved under (``{"model":
    model.state_dict(), ...}``: ``model``; the job's, whose ``DLRM`` sits in ``DLRMTrain``:
    ``model.model``)."""
    source = CheckpointSource(root)
    step = source.latest() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {root}; train and save one first")
    chain = source.chain(step)
    last = chain[-1]
    modules = [(path, m) for path, m in model.named_modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no TorchRec EmbeddingBagCollection or EmbeddingCollection to serve")
    names = {c.name for _, m in modules for c in _configs(m)}
    options.check(names, set(last.tables))
    served = {path: _served_module(chain, prefix, path, m, options) for path, m in modules}
    dense = dense_entries(model, {path for path, _ in modules}, prefix, last, options.device)
    for path, module in served.items():  # (everything read: now the model changes)
        if not path:  # the model is the embedding module itself
            model = module
            continue
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, module)
    for name, value in dense.items():
        assign(model, name, value)
    return model.to(options.device).eval(), step  # (and the buffers a state dict leaves out)


def _configs(module):
    return module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection) else module.embedding_configs()


def _served_module(chain: list[Link], prefix: str, path: str, module, options: ServingOptions):
    bags = isinstance(module, EmbeddingBagCollection)
    entries = "embedding_bags" if bags else "embeddings"
    base = f"{prefix}.{path}.{entries}." if path else f"{prefix}.{entries}."
    tables = []
    for config in _configs(module):
        pooling = _POOLING[config.pooling] if bags else "none"
        fqn = f"{base}{config.name}."
        dtype = options.dtype_of(config.name)
        if config.name in chain[-1].tables:
            saved = find_table(chain[-1], config.name)
            for field in ("embedding_dim", "num_embeddings", "total_num_buckets"):  # (the ids it serves)
                if getattr(saved.saved, field) != getattr(config, field, None):
                    raise ValueError(f"{chain[-1].path}: KV-ZCH table '{config.name}' was saved with {field} "
                                     f"{getattr(saved.saved, field)}, the model has {getattr(config, field, None)}: "
                                     "serve the model it was trained with")
            if saved.base != fqn:
                raise ValueError(f"{chain[-1].path}: KV-ZCH table '{config.name}' was saved as "
                                 f"'{saved.base}weight', the model has it as '{fqn}weight'"
                                 + _prefix_hint(saved.base, fqn, prefix))
            tables.append(build_table(chain, config.name, dtype=dtype, pooling=pooling,
                                      buckets=(options.buckets or {}).get(config.name), default=options.default,
                                      params=(options.kvzch or {}).get(config.name), device=options.device))
        else:
            tables.append(ordinary_table(chain[-1], fqn + "weight", ServedTable(
                config.name, config.embedding_dim, dtype, pooling, capacity=config.num_embeddings,
                id_range=(0, config.num_embeddings), device=options.device)))
    features = [list(c.feature_names) for c in _configs(module)]
    saved_as = {c.name: f"{base}{c.name}.weight" for c in _configs(module)}
    if bags:
        return ServedEmbeddingBagCollection(tables, features, saved_as, is_weighted=module.is_weighted())
    return ServedEmbeddingCollection(tables, features, saved_as)


def ordinary_table(link: Link, fqn: str, empty: ServedTable) -> ServedTable:
    """``empty`` (a served table of ids ``[0, num_embeddings)``) filled with an ordinary
    table's weights, entry ``fqn`` of ``link``."""
    num = empty.id_range[1]
    weight = _read_entries(link, {fqn: (num, empty.dim)}, f"table '{empty.name}'")[fqn]
    empty.upsert(torch.arange(num), weight)
    return empty


def _prefix_hint(saved: str, wanted: str, prefix: str) -> str:
    """The prefix that would have matched, when only the prefix differs."""
    rest = wanted[len(prefix):]  # ".<module path>.<entries>.<table>."
    if saved.endswith(rest) and len(saved) > len(rest):
        return f"; pass prefix='{saved[: -len(rest)]}'"
    return "; serve the model it was trained with"


def dense_entries(model: nn.Module, embedding_paths: set[str], prefix: str, link: Link,
                  device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every entry of the model's state dict outside the embedding modules at
    ``embedding_paths`` (its dense part; non-persistent buffers are the model's own), read
    from ``link`` (checked as ``_read_entries`` says), on ``device``."""
    def inside(name):
        return any(p == "" or name.startswith(p + ".") for p in embedding_paths)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items() if not inside(name)}
    read = _read_entries(link, {f"{prefix}.{name}": shape for name, shape in shapes.items()}, "the dense model")
    return {name: read[f"{prefix}.{name}"].to(device) for name in shapes}


def _read_entries(link: Link, shapes: dict[str, tuple], what: str) -> dict[str, torch.Tensor]:
    """Entries ``{fqn: shape}`` of ``link``, checked (present, the same shape, checksums)."""
    meta = link.metadata.state_dict_metadata
    for fqn, shape in shapes.items():
        saved = meta.get(fqn)
        if not isinstance(saved, TensorStorageMetadata):
            raise ValueError(f"{link.path} has no entry '{fqn}' ({what}); was it saved from another model, or "
                             "under another prefix?")
        if tuple(saved.size) != tuple(shape):
            raise ValueError(f"{link.path}: '{fqn}' ({what}) was saved with shape {list(saved.size)}, the model "
                             f"has {list(shape)}; serve the model it was trained with")
    indices = [MetadataIndex(fqn, c.offsets) for fqn in shapes for c in meta[fqn].chunks]
    link.check(indices)
    verify_items(str(link.path), link.metadata, indices, link.checksum_files, lambda fqn: f"'{fqn}' ({what})")
    out = {fqn: torch.empty(shape, dtype=meta[fqn].properties.dtype) for fqn, shape in shapes.items()}
    if out:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(out, checkpoint_id=link.path, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return out


def assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Parameter or buffer ``name`` of ``model`` becomes ``value`` (a parameter without grad)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value
