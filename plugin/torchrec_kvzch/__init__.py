"""torchrec-kvzch: KV-ZCH (key-value, zero-collision hashing) embedding tables for TorchRec."""

import importlib
import logging
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("torchrec-kvzch")  # setup.cfg's, as installed
except PackageNotFoundError:  # imported from a source tree on PYTHONPATH (the offline GPU kit)
    __version__ = "0+unknown"

# The stacks the suite runs on (docs/stacks.md): torch, fbgemm-gpu, torchrec.
SUPPORTED_STACKS = (("2.13", "1.8", "1.8"), ("2.11", "1.6", "1.6"))


def installed_versions() -> dict[str, str | None]:
    """torch, fbgemm-gpu (either build) and torchrec as installed, full versions (None: absent)."""
    def first(*names: str) -> str | None:
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        return None

    return {"torch": first("torch"), "fbgemm_gpu": first("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly"),
            "torchrec": first("torchrec")}


def installed_stack() -> tuple[str, str, str]:
    """torch, fbgemm-gpu and torchrec as installed, each "major.minor" ("none": absent)."""
    return tuple(".".join(v.split("+")[0].split(".")[:2]) if v else "none" for v in installed_versions().values())


def check_stack() -> bool:
    """Logs a warning unless the installed stack is a tested one (other pairings may work, but
    are untested); returns whether it is."""
    stack = installed_stack()
    if stack in SUPPORTED_STACKS:
        return True
    logging.getLogger(__name__).warning(
        "torchrec_kvzch is tested on torch/fbgemm-gpu/torchrec %s; this is %s. fbgemm-gpu must "
        "match torch (fbgemm-gpu 1.8 does not load on torch 2.11)",
        " or ".join("/".join(s) for s in SUPPORTED_STACKS), "/".join(stack))
    return False


check_stack()

# The public API, one layer after another, imported on first use (PEP 562), so that a process
# that only needs our ops or one table shard (``import torchrec_kvzch.ops``: a loaded program)
# does not import TorchRec.
_EXPORTS = {
    "torchrec_kvzch.params": ("AdmissionPolicy", "BucketRange", "EvictionKind", "EvictionPolicy",
                              "EvictionTrigger", "KVZCHTableParams", "OptimizerKind", "RankBudget",
                              "WeightDecayMode"),
    "torchrec_kvzch.table": ("IdMap", "KVTensor", "RowLayout", "RowPart", "RowStore", "SharedBudget", "TableTBE",
                             "native_status"),
    "torchrec_kvzch.torchrec": ("KVZCHConstraints", "KVZCHEmbeddingBagCollectionSharder",
                                "KVZCHEmbeddingCollectionSharder", "KVZCHShardingPlanner", "kvzch_embedding_bag_config",
                                "kvzch_embedding_config", "kvzch_sharders", "kvzch_tables"),
    "torchrec_kvzch.torchrec.config": ("ConfigError", "ShardingConfig", "load_config"),
    "torchrec_kvzch.checkpoint": ("CheckpointError", "CheckpointManager", "KVZCHAsyncStager", "KVZCHFileSystemWriter",
                                  "KVZCHLoadPlanner", "KVZCHSavePlanner"),
}
_SUBPACKAGES = ("params", "table", "torchrec", "checkpoint", "serving", "job", "ops")
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        if name in _SUBPACKAGES:  # ``torchrec_kvzch.checkpoint...`` after ``import torchrec_kvzch``
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'torchrec_kvzch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (once)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [*_MODULE_OF, "SUPPORTED_STACKS", "check_stack", "installed_stack", "installed_versions"]
