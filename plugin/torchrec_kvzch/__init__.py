"""torchrec-kvzch: KV-ZCH (key-value, zero-collision hashing) embedding tables for TorchRec."""

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

# The public API, one layer after another; each layer imports only the ones above it here.
from torchrec_kvzch.params import (  # noqa: E402
    AdmissionPolicy,
    BucketRange,
    EvictionKind,
    EvictionPolicy,
    EvictionTrigger,
    KVZCHTableParams,
    OptimizerKind,
    RankBudget,
)
from torchrec_kvzch.table import (  # noqa: E402
    IdMap,
    KVTensor,
    RowLayout,
    RowPart,
    RowStore,
    SharedBudget,
    TableTBE,
    native_status,
)
from torchrec_kvzch.torchrec import (  # noqa: E402
    KVZCHConstraints,
    KVZCHEmbeddingBagCollectionSharder,
    KVZCHEmbeddingCollectionSharder,
    KVZCHShardingPlanner,
    kvzch_embedding_bag_config,
    kvzch_embedding_config,
    kvzch_sharders,
    kvzch_tables,
)
from torchrec_kvzch.torchrec.config import ConfigError, ShardingConfig, load_config  # noqa: E402
from torchrec_kvzch.checkpoint import (  # noqa: E402
    CheckpointError,
    CheckpointManager,
    KVZCHAsyncStager,
    KVZCHFileSystemWriter,
    KVZCHLoadPlanner,
    KVZCHSavePlanner,
)

__all__ = [
    # parameters
    "AdmissionPolicy", "BucketRange", "EvictionKind", "EvictionPolicy", "EvictionTrigger", "KVZCHTableParams",
    "OptimizerKind", "RankBudget",
    # one table shard
    "IdMap", "KVTensor", "RowLayout", "RowPart", "RowStore", "SharedBudget", "TableTBE",
    "native_status",
    # TorchRec
    "ConfigError", "KVZCHConstraints", "KVZCHEmbeddingBagCollectionSharder",
    "KVZCHEmbeddingCollectionSharder", "KVZCHShardingPlanner", "ShardingConfig",
    "kvzch_embedding_bag_config", "kvzch_embedding_config", "kvzch_sharders", "kvzch_tables",
    "load_config",
    # checkpoints
    "CheckpointError", "CheckpointManager", "KVZCHAsyncStager", "KVZCHFileSystemWriter", "KVZCHLoadPlanner",
    "KVZCHSavePlanner",
    # the stack
    "SUPPORTED_STACKS", "check_stack", "installed_stack", "installed_versions",
]
