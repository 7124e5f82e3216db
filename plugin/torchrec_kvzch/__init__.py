"""torchrec-kvzch: KV-ZCH (key-value, zero-collision hashing) embedding tables for TorchRec."""

import logging
from importlib.metadata import PackageNotFoundError, version

# The stacks the suite runs on (README, "Supported stacks"): torch, fbgemm-gpu, torchrec.
SUPPORTED_STACKS = (("2.13", "1.8", "1.8"), ("2.11", "1.6", "1.6"))


def installed_stack() -> tuple[str, str, str]:
    """torch, fbgemm-gpu (either build) and torchrec as installed, each "major.minor"."""
    def minor(*names: str) -> str:
        for name in names:
            try:
                return ".".join(version(name).split("+")[0].split(".")[:2])
            except PackageNotFoundError:
                continue
        return "none"

    return minor("torch"), minor("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly"), minor("torchrec")


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

from torchrec_kvzch.kv_tensor import KVTensor, RowPart
from torchrec_kvzch.params import (
    BucketRange,
    EvictionPolicy,
    KVZCHTableParams,
    OptimizerKind,
    RankBudget,
)
from torchrec_kvzch.store import IdMap, RowLayout, RowStore
from torchrec_kvzch.store.eviction import SharedBudget
from torchrec_kvzch.store.id_map import native_status

__all__ = [
    "BucketRange",
    "EvictionPolicy",
    "IdMap",
    "KVTensor",
    "KVZCHTableParams",
    "OptimizerKind",
    "RankBudget",
    "RowLayout",
    "RowPart",
    "RowStore",
    "SharedBudget",
    "native_status",
]
